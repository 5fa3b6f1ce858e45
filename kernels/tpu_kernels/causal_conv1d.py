"""Causal depthwise conv1d (the short convolution of Mamba and Gated DeltaNet layers) in Pallas:
forward and backward for prefill / training, and the in-place decode update.

Math (Transformers' `causal_conv1d_fn` / `causal_conv1d_update`, Dao-AILab causal-conv1d).
x [B, D, T], weight [D, W], bias [D] or None; every channel d has its own W taps:

    z[b, d, t]   = bias[d] + sum_{i<W} weight[d, i] * x[b, d, t - (W-1) + i]    (x = 0 before t = 0)
    out[b, d, t] = act(z[b, d, t]),        act = identity, or silu(z) = z * sigmoid(z)

As Transformers computes it: x is cast to the weight's dtype (the compute dtype c), the taps
are summed in f32, z is rounded to c (F.conv1d's output), the activation is taken in f32 and
rounded to c, and the result is returned in x's dtype. For f32 weights every rounding but
the last is exact.

Packed sequences: a row of x may hold several sequences back to back (`cu_seqlens`, or
Mamba's `seq_idx`). Each sequence starts from zeros: with pos[b, t] the position of token t
inside its own sequence, tap i of token t is used only if its look-back k = W-1-i <= pos[b, t].

Backward, with dz = dout * act'(z) (0 at t >= T):

    dx[b, d, s]  = sum_i weight[d, i] * dz[b, d, s + k]      (k = W-1-i; only where tap i of
                                                              token s + k is used)
    dweight[d, i] = sum_{b,t} dz[b, d, t] * x[b, d, t - k]   (same condition)
    dbias[d]     = sum_{b,t} dz[b, d, t]

Decode update (`causal_conv1d_update`): conv_state [B, D, S] (S >= W-1) holds the last S
inputs of each sequence. With full = cat(conv_state, x) along time, cast to c,

    out[b, d, t]  = act(bias[d] + sum_i weight[d, i] * full[b, d, S + t - (W-1) + i])
    new_state     = full[b, d, T:]  (the last S columns), cast back to the state's dtype

and Transformers writes new_state into conv_state in place. Here the kernel's state output
aliases its state input (`input_output_aliases`), so a caller that donates the state
(jax.jit donate_argnums, or TorchTPU's jax_op donation) has it updated in place: read once,
written once.

Layout. The kernels work channels-last: x as [B, T, D] (T on sublanes, D on lanes: 8192
channels at Qwen3.5-9B are 64 full lanes), the weight as [W, D], the state as [B, S, D].
Transformers' x [B, D, T] is a transposed view of its [B, T, D] projection, so a torch
caller passes that contiguous tensor with `channels_last=True` and nothing moves; given
[B, D, T], the functions swap the axes in XLA. For the state, [B, D, S] -> [B, S, D] is
free: XLA's own TPU layout for a [B, D, S] array with small S is S-major ({1,2,0}), the
bytes of a row-major [B, S, D] (checked in the compiled HLO: a bitcast, no copy).

Grids and blocks (every axis "parallel": no state is carried between grid steps).

  forward   grid (B, cdiv(D, block_d), cdiv(T, block_t)); per step x (block_t, block_d), the
            halo: the `halo` rows just before the block, read as a second (halo, block_d)
            block of the same array at block index t * block_t / halo - 1 (clamped to 0
            at t = 0, where those rows are zeroed), the weight (W, block_d) (fetched once
            per channel block: t is the innermost axis) and bias (1, block_d); packed
            calls add pos (block_t, 1) int32. halo is W-1 rounded up to the sublane tile
            (8 rows f32, 16 bf16) and block_t is a multiple of it, so the halo block
            never reaches before row 0 or past the array: no out-of-bounds read.
  backward  the same grid. dx of a row needs dz of the W-1 rows after it, and those need x
            of the W-1 rows before them: each step reads x's previous and next halo, dout's
            next halo (and pos's), recomputes z on its block_t + halo rows, and writes dx
            and its block's dweight / dbias partial sums (f32, one slot per (b, t) step,
            summed by XLA), so that no axis carries an accumulator.
  update    grid (cdiv(B, block_b), cdiv(D, block_d)); x (block_b, T, block_d), state
            (block_b, S, block_d) in and out (aliased), weight, bias. One step (T = 1) takes
            x and out as [B, D] with (block_b, block_d) blocks: then x, out and the state
            all reach and leave the kernel by bitcasts (no retiling copy around it).

When T fits in one block there is no halo operand at all. Partial last blocks (T, D or B
not a multiple of the block) are clipped by Pallas; rows past T may hold garbage, so the
backward selects (never multiplies) them away. Any T >= 1 and D >= 1 work; widths 1 to
MAX_WIDTH (Transformers' families use 2 to 7).

Tiles. block_t is the largest multiple of the halo (of 128 rows from 128 on) that fits the
chip's VMEM budget (`vmem.py`: double-buffered blocks plus the f32 temporaries), capped at
MAX_BLOCK_T; block_d the whole D up to MAX_BLOCK_D lanes, else MAX_BLOCK_D, halved (down to
128) while that keeps block_t under PREFERRED_BLOCK_T. At Qwen3.5-9B's prefill (T 4096, D
8192, bf16): forward 256 x 2048 (v6e) / 256 x 1024 (v5e), backward 256 x 1024 / 256 x 512,
all under the chips' default scoped limits. The update takes as many batch rows per step
as fit, up to MAX_BLOCK_B (batch-64 decode: 16 rows x 2048 channels on v6e, 16 x 1024 on
v5e).

Dtypes: x, weight, bias and conv_state are float32 or bfloat16 (each its own; bias must
match the weight, as F.conv1d requires). float64, float16 and integer inputs are refused,
never silently cast.

API (JAX; `chip` and every keyword but cu_seqlens / seq_idx are static):

  causal_conv1d_fn(x, weight, bias=None, activation=None, *, cu_seqlens=None, seq_idx=None,
                   channels_last=False, chip, block_t, block_d, vmem_limit_bytes, interpret)
      -> out, differentiable in x, weight, bias (custom VJP, Pallas backward).
  causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *, chip, block_b,
                       block_d, vmem_limit_bytes, interpret) -> (out, new_conv_state),
      the state aliased in the kernel (donate it); no gradient.
  conv_state_from_prefill(x, state_len) -> the state Transformers' cache keeps after a
      first prefill (the last S inputs, zero-padded).
  conv1d_forward / conv1d_backward / conv1d_update: the kernels, channels-last; and
  forward_tiling / backward_tiling / update_tiling: their tiles and VMEM plans.
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

SUPPORTED_DTYPES = (jnp.float32, jnp.bfloat16)
# Activation names as Transformers' families and Dao-AILab's causal_conv1d pass them.
ACTIVATIONS = (None, "silu", "swish")
MAX_WIDTH = 16
# Lanes per block. Beyond this the blocks only grow the f32 temporaries.
MAX_BLOCK_D = 2048
# Rows per block (forward / backward): enough to amortise the per-step overhead and the
# halo re-read (halo / block_t of x again).
MAX_BLOCK_T = 1024
# Rows per block worth narrowing the channel block for (see _time_tiling).
PREFERRED_BLOCK_T = 256
MAX_BLOCK_B = 64
# f32 (rows, block_d) temporaries live at once in the kernel bodies, counted generously
# (the extended x, a shifted tap, the sum, the activation; the backward adds z, dz, dout,
# the dx sum and the dweight products).
_FWD_F32_TEMPORARIES = 5
_BWD_F32_TEMPORARIES = 9
_UPDATE_F32_TEMPORARIES = 5


@dataclasses.dataclass(frozen=True)
class CausalConv1dConfig:
  """Everything static about one conv call (hashable: it keys jit caches)."""

  activation: str | None = None
  chip: str = chips.DEFAULT_CHIP
  block_t: int | None = None           # None: chosen from the VMEM budget
  block_d: int | None = None           # None: min(D, MAX_BLOCK_D)
  block_b: int | None = None           # update only; None: from the VMEM budget
  vmem_limit_bytes: int | None = None  # None: the chip's default scoped limit
  interpret: bool = False              # Pallas interpret mode (CPU)

  def __post_init__(self):
    if self.activation not in ACTIVATIONS:
      raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
    chips.get_chip(self.chip)  # raises for an unknown chip
    for name in ("block_t", "block_d", "block_b"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, (int, np.integer)) or value <= 0):
        raise ValueError(f"{name} must be a positive int, got {value!r}")

  @property
  def silu(self) -> bool:
    return self.activation in ("silu", "swish")


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class ConvTiling:
  """How one kernel call is cut up, and the VMEM it plans for."""

  block_t: int            # rows of T per step (update: T itself)
  block_d: int            # channels per step
  block_b: int            # batch rows per step (1 for forward / backward)
  halo: int               # rows of the halo blocks (0: one T block, no halo operand)
  vmem_limit_bytes: int   # the scoped-VMEM limit the kernel is compiled with
  vmem_plan_bytes: int    # what its blocks and f32 temporaries occupy by our count


def halo_rows(width: int, dtype) -> int:
  """Rows of a halo block: W-1 rounded up to the sublane tile of `dtype` (at least one tile)."""
  return vmem.round_up(max(width - 1, 1), vmem.sublane_multiple(dtype))


def _itemsize(dtype) -> int:
  return np.dtype(dtype).itemsize


def _padded_rows(rows: int, dtype) -> int:
  return vmem.round_up(rows, vmem.sublane_multiple(dtype))


def _block_d_choices(dim: int, config: CausalConv1dConfig) -> list[int]:
  """Channel blocks to try, largest first: whole D or MAX_BLOCK_D, then halves down to 128."""
  if config.block_d is not None:
    if config.block_d >= dim:
      return [dim]
    if config.block_d % 128:
      raise ValueError(f"block_d={config.block_d} must be a multiple of 128 (or cover all "
                       f"{dim} channels)")
    return [config.block_d]
  first = dim if dim <= MAX_BLOCK_D else MAX_BLOCK_D
  choices = [first]
  while choices[-1] > 128 and choices[-1] % 256 == 0:
    choices.append(choices[-1] // 2)
  return choices


def _limit_for(plan_smallest: int, config: CausalConv1dConfig):
  """The scoped-VMEM limit: the caller's, or the chip default raised as far as needed."""
  chip = chips.get_chip(config.chip)
  limit = vmem.resolve_vmem_limit(chip, config.vmem_limit_bytes)
  if config.vmem_limit_bytes is None and plan_smallest > vmem.vmem_budget(chip, None):
    needed = vmem.round_up(int(plan_smallest / vmem.BUDGET_FRACTION), vmem.MiB)
    limit = min(needed, chip.max_vmem_limit_bytes)
  return limit, int(limit * vmem.BUDGET_FRACTION)


