"""RMSNorm (plain, fused residual add, Gemma-style offset) forward and backward in Pallas.

Math, per row r of x (all arithmetic in f32 whatever the input dtype):

    inv[r]  = 1 / sqrt(mean_j(x[r, j]^2) + eps)
    y[r, j] = x[r, j] * inv[r] * (offset + w[j])          offset = 0 (Llama) or 1 (Gemma)

Fused residual add (pre-norm blocks): s = x + residual is rounded to the residual's
dtype and returned as the new residual, and y = RMSNorm(s). Rounding s before
normalising makes the fused op equal the unfused `residual = x + residual;
y = norm(residual)` that a model would otherwise run.

Backward, with g = dL/dy and gw = g * (offset + w):

    dx[r, j] = inv[r] * (gw[r, j] - x[r, j] * inv[r]^2 * mean_j(gw[r, j] * x[r, j]))
    dw[j]    = sum_r g[r, j] * x[r, j] * inv[r]

For the fused op the gradient reaching s is dx plus the gradient of the returned
residual, and it flows unchanged to both x and residual.

Layout. Any leading dimensions are flattened: x is (rows, hidden). The grid is
one-dimensional over row blocks, (cdiv(rows, block_rows),), and every block spans
the full hidden width, (block_rows, hidden); a block whose last dimension equals
the array's is legal for Mosaic at any size, so hidden needs no padding (896, 1000,
2880 all work). The weight is one (1, hidden) block whose index never changes, so
it is fetched once. When rows is not a multiple of block_rows the last block is
partial: Pallas clips its DMA, rows past the end are never written back, and the
backward masks them out of the weight gradient (they may hold garbage, even NaN).

The weight gradient is reduced in two stages so that the row axis stays
"parallel" (megacore chips split it across TensorCores): each grid step writes
its block's column sums to its own (1, hidden) slot of an f32 array of shape
(num_blocks, 1, hidden), and XLA sums the slots.

Narrow rows. A row narrower than 128 fills part of a lane tile, and the TPU stores most
[rows, hidden] arrays of such rows column-major (`vmem.prefers_column_major`: [196608, 64]
does, [8, 64] does not). There the plain forward runs on the transpose of
x's last two axes: x (..., seq, hidden) read as (slabs, hidden, seq), a free view of that
layout; grid (slabs, cdiv(seq, block)) over blocks (hidden, block), block a multiple of 128
(or all of seq), the weight one (hidden, 1) block, and a row's mean square is a reduction
over sublanes. On the row layout XLA would copy x into row-major before the kernel and the
output back after it (on v6e, at SD3.5's [196608, 64] q / k norms, those two copies were
527k of the program's 765k estimated cycles). For more than two axes the choice reads
only the last two (the TPU's layout of [B, H, S, 64] swaps exactly those; of [B, S, H, 64]
it does not, and there x is copied either way). The plain backward does the same (the
weight gradient's partial sums one (hidden, 1) slot per block, summed by XLA); the fused
residual add keeps the row layout.

Tiles. block_rows is the largest multiple of the dtype's sublane tile that fits
the chip's VMEM budget (see `vmem.py`), counting double-buffered input and output
blocks and the f32 temporaries, and capped at MAX_BLOCK_ROWS; a problem with
fewer rows than that is one block.

Gated RMSNorm (Transformers' `RMSNormGated`: weight * norm(x) * act(gate), SiLU or sigmoid
gate, forward and backward) shares this tiling and layout: its math and the two rounding
conventions the families use are at the section "gated RMSNorm" below.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

from . import chips
from . import vmem

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)

# Beyond this, bigger blocks buy nothing for a memory-bound kernel (the per-step
# overhead is already amortised) and only delay the start of the pipeline.
MAX_BLOCK_ROWS = 1024
# The lane-block cap of the narrow-row kernels (`column_tiling`): 8192 rows of 64 in bf16
# are 1 MiB per block, as much as 1024 rows of 512 (4096 and 16384 estimate no better at
# SD3.5's [196608, 64] and [15984, 64]).
MAX_BLOCK_COLUMNS = 8192
# f32 full-block temporaries live at once in the kernel bodies (counted generously:
# the compiler may keep x, x*x, the product and casts around together).
_FWD_F32_TEMPORARIES = 3
_BWD_F32_TEMPORARIES = 5


@dataclasses.dataclass(frozen=True)
class RmsNormConfig:
  """Everything static about one RMSNorm call (hashable: it keys jit caches)."""

  eps: float = 1e-6
  offset: float = 0.0
  chip: str = chips.DEFAULT_CHIP
  block_rows: int | None = None        # None: chosen from the VMEM budget
  vmem_limit_bytes: int | None = None  # None: the chip's default scoped limit
  interpret: bool = False              # Pallas interpret mode (CPU)

  def __post_init__(self):
    if not math.isfinite(self.eps) or self.eps < 0:
      raise ValueError(f"eps must be finite and >= 0, got {self.eps!r}")
    if not math.isfinite(self.offset):
      raise ValueError(f"offset must be finite, got {self.offset!r}")
    chips.get_chip(self.chip)  # raises for an unknown chip
    if self.block_rows is not None and self.block_rows <= 0:
      raise ValueError(f"block_rows must be positive, got {self.block_rows!r}")


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How one kernel call is cut up, and the VMEM it plans for."""

  block_rows: int
  vmem_limit_bytes: int   # the scoped-VMEM limit the kernel is compiled with
  vmem_plan_bytes: int    # what its blocks and f32 temporaries occupy by our count


