"""How much of the MXU's peak one matmul of flash attention's shapes gets, in libtpu's
static estimate: the evidence behind docs/performance/flash-attention.md's account of the v6e
attention gap.

Each probe is a Pallas kernel that runs one `lax.dot_general` of two bf16 blocks held in
VMEM per grid step (STEPS steps over the same blocks: no DMA after the first) and stores
the f32 result. efficiency = 2 M N K STEPS / peak / (estimated cycles / clock): the
share of the chip's bf16 peak (`tpu_kernels.chips`) the matmul gets, per-step overhead
and the result's store included, as in a kernel.

The probes are attention's matmuls at 1024 x 1024 blocks, head_dim 128 (s = q k^T,
o = p v, and o^T = v^T p^T, the form the dq kernel uses for its ds k), next to a
full-depth matmul of the same output size. Usage:

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/probes/mxu.py [--chips v6e v5e] [--probes NAME ...]

It prints one `ROW {json}` line per (chip, probe) and a markdown table. About 10 s a
probe.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import os  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__":
  children.enable_static_profile()   # before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from tpu_kernels import aot, chips  # noqa: E402
from tpu_kernels.attention_common import NN, NT, TN  # noqa: E402

STEPS = 8
BLOCK, HEAD_DIM = 1024, 128
# name -> (lhs shape, rhs shape, dimension numbers); the output is (M, N).
PROBES = {
    "s = q k^T": ((BLOCK, HEAD_DIM), (BLOCK, HEAD_DIM), NT),
    "o = p v": ((BLOCK, BLOCK), (BLOCK, HEAD_DIM), NN),
    "o^T = v^T p^T": ((BLOCK, HEAD_DIM), (BLOCK, BLOCK), TN),
    "full depth 1024x256 @ 256x1024": ((BLOCK, 2 * HEAD_DIM), (2 * HEAD_DIM, BLOCK), NN),
}


def _mnk(lhs, rhs, dims):
  """(M, N, K) of lax.dot_general(lhs, rhs, dims) for 2-D operands."""
  (lhs_contract,), (rhs_contract,) = dims[0]
  return lhs[1 - lhs_contract], rhs[1 - rhs_contract], lhs[lhs_contract]


def rate(chip_name: str, name: str) -> dict:
  lhs, rhs, dims = PROBES[name]
  m, n, k = _mnk(lhs, rhs, dims)

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = lax.dot_general(a_ref[...], b_ref[...], dims,
                                 preferred_element_type=jnp.float32)

  def probe(a, b):
    return pl.pallas_call(
        kernel, grid=(STEPS,),
        in_specs=[pl.BlockSpec(lhs, lambda i: (0, 0)), pl.BlockSpec(rhs, lambda i: (0, 0))],
        out_specs=pl.BlockSpec((m, n), lambda i: (0, 0)),
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=64 << 20))(a, b)

  report = aot.compile_for_chip(
      probe, [jax.ShapeDtypeStruct(lhs, jnp.bfloat16), jax.ShapeDtypeStruct(rhs, jnp.bfloat16)],
      chip_name)
  chip = chips.get_chip(chip_name)
  row = {"chip": chip_name, "probe": name, "m": m, "n": n, "k": k, "steps": STEPS,
         "cycles": report.estimated_cycles, "error": report.error}
  if report.estimated_cycles:
    seconds = report.estimated_cycles / chip.clock_hz
    row["cycles_per_step"] = report.estimated_cycles / STEPS
    row["efficiency"] = 2 * m * n * k * STEPS / chip.bf16_flops_per_s / seconds
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", nargs="+", default=["v6e", "v5e"])
  parser.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
  args = parser.parse_args(argv)
  rows = [rate(c, p) for c in args.chips for p in args.probes]
  for row in rows:
    children.print_row(row)
  print("\n| chip | matmul | M x K x N | cycles / step | efficiency |\n|---|---|---|---:|---:|")
  for r in rows:
    eff = f"{r['efficiency']:.2f}" if "efficiency" in r else f"not rated ({r['error']})"
    per_step = f"{r['cycles_per_step']:,.0f}" if "cycles_per_step" in r else ""
    print(f"| {r['chip']} | {r['probe']} | {r['m']} x {r['k']} x {r['n']} | {per_step} | {eff} |")
  return 0 if all("efficiency" in r for r in rows) else 1


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