def _time_tiling(seqlen, dim, width, plan, dtype, config, what) -> ConvTiling:
  """block_t / block_d for the forward or backward, given plan(block_t, block_d, halo)."""
  halo = halo_rows(width, dtype)
  choices = _block_d_choices(dim, config)
  limit, budget = _limit_for(plan(halo, choices[-1], halo), config)

  if config.block_t is not None:
    block_t = config.block_t
    if block_t >= seqlen:
      block_t = seqlen
    elif block_t % halo:
      raise ValueError(
          f"block_t={config.block_t} must be a multiple of {halo} (W-1 rounded up to the "
          f"sublane tile of {np.dtype(dtype).name}), or cover all {seqlen} steps")
    block_d = choices[0]
    h = halo if block_t < seqlen else 0
    return ConvTiling(block_t, block_d, 1, h, limit, plan(block_t, block_d, h))

  # The widest channel block whose rows reach PREFERRED_BLOCK_T (or all of T); failing
  # that, the one with the most rows. Narrow blocks cost little (a 256-lane block is two
  # vregs wide), short ones re-read the halo often.
  best = None
  target = min(vmem.round_up(PREFERRED_BLOCK_T, halo), vmem.round_up(seqlen, halo))
  for block_d in choices:
    # plan is linear in block_t over whole halos (halo is a multiple of the sublane tile).
    per_halo = plan(2 * halo, block_d, halo) - plan(halo, block_d, halo)
    fixed = plan(halo, block_d, halo) - per_halo
    fit = min(max(budget - fixed, 0) // per_halo * halo,
              vmem.round_down(MAX_BLOCK_T, halo) or halo)
    if fit >= 128 and 128 % halo == 0:
      fit = vmem.round_down(fit, 128)   # whole 128-row blocks divide the usual T
    if fit >= halo and (best is None or fit > best[0]):
      best = (fit, block_d)
    if fit >= target:
      break
  if best is not None:
    block_t, block_d = best
    if seqlen <= block_t:
      return ConvTiling(seqlen, block_d, 1, 0, limit, plan(seqlen, block_d, 0))
    return ConvTiling(block_t, block_d, 1, halo, limit, plan(block_t, block_d, halo))
  chip = chips.get_chip(config.chip)
  raise ValueError(
      f"the causal conv1d {what} needs {plan(halo, choices[-1], halo)} bytes of VMEM at "
      f"{halo} rows x {choices[-1]} channels per block, more than the budget of {budget} "
      f"bytes under a {limit}-byte limit on {chip.name}")


