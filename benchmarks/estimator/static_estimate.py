"""Compiling a program for a TPU chip ahead of time, and reading libtpu's static estimate.

With the static profile asked for (`children.enable_static_profile`, before jax loads), each
op of a compiled program carries `estimated_cycles`: for a Mosaic (Pallas) kernel, the
bundles it really issues (loops unrolled, trip counts evaluated) plus DMA-wait stalls;
identical run to run. Compiling needs no TPU: the chip's topology stands in for it
(`tpu_kernels.aot`). Nothing here imports jax at import time.
"""

from __future__ import annotations

import re

# The estimator's value for an op it cannot estimate: INT64_MAX (seen on v6e's offloaded
# scatter-add, `scatter_offload_custom_fusion`).
UNESTIMATED = 2 ** 62


def compile_on_chip(fn, specs, chip: str, *, auto_out_layout: bool = False):
  """`fn` compiled for `chip` on ShapeDtypeStruct `specs` placed on its topology's device.
  `auto_out_layout`: the outputs take the layout XLA chooses (`Layout.AUTO`), as they do
  where a Mosaic kernel reads them inside a larger program; else the entry's default."""
  import jax
  from tpu_kernels import aot
  device = aot.topology_device(chip)
  args = [aot._on_device(s, device) for s in specs]
  if auto_out_layout:
    from jax.experimental.layout import Format, Layout
    jitted = jax.jit(fn, out_shardings=Format(Layout.AUTO,
                                              jax.sharding.make_single_device_sharding(device)))
  else:
    jitted = jax.jit(fn)
  return jitted.trace(*args).lower().compile()


def kernel_cycles(hlo_text: str) -> tuple[int, int]:
  """(sum of the Mosaic kernels' estimated cycles, number of Mosaic kernels)."""
  from tpu_kernels import aot
  cycles = aot.mosaic_kernel_cycles(hlo_text)
  return sum(cycles), len(cycles)


def op_cycles(hlo_text: str) -> list[tuple[str, int]]:
  """(instruction name, estimated cycles) of every op of compiled HLO text that carries one."""
  from tpu_kernels import aot
  out = []
  for instruction in re.split(r"\n\s*(?:ROOT\s+)?%", hlo_text.replace('\\"', '"')):
    found = aot._ESTIMATED_CYCLES.search(instruction)
    if found:
      name = instruction.strip().removeprefix("ROOT ").lstrip("%").split(" ", 1)[0]
      out.append((name, int(found.group(1))))
  return out


def whole_program(fn, specs, chip: str, hbm_bytes: int) -> dict:
  """A partial row: the static estimate of every Mosaic kernel of the program as compiled,
  at `hbm_bytes` (the bytes it must move; the estimator does not cap HBM bandwidth)."""
  from tpu_kernels import aot
  report = aot.compile_for_chip(fn, specs, chip)
  if not report.ok:
    return dict(compiled=False, error=report.error)
  return dict(compiled=True, error=None, estimated_cycles=report.estimated_cycles,
              hbm_bytes=hbm_bytes, method="static estimate of the whole program")
