"""Tunes flash attention's (block_q, block_k) with libtpu's static estimate; writes the table.

    python benchmarks/tuning/flash_attention.py [--chips v6e] [--from-log]

For every key of the grid below (chip, dtype, head_dim, group, sequence bucket: causal
self-attention without a window, i.e. prefill), each (block_q, block_k) pair of
{256, 512, 1024} that the kernel allows at the bucket's length is rated, under the
chip's default scoped-VMEM limit or, where its plan for the key's group needs more,
the smallest whole-MiB limit that fits it (up to the chip's maximum), and the one with
the fewest cycles wins (ties: the larger blocks). A candidate is rated on the causal
forward's MHA program, one head (benchmarks/rating/flash_attention.py: the GQA program rates
at 0 cycles; per query head the work is the same), at the bucket's length, or at
MAX_RATED_SEQ for longer
buckets (the estimator unrolls every grid step; per visited tile the cost is the same,
so the ranking carries over). Backward kernels use the same blocks; the rating is the
forward's (the inference path). Every rating goes to benchmarks/results/flash_tuning.jsonl,
the winners to the generated tables (kernels/tpu_kernels/tuned/flash_attention.<chip>.json),
which ship with the kernel. Static estimates,
not measurements. Each (chip, head_dim, length) is rated in its own subprocess (the
estimator's memory grows with every compile of a process); if the estimator aborts that
process, each pair is re-rated alone, and a key with any pair left unrated keeps the
heuristic tiling (the unrated pair might have won). `--chips v5e` re-rates one chip and
keeps the log's other rows; `--from-log` rebuilds the table without the estimator.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402

from benchmarks import RESULTS, read_rows, write_rows, tuning  # noqa: E402  (no jax)
from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and "--rate" in sys.argv:   # the rating child: before jax loads
  children.enable_static_profile()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, flash_attention as F, vmem  # noqa: E402

CHIPS = ("v5e", "v6e")
TABLE_ABOUT = [
    "(block_q, block_k, vmem_limit_bytes) of flash attention for causal self-attention "
    "without a window, per key: the pair with the fewest cycles in libtpu's static estimate "
    "of the forward (rated on its MHA program, one head; see "
    "benchmarks/tuning/flash_attention.py), with the scoped-VMEM limit its plan needs (the "
    "chip's default, or more).",
    "Static estimates, not measurements: nothing here ran on a TPU.",
    "Keys are produced by flash_attention.tuning_key (tests/jax/test_flash_attention_tiling.py "
    "checks every one).",
]
DTYPES = ("bfloat16",)
HEAD_DIMS = (64, 128, 256)
GROUPS = (1, 4, 8)
SEQS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
BLOCKS = (256, 512, 1024)
MAX_RATED_SEQ = 8192


def grid(chips_: tuple[str, ...] = CHIPS) -> list[F.TuningKey]:
  return [F.TuningKey(c, d, h, g, s) for c in chips_ for d in DTYPES for h in HEAD_DIMS
          for g in GROUPS for s in SEQS]


def candidates(key: F.TuningKey) -> dict[tuple[int, int], int]:
  """{(block_q, block_k): scoped-VMEM limit} of the pairs the kernel allows at the
  bucket's length: under the chip's default limit where the plan fits its budget, else
  under the smallest whole-MiB limit that makes it fit, up to the chip's maximum."""
  chip = chips.get_chip(key.chip)
  out = {}
  for bq in BLOCKS:
    for bk in BLOCKS:
      if bq > key.seq or bk > key.seq:
        continue
      t = F.attention_tiling(key.seq, key.seq, key.head_dim, group=key.group,
                             dtype=jnp.dtype(key.dtype), chip=key.chip, block_q=bq, block_k=bk)
      if (t.block_q, t.block_k) != (bq, bk):
        continue
      needed = vmem.round_up(math.ceil(t.vmem_plan_bytes / vmem.BUDGET_FRACTION), vmem.MiB)
      limit = max(chip.default_scoped_vmem_bytes, needed)
      if limit <= chip.max_vmem_limit_bytes:
        out[(bq, bk)] = limit
  return out


def rated_seq(key: F.TuningKey) -> int:
  return min(key.seq, MAX_RATED_SEQ)


