"""The grouped matmul beyond the headline: other MoE models' expert shapes (cases/survey.py),
rated by the same method as `estimate.py` (ours: `rating/ragged_dot.rate_gmm` on the kernel
call the op makes (`gmm_case`) at balanced routing and the kernel's default tiling, which
includes the tuning table; cycles extrapolated from 4 and 8 visits; XLA's
`jax.lax.ragged_dot`: its `cost_analysis()`, peers/xla_ops.py), one child process per rating
(the estimator can abort or exhaust memory on some tilings; such a row is kept with its
error).

    python benchmarks/ragged_survey.py [--chips v6e] [--models mixtral-8x7b ...] [--m 512 8192]
                                       [--memory-bytes N]

Writes benchmarks/results/ragged_survey.jsonl: this run's rows replace the file's rows of
the same (chip, model, m); the others are kept. Static estimates, not measurements.
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402

from benchmarks import RESULTS, write_rows  # noqa: E402
from benchmarks.cases import survey  # noqa: E402  (no jax)
from benchmarks.estimator import children  # noqa: E402  (no jax)
from benchmarks.tuning import kept_rows  # noqa: E402


def rate(model: str, m: int, part: str, chip: str, implementation: str) -> dict:
  """One rating, in this process: ours by the static estimate, XLA by cost_analysis."""
  from tpu_kernels import chips
  from benchmarks.estimator.xla_cost import xla_cost
  from benchmarks.peers import xla_ops
  from benchmarks.rating import ragged_dot
  from benchmarks.rating import roofline
  case, c = survey.case(model, m, part), chips.get_chip(chip)
  gmm = ragged_dot.gmm_case(case, chip)
  row = dict(model=model, m=m, part=part, chip=chip, implementation=implementation,
             roofline_us=roofline.roofline_us(gmm, c))
  if implementation == "pallas":
    r = ragged_dot.rate_gmm(gmm, chip)
    row.update(tiling=r["tiling"], compute_us=roofline.compute_us(r["estimated_cycles"], c),
               hbm_bytes=r["hbm_bytes"])
  else:
    r = xla_cost(lambda: xla_ops.grouped_matmul_program(case), chip, case.min_bytes())
    if not r["compiled"]:
      return dict(row, error=r["error"])
    row.update(compute_us=r["compute_us"], hbm_bytes=r["hbm_bytes"], method=r["method"])
  row["hbm_us"] = roofline.hbm_us(row["hbm_bytes"], c)
  row["predicted_us"] = max(row["compute_us"], row["hbm_us"])
  row["efficiency"] = row["roofline_us"] / row["predicted_us"]
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v6e"])
  parser.add_argument("--models", nargs="+", default=list(survey.MODELS))
  parser.add_argument("--m", nargs="+", type=int, default=[512, 8192, 65536])
  parser.add_argument("--out", type=Path, default=RESULTS)
  parser.add_argument("--memory-bytes", type=int, default=children.CHILD_MEMORY_BYTES,
                      help="each rating's memory cap (some large gated blocks need 20 GiB)")
  parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    children.limit_memory(args.memory_bytes)   # some tilings take all memory: fail the row
    model, m, part, chip, implementation = args.child
    if implementation == "pallas":
      children.enable_static_profile()   # before jax loads
    children.print_row(rate(model, int(m), part, chip, implementation))
    return
  args.out.mkdir(parents=True, exist_ok=True)
  rows = []
  for chip in args.chips:
    for model in args.models:
      for m in args.m:
        if m < survey.MODELS[model][0]:
          continue
        for part in survey.PARTS:
          for implementation in ("pallas", "xla (lax.ragged_dot)"):
            got, error = children.run_child(__file__, ["--child", model, str(m), part, chip,
                                                       implementation, "--memory-bytes",
                                                       str(args.memory_bytes)], timeout=900)
            row = got[-1] if not error else dict(model=model, m=m, part=part, chip=chip,
                                                 implementation=implementation, error=error)
            rows.append(row)
            print(json.dumps(row), flush=True)
  path = args.out / "ragged_survey.jsonl"
  rerated = {(r["chip"], r["model"], r["m"]) for r in rows}
  kept = kept_rows(path, lambda r: (r["chip"], r["model"], r["m"]) in rerated)
  write_rows(path, kept + rows)


if __name__ == "__main__":
  main()
