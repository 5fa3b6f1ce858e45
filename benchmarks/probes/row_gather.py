"""What the experts layer's row gather costs as row DMAs, against XLA's gather, in libtpu's
static estimate: the evidence behind docs/performance/experts-layer.md's verdict on fusing
moe.route's gather into the gate/up kernel (issue 28, item 3).

At prefill moe.route gathers x[T, H] into the T*K rows of the sorted (token, expert) pairs
(Qwen3-30B-A3B, 8192 tokens x top-8: 65,536 rows of 2048 bfloat16, 268 MB written). A fused
gate/up kernel would fetch each visit's rows itself, one DMA per row by scalar-prefetched
row ids, as moe_combine.gather_weighted_sum does for the combine. Two things decide it:

* whether Mosaic can DMA one bfloat16 row: it cannot (a bf16 HBM slice must cover whole
  (16, 128) tiles: "Slice sizes along tiled dimensions must be aligned to tiles"). Packing
  the row's bf16 pairs into uint32 words (word j = x[:, j] | x[:, j + H/2] << 16, one
  elementwise XLA pass over x) makes each row a 32-bit row, which does compile; the kernel
  would unpack the two halves and contract each with its half of the weight rows;
* what a row DMA costs. The probes below each produce the gathered [T*K, W] array:

    xla bf16 gather      x.at[ids].get(mode="promise_in_bounds"), as moe.route does
    dma u32 rows         one DMA per row of the packed uint32 [T, H/2] (BLOCK rows a step)
    dma bf16 rows        the same of bf16 [T, H] rows (expected: Mosaic's tile error)
    pack                 the bf16 -> uint32 packing pass alone

Usage (a probe a process: libtpu's estimator aborts processes on some chips):

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/probes/row_gather.py [--chips v6e v5e]
        [--tokens 8192] [--top-k 8] [--hidden 2048] [--block 512] [--probes NAME ...]

It prints one `ROW {json}` line per (chip, probe) and a markdown table; about 10 s a probe
at the default (Qwen3-30B-A3B prefill) shape.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import os  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and "--child" in sys.argv:
  children.enable_static_profile()   # before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

from tpu_kernels import aot, chips  # noqa: E402

PROBES = ("xla bf16 gather", "dma u32 rows", "dma bf16 rows", "pack")


def row_dma_gather(x: jax.Array, ids: jax.Array, block: int, *,
                   interpret: bool = False) -> jax.Array:
  """x [T, W] (any dtype, in HBM), ids [S] int32 in [0, T), S a multiple of `block` ->
  x[ids] [S, W]: each grid step starts `block` row copies into its output block, all on
  one DMA semaphore, and waits once for their bytes (moe_combine's pattern)."""
  rows, width = ids.shape[0], x.shape[1]
  steps = rows // block
  ids_by_step = ids.reshape(steps, 1, block)   # whole trailing dims: no 1-D SMEM block

  def kernel(ids_ref, x_hbm, out_ref, sem):
    for r in range(block):
      pltpu.make_async_copy(x_hbm.at[pl.ds(ids_ref[0, r], 1)], out_ref.at[pl.ds(r, 1)],
                            sem).start()
    pltpu.make_async_copy(x_hbm.at[pl.ds(0, block)], out_ref, sem).wait()

  return pl.pallas_call(
      kernel, grid=(steps,),
      in_specs=[pl.BlockSpec((None, 1, block), lambda i: (i, 0, 0), memory_space=pltpu.SMEM),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, width), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((rows, width), x.dtype),
      scratch_shapes=[pltpu.SemaphoreType.DMA(())],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret)(ids_by_step, x)


def pack_bf16_pairs(x: jax.Array) -> jax.Array:
  """bf16 [T, H], H even -> uint32 [T, H / 2]: word j holds x[:, j] in its low half and
  x[:, j + H / 2] in its high half (so each half unpacks to a contiguous half of the row)."""
  half = x.shape[1] // 2
  low = jax.lax.bitcast_convert_type(x[:, :half], jnp.uint16).astype(jnp.uint32)
  high = jax.lax.bitcast_convert_type(x[:, half:], jnp.uint16).astype(jnp.uint32)
  return low | (high << 16)


def rate(chip_name: str, probe: str, tokens: int, top_k: int, hidden: int, block: int) -> dict:
  rows = tokens * top_k
  x_bf16 = jax.ShapeDtypeStruct((tokens, hidden), jnp.bfloat16)
  ids = jax.ShapeDtypeStruct((rows,), jnp.int32)
  fn, specs, moved = {
      "xla bf16 gather": (lambda x, i: x.at[i].get(mode="promise_in_bounds"), [x_bf16, ids],
                          2 * rows * hidden * 2),
      "dma u32 rows": (lambda x, i: row_dma_gather(x, i, block),
                       [jax.ShapeDtypeStruct((tokens, hidden // 2), jnp.uint32), ids],
                       2 * rows * hidden * 2),
      "dma bf16 rows": (lambda x, i: row_dma_gather(x, i, block), [x_bf16, ids],
                        2 * rows * hidden * 2),
      "pack": (lambda x, i: pack_bf16_pairs(x), [x_bf16, ids], 2 * tokens * hidden * 2),
  }[probe]
  report = aot.compile_for_chip(fn, specs, chip_name)
  chip = chips.get_chip(chip_name)
  row = {"chip": chip_name, "probe": probe, "tokens": tokens, "top_k": top_k, "hidden": hidden,
         "block": block, "cycles": report.estimated_cycles,
         "hbm_floor_us": moved / chip.hbm_bytes_per_s * 1e6,
         "error": report.error and report.error.splitlines()[0][:300]}
  if report.estimated_cycles:
    row["us"] = report.estimated_cycles / chip.clock_hz * 1e6
    if probe.startswith("dma"):
      row["cycles_per_row"] = report.estimated_cycles / rows
  return row


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--chips", nargs="+", default=["v6e", "v5e"])
  parser.add_argument("--probes", nargs="+", default=list(PROBES), choices=PROBES)
  parser.add_argument("--tokens", type=int, default=8192)
  parser.add_argument("--top-k", type=int, default=8)
  parser.add_argument("--hidden", type=int, default=2048)
  parser.add_argument("--block", type=int, default=512)
  parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if (args.tokens * args.top_k) % args.block or args.hidden % 2:
    parser.error("--block must divide tokens x top-k, and --hidden be even")
  shape = ["--tokens", str(args.tokens), "--top-k", str(args.top_k),
           "--hidden", str(args.hidden), "--block", str(args.block)]
  if args.child:   # one (chip, probe) in this process
    children.print_row(rate(args.chips[0], args.probes[0], args.tokens, args.top_k,
                          args.hidden, args.block))
    return 0
  rows = []
  for chip in args.chips:
    for probe in args.probes:
      found, fatal = children.run_child(__file__, ["--child", "--chips", chip, "--probes", probe,
                                                   *shape], timeout=900)
      rows += found or [{"chip": chip, "probe": probe, "error": f"aborted: {fatal}"}]
  for row in rows:
    children.print_row(row)
  print(f"\n{args.tokens} tokens x top-{args.top_k}, hidden {args.hidden}, {args.block} rows "
        "a step (static estimates)\n\n| chip | probe | cycles | µs | cycles / row | "
        "HBM floor µs |\n|---|---|---:|---:|---:|---:|")
  for r in rows:
    if r.get("us"):
      per_row = f"{r['cycles_per_row']:.1f}" if "cycles_per_row" in r else ""
      print(f"| {r['chip']} | {r['probe']} | {r['cycles']:,} | {r['us']:,.1f} | {per_row} | "
            f"{r['hbm_floor_us']:,.1f} |")
    else:
      print(f"| {r['chip']} | {r['probe']} | not rated: {r['error']} | | | |")
  return 0


if __name__ == "__main__":
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  sys.exit(main())
