"""The grouped matmul beyond the headline: other MoE models' expert shapes, rated by the
same method as `estimate.py` (ours: `estimate.rate_gmm`, a `ragged_estimate.GmmCase` at
balanced routing and the kernel's default tiling, which includes the tuning table;
cycles extrapolated from 4 and 8 visits; XLA's `jax.lax.ragged_dot`: its
`cost_analysis()`), one child process per rating (the estimator can abort or exhaust
memory on some tilings; such a row is kept with its error).

    python benchmarks/ragged_survey.py [--chips v6e] [--models mixtral-8x7b ...] [--m 512 8192]
                                       [--memory-bytes N]

Writes benchmarks/results/ragged_survey.jsonl: this run's rows replace the file's rows of
the same (chip, model, m); the others are kept. Static estimates, not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import headline  # noqa: E402  (no jax)
import tuning  # noqa: E402  (no jax)

# (experts, hidden, one expert's intermediate size), from each model's config.json.
MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768),
    "qwen3-235b-a22b": (128, 4096, 1536),
    "mixtral-8x7b": (8, 4096, 14336),
    "deepseek-v3": (256, 7168, 2048),
    "olmoe-1b-7b": (64, 2048, 1024),
}
PARTS = ("gate_up", "down")
CHILD_MEMORY_BYTES = 12 << 30


def _case(model: str, m: int, part: str, chip: str):
  import ragged_estimate
  groups, hidden, width = MODELS[model]
  k, n, gated = (hidden, width, True) if part == "gate_up" else (width, hidden, False)
  return ragged_estimate.GmmCase(m, groups, k, n, gated, chip=chip)


def rate(model: str, m: int, part: str, chip: str, implementation: str) -> dict:
  """One rating, in this process: ours by the static estimate, XLA by cost_analysis."""
  import estimate
  import ragged_estimate
  from tpu_kernels import chips
  case, c = _case(model, m, part, chip), chips.get_chip(chip)
  row = dict(model=model, m=m, part=part, chip=chip, implementation=implementation,
             roofline_us=headline.roofline_us(case, c))
  if implementation == "pallas":
    r = estimate.rate_gmm(case, chip)
    row.update(tiling=r["tiling"], compute_us=r["estimated_cycles"] / c.clock_hz * 1e6,
               hbm_bytes=r["hbm_bytes"])
  else:
    r = estimate._xla_cost(lambda: ragged_estimate.xla_function(case), chip)
    if not r["compiled"]:
      return dict(row, error=r["error"])
    row.update(compute_us=r["compute_us"], hbm_bytes=r["hbm_bytes"])
  row["hbm_us"] = row["hbm_bytes"] / c.hbm_bytes_per_s * 1e6
  row["predicted_us"] = max(row["compute_us"], row["hbm_us"])
  row["efficiency"] = row["roofline_us"] / row["predicted_us"]
  return row


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v6e"])
  parser.add_argument("--models", nargs="+", default=list(MODELS))
  parser.add_argument("--m", nargs="+", type=int, default=[512, 8192, 65536])
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  parser.add_argument("--memory-bytes", type=int, default=CHILD_MEMORY_BYTES,
                      help="each rating's memory cap (some large gated blocks need 20 GiB)")
  parser.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.child:
    import resource   # some tilings make the estimator take all memory: fail the row instead
    resource.setrlimit(resource.RLIMIT_AS, (args.memory_bytes, args.memory_bytes))
    model, m, part, chip, implementation = args.child
    tuning.print_row(rate(model, int(m), part, chip, implementation))
    return
  args.out.mkdir(parents=True, exist_ok=True)
  rows = []
  for chip in args.chips:
    for model in args.models:
      for m in args.m:
        if m < MODELS[model][0]:
          continue
        for part in PARTS:
          for implementation in ("pallas", "xla (lax.ragged_dot)"):
            env = tuning.child_env(
                ESTIMATE_STATIC_PROFILE="1" if implementation == "pallas" else "0")
            got, error = tuning.run_child(__file__, ["--child", model, str(m), part, chip,
                                                     implementation, "--memory-bytes",
                                                     str(args.memory_bytes)], timeout=900, env=env)
            row = got[-1] if not error else dict(model=model, m=m, part=part, chip=chip,
                                                 implementation=implementation, error=error)
            rows.append(row)
            print(json.dumps(row), flush=True)
  path = args.out / "ragged_survey.jsonl"
  rerated = {(r["chip"], r["model"], r["m"]) for r in rows}
  kept = tuning.kept_rows(path, lambda r: (r["chip"], r["model"], r["m"]) in rerated)
  tuning.write_log(path, kept + rows)


if __name__ == "__main__":
  main()
