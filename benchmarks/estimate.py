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

Grouped matmul (ragged-dot-tpu, Qwen3-30B-A3B gate/up and down, balanced routing): the
kernel's visit table lives in SMEM, which the estimator reads as zeros, so the kernel is
built with a static visit count and its table made visible (benchmarks/ragged_estimate.py).
Its estimator time grows faster than linearly with grid steps, so each case is estimated at
two truncated visit counts (4 and 8 visits, identical per-visit work) and the kernel's
cycles extrapolated linearly to the real count (exactly linear where checked: 4, 8, 16).
The kernel takes the visit table as an input. The small scalar-core kernel that builds it
from group_sizes (group_metadata) is not rated: the estimator crashes on its loops (stack
overflow in its evaluator). It is one launch walking G_total + 2 G_local groups and writing
7 words per visit to SMEM, so it is left out of the prediction (each row says so).
(Built from XLA ops instead, the table cost ~30 small ops, 80-101k cycles on v6e.)
The XLA baseline jax.lax.ragged_dot crashes the estimator (SIGSEGV), so it is rated by
XLA's own cost_analysis()["optimal_seconds"], compiled in a subprocess without the flag.

Writes <out>/estimates.jsonl and <out>/estimates.md. (Issue 6 grows this into the
full estimator: anchors, autotuning, charts.)
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))

# The static profile must be requested before libtpu loads, i.e. before jax is imported.
# (Not in the subprocess that rates XLA's ragged_dot by cost_analysis: the flag crashes it.)
if os.environ.get("ESTIMATE_STATIC_PROFILE", "1") == "1":
  _PROFILE_DIR = tempfile.mkdtemp(prefix="static_llo_profile_")
  os.environ["LIBTPU_INIT_ARGS"] = (os.environ.get("LIBTPU_INIT_ARGS", "") +
                                    f" --xla_jf_dump_static_llo_profile_to={_PROFILE_DIR}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tpu_kernels import aot, chips, rms_norm  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks"))
import ragged_estimate  # noqa: E402

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


@dataclasses.dataclass(frozen=True)
class RaggedCase:
  """A grouped-matmul forward at balanced routing; `estimate_ragged` rates it per chip."""

  kernel: str
  name: str
  implementation: str     # "pallas" or "xla (lax.ragged_dot)"
  gmm: Callable[[str], ragged_estimate.GmmCase]   # chip -> the case with the chip's tiling


QWEN3 = dict(groups=128, hidden=2048, width=768)   # Qwen3-30B-A3B experts
TRUNCATED_VISITS = (4, 8)


def ragged_dot_cases(m: int) -> list[RaggedCase]:
  g, h, i = QWEN3["groups"], QWEN3["hidden"], QWEN3["width"]
  out = []
  for label, k, n_out, gated in ((f"gate_up+silu bf16 m={m}", h, i, True),
                                 (f"down bf16 m={m}", i, h, False)):
    name = f"ragged_dot Qwen3-30B-A3B {label}"
    gmm = functools.partial(ragged_estimate.GmmCase, m, g, k, n_out, gated)
    out += [RaggedCase("ragged-dot-tpu", name, "pallas", lambda chip, gmm=gmm: gmm(chip=chip)),
            RaggedCase("ragged-dot-tpu", name, "xla (lax.ragged_dot)",
                       lambda chip, gmm=gmm: gmm(chip=chip))]
  return out


def all_cases(quick: bool, kernels=None) -> list:
  if quick:
    cases = rms_norm_cases(8, 4096)
  else:
    cases = [*rms_norm_cases(8192, 4096), *rms_norm_cases(8, 4096), *ragged_dot_cases(512),
             *ragged_dot_cases(8192)]
  return [c for c in cases if kernels is None or c.kernel in kernels]


def _kernel_cycles(hlo_text: str) -> int:
  """The static estimate of the Mosaic kernels alone (their tpu_custom_call lines)."""
  total = 0
  for line in hlo_text.replace('\\"', '"').splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      total += int(re.search(r'"estimated_cycles":"?(\d+)', line).group(1))
  return total