def forward_tiling(batch, seqlen, dim, width, x_dtype, weight_dtype, packed,
                   config: CausalConv1dConfig) -> ConvTiling:
  """Tiling of the forward kernel for x [batch, seqlen, dim] (channels-last)."""
  del batch
  xb, wb = _itemsize(x_dtype), _itemsize(weight_dtype)

  def plan(block_t, block_d, halo):
    lanes = vmem.lane_padded(block_d)
    rows_t = _padded_rows(block_t, x_dtype)
    buffers = (rows_t * lanes * xb * 2                      # x in, out (x's dtype)
               + halo * lanes * xb                          # previous rows
               + (rows_t * 128 * 4 if packed else 0)        # pos (block_t, 1) int32
               + (_padded_rows(width, weight_dtype) + _padded_rows(1, weight_dtype))
               * lanes * wb)                                # weight, bias
    temps = _FWD_F32_TEMPORARIES * (rows_t + halo) * lanes * 4
    return 2 * buffers + temps

  return _time_tiling(seqlen, dim, width, plan, x_dtype, config, "forward")


def backward_tiling(batch, seqlen, dim, width, x_dtype, weight_dtype, packed,
                    config: CausalConv1dConfig) -> ConvTiling:
  """Tiling of the backward kernel for x [batch, seqlen, dim] (channels-last)."""
  del batch
  xb, wb = _itemsize(x_dtype), _itemsize(weight_dtype)

  def plan(block_t, block_d, halo):
    lanes = vmem.lane_padded(block_d)
    rows_t = _padded_rows(block_t, x_dtype)
    buffers = (rows_t * lanes * xb * 3                      # x, dout in; dx out
               + 3 * halo * lanes * xb                      # x's two halos, dout's next
               + ((rows_t + halo) * 128 * 4 if packed else 0)
               + (_padded_rows(width, weight_dtype) + _padded_rows(1, weight_dtype))
               * lanes * wb
               + (_padded_rows(width, jnp.float32) + 8) * lanes * 4)  # dweight, dbias slots
    temps = _BWD_F32_TEMPORARIES * (rows_t + 2 * halo) * lanes * 4
    return 2 * buffers + temps

  return _time_tiling(seqlen, dim, width, plan, x_dtype, config, "backward")


def update_tiling(batch, seqlen, state_len, dim, width, x_dtype, state_dtype, weight_dtype,
                  config: CausalConv1dConfig) -> ConvTiling:
  """Tiling of the decode update for x [batch, seqlen, dim], state [batch, state_len, dim].

  One step (seqlen 1) takes x and out as 2-D (block_b, block_d) blocks, so block_b is then
  a multiple of x's sublane tile (or the whole batch)."""
  xb, sb, wb = _itemsize(x_dtype), _itemsize(state_dtype), _itemsize(weight_dtype)
  two_d = seqlen == 1
  rows = vmem.sublane_multiple(x_dtype) if two_d else 1   # block_b granularity

  def plan(block_b, block_d):
    lanes = vmem.lane_padded(block_d)
    x_rows = _padded_rows(block_b, x_dtype) if two_d else block_b * _padded_rows(seqlen,
                                                                                 x_dtype)
    buffers = (2 * x_rows * xb                                                # x in, out
               + 2 * block_b * _padded_rows(state_len, state_dtype) * sb     # state in, out
               + (_padded_rows(width, weight_dtype) + _padded_rows(1, weight_dtype)) * wb)
    temps = _UPDATE_F32_TEMPORARIES * block_b * vmem.round_up(state_len + seqlen, 8) * 4
    return (2 * buffers + temps) * lanes

  choices = _block_d_choices(dim, config)
  smallest = min(batch, rows)
  limit, budget = _limit_for(plan(smallest, choices[-1]), config)
  if config.block_b is not None:
    block_b = min(config.block_b, batch)
    if block_b < batch and block_b % rows:
      raise ValueError(f"block_b={config.block_b} must be a multiple of {rows} for one-step "
                       f"updates of {np.dtype(x_dtype).name} x (or cover all {batch} rows)")
    return ConvTiling(seqlen, choices[0], block_b, 0, limit, plan(block_b, choices[0]))
  for block_d in choices:
    if plan(smallest, block_d) > budget:
      continue
    block_b = smallest
    for candidate in range(rows, min(batch, MAX_BLOCK_B) + rows, rows):
      candidate = min(candidate, batch)
      if plan(candidate, block_d) > budget:
        break
      block_b = candidate
    if not two_d and block_b >= 8:
      block_b = vmem.round_down(block_b, 8)
    return ConvTiling(seqlen, block_d, block_b, 0, limit, plan(block_b, block_d))
  chip = chips.get_chip(config.chip)
  raise ValueError(
      f"the causal conv1d update needs {plan(1, choices[-1])} bytes of VMEM for one batch "
      f"row of {choices[-1]} channels, more than the budget of {budget} bytes under a "
      f"{limit}-byte limit on {chip.name}")


