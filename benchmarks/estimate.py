"""Static performance estimates from the TPU compiler's own cycle count (no TPU needed).

    python benchmarks/estimate.py [--chips v5e v6e] [--quick] [--out benchmarks/results]

Each case is compiled ahead of time with libtpu's static LLO profile switched on; every
op of the compiled program then carries `estimated_cycles`. Because that estimate
does not cap HBM bandwidth, the prediction is

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth)

where hbm_bytes counts every block the kernel's grid fetches or writes back (for
RMSNorm each row block once, the weight once: the operand and result sizes). The
roofline is max(flops / peak, minimum bytes / bandwidth); efficiency = roofline /
prediction. The XLA baseline (plain jnp RMSNorm) is estimated the same way.
These are static estimates, not measurements: nothing here ran on a TPU.

Writes <out>/estimates.jsonl and <out>/estimates.md. (Issue 6 grows this into the
full estimator: anchors, autotuning, charts.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))

# The static profile must be requested before libtpu loads, i.e. before jax is imported.
_PROFILE_DIR = tempfile.mkdtemp(prefix="static_llo_profile_")
os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                  f" --xla_jf_dump_static_llo_profile_to={_PROFILE_DIR}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tpu_kernels import aot, chips, rms_norm  # noqa: E402

S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class Case:
  kernel: str
  name: str
  implementation: str                  # "pallas" or "xla"
  build: Callable[[str], tuple[Callable, list]]   # chip -> (fn, arg specs)
  hbm_bytes: int                        # bytes the grid really moves
  min_bytes: int                        # operands + results once
  flops: int


def _nbytes(shape, dtype) -> int:
  return int(np.prod(shape)) * jnp.dtype(dtype).itemsize


def rms_norm_cases(rows: int, hidden: int, dtype=jnp.bfloat16) -> list[Case]:
  x, w = S((rows, hidden), dtype), S((hidden,), dtype)
  moved = 2 * _nbytes((rows, hidden), dtype) + _nbytes((hidden,), dtype)
  flops = 4 * rows * hidden
  label = f"rms_norm bf16[{rows},{hidden}]" if dtype == jnp.bfloat16 else \
      f"rms_norm {jnp.dtype(dtype).name}[{rows},{hidden}]"

  def pallas(chip):
    return functools.partial(rms_norm.rms_norm, chip=chip), [x, w]

  def xla(chip):
    return rms_norm.rms_norm_reference, [x, w]

  return [Case("rms-norm-tpu", label, "pallas", pallas, moved, moved, flops),
          Case("rms-norm-tpu", label, "xla (jnp)", xla, moved, moved, flops)]


def all_cases(quick: bool) -> list[Case]:
  if quick:
    return rms_norm_cases(8, 4096)
  return [*rms_norm_cases(8192, 4096), *rms_norm_cases(8, 4096)]


def estimate(case: Case, chip_name: str) -> dict:
  chip = chips.get_chip(chip_name)
  fn, specs = case.build(chip_name)
  report = aot.compile_for_chip(fn, specs, chip_name)
  row = dict(kernel=case.kernel, case=case.name, implementation=case.implementation,
             chip=chip_name, compiled=report.ok, error=report.error)
  if not report.ok or report.estimated_cycles is None:
    return row
  compute_us = report.estimated_cycles / chip.clock_hz * 1e6
  hbm_us = case.hbm_bytes / chip.hbm_bytes_per_s * 1e6
  predicted_us = max(compute_us, hbm_us)
  roofline_us = max(case.flops / chip.bf16_flops_per_s, case.min_bytes / chip.hbm_bytes_per_s) * 1e6
  row.update(estimated_cycles=report.estimated_cycles, compute_us=compute_us,
             hbm_bytes=case.hbm_bytes, hbm_us=hbm_us, predicted_us=predicted_us,
             roofline_us=roofline_us, efficiency=roofline_us / predicted_us)
  return row


def markdown(rows: list[dict]) -> str:
  lines = ["| case | impl | chip | cycles | compute µs | HBM µs | predicted µs | roofline µs | efficiency |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "predicted_us" not in r:
      lines.append(f"| {r['case']} | {r['implementation']} | {r['chip']} | failed: {r['error']} |||||")
      continue
    lines.append(f"| {r['case']} | {r['implementation']} | {r['chip']} | {r['estimated_cycles']:,} "
                 f"| {r['compute_us']:.2f} | {r['hbm_us']:.2f} | {r['predicted_us']:.2f} "
                 f"| {r['roofline_us']:.2f} | {r['efficiency']:.2f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--quick", action="store_true", help="decode-size cases only (seconds)")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  args = parser.parse_args(argv)
  rows = [estimate(case, chip) for case in all_cases(args.quick) for chip in args.chips]
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "estimates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  table = markdown(rows)
  (args.out / "estimates.md").write_text(
      "Static estimates (libtpu cycle count, not a TPU measurement):\n\n" + table)
  print(table)
  return 0 if all(r["compiled"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
