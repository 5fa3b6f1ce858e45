"""The MoE experts combine as a Pallas kernel of row DMAs (moe.combine's step 7).

    gather_weighted_sum(y[S, H] f32, ids[T, K] int32, weights[T, K]) -> [T, H]
    out[t] = sum_k weights[t, k] * y[ids[t, k]]        (float32 sum, cast to out_dtype)

Why a kernel: XLA compiles the gather of whole rows into a gather fusion that libtpu's
static estimate rates far below HBM bandwidth at prefill. Qwen3-30B-A3B, 8192 tokens x
top-8, the gather of 65,536 float32 rows of 2048 (537 MB; reading them takes 330 us at
v6e's bandwidth): XLA's combine 3,082 us of cycles on v6e, 4,793 on v5e; this kernel 1,178
and 1,658. At decode it also spares XLA's half-dozen small ops (v6e, T = 1: 8.5 -> 2.4 us;
4.3 with the argsort that inverted moe.route's permutation; moe.route gives that
inverse, pos, itself since 2026-12-06). A row is contiguous in HBM, so one DMA moves it whole.

Layout: the grid walks the T tokens in blocks of `block_tokens` ("parallel": steps are
independent). Each step
  1. reads its K * bt row ids from an SMEM block,
  2. starts one copy per (token, k), y[ids[t, k]] -> rows[k, t] (a VMEM scratch
     [K, bt, H] float32), all on one DMA semaphore,
  3. waits once per k for a slab's bytes (bt rows: every copy has the same size),
  4. writes sum_k weights[t, k] * rows[k] to its [bt, H] output block: whole-slab adds.
The ids are zero-padded to whole steps: a last, partial step copies row 0 for its padded
tokens into scratch rows whose output rows Pallas' masked write-back drops, so no copy
reads out of bounds and no output row is left unwritten.

The ids must lie in [0, S): moe.combine passes moe.route's pos (a permutation), so
this is the caller's promise and is not checked at run time (an id out of range would be
a DMA out of bounds). Not differentiable by itself: moe.combine gives it a custom VJP.

Why the route's gather is not row DMAs (past decode it is XLA's; at decode
moe_route's one-hot matmuls): the same row DMAs cannot move one bfloat16 row
(Mosaic: a bf16 HBM row slice is not aligned to its (16, 128) tiles), and packed as uint32
words they rate 882 us on v6e at Qwen3's prefill (plus 69 us of packing) against 291 us
for XLA's gather alone (benchmarks/probes/row_gather.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import chips, vmem

# Tokens per grid step, the most that fits the VMEM budget. v6e, Qwen3-30B-A3B prefill
# (static estimate): 8 -> 1,502 us, 16 -> 1,286, 32 -> 1,178, 64 -> 1,125. 32 keeps the
# unrolled copy loop at K * 32 starts and the scratch at K * 32 * H * 4 bytes (2 MiB at
# K = 8, H = 2048).
BLOCK_TOKENS = (32, 16, 8)


def block_tokens(tokens: int, top_k: int, hidden: int, out_dtype, chip: str) -> int | None:
  """Tokens per grid step for this shape on `chip` (all of them when fewer than the first
  choice), or None when not even 8 fit the VMEM budget (moe.combine then takes XLA's
  combine). Counted: the [K, bt, H] float32 scratch, the double-buffered [bt, H] output
  and [bt, K] weight blocks, and two float32 [bt, H] temporaries of the sum."""
  budget = vmem.vmem_budget(chips.get_chip(chip), None)
  width = vmem.lane_padded(hidden)
  for block in ([tokens] if tokens < BLOCK_TOKENS[0] else BLOCK_TOKENS):
    rows = vmem.round_up(block, 8)
    plan = (top_k * rows * width * 4 + 2 * rows * width * jnp.dtype(out_dtype).itemsize
            + 2 * rows * vmem.lane_padded(top_k) * 4 + 2 * rows * width * 4)
    if plan <= budget:
      return block
  return None


@functools.partial(jax.jit, static_argnames=("out_dtype", "chip", "interpret"))
def gather_weighted_sum(y: jax.Array, ids: jax.Array, weights: jax.Array, *,
                        out_dtype=jnp.float32, chip: str = chips.DEFAULT_CHIP,
                        interpret: bool = False) -> jax.Array:
  """y [S, H] float32, ids [T, K] int32 in [0, S), weights [T, K] (any float dtype, applied
  in float32) -> [T, H] out_dtype: out[t] = sum_k weights[t, k] * y[ids[t, k]].

  No tokens (or K = 0) give zeros [T, H]. Raises ValueError where no block of tokens fits
  the chip's VMEM budget (`block_tokens`), or y has fewer rows than a step has tokens."""
  if y.ndim != 2 or ids.ndim != 2 or weights.shape != ids.shape:
    raise ValueError(f"gather_weighted_sum takes y [S, H], ids and weights [T, K], got "
                     f"{y.shape}, {ids.shape}, {weights.shape}")
  if y.dtype != jnp.float32:
    raise TypeError(f"y must be float32 (the down projection's out), got {y.dtype}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"ids must be integer, got {ids.dtype}")
  tokens, top_k = ids.shape
  hidden = y.shape[1]
  if tokens == 0 or top_k == 0:     # nothing to gather: an empty batch, or no experts per token
    return jnp.zeros((tokens, hidden), out_dtype)
  block = block_tokens(tokens, top_k, hidden, out_dtype, chip)
  if block is None:
    raise ValueError(f"gather_weighted_sum: K = {top_k} rows of {hidden} float32 per token do "
                     f"not fit {chip}'s VMEM budget at 8 tokens per step")
  if y.shape[0] < block:    # each wait names a slab of `block` rows of y (moe: S = T * K >= it)
    raise ValueError(f"gather_weighted_sum: y has {y.shape[0]} rows, fewer than the {block} "
                     f"tokens of a step")
  steps = pl.cdiv(tokens, block)
  # The weights go in as they are, cast in the kernel (XLA's convert is an op of its own:
  # 2.1k cycles of v6e's static estimate at T = 1), unless a block of them would be a
  # partial packed tile (fewer rows than the dtype packs, as 8 rows of bfloat16), or of a
  # dtype other than bfloat16.
  if (weights.dtype != jnp.bfloat16
      or block != tokens and block % vmem.sublane_multiple(weights.dtype)):
    weights = weights.astype(jnp.float32)
  # [steps, 1, K * bt]: Mosaic checks a 1-D block against the local device's tiling, which
  # an ahead-of-time compile on a CPU host does not have; whole trailing dims pass without.
  ids_by_step = jnp.pad(ids.reshape(-1).astype(jnp.int32),
                        (0, (steps * block - tokens) * top_k)).reshape(steps, 1, block * top_k)

  def kernel(ids_ref, w_ref, y_hbm, out_ref, rows_ref, sem):
    for t in range(block):
      for k in range(top_k):
        pltpu.make_async_copy(y_hbm.at[pl.ds(ids_ref[0, t * top_k + k], 1)],
                              rows_ref.at[k, pl.ds(t, 1)], sem).start()
    for k in range(top_k):    # one wait per slab: the bytes of its `block` row copies
      pltpu.make_async_copy(y_hbm.at[pl.ds(0, block)], rows_ref.at[k], sem).wait()
    w = w_ref[...].astype(jnp.float32)                               # [bt, K]
    acc = rows_ref[0] * w[:, 0:1]
    for k in range(1, top_k):
      acc += rows_ref[k] * w[:, k:k + 1]
    out_ref[...] = acc.astype(out_ref.dtype)

  return pl.pallas_call(
      kernel,
      grid=(steps,),
      in_specs=[pl.BlockSpec((None, 1, block * top_k), lambda i: (i, 0, 0),
                             memory_space=pltpu.SMEM),
                pl.BlockSpec((block, top_k), lambda i: (i, 0)),
                pl.BlockSpec(memory_space=pl.ANY)],
      out_specs=pl.BlockSpec((block, hidden), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((tokens, hidden), out_dtype),
      scratch_shapes=[pltpu.VMEM((top_k, block, hidden), jnp.float32),
                      pltpu.SemaphoreType.DMA(())],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
  )(ids_by_step, weights, y)