def _tiling(rows: int, hidden: int, *, bytes_per_row_buffers: int,
            f32_temporaries: int, dtypes, config: RmsNormConfig) -> Tiling:
  """Rows per block and VMEM limit for a (rows, hidden) problem.

  Rows per block: a multiple of the sublane tile that fits the VMEM budget, capped
  at MAX_BLOCK_ROWS, or all rows when they fit in one block. When even the smallest
  block does not fit the chip's default limit (very wide rows), the limit is raised
  as far as the chip allows, unless the caller fixed `vmem_limit_bytes`.
  """
  chip = chips.get_chip(config.chip)
  padded = vmem.lane_padded(hidden)
  sublanes = max(vmem.sublane_multiple(d) for d in dtypes)
  # The weight block: one row, padded to a full sublane tile, double-buffered.
  fixed = 2 * 8 * padded * 4
  per_row = padded * (2 * bytes_per_row_buffers + 4 * f32_temporaries)

  def plan(block_rows):
    return fixed + per_row * vmem.round_up(block_rows, sublanes)

  limit = vmem.resolve_vmem_limit(chip, config.vmem_limit_bytes)
  if config.vmem_limit_bytes is None and plan(sublanes) > vmem.vmem_budget(chip, None):
    needed = vmem.round_up(int(plan(sublanes) / vmem.BUDGET_FRACTION), vmem.MiB)
    limit = min(needed, chip.max_vmem_limit_bytes)
  budget = int(limit * vmem.BUDGET_FRACTION)

  if config.block_rows is not None:
    block_rows = config.block_rows
    if block_rows < rows and block_rows % sublanes:
      raise ValueError(
          f"block_rows={block_rows} must be a multiple of {sublanes} for dtypes "
          f"{[np.dtype(d).name for d in dtypes]} (or cover all {rows} rows)")
    block_rows = min(block_rows, rows)
    return Tiling(block_rows, limit, plan(block_rows))

  fit = vmem.round_down(max(budget - fixed, 0) // per_row, sublanes)
  if fit < sublanes:
    raise ValueError(
        f"hidden={hidden} needs {plan(sublanes)} bytes of VMEM at {sublanes} rows per "
        f"block, more than the budget of {budget} bytes under a {limit}-byte limit on "
        f"{chip.name}")
  block_rows = min(fit, MAX_BLOCK_ROWS)
  block_rows = rows if rows <= block_rows else block_rows
  return Tiling(block_rows, limit, plan(block_rows))


def forward_tiling(rows, hidden, x_dtype, out_dtype, has_residual, config) -> Tiling:
  """Tiling of the forward kernel for a (rows, hidden) input (dtypes as the kernel sees them)."""
  x_bytes = np.dtype(x_dtype).itemsize
  per_row = x_bytes + np.dtype(out_dtype).itemsize + (2 * x_bytes if has_residual else 0)
  return _tiling(rows, hidden, bytes_per_row_buffers=per_row,
                 f32_temporaries=_FWD_F32_TEMPORARIES,
                 dtypes=(x_dtype, out_dtype), config=config)


def _column_tiling(rows, hidden, *, dtypes, buffer_bytes, f32_temporaries, weight_blocks,
                   config) -> Tiling | None:
  """Lane blocks of the transposed layout (`column_tiling`); `buffer_bytes` per element of a
  column over the double-buffered blocks, `weight_blocks` (hidden, 1) f32-sized blocks."""
  if (hidden >= 128 or config.block_rows is not None
      or not vmem.prefers_column_major(rows, hidden)):
    return None
  chip = chips.get_chip(config.chip)
  sublanes = vmem.round_up(hidden, max(vmem.sublane_multiple(d) for d in dtypes))
  per_column = sublanes * (2 * buffer_bytes + 4 * f32_temporaries)
  # The (hidden, 1) blocks (the weight; the backward's weight-gradient slot), lane-padded
  # and double-buffered.
  fixed = weight_blocks * 2 * vmem.round_up(hidden, 8) * 128 * 4
  limit = vmem.resolve_vmem_limit(chip, config.vmem_limit_bytes)
  fit = vmem.round_down(max(int(limit * vmem.BUDGET_FRACTION) - fixed, 0) // per_column, 128)
  if fit < 128:
    return None
  block = min(fit, MAX_BLOCK_COLUMNS)
  block = rows if rows <= block else block
  return Tiling(block, limit, fixed + per_column * vmem.round_up(block, 128))


def column_tiling(rows, hidden, x_dtype, out_dtype, config) -> Tiling | None:
  """Tiling of the plain forward on the transpose (hidden, rows) of x's last two axes
  (rows: x.shape[-2]; `block_rows`: rows of x per lane block, a multiple of 128 or all of
  them), or None where the row layout is used: hidden >= 128, a row-major default layout
  of those two axes, a caller-fixed block_rows, or a column of hidden too tall for the
  VMEM budget at 128 lanes."""
  dtypes = (x_dtype, out_dtype)
  return _column_tiling(rows, hidden, dtypes=dtypes,
                        buffer_bytes=sum(np.dtype(d).itemsize for d in dtypes),
                        f32_temporaries=_FWD_F32_TEMPORARIES, weight_blocks=1, config=config)


def column_backward_tiling(rows, hidden, x_dtype, grad_dtype, config) -> Tiling | None:
  """Tiling of the plain backward on the transpose, as `column_tiling` (x and dx in x's
  dtype, g in grad_dtype)."""
  x_bytes, g_bytes = np.dtype(x_dtype).itemsize, np.dtype(grad_dtype).itemsize
  return _column_tiling(rows, hidden, dtypes=(x_dtype, grad_dtype),
                        buffer_bytes=2 * x_bytes + g_bytes,
                        f32_temporaries=_BWD_F32_TEMPORARIES, weight_blocks=2, config=config)


def backward_tiling(rows, hidden, x_dtype, grad_dtype, has_residual_grad, config) -> Tiling:
  """Tiling of the backward kernel for a (rows, hidden) input."""
  x_bytes, g_bytes = np.dtype(x_dtype).itemsize, np.dtype(grad_dtype).itemsize
  per_row = 2 * x_bytes + g_bytes + (x_bytes if has_residual_grad else 0)
  return _tiling(rows, hidden, bytes_per_row_buffers=per_row,
                 f32_temporaries=_BWD_F32_TEMPORARIES,
                 dtypes=(x_dtype, grad_dtype), config=config)


def _compiler_params(tiling: Tiling, num_operands: int, weight_index: int, grid_dims=1):
  fusion = [i == weight_index for i in range(num_operands)]
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * grid_dims,
                              vmem_limit_bytes=tiling.vmem_limit_bytes,
                              allow_input_fusion=fusion)


# ----------------------------------------------------------------------------- kernels


def _forward_kernel(*refs, eps, offset, has_residual):
  if has_residual:
    x_ref, residual_ref, w_ref, out_ref, residual_out_ref = refs
    s = x_ref[...].astype(jnp.float32) + residual_ref[...].astype(jnp.float32)
    s = s.astype(residual_out_ref.dtype)
    residual_out_ref[...] = s
    x = s.astype(jnp.float32)
  else:
    x_ref, w_ref, out_ref = refs
    x = x_ref[...].astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  scale = w_ref[...].astype(jnp.float32) + offset
  out_ref[...] = (x * inv * scale).astype(out_ref.dtype)


def _forward_columns_kernel(x_ref, w_ref, out_ref, *, eps, offset):
  x = x_ref[...].astype(jnp.float32)                  # (hidden, block): a row of x per lane
  inv = jax.lax.rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + eps)
  scale = w_ref[...].astype(jnp.float32) + offset     # (hidden, 1)
  out_ref[...] = (x * inv * scale).astype(out_ref.dtype)