def _compile_text(fn, specs, chip_name) -> str:
  device = aot.topology_device(chip_name)
  specs = [aot._on_device(s, device) for s in specs]
  return jax.jit(fn).trace(*specs).lower().compile().as_text()


def _child(mode: str, case: RaggedCase, chip_name: str, profile: bool) -> dict:
  """Runs `_child_main` in a subprocess (the estimator may abort the process)."""
  env = {**os.environ, "ESTIMATE_STATIC_PROFILE": "1" if profile else "0"}
  env["LIBTPU_INIT_ARGS"] = re.sub(r"--xla_jf_dump_static_llo_profile_to=\S+", "",
                                   env.get("LIBTPU_INIT_ARGS", ""))
  result = subprocess.run([sys.executable, __file__, "--child", mode, case.name, chip_name],
                          capture_output=True, text=True, timeout=600, env=env)
  if result.returncode:
    fatal = [l for l in result.stderr.splitlines() if re.match(r"F\d{4} ", l)] or \
        result.stderr.strip().splitlines()[-1:]
    raise RuntimeError(f"exit {result.returncode}: {fatal[0][:300] if fatal else ''}")
  return json.loads(result.stdout.strip().splitlines()[-1])


def _child_main(mode: str, name: str, chip_name: str) -> None:
  """xla-cost: cost_analysis of XLA's ragged_dot (no profile flag: it crashes the
  estimator)."""
  assert mode == "xla-cost", mode
  case = next(c for c in all_cases(False) if isinstance(c, RaggedCase) and c.name == name)
  gmm = case.gmm(chip_name)
  fn, specs = ragged_estimate.xla_function(gmm)
  cost = jax.jit(fn).trace(*[aot._on_device(s, aot.topology_device(chip_name))
                             for s in specs]).lower().compile().cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  print(json.dumps({k: float(cost[k]) for k in ("optimal_seconds", "bytes accessed",
                                                 "flops")}))


