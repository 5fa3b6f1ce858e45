"""Plain XLA programs: rated by XLA's own cost model, or op by op by the static estimate.

The static estimator crashes on XLA's ragged_dot and takes >300 s / 19 GB on XLA's
attention, so an XLA baseline is rated by `cost_analysis()` (`xla_cost`: optimal_seconds
and bytes accessed), a lower bound for XLA. The glue around a kernel (a route, a combine,
projections) is rated op by op with the static profile on (`glue_part`: cycles summed,
bytes from cost_analysis raised to what the part must move), or by cost_analysis where the
estimator aborts on it (`glue_cost_analysis`). Nothing here imports jax at import time.
"""

from __future__ import annotations

from typing import Callable

from benchmarks.estimator.static_estimate import UNESTIMATED, compile_on_chip, op_cycles


def cost_analysis(compiled) -> dict:
  """XLA's cost_analysis of a compiled program (one dict: flops, bytes accessed,
  optimal_seconds)."""
  cost = compiled.cost_analysis()
  return cost[0] if isinstance(cost, list) else cost


def optimal_seconds(cost: dict, chip) -> tuple[float, bool]:
  """(seconds, valid): XLA's optimal_seconds, or where it is invalid (<= 0, as for the
  gathering paged attention) its flops at `chip`'s bf16 peak (a lower bound for XLA)."""
  optimal = float(cost["optimal_seconds"])
  if optimal > 0:
    return optimal, True
  return float(cost["flops"]) / chip.bf16_flops_per_s, False


def xla_cost(build: Callable[[], tuple], chip: str, min_bytes: int = 0) -> dict:
  """XLA's own cost model for a plain XLA program (no Mosaic kernel): a partial row.
  hbm_bytes = max(bytes accessed, min_bytes), `min_bytes` being what the program must move
  (the case's: every operand read once, every result written once). cost_analysis can count
  less: libtpu 0.0.52 compiles lax.ragged_dot, by default, to one fusion of a convolution
  over all groups, and its bytes accessed count the weights' window (one group's weights,
  8 MB of OLMoE's 537 MB gate/up), not the weights the fusion reads."""
  from tpu_kernels import chips
  fn, specs = build()
  try:
    compiled = compile_on_chip(fn, specs, chip)
  except Exception as e:  # noqa: BLE001  (the compiler's verdict is the row)
    return dict(compiled=False, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
  cost = cost_analysis(compiled)
  accessed = int(cost["bytes accessed"])
  row = dict(compiled=True, error=None, estimated_cycles=None,
             hbm_bytes=max(accessed, min_bytes), xla_flops=float(cost["flops"]),
             method="XLA cost_analysis (optimal_seconds, bytes accessed)")
  if min_bytes > accessed:
    row["method"] = (f"XLA cost_analysis (optimal_seconds; its bytes accessed, {accessed}, "
                     f"raised to the {min_bytes} the program must move)")
  seconds, valid = optimal_seconds(cost, chips.get_chip(chip))
  row["compute_us"] = seconds * 1e6
  if not valid:   # seen for the gathering paged attention: negative optimal_seconds
    row["method"] = (f"XLA cost_analysis: its optimal_seconds is invalid "
                     f"({float(cost['optimal_seconds']):.3g}), so its flops at peak and its "
                     "bytes accessed at full bandwidth (a lower bound for XLA)")
  return row


def compile_glue(fn, specs, chip: str, kernel_fed: bool = False):
  """The glue program compiled for the chip, and XLA's cost_analysis of it. `kernel_fed`:
  its outputs go to a Mosaic kernel within the layer (the route's rows to gate/up, the
  gate pass's to down), so they take the layout XLA chooses (`Layout.AUTO`), as they do
  there. Else they keep the entry's default layout, as the layer's own result does: a
  result such as [256, 2880] bfloat16 then gets a copy into the TPU's column-major layout
  (7,550 cycles on v6e)."""
  compiled = compile_on_chip(fn, specs, chip, auto_out_layout=kernel_fed)
  return compiled, cost_analysis(compiled)


def glue_part(fn, specs, chip: str, min_bytes: int = 0, kernel_fed: bool = False) -> dict:
  """An XLA program `fn(*specs)` rated as compiled for the chip (the static profile on):
  cycles = the sum of its ops' estimates, hbm_bytes = max(cost_analysis's bytes accessed,
  min_bytes); ops, method, and the ops the estimator could not rate. The experts layer's
  glue, the seed prediction's parts and the row quantization before a w8a8 grouped matmul
  use it."""
  compiled, cost = compile_glue(fn, specs, chip, kernel_fed)
  ops = op_cycles(compiled.as_text())
  if not ops:
    raise RuntimeError("the compiled glue carries no estimated_cycles (profile flag off?)")
  unrated = [name for name, c in ops if c >= UNESTIMATED]
  accessed = int(cost.get("bytes accessed", 0))   # absent for a lone Pallas kernel
  part = dict(cycles=sum(c for _, c in ops if c < UNESTIMATED),
              hbm_bytes=max(accessed, min_bytes), ops=len(ops),
              method="static estimate of the compiled ops; bytes: cost_analysis")
  if min_bytes > accessed:
    part["method"] += (f" ({accessed}) raised to the {min_bytes} the "
                       "part must move (a kernel's own DMAs are not in cost_analysis)")
  if unrated:
    part["unrated_ops"] = unrated
    part["method"] += (f"; {', '.join(unrated)}: the estimator returns INT64_MAX, counted "
                       "by its bytes only")
  return part


def glue_cost_analysis(fn, specs, chip: str, min_bytes: int = 0,
                       kernel_fed: bool = False) -> dict:
  """A glue part by XLA's cost_analysis (no profile flag): where the static estimator
  aborts on it (v5e: gathers and scatters, "Unsupported DMA direction: 10 on VL/VLP")."""
  from tpu_kernels import chips
  _, cost = compile_glue(fn, specs, chip, kernel_fed)
  seconds = float(cost["optimal_seconds"])
  if seconds <= 0:
    raise RuntimeError(f"cost_analysis gives optimal_seconds {seconds}")
  return dict(cycles=round(seconds * chips.get_chip(chip).clock_hz),
              hbm_bytes=max(int(cost["bytes accessed"]), min_bytes),
              method="XLA cost_analysis (optimal_seconds, bytes accessed; a lower bound: "
                     "no per-op cost): the static estimator aborts on this part")