def _backward_columns_kernel(x_ref, w_ref, g_ref, dx_ref, dw_partial_ref, *, eps, offset,
                            seq, block):
  x = x_ref[...].astype(jnp.float32)                  # (hidden, block): a row of x per lane
  g = g_ref[...].astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x * x, axis=0, keepdims=True) + eps)
  gw = g * (w_ref[...].astype(jnp.float32) + offset)
  dx = inv * (gw - x * (inv * inv) * jnp.mean(gw * x, axis=0, keepdims=True))
  dx_ref[...] = dx.astype(dx_ref.dtype)
  # Lanes past `seq` in a partial last block hold garbage: select, not multiply.
  column = pl.program_id(1) * block + jax.lax.broadcasted_iota(jnp.int32, x.shape, 1)
  contribution = jnp.where(column < seq, g * x * inv, 0.0)
  dw_partial_ref[...] = jnp.sum(contribution, axis=1, keepdims=True)


def _backward_kernel(*refs, eps, offset, rows, block_rows, has_residual_grad):
  if has_residual_grad:
    x_ref, w_ref, g_ref, g_residual_ref, dx_ref, dw_partial_ref = refs
  else:
    x_ref, w_ref, g_ref, dx_ref, dw_partial_ref = refs
  x = x_ref[...].astype(jnp.float32)
  g = g_ref[...].astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  gw = g * (w_ref[...].astype(jnp.float32) + offset)
  dx = inv * (gw - x * (inv * inv) * jnp.mean(gw * x, axis=-1, keepdims=True))
  if has_residual_grad:
    dx = dx + g_residual_ref[...].astype(jnp.float32)
  dx_ref[...] = dx.astype(dx_ref.dtype)
  # Rows past `rows` in a partial last block hold garbage: select, not multiply,
  # so that a NaN there cannot leak into the sum.
  row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  contribution = jnp.where(row < rows, g * x * inv, 0.0)
  dw_partial_ref[...] = jnp.sum(contribution, axis=0, keepdims=True)


# ----------------------------------------------------------------------------- calls


def _as_rows(a, hidden):
  return a.reshape(-1, hidden)


def _kernel_dtype(dtype):
  """The dtype an operand has inside the kernel.

  Mosaic has no f16 vector loads on v5e/v6e ("Invalid vector type for load"), so
  f16 travels as f32 (exact) and the result is rounded back to f16 once, at the end.
  This costs an extra pass over HBM for f16 only; bf16 and f32 go in as they are.
  """
  return jnp.float32 if dtype == jnp.float16 else dtype


def _to_kernel(a):
  return a.astype(_kernel_dtype(a.dtype))


def _check_dtype(name, a):
  if a.dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {a.dtype}")