def _compiler_params(tiling: ConvTiling, num_axes: int):
  return pltpu.CompilerParams(dimension_semantics=("parallel",) * num_axes,
                              vmem_limit_bytes=tiling.vmem_limit_bytes)


# ----------------------------------------------------------------------------- kernel math


def _widen(a, compute_dtype):
  """A block as the conv sees it: rounded to the compute (weight) dtype, then f32."""
  return a.astype(compute_dtype).astype(jnp.float32)


def _activation(z, silu):
  return z * jax.nn.sigmoid(z) if silu else z


def _activation_grad(z, silu):
  if not silu:
    return jnp.ones_like(z)
  s = jax.nn.sigmoid(z)
  return s * (1.0 + z * (1.0 - s))


def _taps(x_ext, w, pos, base, rows, width):
  """z[j] = sum_i w[i] * x_ext[base + j - k] (k = W-1-i) for j < rows, f32.

  pos: None (one sequence per row: x_ext already holds zeros before t = 0), or the
  (rows, block_d) in-sequence positions: tap i is used only where k <= pos[j].
  """
  z = None
  for i in range(width):
    k = width - 1 - i
    tap = x_ext[base - k: base - k + rows]
    if pos is not None and k:
      tap = jnp.where(pos >= k, tap, 0.0)
    term = w[i:i + 1] * tap
    z = term if z is None else z + term
  return z


def _forward_kernel(*refs, width, halo, block_t, has_halo, packed, has_bias, silu,
                    compute_dtype):
  refs = list(refs)
  x_ref = refs.pop(0)
  prev_ref = refs.pop(0) if has_halo else None
  pos_ref = refs.pop(0) if packed else None
  w_ref = refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  (out_ref,) = refs
  rows, block_d = x_ref.shape
  x = _widen(x_ref[...], compute_dtype)
  if has_halo:
    t0 = pl.program_id(2) * block_t
    row = t0 - halo + jax.lax.broadcasted_iota(jnp.int32, (halo, block_d), 0)
    prev = jnp.where(row >= 0, _widen(prev_ref[...], compute_dtype), 0.0)
  else:
    prev = jnp.zeros((halo, block_d), jnp.float32)
  x_ext = jnp.concatenate([prev, x], axis=0)
  pos = jnp.broadcast_to(pos_ref[...], (rows, block_d)) if packed else None
  z = _taps(x_ext, w_ref[...].astype(jnp.float32), pos, halo, rows, width)
  if has_bias:
    z = z + b_ref[...].astype(jnp.float32)
  z = z.astype(compute_dtype).astype(jnp.float32)          # F.conv1d's output dtype
  out = _activation(z, silu).astype(compute_dtype)
  out_ref[...] = out.astype(out_ref.dtype)