def rate(chip: str, dtype: str, head_dim: int, seq: int, pairs) -> list[dict]:
  """Cycles of the one-head causal forward at each (block_q, block_k) (in this process)."""
  from tpu_kernels import aot
  from benchmarks.cases.headline import Attention
  from benchmarks.rating import flash_attention as attention_rating
  case = Attention(seq=seq, q_heads=1, kv_heads=1, head_dim=head_dim, dtype=dtype)
  rows = []
  for bq, bk in pairs:
    t = F.Tiling(bq, bk, vmem.resolve_vmem_limit(chips.get_chip(chip), None), 0)
    fn, specs = attention_rating.mha_program(seq, 1, case, t, chip)
    report = aot.compile_for_chip(fn, specs, chip)
    rows.append(dict(chip=chip, dtype=dtype, head_dim=head_dim, seq=seq, block_q=bq,
                     block_k=bk, compiled=report.ok, error=report.error,
                     estimated_cycles=report.estimated_cycles))
  return rows


def table_from_ratings(ratings: dict) -> dict[F.TuningKey, tuple[int, int, int]]:
  """Per key, the allowed pair with the fewest cycles (ties: the larger blocks), with the
  scoped-VMEM limit it needs. A key with any allowed pair the estimator could not rate
  keeps the heuristic: the unrated pair might have won."""
  table = {}
  for key in grid():
    allowed = candidates(key)
    rated = [(ratings[r], -bq * bk, -bk, (bq, bk, limit)) for (bq, bk), limit in allowed.items()
             if (r := (key.chip, key.dtype, key.head_dim, rated_seq(key), bq, bk)) in ratings]
    if rated and len(rated) == len(allowed):
      table[key] = min(rated)[3]
  return table


def rate_jobs(jobs: dict[tuple, set]) -> list[dict]:
  """Rates every (chip, dtype, head_dim, rated seq) -> pairs job in a child. If the child
  dies (the estimator aborted on one pair), each pair is rated in a child of its own and
  the ones that still fail are logged without cycles."""
  rows = []
  for (chip, dtype, head_dim, seq), pairs in sorted(jobs.items()):
    job = dict(chip=chip, dtype=dtype, head_dim=head_dim, seq=seq, pairs=sorted(pairs))
    done, error = children.run_child(__file__, ["--rate", json.dumps(job)])
    if error or len(done) != len(pairs):
      done = []
      for pair in sorted(pairs):
        one, error = children.run_child(__file__,
                                        ["--rate", json.dumps({**job, "pairs": [pair]})])
        done += one or [dict(chip=chip, dtype=dtype, head_dim=head_dim, seq=seq,
                             block_q=pair[0], block_k=pair[1], compiled=False, error=error,
                             estimated_cycles=None)]
    for row in done:
      print(f"{chip} {dtype} D={head_dim} S={seq} {row['block_q']}x{row['block_k']}: "
            f"{row['estimated_cycles']} cycles {row['error'] or ''}", flush=True)
    rows += done
  return rows


def main(argv=None) -> int:
  p = tuning.argument_parser(__doc__, RESULTS / "flash_tuning.jsonl", CHIPS)
  p.add_argument("--rate", help=argparse.SUPPRESS)   # internal: one rating job, ROW lines
  a = p.parse_args(argv)
  if a.rate:
    job = json.loads(a.rate)
    for row in rate(job["chip"], job["dtype"], job["head_dim"], job["seq"],
                    [tuple(x) for x in job["pairs"]]):
      children.print_row(row)
    return 0
  if a.from_log:
    rows = read_rows(a.log)
  else:
    jobs: dict[tuple, set] = {}   # (chip, dtype, head_dim, rated seq) -> pairs to rate
    for key in grid(tuple(a.chips)):
      jobs.setdefault((key.chip, key.dtype, key.head_dim, rated_seq(key)), set()).update(
          candidates(key))
    rows = tuning.kept_rows(a.log, lambda r: r["chip"] in a.chips) + rate_jobs(jobs)
    write_rows(a.log, rows)
  ratings = {(r["chip"], r["dtype"], r["head_dim"], r["seq"], r["block_q"], r["block_k"]):
             r["estimated_cycles"] for r in rows if r["compiled"] and r["estimated_cycles"]}
  table = {dataclasses.astuple(k): v for k, v in table_from_ratings(ratings).items()}
  tuning.write_tables(a.out, __file__, "flash_attention", F.TuningKey, F.TUNED_VALUE_FIELDS,
                      table, CHIPS, TABLE_ABOUT)
  return 0


if __name__ == "__main__":
  sys.exit(main())
