"""Tunes the grouped matmul's forward blocks with libtpu's static estimate; writes the table.

    python benchmarks/tuning/ragged_dot.py [--chips v6e] [--models ...] [--weight-dtypes ...]
                                           [--retry-failed] [--summary]

Grid (`MODELS_BY_CHIP`): the headline model's expert shapes (Qwen3-30B-A3B) and those
of the survey's models (cases/survey.py: Mixtral-8x7B, Qwen3-235B-A22B, DeepSeek-V3,
OLMoE-1B-7B), on both chips. The first four were chosen where the heuristic tiling rated
below 0.95 of the roofline or behind XLA's ragged_dot on v6e; since 2026-12-06 every
survey model is in the grid on both chips, because at unaligned routing the heuristic's
split-k tiles refetch the weights at every visit (v5e's 16 MiB default scoped limit makes
it split k at most of these shapes). Gate/up (gated, silu) and down, at m = 512 and 8192
rows (`ROWS`), and for the headline model 65536 too (`ROWS_BY_MODEL`), bf16. And with
int8 and float8_e4m3fn weights (bf16 activations, weights [G, k, n] and their scale, as
`quantize_experts_` stores them; the key's `weight_dtype`), the quantized decode rows
whose heuristic tiling missed 0.85 of the quantized roofline: Mixtral-8x7B at m = 512 on
both chips (`QUANTIZED_ROWS_BY_MODEL`). There the heuristic then stayed under the default
scoped-VMEM limit and took narrow n blocks, and the activations were re-read once per n
block (since 2026-12-06 it takes one k block under up to 64 MiB where k fits one:
`ragged_dot._one_k_block_tiling`).
And gpt-oss-20b's gate/up at the experts layer's prefill (8192 tokens x top-4 = 32768
rows) on both chips (`INTERLEAVED_ROWS_BY_MODEL`): its interleaved columns take the
"lanes" kernel (2 x block_n weight columns per tile, de-interleaved in the epilogue), a
key of its own (`TuningKey.interleaved`). And the experts layer's down projection at
those prefill rows (65536 for Qwen3-30B-A3B, 32768 for gpt-oss-20b), which writes
float32 for the combine (`F32_OUT_ROWS_BY_MODEL`, key `TuningKey.f32_out`). There too
the heuristic then stayed under the default limit and split k: (512, 512, 256) for gpt-oss's
gate/up on v5e.

Two routings. The headline rates the kernel at *balanced* routing: every group m / G
rows, aligned with the row tiles. Real routing is not aligned: a group boundary inside
a row tile makes one more visit, tiles_m + G - 1 in all (*unaligned*). That costs a
split-k tiling a refetch of the group's weights (a visit walks all k blocks, so the
weight block index changes), which whole-k tilings do not pay (the same block stays).
At decode sizes balanced routing therefore flatters a split k by up to 2x in weight
bytes. Each rated candidate gets both predictions: balanced, from the static estimate
(`rating/ragged_dot.rate_gmm`, as in the headline); unaligned, from the same estimate's cycles
per visit times the unaligned visit count, and the bytes of `modelled_bytes` at that
count (the estimator itself only sees the balanced table). A prediction is
max(cycles / clock, bytes / HBM bandwidth).

Candidates: every (block_m, block_k, block_n) the kernel accepts whose VMEM plan fits
under the chip's largest scoped limit (`Chip.max_vmem_limit_bytes`, 112 MiB on v5e and
v6e; block_m a power of two from the sublane multiple to MAX_BLOCK_M, block_k and
block_n from the kernel's own lane-block candidates, and block_k the whole k also where k
is past the heuristic's MAX_BLOCK_K: gmm_tiling takes such a tuned entry, and one k block
keeps a group's weight block in place across its visits, so unaligned routing refetches
nothing; since 2026-12-07, rated for Mixtral-8x7B's down, k = 14336). Until 2026-12-02 the ceiling was
64 MiB: the keys not re-rated since (all but Mixtral-8x7B's on v6e) chose among those
candidates only, and a 65 MiB tiling rated 21% faster on Mixtral's gate/up at m=8192.
block_m = 1024 is not a candidate: the estimator exhausts memory on it (Mixtral-sized
blocks, 14 GiB). Rating one is two compiles (10-80 s), too many to rate them all, so they
are ranked first by a traffic model (`modelled_seconds`: bytes moved over the HBM
bandwidth, against padded MXU work at peak plus STEP_CYCLES per grid step). Rated: the
heuristic's own pick, the best TOP_RATED by the model at unaligned routing, and the
best by the model at balanced routing; `--also` rates given blocks besides (the log
keeps every rating, so they compete with the rest).

The table: per key, among the rated candidates no slower than the heuristic's pick at
balanced routing (so the headline's measure never gets worse), the one with the lowest
unaligned prediction (ties: lower balanced prediction, then larger blocks) enters if it
beats the heuristic's pick by at least MIN_GAIN unaligned. A key whose heuristic pick the
estimator cannot rate gets no entry. Every rating goes to
benchmarks/results/ragged_tuning.jsonl; a re-run keeps a key's earlier ratings of other
blocks (`merged_log`).

Limits, stated: the model only chooses what gets rated; an unrated candidate might have
been better. The unaligned prediction is a hand extrapolation, not the estimator's own
(it assumes every visit costs a balanced visit's cycles). The estimator exhausts memory
on some large gated blocks (each child is capped at children.CHILD_MEMORY_BYTES):
such a candidate is logged with its error and cannot win unless `--retry-failed`,
which re-rates failed ones alone under RETRY_MEMORY_BYTES, rates it. Static estimates,
not measurements.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
from unittest import mock  # noqa: E402

from benchmarks import RESULTS, read_rows, tuning, write_rows  # noqa: E402  (no jax)
from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and "--key" in sys.argv:   # the rating child: before jax loads
  children.enable_static_profile()

import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, ragged_dot as R, vmem  # noqa: E402

from benchmarks.cases import survey  # noqa: E402
from benchmarks.cases.headline import MOE_MODELS  # noqa: E402
from benchmarks.rating import ragged_dot as ragged_rating  # noqa: E402
from benchmarks.rating.roofline import prediction, roofline_us  # noqa: E402

MODELS = ("qwen3-30b-a3b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3", "olmoe-1b-7b",
          "gpt-oss-20b")
MODELS_BY_CHIP = {"v5e": MODELS[:5], "v6e": MODELS[:5]}
CHIPS = tuple(MODELS_BY_CHIP)
ROWS = (512, 8192)
# The headline model also at a long prefill's rows (8192 tokens x top-8 experts).
ROWS_BY_MODEL = {"qwen3-30b-a3b": (512, 8192, 65536)}
# 1-byte weights (bf16 activations, [G, k, n] as quantize_experts_ stores them): the
# quantized decode rows whose heuristic tiling missed 0.85 of the quantized roofline
# (docs/performance.md, "Quantized decode"), on both chips.
QUANTIZED_ROWS_BY_MODEL = {"mixtral-8x7b": (512,)}
# Down at decode where k is cut into blocks (past MAX_BLOCK_K, so no one-k-block tiling):
# the heuristic stays under the default scoped-VMEM limit there and takes narrow n blocks,
# re-reading the rows once per n block. Mixtral-8x7B's down (k = 14336) at 64 rows, every
# weight dtype, both chips: tpu-inference's gmm rated 1.06x ahead of the heuristic's
# tiling with int8 / fp8 weights on v5e (docs/performance.md, "tpu-inference").
DOWN_DECODE_ROWS_BY_MODEL = {"mixtral-8x7b": (64,)}
# Interleaved gate/up columns (their own kernel body, the "lanes" route): gpt-oss-20b's
# gate/up at its prefill row of the experts layer, 8192 tokens x top-4, on both chips.
INTERLEAVED_ROWS_BY_MODEL = {"gpt-oss-20b": (32768,)}
# Down with a float32 output (moe_experts', summed in float32 by the combine): the experts
# layer's prefill rows (8192 tokens x top-k) of its two models, on both chips.
F32_OUT_ROWS_BY_MODEL = {"qwen3-30b-a3b": (65536,), "gpt-oss-20b": (32768,)}
WEIGHT_DTYPES = ("bfloat16",) + R.QUANTIZED_DTYPE_NAMES
STEP_CYCLES = 600     # rough cost of one grid step; only ranks candidates for rating
TOP_RATED = 3
MIN_GAIN = 0.01
WORKERS = 2           # ratings in parallel (each compile is single-threaded)
RETRY_MEMORY_BYTES = 20 << 30   # --retry-failed: one rating at a time may take more
TABLE_ABOUT = [
    "Forward grouped-matmul blocks (block_m, block_k, block_n) per key.",
    "A key whose weight_dtype is not its dtype is a call with int8 / float8_e4m3fn weights "
    "[G, k, n] and their float32 scale, bf16 activations (as quantize_experts_ stores them).",
    "interleaved: gate/up columns interleaved in one weight (gpt-oss; the 'lanes' kernel). "
    "f32_out: a float32 output of a bf16 call (the experts layer's down projection).",
    "Each rated candidate has two predictions, max(cycles / clock, bytes moved / HBM "
    "bandwidth), from libtpu's static estimate (benchmarks/rating/ragged_dot.py): at balanced "
    "routing (groups aligned with the row tiles, as the headline rates) and at unaligned "
    "routing (every group boundary inside a row tile).",
    "The entry is the candidate no slower than the heuristic tiling at balanced routing that "
    "is fastest at unaligned routing, kept only where it beats the heuristic's unaligned "
    "prediction by at least 1% (benchmarks/tuning/ragged_dot.py).",
    "Static estimates, not measurements: nothing here ran on a TPU.",
    "Keys are produced by ragged_dot.tuning_key (tests/jax/test_ragged_dot_tiling.py checks "
    "every one).",
]


def model_shape(model: str) -> tuple[int, int, int]:
  """(experts, hidden, expert width): the survey's models, and gpt-oss-20b (headline's)."""
  return survey.MODELS.get(model) or MOE_MODELS[model]


def grid(chips_: tuple[str, ...] = CHIPS, models: tuple[str, ...] = MODELS,
         weight_dtypes: tuple[str, ...] = WEIGHT_DTYPES) -> list[R.TuningKey]:
  """The keys of `chips_` x `models` x `weight_dtypes` that MODELS_BY_CHIP (bf16),
  QUANTIZED_ROWS_BY_MODEL (1-byte weights, every chip), DOWN_DECODE_ROWS_BY_MODEL (down
  only, every weight dtype and chip), INTERLEAVED_ROWS_BY_MODEL and F32_OUT_ROWS_BY_MODEL
  (bf16, every chip) tune."""
  keys = []
  for chip in chips_:
    for model in models:
      groups, hidden, width = model_shape(model)
      for wdt in weight_dtypes:
        if wdt == "bfloat16":
          rows = ROWS_BY_MODEL.get(model, ROWS) if model in MODELS_BY_CHIP[chip] else ()
        else:
          rows = QUANTIZED_ROWS_BY_MODEL.get(model, ())
        for m in rows:
          keys.append(R.TuningKey(chip, "bfloat16", wdt, 2, m, hidden, width, groups))  # gate/up
          keys.append(R.TuningKey(chip, "bfloat16", wdt, 1, m, width, hidden, groups))  # down
        keys += [R.TuningKey(chip, "bfloat16", wdt, 1, m, width, hidden, groups)
                 for m in DOWN_DECODE_ROWS_BY_MODEL.get(model, ())]
      if "bfloat16" in weight_dtypes:
        keys += [R.TuningKey(chip, "bfloat16", "bfloat16", 2, m, hidden, width, groups,
                             interleaved=True) for m in INTERLEAVED_ROWS_BY_MODEL.get(model, ())]
        keys += [R.TuningKey(chip, "bfloat16", "bfloat16", 1, m, width, hidden, groups,
                             f32_out=True) for m in F32_OUT_ROWS_BY_MODEL.get(model, ())]
  return keys


def case(key: R.TuningKey, blocks: tuple[int, int, int] | None = None):
  """The key's call at balanced routing: bf16 weights [G, n, k] (Transformers' layout),
  1-byte weights [G, k, n] with their scale (quantize_experts_'s)."""
  return ragged_rating.GmmCase(key.m_bucket, key.num_groups, key.k, key.n,
                                 key.num_rhs == 2, chip=key.chip, dtype=key.dtype,
                                 blocks=blocks, weight_dtype=key.weight_dtype,
                                 transpose_rhs=not key.quantized,
                                 interleaved=key.interleaved,
                                 out_dtype="float32" if key.f32_out else None)


def candidates(key: R.TuningKey) -> list[tuple[int, int, int]]:
  """Every block triple the kernel accepts for the key's shape within the ceiling."""
  dt, wdt = jnp.dtype(key.dtype), jnp.dtype(key.weight_dtype)
  sub = vmem.sublane_multiple(dt)
  chip = chips.get_chip(key.chip)
  budget = vmem.vmem_budget(chip, chip.max_vmem_limit_bytes)
  block_ms = [b for b in (1 << i for i in range(3, 11))
              if sub <= b <= min(R.MAX_BLOCK_M, key.m_bucket)]
  block_ks = R._lane_block_candidates(key.k, None, None)
  if key.k not in block_ks:   # the whole k past MAX_BLOCK_K too: gmm_tiling takes it tuned
    block_ks.insert(0, key.k)
  block_ns = [b for b in R._lane_block_candidates(key.n, None, key.n_must_divide)
              if b <= R.MAX_BLOCK_N]
  out = []
  for bm in block_ms:
    for bk in block_ks:
      for bn in block_ns:
        t = R.gmm_tiling(key.m_bucket, key.k, key.n, num_groups=key.num_groups, lhs_dtype=dt,
                         rhs_dtype=wdt, out_dtype=key.out_dtype, num_rhs=key.num_rhs,
                         n_must_divide=key.n_must_divide, chip=key.chip, block_m=bm,
                         block_k=bk, block_n=bn, interleaved=key.interleaved)
        if t.vmem_plan_bytes <= budget:
          out.append((bm, bk, bn))
  return out


def balanced_visits(key: R.TuningKey, block_m: int) -> int:
  return ragged_rating.BalancedTable(key.m_bucket, key.num_groups, block_m).num_visits


def unaligned_visits(key: R.TuningKey, block_m: int) -> int:
  """Visits when every group boundary falls inside a row tile."""
  return key.m_bucket // block_m + key.num_groups - 1


def modelled_bytes(key: R.TuningKey, blocks: tuple[int, int, int], visits: int) -> int:
  """The bytes the forward grid moves over `visits` visits, in closed form (equal to
  `GmmCase.hbm_bytes`'s replay of the index maps: tests/jax/test_ragged_estimate.py).
  A block is fetched when its index changes between grid steps (n tile, visit, k tile):
  with the whole k in one block, lhs once per row tile and the weights once per group;
  with k split, both at every visit. All of it per n tile, except a lone lhs block,
  fetched once."""
  bm, bk, bn = blocks
  item, w_item = jnp.dtype(key.dtype).itemsize, jnp.dtype(key.weight_dtype).itemsize
  out_item = jnp.dtype(key.out_dtype).itemsize
  tiles_m, tiles_k, tiles_n = -(-key.m_bucket // bm), -(-key.k // bk), -(-key.n // bn)
  lhs_fetches, rhs_fetches = (tiles_m, key.num_groups) if tiles_k == 1 else (visits, visits)
  lhs = lhs_fetches * bm * tiles_k * bk * item
  rhs = rhs_fetches * key.num_rhs * tiles_k * bk * bn * w_item
  if key.quantized:   # a group's f32 scale row: once per group (any k split)
    rhs += key.num_groups * key.num_rhs * bn * 4
  out = tiles_m * bm * bn * out_item
  if tiles_m == 1 and tiles_k == 1:
    return lhs + tiles_n * (rhs + out)
  return tiles_n * (lhs + rhs + out)


def modelled_seconds(key: R.TuningKey, blocks: tuple[int, int, int], visits: int) -> float:
  """The traffic model that picks which candidates are rated (see the module doc)."""
  c = chips.get_chip(key.chip)
  bm, bk, bn = blocks
  tiles_k, tiles_n = -(-key.k // bk), -(-key.n // bn)
  mxu = 2 * visits * bm * tiles_k * bk * tiles_n * bn * key.num_rhs / c.bf16_flops_per_s
  steps = visits * tiles_k * tiles_n
  return max(modelled_bytes(key, blocks, visits) / c.hbm_bytes_per_s,
             mxu + steps * STEP_CYCLES / c.clock_hz)


def heuristic_blocks(key: R.TuningKey) -> tuple[int, int, int]:
  """The heuristic's pick, whatever the shipped table holds."""
  with mock.patch.dict(R.TUNED_BLOCKS, clear=True):
    tiling = case(key).tiling()
  return tiling.block_m, tiling.block_k, tiling.block_n


def to_rate(key: R.TuningKey) -> list[tuple[int, int, int]]:
  """The heuristic's pick, the TOP_RATED best others by the model at unaligned routing,
  and the best other by the model at balanced routing."""
  own = heuristic_blocks(key)
  others = [b for b in candidates(key) if b != own]

  def ranked(visits):
    return sorted(others, key=lambda b: (modelled_seconds(key, b, visits(key, b[0])),
                                         -b[0] * b[1] * b[2]))

  chosen = [own] + ranked(unaligned_visits)[:TOP_RATED]
  chosen += [b for b in ranked(balanced_visits) if b not in chosen][:1]
  return chosen


def rate(key: R.TuningKey, blocks: tuple[int, int, int]) -> dict:
  """One rating, in this process: the balanced prediction from the static estimate, the
  unaligned one extrapolated from it (module doc)."""
  c = chips.get_chip(key.chip)
  r = ragged_rating.rate_gmm(case(key, blocks), key.chip)
  balanced, unaligned = balanced_visits(key, blocks[0]), unaligned_visits(key, blocks[0])
  row = dict(blocks=list(blocks), vmem_limit_bytes=r["tiling"]["vmem_limit_bytes"],
             cycles_per_visit=r["cycles_per_visit"])
  for routing, visits, cycles, nbytes in [
      ("balanced", balanced, r["estimated_cycles"], r["hbm_bytes"]),
      ("unaligned", unaligned,
       r["estimated_cycles"] + r["cycles_per_visit"] * (unaligned - balanced),
       modelled_bytes(key, blocks, unaligned))]:
    row[routing] = dict(visits=visits, estimated_cycles=round(cycles), hbm_bytes=nbytes,
                        **prediction(cycles, nbytes, c))
  return row


def _rated(rows: list[dict], key: R.TuningKey) -> tuple[list[dict], dict | None]:
  """The key's successful ratings, and among them the heuristic's pick (None if unrated)."""
  mine = [r for r in rows if R.TuningKey(*r["key"]) == key and "balanced" in r]
  return mine, next((r for r in mine if r["heuristic"]), None)


def table_from_ratings(rows: list[dict]) -> dict[R.TuningKey, tuple[int, int, int]]:
  """Per key, among the rated candidates no slower than the heuristic's pick at balanced
  routing, the best at unaligned routing, where it beats the heuristic's there by
  MIN_GAIN."""
  def cost(r):
    b = r["blocks"]
    return (r["unaligned"]["predicted_us"], r["balanced"]["predicted_us"], -b[0] * b[1] * b[2])

  table = {}
  for key in grid():
    mine, own = _rated(rows, key)
    if own is None:
      continue
    no_slower = [r for r in mine
                 if r["balanced"]["predicted_us"] <= own["balanced"]["predicted_us"]]
    best = min(no_slower, key=cost)
    if best["unaligned"]["predicted_us"] < (1 - MIN_GAIN) * own["unaligned"]["predicted_us"]:
      table[key] = tuple(best["blocks"])
  return table


def summary(rows: list[dict]) -> list[str]:
  """docs/performance/ragged-dot.md's table, from the ratings: per key, efficiency (roofline /
  prediction) at balanced / unaligned routing of the heuristic's pick and of the table's entry."""
  table = table_from_ratings(rows)
  lines = ["| chip | model | m | part | heuristic | tuned | blocks |", "|---|---|---:|---|---|---|---|"]
  by_shape = {model_shape(name): name for name in MODELS}
  for key in grid():
    mine, own = _rated(rows, key)
    gate_up = key.num_rhs == 2
    model = by_shape[(key.num_groups, key.k, key.n) if gate_up else (key.num_groups, key.n, key.k)]
    roofline = roofline_us(case(key), chips.get_chip(key.chip))

    def efficiency(r):
      return " / ".join(f"{min(1.0, roofline / r[routing]['predicted_us']):.2f}"
                        for routing in ("balanced", "unaligned"))

    heuristic = efficiency(own) if own else "not rated"
    entry = table.get(key)
    tuned = (efficiency(next(r for r in mine if tuple(r["blocks"]) == entry)) if entry
             else "no entry")
    part = ("gate/up" if gate_up else "down") + (
        f" {key.weight_dtype}" if key.quantized else "") + (
        " (interleaved)" if key.interleaved else "") + (" (f32 out)" if key.f32_out else "")
    lines.append(f"| {key.chip} | {model} | {key.m_bucket} | {part} "
                 f"| {heuristic} | {tuned} | {entry or ''} |")
  return lines


def merged_log(old_rows: list[dict], new_rows: list[dict]) -> list[dict]:
  """The log after a run: the new ratings, and the earlier ones they do not replace. A
  rating replaces an earlier one of the same key and blocks, and a key's new heuristic
  pick replaces its earlier one; a key's other earlier candidates stay (a run ranks the
  candidates afresh, and a candidate rated before stays a valid choice). Ratings are
  deterministic, so a kept row is what a re-rating would give, while the kernel's
  program for those blocks is unchanged: re-rate every key after a kernel change."""
  key = lambda r: R.TuningKey(*r["key"])   # a row logged before a field was added: its default
  new_keys = {key(r) for r in new_rows if r["heuristic"]}   # keys whose pick was re-rated
  fresh = {(key(r), tuple(r["blocks"])) for r in new_rows}
  kept = [r for r in old_rows if (key(r), tuple(r["blocks"])) not in fresh
          and not (r["heuristic"] and key(r) in new_keys)]
  return kept + new_rows


def _rate_in_child(key: R.TuningKey, blocks, heuristic: bool,
                   memory_bytes: int = children.CHILD_MEMORY_BYTES) -> dict:
  found, error = children.run_child(__file__, ["--key", json.dumps(dataclasses.astuple(key)),
                                               "--blocks", ",".join(map(str, blocks)),
                                               "--memory-bytes", str(memory_bytes)],
                                    timeout=1200)
  row = found[0] if found else dict(blocks=list(blocks), error=error)
  row.update(key=list(dataclasses.astuple(key)), heuristic=heuristic)
  print(f"{key}: {blocks}{' (heuristic)' if heuristic else ''}: " + (
      error or " ".join(f"{routing} {row[routing]['predicted_us']:.1f} us"
                        for routing in ("balanced", "unaligned"))), flush=True)
  return row


def main(argv=None) -> int:
  p = tuning.argument_parser(__doc__, RESULTS / "ragged_tuning.jsonl", CHIPS)
  p.add_argument("--key", help=argparse.SUPPRESS)      # internal: rate one candidate
  p.add_argument("--blocks", help=argparse.SUPPRESS)
  p.add_argument("--memory-bytes", type=int, help=argparse.SUPPRESS)
  p.add_argument("--retry-failed", action="store_true",
                 help="re-rate the log's failed ratings one at a time, with a memory cap of "
                      "RETRY_MEMORY_BYTES (the estimator exhausts memory on some blocks)")
  p.add_argument("--models", nargs="+", default=list(MODELS),
                 help="re-rate these models' keys; the log's rows for the others are kept")
  p.add_argument("--weight-dtypes", nargs="+", default=list(WEIGHT_DTYPES),
                 choices=WEIGHT_DTYPES, help="re-rate the keys of these weight dtypes only")
  p.add_argument("--also", nargs="+", default=[], metavar="BM,BK,BN",
                 help="rate only these blocks, for each key that accepts them (candidates "
                      "the traffic model ranks low), keeping the log's other ratings")
  p.add_argument("--unrated", action="store_true",
                 help="rate only the keys the log holds no rating of (keys new to the grid)")
  p.add_argument("--summary", action="store_true",
                 help="print the efficiency table of the log's ratings (docs/performance/"
                      "ragged-dot.md's) and exit")
  a = p.parse_args(argv)
  if a.key:
    # some blocks make the estimator take all memory: fail the row instead
    children.limit_memory(a.memory_bytes or children.CHILD_MEMORY_BYTES)
    blocks = tuple(int(x) for x in a.blocks.split(","))
    children.print_row(rate(R.TuningKey(*json.loads(a.key)), blocks))
    return 0
  if a.summary:
    print("\n".join(summary(read_rows(a.log))))
    return 0
  if a.from_log:
    rows = read_rows(a.log)
  elif a.retry_failed:
    rows = [r if "error" not in r or R.TuningKey(*r["key"]).chip not in a.chips else
            _rate_in_child(R.TuningKey(*r["key"]), tuple(r["blocks"]), r["heuristic"],
                           RETRY_MEMORY_BYTES) for r in read_rows(a.log)]
    write_rows(a.log, rows)
  else:
    also = [tuple(int(x) for x in b.split(",")) for b in a.also]
    jobs = []
    logged = {R.TuningKey(*r["key"]) for r in read_rows(a.log)}
    for key in grid(tuple(a.chips), tuple(a.models), tuple(a.weight_dtypes)):
      if a.unrated and key in logged:
        continue
      if also:
        own = heuristic_blocks(key)
        jobs += [(key, b, b == own) for b in also if b in candidates(key)]
      else:
        jobs += [(key, b, i == 0) for i, b in enumerate(to_rate(key))]
    with concurrent.futures.ThreadPoolExecutor(WORKERS) as pool:
      new_rows = list(pool.map(lambda job: _rate_in_child(*job), jobs))
    rows = merged_log(read_rows(a.log), new_rows)
    write_rows(a.log, rows)
  table = {dataclasses.astuple(k): v for k, v in table_from_ratings(rows).items()}
  tuning.write_tables(a.out, __file__, "ragged_dot", R.TuningKey, R.TUNED_VALUE_FIELDS, table,
                      CHIPS, TABLE_ABOUT)
  return 0


if __name__ == "__main__":
  sys.exit(main())