def _backward_kernel(*refs, width, halo, block_t, seqlen, has_halo, packed, has_bias,
                     silu, compute_dtype):
  refs = list(refs)
  x_ref = refs.pop(0)
  prev_ref, next_ref = (refs.pop(0), refs.pop(0)) if has_halo else (None, None)
  dy_ref = refs.pop(0)
  dy_next_ref = refs.pop(0) if has_halo else None
  pos_ref = refs.pop(0) if packed else None
  pos_next_ref = refs.pop(0) if packed and has_halo else None
  w_ref = refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  dx_ref, dw_ref = refs.pop(0), refs.pop(0)
  db_ref = refs.pop(0) if has_bias else None
  assert not refs
  rows, block_d = x_ref.shape
  ext = rows + halo                    # rows of z / dz: global rows [t0, t0 + rows + halo)
  t0 = pl.program_id(2) * block_t

  def widen(ref):
    return _widen(ref[...], compute_dtype) if ref is not None else jnp.zeros(
        (halo, block_d), jnp.float32)

  x_ext = jnp.concatenate([widen(prev_ref), _widen(x_ref[...], compute_dtype),
                           widen(next_ref)], axis=0)
  # Rows before 0 (the clamped halo of the first block) and past T (a partial block, the
  # next halo of the last block) are zeros by definition; select, since they may be garbage.
  row = t0 - halo + jax.lax.broadcasted_iota(jnp.int32, (rows + 2 * halo, block_d), 0)
  x_ext = jnp.where((row >= 0) & (row < seqlen), x_ext, 0.0)
  if packed:
    pos_next = (pos_next_ref[...] if pos_next_ref is not None
                else jnp.zeros((halo, 1), jnp.int32))
    pos = jnp.broadcast_to(jnp.concatenate([pos_ref[...], pos_next], axis=0), (ext, block_d))
  else:
    pos = None
  w = w_ref[...].astype(jnp.float32)
  z = _taps(x_ext, w, pos, halo, ext, width)
  if has_bias:
    z = z + b_ref[...].astype(jnp.float32)
  z = z.astype(compute_dtype).astype(jnp.float32)
  dy_next = (dy_next_ref[...].astype(jnp.float32) if dy_next_ref is not None
             else jnp.zeros((halo, block_d), jnp.float32))
  dy = jnp.concatenate([dy_ref[...].astype(jnp.float32), dy_next], axis=0)
  zrow = t0 + jax.lax.broadcasted_iota(jnp.int32, (ext, block_d), 0)
  dz = jnp.where(zrow < seqlen, dy * _activation_grad(z, silu), 0.0)

  dx = None
  for i in range(width):
    k = width - 1 - i
    term = dz[k:k + rows]
    if packed and k:
      term = jnp.where(pos[k:k + rows] >= k, term, 0.0)
    term = w[i:i + 1] * term
    dx = term if dx is None else dx + term
  dx_ref[...] = dx.astype(dx_ref.dtype)

  dz_block = dz[:rows]
  for i in range(width):
    k = width - 1 - i
    tap = x_ext[halo - k: halo - k + rows]
    if packed and k:
      tap = jnp.where(pos[:rows] >= k, tap, 0.0)
    dw_ref[i:i + 1, :] = jnp.sum(dz_block * tap, axis=0, keepdims=True)
  if has_bias:
    db_ref[...] = jnp.sum(dz_block, axis=0, keepdims=True)


def _update_kernel(*refs, width, state_len, seqlen, has_bias, silu, compute_dtype):
  refs = list(refs)
  x_ref, s_ref, w_ref = refs.pop(0), refs.pop(0), refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  out_ref, s_out_ref = refs
  x = _widen(x_ref[...], compute_dtype)
  if x.ndim == 2:           # one step: x and out are (block_b, block_d) blocks
    x = x[:, None, :]
  # Transformers: full = cat(conv_state, x).to(weight.dtype); state <- full[..., -S:].
  full = jnp.concatenate([_widen(s_ref[...], compute_dtype), x], axis=1)
  s_out_ref[...] = full[:, seqlen:, :].astype(s_out_ref.dtype)
  w = w_ref[...].astype(jnp.float32)
  z = None
  for i in range(width):
    start = state_len - (width - 1) + i
    term = w[i:i + 1][None] * full[:, start:start + seqlen, :]
    z = term if z is None else z + term
  if has_bias:
    z = z + b_ref[...].astype(jnp.float32)[None]
  z = z.astype(compute_dtype).astype(jnp.float32)
  out = _activation(z, silu).astype(compute_dtype)
  out_ref[...] = (out[:, 0, :] if len(out_ref.shape) == 2 else out).astype(out_ref.dtype)


# ----------------------------------------------------------------------------- calls


def _check_dtype(name, a):
  dtype = jnp.dtype(a.dtype)
  if dtype == jnp.float64:
    raise TypeError(f"{name} is float64: the TPU kernels take float32 or bfloat16 (cast it "
                    "explicitly; nothing is down-cast silently)")
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(f"{name} must be float32 or bfloat16, got {dtype}")


def _check_weight(weight, bias, dim):
  _check_dtype("weight", weight)
  if weight.ndim != 2 or weight.shape[0] != dim:
    raise ValueError(f"weight must have shape ({dim}, W), got {weight.shape}")
  width = weight.shape[1]
  if not 1 <= width <= MAX_WIDTH:
    raise ValueError(f"conv width W={width} is not supported (1 <= W <= {MAX_WIDTH})")
  if bias is not None:
    _check_dtype("bias", bias)
    if bias.shape != (dim,):
      raise ValueError(f"bias must have shape ({dim},), got {bias.shape}")
    if bias.dtype != weight.dtype:
      raise TypeError(f"bias dtype {bias.dtype} must match the weight's {weight.dtype} "
                      "(as F.conv1d requires)")
  return width


def conv1d_forward(x, weight_t, bias, pos, *, config: CausalConv1dConfig):
  """Forward kernel, channels-last.

  Args:
    x: [B, T, D] f32 / bf16.
    weight_t: [W, D], the transposed conv weight (its dtype is the compute dtype).
    bias: [D] in the weight's dtype, or None.
    pos: None, or [B, T, 1] int32 in-sequence positions (packed sequences).
  Returns:
    out [B, T, D] in x's dtype.
  """
  batch, seqlen, dim = x.shape
  width = weight_t.shape[0]
  if batch * seqlen * dim == 0:
    return jnp.zeros(x.shape, x.dtype)
  packed, has_bias = pos is not None, bias is not None
  tiling = forward_tiling(batch, seqlen, dim, width, x.dtype, weight_t.dtype, packed, config)
  block_t, block_d, halo = tiling.block_t, tiling.block_d, tiling.halo
  has_halo = halo > 0
  halo = halo or halo_rows(width, x.dtype)
  ratio = block_t // halo
  grid = (batch, pl.cdiv(dim, block_d), pl.cdiv(seqlen, block_t))

  operands = [x]
  in_specs = [pl.BlockSpec((None, block_t, block_d), lambda b, d, t: (b, t, d))]
  if has_halo:
    operands.append(x)
    in_specs.append(pl.BlockSpec((None, halo, block_d),
                                 lambda b, d, t: (b, jnp.maximum(t * ratio - 1, 0), d)))
  if packed:
    operands.append(pos)
    in_specs.append(pl.BlockSpec((None, block_t, 1), lambda b, d, t: (b, t, 0)))
  operands.append(weight_t)
  in_specs.append(pl.BlockSpec((width, block_d), lambda b, d, t: (0, d)))
  if has_bias:
    operands.append(bias.reshape(1, dim))
    in_specs.append(pl.BlockSpec((1, block_d), lambda b, d, t: (0, d)))

  return pl.pallas_call(
      functools.partial(_forward_kernel, width=width, halo=halo, block_t=block_t,
                        has_halo=has_halo, packed=packed, has_bias=has_bias,
                        silu=config.silu, compute_dtype=weight_t.dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, block_t, block_d), lambda b, d, t: (b, t, d)),
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      compiler_params=_compiler_params(tiling, 3),
      interpret=config.interpret,
      name="causal_conv1d_fwd",
  )(*operands)


