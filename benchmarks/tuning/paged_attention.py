"""Tunes paged attention's decode block_kv with libtpu's static estimate; writes the table.

    python benchmarks/tuning/paged_attention.py [--chips v6e] [--from-log] [--markdown]

For every key of the grid below (chip, cache dtype, page size, head_dim, KV heads), each
block_kv candidate that the kernel allows (a multiple of the page size, at most 64 pages,
within the VMEM budget) is rated with benchmarks/rating/paged_attention.py on a uniform decode
batch (G = 4 query heads per KV head, 8192 tokens of context); the candidate with the
fewest estimated cycles wins (ties: the larger block, fewer grid steps). Every
candidate's estimate goes to benchmarks/results/paged_tuning.jsonl, and the winners to
the generated tables (kernels/tpu_kernels/tuned/paged_attention.<chip>.json), which ship
with the kernel. Static estimates, not
measurements. About 15 minutes. Each candidate is rated in its own subprocess: the estimator's
memory grows with every compile of a process (one process rating the whole grid reached
22 GB and was killed).

v5e and v6e. On v5e libtpu 0.0.42's static profile aborts the process on some
candidates (an LLO_CHECK in a vunpack, mostly with int8 caches); a key with any unrated
candidate keeps the heuristic tiling (the unrated one might have won). The kernel
compiles for v5e without the profile flag (tests/jax/test_paged_attention_aot.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402

from benchmarks import RESULTS, read_rows, tuning, write_rows  # noqa: E402  (no jax)
from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and "--key" in sys.argv:   # the rating child: before jax loads
  children.enable_static_profile()

import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, paged_attention as PA, vmem  # noqa: E402

from benchmarks.cases.headline import PagedDecode  # noqa: E402
from benchmarks.rating import paged_attention as paged_rating  # noqa: E402

CHIPS = ("v5e", "v6e")
TABLE_ABOUT = [
    "block_kv of ragged paged attention for decode (block_q 1), per key: the candidate with "
    "the fewest cycles in libtpu's static estimate of a uniform decode batch (8192 tokens of "
    "context, 64 sequences, extrapolated from 2 and 4; see benchmarks/rating/paged_attention.py).",
    "Static estimates, not measurements: nothing here ran on a TPU.",
    "Keys are produced by paged_attention.tuning_key (tests/jax/test_paged_attention_tiling.py "
    "checks every one).",
]
CONTEXT = 8192
GROUP = 4


def grid(chips_: tuple[str, ...] = CHIPS) -> list[PA.TuningKey]:
  """The decode buckets tuned so far: Llama-3-8B-like heads (32 / 8, D 128) at the page
  sizes serving engines use, bf16, int8 and fp8 caches. Other buckets use the heuristic."""
  return [PA.TuningKey(chip, kv_dtype, page_size, 128, 8) for chip in chips_
          for kv_dtype in ("bfloat16", "int8", "float8_e4m3fn") for page_size in (16, 64, 256)]


def candidates(key: PA.TuningKey) -> list[int]:
  chip = chips.get_chip(key.chip)
  budget = vmem.vmem_budget(chip, None)
  out = []
  for block_kv in PA._BLOCK_KV_CANDIDATES:
    if block_kv % key.page_size or block_kv // key.page_size > PA._MAX_PAGES_PER_BLOCK \
        or block_kv > CONTEXT:
      continue
    t = PA.paged_tiling(1, 1, CONTEXT // key.page_size, key.page_size, key.head_dim,
                        num_kv_heads=key.num_kv_heads, group=GROUP, q_dtype=jnp.bfloat16,
                        kv_dtype=jnp.dtype(key.kv_dtype), chip=key.chip, block_kv=block_kv)
    if t.vmem_plan_bytes <= budget:
      out.append(block_kv)
  return out


def rate(key: PA.TuningKey, block_kv: int | None = None) -> list[dict]:
  """Every candidate of one key (or just `block_kv`), estimated in this process."""
  case = PagedDecode(CONTEXT, 64, GROUP * key.num_kv_heads, key.num_kv_heads,
                     key.head_dim, key.page_size, key.kv_dtype)
  chosen = candidates(key) if block_kv is None else [block_kv]
  return [paged_rating.estimate(case, key.chip, b) for b in chosen]


def table_from_ratings(rows: list[dict]) -> dict[PA.TuningKey, int]:
  """Per key, the candidate with the fewest cycles (ties: the larger block). A key with
  any candidate the estimator could not rate keeps the heuristic: the unrated one might
  have won."""
  table = {}
  for key in grid():
    mine = [r for r in rows if PA.TuningKey(*r["key"]) == key]
    if mine and all(r["estimated_cycles"] for r in mine) and \
        {r["block_kv"] for r in mine} == set(candidates(key)):
      table[key] = -min((r["estimated_cycles"], -r["block_kv"]) for r in mine)[1]
  return table


def markdown(rows: list[dict]) -> str:
  """The winner of every key of the grid as a markdown table (paged-attention-tpu's card,
  "More performance"), or why a key keeps the heuristic."""
  table = table_from_ratings(rows)
  out = ["| chip | cache | page size | block_kv | compute (static) | HBM bound | prediction "
         "| efficiency |", "|---|---|---|---|---|---|---|---|"]
  for key in grid():
    head = f"| {key.chip} | {key.kv_dtype} | {key.page_size} |"
    if key not in table:
      mine = [r for r in rows if PA.TuningKey(*r["key"]) == key]
      failed = ", ".join(str(r["block_kv"]) for r in mine if not r["estimated_cycles"])
      why = f"the estimator aborts at block_kv {failed}" if failed else "not every candidate rated"
      out.append(f"{head} heuristic | not rated: {why} ||||")
      continue
    r = next(r for r in rows if PA.TuningKey(*r["key"]) == key and r["block_kv"] == table[key])
    out.append(f"{head} {table[key]} | {r['compute_us']:,.0f} µs | {r['hbm_us']:,.0f} µs | "
               f"{r['predicted_us']:,.0f} µs | {r['efficiency']:.2f} |")
  return "\n".join(out) + "\n"


def main(argv=None) -> int:
  p = tuning.argument_parser(__doc__, RESULTS / "paged_tuning.jsonl", CHIPS)
  p.add_argument("--markdown", action="store_true",
                 help="print the card's table of winners from --log (no estimator)")
  p.add_argument("--key", help=argparse.SUPPRESS)   # internal: rate one key, print JSON lines
  p.add_argument("--block-kv", type=int, help=argparse.SUPPRESS)   # ... at this candidate
  a = p.parse_args(argv)
  if a.key:
    for row in rate(PA.TuningKey(*json.loads(a.key)), a.block_kv):
      children.print_row(row)
    return 0
  if a.markdown:
    print(markdown(read_rows(a.log)), end="")
    return 0
  if a.from_log:
    rows = read_rows(a.log)
  else:
    rows = tuning.kept_rows(a.log, lambda r: r["key"][0] in a.chips)
    for key in grid(tuple(a.chips)):
      for block_kv in candidates(key):   # one child per candidate: the estimator may abort
        found, error = children.run_child(
            __file__, ["--key", json.dumps(dataclasses.astuple(key)), "--block-kv", str(block_kv)])
        row = found[0] if found else dict(block_kv=block_kv, estimated_cycles=None, error=error)
        row["key"] = list(dataclasses.astuple(key))
        rows.append(row)
        print(f"{key}: block_kv {block_kv}: {row['estimated_cycles']} cycles "
              f"{row.get('error') or ''}", flush=True)
    write_rows(a.log, rows)
  table = {dataclasses.astuple(k): v for k, v in table_from_ratings(rows).items()}
  tuning.write_tables(a.out, __file__, "paged_attention", PA.TuningKey, PA.TUNED_VALUE_FIELDS,
                      table, CHIPS, TABLE_ABOUT)
  return 0


if __name__ == "__main__":
  sys.exit(main())
