"""Static performance estimates from the TPU compiler's own cycle count (no TPU needed).

    python benchmarks/estimate.py [--chips v5e v6e] [--quick] [--cases SUBSTR ...]
                                  [--no-anchors] [--out benchmarks/results]

Every case (`benchmarks/cases/`: the headline and every other family) is rated for each
chip, for our kernel (`benchmarks/rating/`), the XLA-native baseline and the peers' own
Pallas kernels (`benchmarks/peers/`: jax's, tokamax's, tpu-inference's), in one run. A
Pallas program is compiled ahead of time with libtpu's static LLO profile on;
each op of the compiled program then carries `estimated_cycles`. That estimate does not
cap HBM bandwidth, so

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth)
    roofline_us  = max(flops / peak, min_bytes / hbm_bandwidth)     (rating/roofline.py)
    efficiency   = roofline_us / predicted_us

where hbm_bytes counts every block the grid really fetches or writes back. These are
static estimates, not measurements: nothing here ran on a TPU.

How each implementation is rated (the details and checks live in each module):

  rms_norm         the whole program, as compiled (ours and plain-jnp XLA alike).
  ragged_dot       `rating/ragged_dot.py`: the kernel's SMEM visit table made visible to
                   the estimator, cycles extrapolated from 4 and 8 visits; the small kernel
                   that builds the table is not rated (the estimator crashes on it).
  flash_attention  `rating/flash_attention.py`: the GQA kernel's MHA program at the same
                   tiling (3-D blocks rate at 0), extrapolated in heads and, past
                   S=8192, per visited tile.
  paged_attention  `rating/paged_attention.py`: per-item values made visible, extrapolated
                   from truncated batches (and, past 4k, contexts).
  experts layer    `rating/experts_layer.py`: the layer part by part, summed.
  XLA baselines    `peers/xla_ops.py`: plain jnp RMSNorm by the same estimator;
                   `jax.lax.ragged_dot`, `jax.nn.dot_product_attention` and the gathering
                   paged attention by XLA's own `cost_analysis()` (optimal_seconds, bytes
                   accessed): the estimator crashes on ragged_dot and takes >300 s / 19 GB
                   on attention.
  peers            `peers/` (their own subprocesses, in their own venvs).

Each of ours is rated in a child process (`--child`): the estimator can abort the
process (libtpu 0.0.42 on the paged kernel for v5e) and its memory grows per compile.
A failed rating is a row with its error, never a crash.

Writes <out>/estimates.jsonl, <out>/estimates.md (the table every kernel card and the
README quote; reports/estimates.py), <out>/estimates.png (every case) and
<out>/estimates-<kernel>.png (one kernel's cases: its card's chart; reports/charts.py).
`python benchmarks/report.py` writes the tables and charts again from the stored rows.
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import time  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

# The static profile must be requested before libtpu loads, i.e. before jax is imported.
# (Not in the children that rate XLA by cost_analysis: the flag crashes ragged_dot.)
if os.environ.get("ESTIMATE_STATIC_PROFILE", "1") == "1":
  children.enable_static_profile()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

from benchmarks import RESULTS, cases, peers, read_rows, write_rows  # noqa: E402
from benchmarks.cases.headline import RmsNorm  # noqa: E402
from benchmarks.peers.protocol import ANCHOR, OURS, Implementation  # noqa: E402
from benchmarks.rating import ours  # noqa: E402
from benchmarks.rating.rows import finish_row  # noqa: E402
from benchmarks.reports import charts  # noqa: E402
from benchmarks.reports import estimates as report  # noqa: E402

QUICK = (RmsNorm(8, 4096),)


def implementations(quick: bool, names_of_cases=None, with_anchors: bool = True,
                    names=None) -> list[Implementation]:
  """What a run rates: ours, XLA's and (unless quick or not with_anchors) the anchors, for
  the cases whose name contains one of `names_of_cases` and, if `names` is given, only the
  implementations whose name contains one of `names`."""
  chosen = QUICK if quick else cases.all_cases()
  if names_of_cases:
    chosen = [c for c in chosen if any(s in c.name for s in names_of_cases)]
  rows = {c.name: (ours.implementations(c), peers.implementations(c)) for c in chosen}
  out = [impl for mine, theirs in rows.values()
         for impl in mine + [t for t in theirs if t.source != ANCHOR]]
  if with_anchors and not quick:
    out += [t for _, theirs in rows.values() for t in theirs if t.source == ANCHOR]
  if names:
    out = [impl for impl in out if any(n in impl.implementation for n in names)]
  return out


def _rate_in_child(impl: Implementation, chip: str) -> dict:
  env = children.child_env(ESTIMATE_STATIC_PROFILE="1" if impl.static_profile else "0")
  rows, error = children.run_child(__file__, ["--child", impl.case, impl.implementation, chip],
                                   timeout=CHILD_TIMEOUT_S, env=env)
  return dict(compiled=False, error=error) if error else rows[-1]


CHILD_TIMEOUT_S = 900


def _child_main(case: str, implementation: str, chip: str) -> None:
  impl = next(i for i in implementations(False, [case], with_anchors=False)
              if i.case == case and i.implementation == implementation)
  try:
    partial = impl.rate(chip)
  except Exception as e:  # noqa: BLE001  (a failed rating is a row)
    partial = dict(compiled=False, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
  children.print_row(partial)


def rate(impl: Implementation, chip: str) -> dict:
  """The full row of `impl` on `chip`: an anchor rates itself (its own children), ours and
  XLA's are rated in a child of this script."""
  start = time.time()
  partial = impl.rate(chip) if impl.source == ANCHOR else _rate_in_child(impl, chip)
  row = finish_row(impl, chip, partial)
  row["rate_seconds"] = round(time.time() - start, 1)
  return row