def conv1d_backward(x, weight_t, bias, pos, grad_out, *, config: CausalConv1dConfig):
  """Backward kernel, channels-last.

  Args: as `conv1d_forward`, plus grad_out [B, T, D] (the output's gradient).
  Returns:
    (dx [B, T, D] in x's dtype, dweight_t [W, D] in the weight's dtype,
     dbias [D] in the bias's dtype or None).
  """
  batch, seqlen, dim = x.shape
  width = weight_t.shape[0]
  has_bias = bias is not None
  if batch * seqlen * dim == 0:
    return (jnp.zeros(x.shape, x.dtype), jnp.zeros_like(weight_t),
            jnp.zeros_like(bias) if has_bias else None)
  packed = pos is not None
  tiling = backward_tiling(batch, seqlen, dim, width, x.dtype, weight_t.dtype, packed, config)
  block_t, block_d, halo = tiling.block_t, tiling.block_d, tiling.halo
  has_halo = halo > 0
  halo = halo or halo_rows(width, x.dtype)
  ratio = block_t // halo
  num_t = pl.cdiv(seqlen, block_t)
  last_halo = pl.cdiv(seqlen, halo) - 1
  grid = (batch, pl.cdiv(dim, block_d), num_t)

  def prev_map(b, d, t):
    return (b, jnp.maximum(t * ratio - 1, 0), d)

  def next_map(b, d, t):
    return (b, jnp.minimum((t + 1) * ratio, last_halo), d)

  block = pl.BlockSpec((None, block_t, block_d), lambda b, d, t: (b, t, d))
  halo_block = (None, halo, block_d)
  operands, in_specs = [x], [block]
  if has_halo:
    operands += [x, x]
    in_specs += [pl.BlockSpec(halo_block, prev_map), pl.BlockSpec(halo_block, next_map)]
  operands.append(grad_out.astype(x.dtype) if grad_out.dtype != x.dtype else grad_out)
  in_specs.append(block)
  if has_halo:
    operands.append(operands[-1])
    in_specs.append(pl.BlockSpec(halo_block, next_map))
  if packed:
    operands.append(pos)
    in_specs.append(pl.BlockSpec((None, block_t, 1), lambda b, d, t: (b, t, 0)))
    if has_halo:
      operands.append(pos)
      in_specs.append(pl.BlockSpec((None, halo, 1),
                                   lambda b, d, t: (b, jnp.minimum((t + 1) * ratio,
                                                                   last_halo), 0)))
  operands.append(weight_t)
  in_specs.append(pl.BlockSpec((width, block_d), lambda b, d, t: (0, d)))
  if has_bias:
    operands.append(bias.reshape(1, dim))
    in_specs.append(pl.BlockSpec((1, block_d), lambda b, d, t: (0, d)))

  out_specs = [block, pl.BlockSpec((None, width, block_d),
                                   lambda b, d, t: (b * num_t + t, 0, d))]
  out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype),
               jax.ShapeDtypeStruct((batch * num_t, width, dim), jnp.float32)]
  if has_bias:
    out_specs.append(pl.BlockSpec((None, 1, block_d), lambda b, d, t: (b * num_t + t, 0, d)))
    out_shape.append(jax.ShapeDtypeStruct((batch * num_t, 1, dim), jnp.float32))

  results = pl.pallas_call(
      functools.partial(_backward_kernel, width=width, halo=halo, block_t=block_t,
                        seqlen=seqlen, has_halo=has_halo, packed=packed,
                        has_bias=has_bias, silu=config.silu,
                        compute_dtype=weight_t.dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      out_shape=out_shape,
      compiler_params=_compiler_params(tiling, 3),
      interpret=config.interpret,
      name="causal_conv1d_bwd",
  )(*operands)
  dx, dw_partial = results[0], results[1]
  dweight_t = jnp.sum(dw_partial, axis=0).astype(weight_t.dtype)
  dbias = jnp.sum(results[2], axis=(0, 1)).astype(bias.dtype) if has_bias else None
  return dx, dweight_t, dbias


def conv1d_update(x, state, weight_t, bias, *, config: CausalConv1dConfig):
  """Decode update kernel, channels-last.

  Args:
    x: [B, T, D]; state: [B, S, D] (S >= W-1); weight_t: [W, D]; bias: [D] or None.
  Returns:
    (out [B, T, D] in x's dtype, new_state [B, S, D] in the state's dtype). The new state
    aliases the state operand: donate it to update it in place.
  """
  batch, seqlen, dim = x.shape
  state_len = state.shape[1]
  width = weight_t.shape[0]
  has_bias = bias is not None
  if batch * dim == 0 or seqlen == 0:
    return jnp.zeros(x.shape, x.dtype), state
  tiling = update_tiling(batch, seqlen, state_len, dim, width, x.dtype, state.dtype,
                         weight_t.dtype, config)
  block_b, block_d = tiling.block_b, tiling.block_d
  grid = (pl.cdiv(batch, block_b), pl.cdiv(dim, block_d))
  if seqlen == 1:
    # [B, 1, D] -> [B, D]: XLA's layout of a one-step x then reaches the kernel (and the
    # output leaves it) by bitcasts; a (block_b, 1, block_d) block would be retiled.
    x = x.reshape(batch, dim)
    x_block = pl.BlockSpec((block_b, block_d), lambda b, d: (b, d))
  else:
    x_block = pl.BlockSpec((block_b, seqlen, block_d), lambda b, d: (b, 0, d))
  s_block = pl.BlockSpec((block_b, state_len, block_d), lambda b, d: (b, 0, d))
  operands = [x, state, weight_t]
  in_specs = [x_block, s_block, pl.BlockSpec((width, block_d), lambda b, d: (0, d))]
  if has_bias:
    operands.append(bias.reshape(1, dim))
    in_specs.append(pl.BlockSpec((1, block_d), lambda b, d: (0, d)))
  out, new_state = pl.pallas_call(
      functools.partial(_update_kernel, width=width, state_len=state_len, seqlen=seqlen,
                        has_bias=has_bias, silu=config.silu, compute_dtype=weight_t.dtype),
      grid=grid,
      in_specs=in_specs,
      out_specs=[x_block, s_block],
      out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype),
                 jax.ShapeDtypeStruct(state.shape, state.dtype)],
      input_output_aliases={1: 1},
      compiler_params=_compiler_params(tiling, 2),
      interpret=config.interpret,
      name="causal_conv1d_update",
  )(*operands)
  return out.reshape(batch, seqlen, dim), new_state