def estimate_ragged(case: RaggedCase, chip_name: str) -> dict:
  """Pallas: predicted = max(kernel cycles / clock, bytes the grid moves / HBM bandwidth)
  (the visit-table kernel is not rated; noted in the row).
  XLA: max(cost_analysis optimal_seconds, operand bytes / HBM bandwidth)."""
  chip = chips.get_chip(chip_name)
  gmm = case.gmm(chip_name)
  row = dict(kernel=case.kernel, case=case.name, implementation=case.implementation,
             chip=chip_name, compiled=False, error=None)
  roofline_us = max(gmm.flops() / chip.bf16_flops_per_s,
                    gmm.min_bytes() / chip.hbm_bytes_per_s) * 1e6
  try:
    if case.implementation != "pallas":
      cost = _child("xla-cost", case, chip_name, profile=False)
      compute_us = cost["optimal_seconds"] * 1e6
      hbm_us = gmm.min_bytes() / chip.hbm_bytes_per_s * 1e6   # each weight read once
      predicted_us = max(compute_us, hbm_us)
      row.update(compiled=True, estimated_cycles=None, method="cost_analysis optimal_seconds",
                 xla_bytes_accessed=cost["bytes accessed"], compute_us=compute_us,
                 hbm_bytes=gmm.min_bytes(), hbm_us=hbm_us, predicted_us=predicted_us,
                 roofline_us=roofline_us, efficiency=roofline_us / predicted_us)
      return row
    t, table = gmm.tiling(), gmm.table()
    table.check(num_k_tiles=-(-gmm.k // t.block_k))
    visits = table.num_visits
    kernel = []
    for v in TRUNCATED_VISITS:
      kernel.append(_kernel_cycles(_compile_text(gmm.function(v), gmm.specs(), chip_name)))
  except Exception as e:  # noqa: BLE001  (a failed case is a row, not a crash)
    row["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return row
  (v1, v2), (k1, k2) = TRUNCATED_VISITS, kernel
  per_visit = (k2 - k1) / (v2 - v1)
  kernel_cycles = round(k1 + per_visit * (visits - v1))
  compute_us = kernel_cycles / chip.clock_hz * 1e6
  hbm_bytes = gmm.hbm_bytes()
  hbm_us = hbm_bytes / chip.hbm_bytes_per_s * 1e6
  predicted_us = max(compute_us, hbm_us)
  row.update(compiled=True, estimated_cycles=kernel_cycles,
             method="static estimate, extrapolated",
             kernel_cycles=kernel_cycles,
             not_rated="the visit-table kernel (the estimator crashes on its loops)",
             visits=visits,
             truncated_visits=list(TRUNCATED_VISITS), truncated_kernel_cycles=kernel,
             cycles_per_visit=per_visit,
             hand_cycles_per_visit=gmm.hand_cycles_per_visit(chip.clock_hz,
                                                             chip.bf16_flops_per_s,
                                                             chip.hbm_bytes_per_s),
             tiling=dict(block_m=t.block_m, block_k=t.block_k, block_n=t.block_n,
                         vmem_limit_bytes=t.vmem_limit_bytes),
             compute_us=compute_us, hbm_bytes=hbm_bytes, hbm_us=hbm_us,
             predicted_us=predicted_us,
             roofline_us=roofline_us, efficiency=roofline_us / predicted_us)
  return row


def estimate(case, chip_name: str) -> dict:
  if isinstance(case, RaggedCase):
    return estimate_ragged(case, chip_name)
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
    cycles = "cost_analysis" if r["estimated_cycles"] is None else f"{r['estimated_cycles']:,}"
    lines.append(f"| {r['case']} | {r['implementation']} | {r['chip']} | {cycles} "
                 f"| {r['compute_us']:.2f} | {r['hbm_us']:.2f} | {r['predicted_us']:.2f} "
                 f"| {r['roofline_us']:.2f} | {r['efficiency']:.2f} |")
  ragged = [r for r in rows if r.get("kernel_cycles") is not None]
  if ragged:
    lines += ["", "Grouped matmul (Pallas) in detail: the kernel's cycles extrapolated from "
              "truncated visit counts (4 and 8 visits; predicted = max(kernel, its HBM "
              "bytes)), the small kernel that builds the visit table left out (the "
              "estimator crashes on it), and the cycles per visit against "
              "a hand count (max(MXU time, weight DMA time at the HBM bandwidth)). XLA rows: "
              "cost_analysis optimal_seconds, weights in XLA's own (G, k, n) layout.", "",
              "| case | chip | tiling bm x bk x bn | visits | kernel cycles "
              "| cycles/visit | hand cycles/visit |",
              "|---|---|---|---:|---:|---:|---:|"]
    for r in ragged:
      t = r["tiling"]
      lines.append(f"| {r['case']} | {r['chip']} | {t['block_m']}x{t['block_k']}x{t['block_n']} "
                   f"| {r['visits']} | {r['kernel_cycles']:,} "
                   f"| {r['cycles_per_visit']:,.0f} | {r['hand_cycles_per_visit']:,.0f} |")
  return "\n".join(lines) + "\n"


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--quick", action="store_true", help="decode-size cases only (seconds)")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  parser.add_argument("--kernels", nargs="+", help="only these kernels (hub names)")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)   # see _child
  args = parser.parse_args(argv)
  if args.child:
    _child_main(*args.child)
    return 0
  rows = []
  for case in all_cases(args.quick, args.kernels):
    for chip in args.chips:
      rows.append(estimate(case, chip))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  (args.out / "estimates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  table = markdown(rows)
  (args.out / "estimates.md").write_text(
      "Static estimates (libtpu cycle count, not a TPU measurement):\n\n" + table)
  print(table)
  return 0 if all(r["compiled"] for r in rows) else 1


if __name__ == "__main__":
  sys.exit(main())