def rms_norm_forward(x, weight, residual=None, *, config: RmsNormConfig = RmsNormConfig()):
  """Forward kernel.

  Args:
    x: (..., hidden) f32 / bf16 / f16.
    weight: (hidden,) f32 / bf16 / f16.
    residual: None, or the same shape and dtype as x (fused residual add).
    config: static parameters.
  Returns:
    out, of x's shape and dtype promote(x, weight); with a residual,
    (out, residual_out) where residual_out = x + residual in x's dtype.
  """
  _check_dtype("x", x)
  _check_dtype("weight", weight)
  hidden = x.shape[-1]
  if weight.shape != (hidden,):
    raise ValueError(f"weight must have shape ({hidden},), got {weight.shape}")
  has_residual = residual is not None
  if has_residual and (residual.shape != x.shape or residual.dtype != x.dtype):
    raise ValueError(f"residual must match x ({x.shape}, {x.dtype}), got "
                     f"({residual.shape}, {residual.dtype})")
  out_dtype = jnp.promote_types(x.dtype, weight.dtype)
  rows = math.prod(x.shape[:-1])
  if rows == 0:
    out = jnp.zeros(x.shape, out_dtype)
    return (out, jnp.zeros_like(x)) if has_residual else out

  if has_residual and _kernel_dtype(x.dtype) != x.dtype:
    # f16: the kernel would see the sum in f32, unrounded. Round it to f16 here (as the
    # unfused model does) and normalise the rounded sum with the plain kernel.
    residual_out = (x.astype(jnp.float32) + residual.astype(jnp.float32)).astype(x.dtype)
    return rms_norm_forward(residual_out, weight, config=config), residual_out

  kx = _kernel_dtype(x.dtype)
  if not has_residual and x.ndim >= 2:
    columns = column_tiling(x.shape[-2], hidden, kx, _kernel_dtype(out_dtype), config)
    if columns is not None:
      return _forward_on_columns(x, weight, out_dtype, columns, config)
  tiling = forward_tiling(rows, hidden, kx, _kernel_dtype(out_dtype), has_residual, config)
  row_block = pl.BlockSpec((tiling.block_rows, hidden), lambda i: (i, 0))
  weight_block = pl.BlockSpec((1, hidden), lambda i: (0, 0))
  operands = [_as_rows(x, hidden)]
  in_specs = [row_block]
  out_shape = [jax.ShapeDtypeStruct((rows, hidden), _kernel_dtype(out_dtype))]
  if has_residual:
    operands.append(_as_rows(residual, hidden))
    in_specs.append(row_block)
    out_shape.append(jax.ShapeDtypeStruct((rows, hidden), kx))
  operands.append(weight.reshape(1, hidden))
  in_specs.append(weight_block)

  results = pl.pallas_call(
      functools.partial(_forward_kernel, eps=config.eps, offset=config.offset,
                        has_residual=has_residual),
      grid=(pl.cdiv(rows, tiling.block_rows),),
      in_specs=in_specs,
      out_specs=[row_block] * len(out_shape),
      out_shape=out_shape,
      compiler_params=_compiler_params(tiling, len(operands), len(operands) - 1),
      interpret=config.interpret,
      name="rms_norm_fwd_residual" if has_residual else "rms_norm_fwd",
  )(*[_to_kernel(a) for a in operands])
  results = [r.reshape(x.shape).astype(d)
             for r, d in zip(results, [out_dtype, x.dtype])]
  results = [r.reshape(x.shape) for r in results]
  return tuple(results) if has_residual else results[0]


def _forward_on_columns(x, weight, out_dtype, tiling: Tiling, config: RmsNormConfig):
  """The plain forward of narrow rows on the transpose of x's last two axes (see the
  module docstring): x (..., seq, hidden) is read as (slabs, hidden, seq), slabs the
  product of the leading axes (1 for a 2-D x); out of x's shape in out_dtype."""
  *lead, seq, hidden = x.shape
  slabs = math.prod(lead)
  column_block = pl.BlockSpec((None, hidden, tiling.block_rows), lambda g, i: (g, 0, i))
  x_t = jnp.swapaxes(_to_kernel(x), -1, -2).reshape(slabs, hidden, seq)
  out_t = pl.pallas_call(
      functools.partial(_forward_columns_kernel, eps=config.eps, offset=config.offset),
      grid=(slabs, pl.cdiv(seq, tiling.block_rows)),
      in_specs=[column_block, pl.BlockSpec((hidden, 1), lambda g, i: (0, 0))],
      out_specs=column_block,
      out_shape=jax.ShapeDtypeStruct((slabs, hidden, seq), _kernel_dtype(out_dtype)),
      compiler_params=_compiler_params(tiling, 2, 1, grid_dims=2),
      interpret=config.interpret,
      name="rms_norm_fwd_columns",
  )(x_t, _to_kernel(weight).reshape(hidden, 1))
  return jnp.swapaxes(out_t.reshape(*lead, hidden, seq), -1, -2).astype(out_dtype)