# ----------------------------------------------------------------------------- packing


def positions_from_cu_seqlens(cu_seqlens, seqlen):
  """[1, T, 1] int32: each token's position inside its sequence.

  cu_seqlens: [N + 1] integers, 0 = cu[0] <= cu[1] <= ... <= cu[N] <= T (sequence j is
  tokens cu[j] .. cu[j+1] - 1; empty sequences are allowed). Tokens at or past cu[N]
  (padding) form one more sequence. Values are data: they are not checked here.
  """
  cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
  t = jnp.arange(seqlen, dtype=jnp.int32)
  j = jnp.clip(jnp.searchsorted(cu, t, side="right") - 1, 0, cu.shape[0] - 1)
  return (t - cu[j]).reshape(1, seqlen, 1)


def positions_from_seq_idx(seq_idx):
  """[B, T, 1] int32 positions from Mamba's seq_idx [B, T] (a sequence is a run of equal ids)."""
  seq_idx = jnp.asarray(seq_idx).astype(jnp.int32)
  batch, seqlen = seq_idx.shape
  t = jnp.broadcast_to(jnp.arange(seqlen, dtype=jnp.int32), (batch, seqlen))
  starts = jnp.concatenate([jnp.ones((batch, 1), bool),
                            seq_idx[:, 1:] != seq_idx[:, :-1]], axis=1)
  start = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
  return (t - start).reshape(batch, seqlen, 1)


def _positions(cu_seqlens, seq_idx, batch, seqlen):
  if cu_seqlens is not None and seq_idx is not None:
    raise ValueError("pass cu_seqlens or seq_idx, not both")
  if cu_seqlens is not None:
    if not jnp.issubdtype(jnp.asarray(cu_seqlens).dtype, jnp.integer):
      raise TypeError(f"cu_seqlens must be integers, got {jnp.asarray(cu_seqlens).dtype}")
    if jnp.ndim(cu_seqlens) != 1 or jnp.shape(cu_seqlens)[0] < 2:
      raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 2 entries, got shape "
                       f"{jnp.shape(cu_seqlens)}")
    if batch != 1:
      raise ValueError(f"cu_seqlens packs sequences into one row: x must have batch 1, got "
                       f"{batch} (use seq_idx [B, T] for several packed rows)")
    return positions_from_cu_seqlens(cu_seqlens, seqlen)
  if seq_idx is not None:
    if not jnp.issubdtype(jnp.asarray(seq_idx).dtype, jnp.integer):
      raise TypeError(f"seq_idx must be integers, got {jnp.asarray(seq_idx).dtype}")
    if jnp.shape(seq_idx) != (batch, seqlen):
      raise ValueError(f"seq_idx must have shape {(batch, seqlen)}, got {jnp.shape(seq_idx)}")
    return positions_from_seq_idx(seq_idx)
  return None


# ----------------------------------------------------------------------------- JAX API


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _conv(x, weight_t, bias, pos, config):
  return conv1d_forward(x, weight_t, bias, pos, config=config)


def _conv_fwd(x, weight_t, bias, pos, config):
  return conv1d_forward(x, weight_t, bias, pos, config=config), (x, weight_t, bias, pos)


def _conv_bwd(config, saved, grad_out):
  x, weight_t, bias, pos = saved
  dx, dweight_t, dbias = conv1d_backward(x, weight_t, bias, pos, grad_out, config=config)
  return dx, dweight_t, dbias, None


_conv.defvjp(_conv_fwd, _conv_bwd)