def merged(old: list[dict], new: list[dict]) -> list[dict]:
  """`old` with each row that `new` re-rates (same case, implementation and chip) replaced
  in place; new rows for other keys are added after the last old row of their case."""
  key = lambda r: (r["case"], r["implementation"], r["chip"])
  fresh = {key(r): r for r in new}
  out = [fresh.pop(key(r), r) for r in old]
  for r in new:
    if key(r) in fresh:
      last = max((i for i, o in enumerate(out) if o["case"] == r["case"]), default=len(out) - 1)
      out.insert(last + 1, fresh.pop(key(r)))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--quick", action="store_true", help="decode-size RMSNorm only (seconds)")
  parser.add_argument("--cases", nargs="+", help="only cases whose name contains one of these")
  parser.add_argument("--no-anchors", action="store_true", help="ours and XLA only")
  parser.add_argument("--implementations", nargs="+",
                      help="only implementations whose name contains one of these (with --merge: "
                           "add or refresh some rows)")
  parser.add_argument("--out", type=Path, default=RESULTS)
  parser.add_argument("--merge", action="store_true",
                      help="keep the rows of --out's estimates.jsonl that this run does not "
                           "re-rate (with --cases: refresh some cases, rewrite every output)")
  parser.add_argument("--markdown-only", action="store_true",
                      help="rewrite --out's estimates.md from its estimates.jsonl (no rating; "
                           "e.g. after benchmarks/calibration.py changed the expected column)")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)   # see _rate_in_child
  args = parser.parse_args(argv)
  if args.child:
    _child_main(*args.child)
    return 0
  if args.markdown_only:
    (args.out / "estimates.md").write_text(
        report.HEADER + report.markdown(read_rows(args.out / "estimates.jsonl")))
    return 0
  rows = []
  for impl in implementations(args.quick, args.cases, not args.no_anchors, args.implementations):
    for chip in args.chips:
      rows.append(rate(impl, chip))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.merge:
    rows = merged(read_rows(args.out / "estimates.jsonl"), rows)
  write_rows(args.out / "estimates.jsonl", rows)
  table = report.markdown(rows)
  (args.out / "estimates.md").write_text(report.HEADER + table)
  charts.charts(rows, args.out)
  print(table)
  mine = [r for r in rows if r["source"] == OURS]
  return 0 if all("predicted_us" in r for r in mine) else 1


if __name__ == "__main__":
  sys.exit(main())