def _backward_on_columns(x, weight, grad_out, tiling: Tiling, config: RmsNormConfig):
  """The plain backward of narrow rows on the transpose of the last two axes, as
  `_forward_on_columns`: (dx in x's dtype and shape, dweight (hidden,) in weight's)."""
  *lead, seq, hidden = x.shape
  slabs, block = math.prod(lead), tiling.block_rows
  num_blocks = pl.cdiv(seq, block)
  column_block = pl.BlockSpec((None, hidden, block), lambda g, i: (g, 0, i))
  transposed = lambda a: jnp.swapaxes(_to_kernel(a), -1, -2).reshape(slabs, hidden, seq)
  dx_t, dw_partial = pl.pallas_call(
      functools.partial(_backward_columns_kernel, eps=config.eps, offset=config.offset,
                        seq=seq, block=block),
      grid=(slabs, num_blocks),
      in_specs=[column_block, pl.BlockSpec((hidden, 1), lambda g, i: (0, 0)), column_block],
      out_specs=[column_block, pl.BlockSpec((None, None, hidden, 1), lambda g, i: (g, i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((slabs, hidden, seq), _kernel_dtype(x.dtype)),
                 jax.ShapeDtypeStruct((slabs, num_blocks, hidden, 1), jnp.float32)],
      compiler_params=_compiler_params(tiling, 3, 1, grid_dims=2),
      interpret=config.interpret,
      name="rms_norm_bwd_columns",
  )(transposed(x), _to_kernel(weight).reshape(hidden, 1), transposed(grad_out))
  dx = jnp.swapaxes(dx_t.reshape(*lead, hidden, seq), -1, -2).astype(x.dtype)
  return dx, jnp.sum(dw_partial, axis=(0, 1, 3)).astype(weight.dtype)


def rms_norm_backward(x, weight, grad_out, grad_residual=None, *,
                      config: RmsNormConfig = RmsNormConfig()):
  """Backward kernel.

  Args:
    x: (..., hidden), the forward's normalised input (for the fused op: the
      returned residual, x + residual).
    weight: (hidden,).
    grad_out: gradient of the output, x's shape, the output's dtype.
    grad_residual: None, or the gradient of the returned residual (fused op).
  Returns:
    (dx, dweight): dx in x's dtype and shape (for the fused op it is the gradient
    of both x and residual), dweight (hidden,) in weight's dtype.
  """
  _check_dtype("x", x)
  _check_dtype("weight", weight)
  _check_dtype("grad_out", grad_out)
  hidden = x.shape[-1]
  if grad_out.shape != x.shape:
    raise ValueError(f"grad_out must have shape {x.shape}, got {grad_out.shape}")
  has_residual_grad = grad_residual is not None
  if has_residual_grad and grad_residual.shape != x.shape:
    raise ValueError(f"grad_residual must have shape {x.shape}, got {grad_residual.shape}")
  rows = math.prod(x.shape[:-1])
  if rows == 0:
    return jnp.zeros_like(x), jnp.zeros_like(weight)

  if not has_residual_grad and x.ndim >= 2:
    columns = column_backward_tiling(x.shape[-2], hidden, _kernel_dtype(x.dtype),
                                     _kernel_dtype(grad_out.dtype), config)
    if columns is not None:
      return _backward_on_columns(x, weight, grad_out, columns, config)
  tiling = backward_tiling(rows, hidden, _kernel_dtype(x.dtype),
                           _kernel_dtype(grad_out.dtype), has_residual_grad, config)
  num_blocks = pl.cdiv(rows, tiling.block_rows)
  row_block = pl.BlockSpec((tiling.block_rows, hidden), lambda i: (i, 0))
  operands = [_as_rows(x, hidden), weight.reshape(1, hidden), _as_rows(grad_out, hidden)]
  in_specs = [row_block, pl.BlockSpec((1, hidden), lambda i: (0, 0)), row_block]
  if has_residual_grad:
    operands.append(_as_rows(grad_residual, hidden))
    in_specs.append(row_block)

  dx, dw_partial = pl.pallas_call(
      functools.partial(_backward_kernel, eps=config.eps, offset=config.offset,
                        rows=rows, block_rows=tiling.block_rows,
                        has_residual_grad=has_residual_grad),
      grid=(num_blocks,),
      in_specs=in_specs,
      out_specs=[row_block, pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((rows, hidden), _kernel_dtype(x.dtype)),
                 jax.ShapeDtypeStruct((num_blocks, 1, hidden), jnp.float32)],
      compiler_params=_compiler_params(tiling, len(operands), 1),
      interpret=config.interpret,
      name="rms_norm_bwd_residual" if has_residual_grad else "rms_norm_bwd",
  )(*[_to_kernel(a) for a in operands])
  dx = dx.astype(x.dtype)
  dweight = jnp.sum(dw_partial, axis=(0, 1)).astype(weight.dtype)
  return dx.reshape(x.shape), dweight


# ----------------------------------------------------------------------------- JAX API


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, weight, config):
  return rms_norm_forward(x, weight, config=config)


def _rms_norm_fwd(x, weight, config):
  return rms_norm_forward(x, weight, config=config), (x, weight)


def _rms_norm_bwd(config, saved, grad_out):
  x, weight = saved
  return rms_norm_backward(x, weight, grad_out, config=config)


_rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused_add_rms_norm(x, residual, weight, config):
  return rms_norm_forward(x, weight, residual, config=config)


def _fused_add_rms_norm_fwd(x, residual, weight, config):
  out, residual_out = rms_norm_forward(x, weight, residual, config=config)
  return (out, residual_out), (residual_out, weight)


def _fused_add_rms_norm_bwd(config, saved, grads):
  residual_out, weight = saved
  grad_out, grad_residual = grads
  ds, dweight = rms_norm_backward(residual_out, weight, grad_out, grad_residual,
                                  config=config)
  return ds, ds, dweight


_fused_add_rms_norm.defvjp(_fused_add_rms_norm_fwd, _fused_add_rms_norm_bwd)


def rms_norm(x, weight, *, eps=1e-6, offset=0.0, chip=chips.DEFAULT_CHIP,
             block_rows=None, vmem_limit_bytes=None, interpret=False):
  """RMSNorm of the last axis, differentiable (Pallas backward).

  x: (..., hidden) f32/bf16/f16; weight: (hidden,). Returns x's shape in
  promote_types(x.dtype, weight.dtype). `offset` is added to the weight (1.0 for
  Gemma's `(1 + w)` scale). `chip` picks tiles and the VMEM limit ("v5e", "v6e",
  "v5p", "v7"); `interpret=True` runs the kernel on CPU.
  """
  config = RmsNormConfig(eps=float(eps), offset=float(offset), chip=chip,
                         block_rows=block_rows, vmem_limit_bytes=vmem_limit_bytes,
                         interpret=interpret)
  return _rms_norm(x, weight, config)


def fused_add_rms_norm(x, residual, weight, *, eps=1e-6, offset=0.0,
                       chip=chips.DEFAULT_CHIP, block_rows=None, vmem_limit_bytes=None,
                       interpret=False):
  """(RMSNorm(x + residual), x + residual), differentiable; see `rms_norm`.

  residual must match x in shape and dtype; the returned residual has x's dtype.
  """
  config = RmsNormConfig(eps=float(eps), offset=float(offset), chip=chip,
                         block_rows=block_rows, vmem_limit_bytes=vmem_limit_bytes,
                         interpret=interpret)
  return _fused_add_rms_norm(x, residual, weight, config)


def rms_norm_reference(x, weight, *, eps=1e-6, offset=0.0):
  """Plain-XLA RMSNorm (f32 math), the baseline the benchmarks compare against."""
  xf = x.astype(jnp.float32)
  inv = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  out_dtype = jnp.promote_types(x.dtype, weight.dtype)
  return (xf * inv * (weight.astype(jnp.float32) + offset)).astype(out_dtype)


# ----------------------------------------------------------------------------- gated RMSNorm
#
# Transformers' `RMSNormGated` hub name (Qwen3.5 / Qwen3.5-MoE / Qwen3-Next / OLMo-Hybrid /
# Qwen4-Exp / Lara-mini with a SiLU gate; Kimi Linear / Bailing-hybrid / GLM-5-Next with a
# sigmoid gate; Qwen4-Exp either). Per row r (one head's values: hidden = the head dim),
# with n = x * inv, inv = 1 / sqrt(mean_j(x[r, j]^2) + eps), and act = silu or sigmoid:
#
#   norm_in_input_dtype=True (Qwen3.5, Qwen3-Next, OLMo-Hybrid, Qwen4-Exp):
#       h = round_p(w * round_x(n)),  y = round_x(h * act(gate))
#     round_x rounds to x's dtype and round_p to promote(w, x), as
#     `self.weight * hidden_states.to(input_dtype)` does in torch;
#   norm_in_input_dtype=False (Kimi Linear, Bailing-hybrid, GLM-5-Next, Lara-mini):
#       h = w * n  (all f32),         y = round_x(h * act(gate)).
#
# The gate is always taken in f32. Backward (roundings are straight-through), with
# dh = dy * act(gate):
#
#   dgate[r, j] = dy * h * act'(gate)
#   dw[j]       = sum_r dh[r, j] * n_used[r, j]         (n_used: round_x(n) or n)
#   dx[r, j]    = inv * (dh w - n * mean_j(dh w n))
#
# Layout, tiles and the two-stage weight-gradient sum are the plain kernel's (module
# docstring): x and gate are (rows, hidden) blocks of the same rows, the weight one (1,
# hidden) block. Families that normalise groups of the hidden size or gate before the norm
# (Mamba2, NemotronH, Bamba, GraniteMoeHybrid, Zamba2, FalconH1) are not under the hub name
# and not supported here.

GATED_DTYPES = (jnp.float32, jnp.bfloat16)
GATE_ACTIVATIONS = ("silu", "sigmoid")
_GATED_FWD_F32_TEMPORARIES = 4
_GATED_BWD_F32_TEMPORARIES = 8


@dataclasses.dataclass(frozen=True)
class RmsNormGatedConfig:
  """Everything static about one gated RMSNorm call (hashable: it keys jit caches)."""

  eps: float = 1e-6
  activation: str = "silu"
  norm_in_input_dtype: bool = True
  chip: str = chips.DEFAULT_CHIP
  block_rows: int | None = None
  vmem_limit_bytes: int | None = None
  interpret: bool = False

  def __post_init__(self):
    if not math.isfinite(self.eps) or self.eps < 0:
      raise ValueError(f"eps must be finite and >= 0, got {self.eps!r}")
    if self.activation not in GATE_ACTIVATIONS:
      raise ValueError(f"activation must be one of {GATE_ACTIVATIONS}, got {self.activation!r}")
    chips.get_chip(self.chip)
    if self.block_rows is not None and self.block_rows <= 0:
      raise ValueError(f"block_rows must be positive, got {self.block_rows!r}")


def gated_forward_tiling(rows, hidden, x_dtype, gate_dtype, config) -> Tiling:
  """Tiling of the gated forward kernel for a (rows, hidden) input."""
  x_bytes, g_bytes = np.dtype(x_dtype).itemsize, np.dtype(gate_dtype).itemsize
  return _tiling(rows, hidden, bytes_per_row_buffers=2 * x_bytes + g_bytes,
                 f32_temporaries=_GATED_FWD_F32_TEMPORARIES, dtypes=(x_dtype, gate_dtype),
                 config=config)


def gated_backward_tiling(rows, hidden, x_dtype, gate_dtype, config) -> Tiling:
  """Tiling of the gated backward kernel (x, gate, dy in; dx, dgate out)."""
  x_bytes, g_bytes = np.dtype(x_dtype).itemsize, np.dtype(gate_dtype).itemsize
  return _tiling(rows, hidden, bytes_per_row_buffers=3 * x_bytes + 2 * g_bytes,
                 f32_temporaries=_GATED_BWD_F32_TEMPORARIES, dtypes=(x_dtype, gate_dtype),
                 config=config)


def _gate(g, activation):
  s = jax.nn.sigmoid(g)
  return g * s if activation == "silu" else s


def _gate_grad(g, activation):
  s = jax.nn.sigmoid(g)
  return s * (1.0 + g * (1.0 - s)) if activation == "silu" else s * (1.0 - s)


def _gated_parts(x, w, eps, norm_in_input_dtype, x_dtype, prod_dtype):
  """(inv, n, n_used, h) of the module comment, all f32."""
  inv = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
  n = x * inv
  if norm_in_input_dtype:
    n_used = n.astype(x_dtype).astype(jnp.float32)
    h = (w * n_used).astype(prod_dtype).astype(jnp.float32)
  else:
    n_used, h = n, w * n
  return inv, n, n_used, h


def _gated_forward_kernel(x_ref, g_ref, w_ref, out_ref, *, eps, activation,
                          norm_in_input_dtype, prod_dtype):
  x = x_ref[...].astype(jnp.float32)
  _, _, _, h = _gated_parts(x, w_ref[...].astype(jnp.float32), eps, norm_in_input_dtype,
                            x_ref.dtype, prod_dtype)
  out_ref[...] = (h * _gate(g_ref[...].astype(jnp.float32), activation)).astype(out_ref.dtype)


def _gated_backward_kernel(x_ref, g_ref, w_ref, dy_ref, dx_ref, dg_ref, dw_partial_ref, *,
                           eps, activation, norm_in_input_dtype, prod_dtype, rows,
                           block_rows):
  x = x_ref[...].astype(jnp.float32)
  g = g_ref[...].astype(jnp.float32)
  w = w_ref[...].astype(jnp.float32)
  dy = dy_ref[...].astype(jnp.float32)
  inv, n, n_used, h = _gated_parts(x, w, eps, norm_in_input_dtype, x_ref.dtype, prod_dtype)
  dh = dy * _gate(g, activation)
  dg_ref[...] = (dy * h * _gate_grad(g, activation)).astype(dg_ref.dtype)
  gw = dh * w
  dx_ref[...] = (inv * (gw - n * jnp.mean(gw * n, axis=-1, keepdims=True))).astype(dx_ref.dtype)
  # Rows past `rows` in a partial last block hold garbage: select, never multiply.
  row = pl.program_id(0) * block_rows + jax.lax.broadcasted_iota(jnp.int32, x.shape, 0)
  dw_partial_ref[...] = jnp.sum(jnp.where(row < rows, dh * n_used, 0.0), axis=0, keepdims=True)


def _check_gated_dtype(name, a):
  if a.dtype not in GATED_DTYPES:
    raise TypeError(f"{name} must be float32 or bfloat16, got {a.dtype}"
                    + (" (nothing is down-cast silently)" if a.dtype == np.float64 else ""))


def _check_gated_inputs(x, gate, weight):
  _check_gated_dtype("x", x)
  _check_gated_dtype("gate", gate)
  _check_gated_dtype("weight", weight)
  if x.ndim < 1:
    raise ValueError(f"x must have a hidden axis, got shape {x.shape}")
  hidden = x.shape[-1]
  if gate.shape != x.shape:
    raise ValueError(f"gate must have x's shape {x.shape}, got {gate.shape}")
  if weight.shape != (hidden,):
    raise ValueError(f"weight must have shape ({hidden},), got {weight.shape}")
  return hidden


def rms_norm_gated_forward(x, gate, weight, *,
                           config: RmsNormGatedConfig = RmsNormGatedConfig()):
  """Gated forward kernel.

  Args:
    x: (..., hidden) f32 / bf16 (hidden: the head dim; Transformers passes (rows, head_dim)).
    gate: x's shape, f32 / bf16.
    weight: (hidden,) f32 / bf16.
  Returns:
    y of x's shape and dtype.
  """
  hidden = _check_gated_inputs(x, gate, weight)
  rows = math.prod(x.shape[:-1])
  if rows == 0:
    return jnp.zeros(x.shape, x.dtype)
  tiling = gated_forward_tiling(rows, hidden, x.dtype, gate.dtype, config)
  row_block = pl.BlockSpec((tiling.block_rows, hidden), lambda i: (i, 0))
  out = pl.pallas_call(
      functools.partial(_gated_forward_kernel, eps=config.eps, activation=config.activation,
                        norm_in_input_dtype=config.norm_in_input_dtype,
                        prod_dtype=jnp.promote_types(x.dtype, weight.dtype)),
      grid=(pl.cdiv(rows, tiling.block_rows),),
      in_specs=[row_block, row_block, pl.BlockSpec((1, hidden), lambda i: (0, 0))],
      out_specs=row_block,
      out_shape=jax.ShapeDtypeStruct((rows, hidden), x.dtype),
      compiler_params=_compiler_params(tiling, 3, 2),
      interpret=config.interpret,
      name="rms_norm_gated_fwd",
  )(_as_rows(x, hidden), _as_rows(gate, hidden), weight.reshape(1, hidden))
  return out.reshape(x.shape)


def rms_norm_gated_backward(x, gate, weight, grad_out, *,
                            config: RmsNormGatedConfig = RmsNormGatedConfig()):
  """Gated backward kernel: (dx in x's dtype, dgate in gate's dtype, dweight in weight's)."""
  hidden = _check_gated_inputs(x, gate, weight)
  if grad_out.shape != x.shape:
    raise ValueError(f"grad_out must have shape {x.shape}, got {grad_out.shape}")
  rows = math.prod(x.shape[:-1])
  if rows == 0:
    return jnp.zeros_like(x), jnp.zeros_like(gate), jnp.zeros_like(weight)
  tiling = gated_backward_tiling(rows, hidden, x.dtype, gate.dtype, config)
  num_blocks = pl.cdiv(rows, tiling.block_rows)
  row_block = pl.BlockSpec((tiling.block_rows, hidden), lambda i: (i, 0))
  dx, dgate, dw_partial = pl.pallas_call(
      functools.partial(_gated_backward_kernel, eps=config.eps,
                        activation=config.activation,
                        norm_in_input_dtype=config.norm_in_input_dtype,
                        prod_dtype=jnp.promote_types(x.dtype, weight.dtype), rows=rows,
                        block_rows=tiling.block_rows),
      grid=(num_blocks,),
      in_specs=[row_block, row_block, pl.BlockSpec((1, hidden), lambda i: (0, 0)), row_block],
      out_specs=[row_block, row_block, pl.BlockSpec((None, 1, hidden), lambda i: (i, 0, 0))],
      out_shape=[jax.ShapeDtypeStruct((rows, hidden), x.dtype),
                 jax.ShapeDtypeStruct((rows, hidden), gate.dtype),
                 jax.ShapeDtypeStruct((num_blocks, 1, hidden), jnp.float32)],
      compiler_params=_compiler_params(tiling, 4, 2),
      interpret=config.interpret,
      name="rms_norm_gated_bwd",
  )(_as_rows(x, hidden), _as_rows(gate, hidden), weight.reshape(1, hidden),
    _as_rows(grad_out.astype(x.dtype), hidden))
  dweight = jnp.sum(dw_partial, axis=(0, 1)).astype(weight.dtype)
  return dx.reshape(x.shape), dgate.reshape(gate.shape), dweight


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm_gated(x, gate, weight, config):
  return rms_norm_gated_forward(x, gate, weight, config=config)


def _rms_norm_gated_fwd(x, gate, weight, config):
  return rms_norm_gated_forward(x, gate, weight, config=config), (x, gate, weight)


def _rms_norm_gated_bwd(config, saved, grad_out):
  x, gate, weight = saved
  return rms_norm_gated_backward(x, gate, weight, grad_out, config=config)


_rms_norm_gated.defvjp(_rms_norm_gated_fwd, _rms_norm_gated_bwd)


def rms_norm_gated(x, gate, weight, *, eps=1e-6, activation="silu", norm_in_input_dtype=True,
                   chip=chips.DEFAULT_CHIP, block_rows=None, vmem_limit_bytes=None,
                   interpret=False):
  """Gated RMSNorm, weight * norm(x) * act(gate), differentiable (Pallas backward).

  x: (..., hidden) f32/bf16; gate: x's shape, f32/bf16; weight: (hidden,) f32/bf16.
  Returns x's shape and dtype. activation: "silu" (Qwen3.5 / Qwen3-Next / OLMo-Hybrid /
  Lara-mini) or "sigmoid" (Kimi Linear / Bailing-hybrid / GLM-5-Next). norm_in_input_dtype:
  True rounds norm(x) to x's dtype before the weight (Qwen3.5 / Qwen3-Next / OLMo-Hybrid /
  Qwen4-Exp), False keeps it all in f32 (Kimi Linear / Bailing-hybrid / GLM-5-Next /
  Lara-mini). chip, block_rows, vmem_limit_bytes, interpret: as `rms_norm`.
  """
  config = RmsNormGatedConfig(eps=float(eps), activation=activation,
                              norm_in_input_dtype=bool(norm_in_input_dtype), chip=chip,
                              block_rows=block_rows, vmem_limit_bytes=vmem_limit_bytes,
                              interpret=interpret)
  return _rms_norm_gated(x, gate, weight, config)


def rms_norm_gated_reference(x, gate, weight, *, eps=1e-6, activation="silu",
                             norm_in_input_dtype=True):
  """Plain-XLA gated RMSNorm (the same roundings), the baseline for benchmarks."""
  _, _, _, h = _gated_parts(x.astype(jnp.float32), weight.astype(jnp.float32), eps,
                            norm_in_input_dtype, x.dtype, jnp.promote_types(x.dtype,
                                                                            weight.dtype))
  return (h * _gate(gate.astype(jnp.float32), activation)).astype(x.dtype)