def causal_conv1d_fn(x, weight, bias=None, activation=None, *, cu_seqlens=None, seq_idx=None,
                     channels_last=False, chip=chips.DEFAULT_CHIP, block_t=None,
                     block_d=None, vmem_limit_bytes=None, interpret=False):
  """Causal depthwise conv1d with Transformers' semantics, differentiable (Pallas backward).

  Args:
    x: [B, D, T] (Transformers' layout), or [B, T, D] with channels_last=True; f32 / bf16.
    weight: [D, W] (conv1d.weight.squeeze(1)), f32 / bf16: the compute dtype (x is cast to
      it, as Transformers does). 1 <= W <= MAX_WIDTH.
    bias: [D] in the weight's dtype, or None.
    activation: None, "silu" or "swish" (static).
    cu_seqlens: None, or [N + 1] int cumulative sequence lengths of the sequences packed
      into x's one row (B must be 1; Transformers' `cu_seq_lens_q`). Each sequence's conv
      starts from zeros; tokens past cu_seqlens[-1] form one more sequence.
    seq_idx: None, or [B, T] int sequence ids (Mamba's), a sequence being a run of equal
      ids. At most one of cu_seqlens / seq_idx.
    channels_last: x (and the output) are [B, T, D] (static).
    chip: "v5e", "v6e", "v5p", "v7": tiles and VMEM limit (static).
    block_t, block_d: force the tiles (tests); vmem_limit_bytes: the scoped-VMEM limit;
    interpret: run the kernels in Pallas interpret mode (CPU).
  Returns:
    out, x's shape and dtype. Gradients flow to x, weight and bias (not to the int inputs).
  """
  config = CausalConv1dConfig(activation=activation, chip=chip, block_t=block_t,
                              block_d=block_d, vmem_limit_bytes=vmem_limit_bytes,
                              interpret=interpret)
  _check_dtype("x", x)
  if x.ndim != 3:
    raise ValueError(f"x must be 3-D ([B, D, T], or [B, T, D] channels-last), got {x.shape}")
  xt = x if channels_last else jnp.swapaxes(x, 1, 2)
  batch, seqlen, dim = xt.shape
  _check_weight(weight, bias, dim)
  pos = _positions(cu_seqlens, seq_idx, batch, seqlen)
  out = _conv(xt, weight.T, bias, pos, config)
  return out if channels_last else jnp.swapaxes(out, 1, 2)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None, *,
                         chip=chips.DEFAULT_CHIP, block_b=None, block_d=None,
                         vmem_limit_bytes=None, interpret=False):
  """One decode step (or a few) of the conv, with Transformers' `causal_conv1d_update` semantics.

  Args:
    x: [B, D, T] (T new tokens per sequence, usually 1) or [B, D] (one token); f32 / bf16.
    conv_state: [B, D, S], S >= W-1, f32 / bf16: the last S inputs of each sequence.
    weight: [D, W]; bias: [D] in the weight's dtype, or None; activation: None / "silu" /
      "swish" (static).
    chip, block_b, block_d, vmem_limit_bytes, interpret: as `causal_conv1d_fn`.
  Returns:
    (out, new_conv_state): out in x's shape and dtype; new_conv_state [B, D, S] in the state's
    dtype, the last S columns of cat(conv_state, x) (through the weight's dtype, as
    Transformers casts them). It aliases conv_state inside the kernel: under
    jax.jit(..., donate_argnums=<conv_state>) the state is updated in place. No gradient
    (decode only).
  """
  config = CausalConv1dConfig(activation=activation, chip=chip, block_b=block_b,
                              block_d=block_d, vmem_limit_bytes=vmem_limit_bytes,
                              interpret=interpret)
  _check_dtype("x", x)
  _check_dtype("conv_state", conv_state)
  squeeze = x.ndim == 2
  x3 = x[:, :, None] if squeeze else x
  if x3.ndim != 3:
    raise ValueError(f"x must be [B, D, T] or [B, D], got {x.shape}")
  batch, dim, _ = x3.shape
  width = _check_weight(weight, bias, dim)
  if conv_state.ndim != 3 or conv_state.shape[:2] != (batch, dim):
    raise ValueError(f"conv_state must have shape ({batch}, {dim}, S), got {conv_state.shape}")
  if conv_state.shape[2] < width - 1:
    raise ValueError(f"conv_state holds {conv_state.shape[2]} steps, fewer than W-1 = "
                     f"{width - 1}")
  out, new_state = conv1d_update(jnp.swapaxes(x3, 1, 2), jnp.swapaxes(conv_state, 1, 2),
                                 weight.T, bias, config=config)
  out = jnp.swapaxes(out, 1, 2)
  return (out[:, :, 0] if squeeze else out), jnp.swapaxes(new_state, 1, 2)


def conv_state_from_prefill(x, state_len, *, channels_last=False):
  """The conv state Transformers' cache keeps after a first prefill of x: the last
  `state_len` inputs, zero-padded on the left when T < state_len; [B, D, S] in x's dtype.
  (x: [B, D, T], or [B, T, D] with channels_last.)"""
  xt = x if channels_last else jnp.swapaxes(x, 1, 2)
  batch, seqlen, dim = xt.shape
  if seqlen < state_len:
    xt = jnp.concatenate([jnp.zeros((batch, state_len - seqlen, dim), x.dtype), xt], axis=1)
  return jnp.swapaxes(xt[:, xt.shape[1] - state_len:], 1, 2)


def causal_conv1d_reference(x, weight, bias=None, activation=None):
  """Plain-XLA conv (f32 math, no packing), x [B, D, T]: the baseline for benchmarks."""
  width = weight.shape[1]
  c = weight.dtype
  xf = jnp.pad(x.astype(c).astype(jnp.float32), ((0, 0), (0, 0), (width - 1, 0)))
  seqlen = x.shape[2]
  z = sum(weight[:, i].astype(jnp.float32)[None, :, None] * xf[:, :, i:i + seqlen]
          for i in range(width))
  if bias is not None:
    z = z + bias.astype(jnp.float32)[None, :, None]
  z = z.astype(c).astype(jnp.float32)
  if activation in ("silu", "swish"):
    z = z * jax.nn.sigmoid(z)
  return z.astype(c).astype(x.dtype)
