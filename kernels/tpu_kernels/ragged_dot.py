"""Grouped matmul (ragged dot) for Mixture-of-Experts, forward and backward, in Pallas.

Math. The rows of lhs (m, k) are sorted by group: group g owns the contiguous rows
[start[g], end[g]) with start = cumsum(group_sizes) - group_sizes. rhs holds the
groups group_offset .. group_offset + G_local - 1 (all groups when group_offset = 0
and G_local = len(group_sizes)); local group i is global group group_offset + i. For
a row r of local group i, with f32 accumulation,

    z[r, :] = (lhs[r, :] @ W_i) * scale_i + bias_i          W_i = rhs[i] or rhs[i].T
    out[r, :] = epilogue(z[r, :])

where scale_i (per output channel) is present for int8 / float8_e4m3fn weights and
the epilogue is the identity, an activation, or, for `gated_ragged_dot`, the gated
unit act(z_gate) * z_up over the two halves of the output columns. Rows that belong
to no local group (other experts' rows under expert parallelism, and rows past
sum(group_sizes)) come out as exact zeros: every output element is written.

Backward (first order), with dz = g * epilogue'(z) (z recomputed, not stored):

    d_lhs[r]  = (dz[r] * scale_i) @ W_i.T          a grouped matmul with rhs transposed
    d_rhs[i]  = lhs_i.T @ dz_i                     the transposed grouped matmul (tgmm)
    d_bias[i] = sum_r dz_i[r]

Quantized weights are frozen: they and their scales get no gradient.

Quantized activations (`lhs_quant="int8"`, int8 weights only; inference, no gradient):
lhs is quantized per row, symmetric, by a small kernel of its own before the matmul
(`quantize_rows`: scale_r = max|lhs[r]| / 127, codes round(lhs[r] / scale_r); one read of
the rows, one write of the codes), and the matmul kernel multiplies int8 codes
on the MXU with an int32 accumulator (exact), then

    z[r, :] = (codes[r, :] @ W_i) * scale_r * scale_i + bias_i

This is tpu-inference's dynamic per-token activation quantization (its quantized_matmul's
x_q_dtype). It spares the int8 -> bf16 widening of every weight block, which keeps a
decode visit compute-bound on v6e (docs/performance.md, "Quantized decode"), and doubles
the MXU's rate at prefill. The error is the activations' rounding: at most scale_r / 2 per
element of lhs, documented in `quantize_rows`.

Layout (forward, `_gmm`). The grid is (n tiles, visits, k tiles). A *visit* is one
(row tile, group) pair: a row tile of block_m rows that spans a group boundary is
visited once per group in it, and the kernel stores only the rows of the visited
group (a masked store into the output block, which stays in VMEM across consecutive
visits of the same tile). Row tiles with no local rows (the head before the first
local group and the tail after the last) get one "zero" visit, so that every tile is
written. The first visit of a tile clears its output block. The visit list is built
from group_sizes by a small scalar-core kernel (`group_metadata`) and scalar-
prefetched into SMEM; the number of visits is a run-time grid size, at most
tiles_m + G_local + 1. Zero
visits skip the matmul and pin their lhs / rhs block indices to those of the
adjacent real visit, so they cost a grid step but no DMA.

Two visits per grid step (`_paired_tiling`): at decode with 1-byte weights and one k
block, grid step s runs table entries 2s and 2s + 1, each with weight (and scale, bias)
blocks of its own ("slots": the same arrays passed twice, index maps one entry apart).
That halves the steps' fixed cost, which a 1-byte weight block's short DMA does not hide.
The paired table (`group_metadata(paired=True)`) puts a no-op entry where a visit must
open a step: the first visit of a row tile (a step's lhs and out blocks are one tile's),
and a visit whose group goes on into the next tile (so that group stays in slot 0 and its
weights are fetched once). A no-op keeps its slot's blocks (no DMA); one also follows the
last visit of every table, for a last step with one visit.

The k axis is reduced innermost into an f32 VMEM accumulator; where one block covers k
(decode's usual tiling), the product goes straight to the epilogue. A k that is not a
multiple of block_k is masked on the last k block (on both operands: the part of a
block past the array end holds stale data, maybe NaN; in f32 on chips without a bf16
vector unit, `_mask_k_tail`). Partial last blocks along m and n are clipped by Pallas
on the way out.

Gated, with gate and up interleaved in one weight (gpt-oss) at prefill ("lanes" in
`gate_up_route`): n tile j reads the weight's columns [2 j bn, 2 (j + 1) bn) into one
[bm, 2 bn] accumulator, and the epilogue splits it into gate and up by lane gathers,
bit for bit (`_deinterleave_lanes`), before the gated unit. At decode ("gate_pass"), where
the float32 [m, 2I] is smaller than the weights, the plain kernel writes it and a small
kernel of its own splits and gates it (`gate_pass`).

Backward (`_tgmm`) for d_rhs: grid (k tiles, n tiles, visits) over the local groups
only (an empty group still gets one visit, which writes its zero gradient); rows of
other groups are masked out of both operands before lhs_tile.T @ dz_tile.

Tiles come from the chip's VMEM budget (`gmm_tiling`, `tgmm_tiling`): the whole k
in one block when it fits (weights are then fetched once per group and n tile),
block_m near the mean group size (few wasted MXU rows at decode), block_n as large
as the budget allows in multiples of 256 (the v6e MXU width). Where every such block_n
pads n (no multiple of 128 divides it: gpt-oss's 2880), a visit takes the whole weight
instead, under a raised scoped-VMEM limit, if the chip holds it. For the shapes in the
tuning tables (`tuned/ragged_dot.<chip>.json`, written by benchmarks/tuning/ragged_dot.py from
libtpu's static estimates) the forward takes the table's blocks instead.
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
from . import masking
from . import tuning_tables
from . import vmem

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
QUANTIZED_DTYPE_NAMES = tuple(np.dtype(d).name for d in QUANTIZED_DTYPES)
SUPPORTED_ACTIVATIONS = ("identity", "silu", "gelu_tanh", "gelu", "relu", "relu2")
# Gated epilogues beyond act(gate) * up, both with a clamp `limit`: gpt-oss's, and the
# clamped SwiGLU of DeepSeek-V4, GLM-5-Next and HY-V4 (see `gated`).
GATED_ACTIVATIONS = SUPPORTED_ACTIVATIONS + ("gpt_oss", "clamped_silu")
LAYOUTS = ("concatenated", "interleaved")
# The pallas_call name of the small kernel that builds each call's visit table.
VISIT_TABLE_KERNEL = "ragged_dot_visit_table"
QUANTIZE_ROWS_KERNEL = "ragged_dot_quantize_rows"   # `quantize_rows` (lhs_quant)

MAX_BLOCK_M = 512
MAX_BLOCK_N = 2048
# Whole-k blocks up to this size; beyond it k is cut into blocks of BLOCK_K_STEP multiples.
MAX_BLOCK_K = 8192
_LANE_STEP = 256   # v6e's MXU is 256 wide; 256-multiples also suit v5e's 128
# The heuristic raises the scoped-VMEM limit up to this for one k block
# (`_one_k_block_tiling`); the tuning table's entries, each compiled by the tests, go up to
# the chip's maximum. Why the margin: at Mixtral-8x7B's w8a8 gate/up (m=64) a 101 MiB
# limit for a 50 MiB plan compiled, but libtpu's static-profile compile of it ran out of
# VMEM (134.6 of 128 MiB), so it could not be rated.
_ONE_K_BLOCK_MAX_LIMIT = 64 * vmem.MiB


# ----------------------------------------------------------------------------- epilogues


def activation(name: str, x):
  """The elementwise activation `name` (f32 in, f32 out)."""
  if name == "identity":
    return x
  if name == "silu":
    return x * jax.nn.sigmoid(x)
  if name == "gelu_tanh":
    return 0.5 * x * (1.0 + jnp.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))
  if name == "gelu":
    return 0.5 * x * (1.0 + jax.lax.erf(x * 0.7071067811865476))
  if name == "relu":
    return jnp.maximum(x, 0.0)
  if name == "relu2":
    r = jnp.maximum(x, 0.0)
    return r * r
  raise ValueError(f"unknown activation {name!r}; expected one of {SUPPORTED_ACTIVATIONS}")


def gated(name: str, gate, up, alpha: float, limit: float):
  """act(gate) * up (f32), or one of the clamped gates (g = min(gate, limit),
  u = clip(up, -limit, limit)):
    "gpt_oss":      (u + 1) * g * sigmoid(alpha * g)
    "clamped_silu": silu(g) * u
  """
  if name == "gpt_oss":
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))
  if name == "clamped_silu":
    gate = jnp.minimum(gate, limit)
    return activation("silu", gate) * jnp.clip(up, -limit, limit)
  return activation(name, gate) * up


@dataclasses.dataclass(frozen=True)
class Epilogue:
  """What the kernel applies to z = acc * scale + bias before storing (static)."""

  activation: str | None = None   # None: store z as it is
  gated: bool = False             # two column sets (gate, up) -> gated(activation, ...)
  alpha: float = 1.702            # gpt_oss only
  limit: float = 7.0              # gpt_oss and clamped_silu only

  def __call__(self, *z):
    if self.gated:
      return gated(self.activation, z[0], z[1], self.alpha, self.limit)
    return z[0] if self.activation is None else activation(self.activation, z[0])


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How one grouped-matmul call is cut up, and the VMEM it plans for."""

  block_m: int
  block_k: int
  block_n: int
  vmem_limit_bytes: int
  vmem_plan_bytes: int
  # Visits per grid step: 2 at decode with 1-byte weights and one k block (`_paired_tiling`;
  # each visit has weight blocks of its own), else 1.
  visits_per_step: int = 1


def _next_pow2(x: int) -> int:
  return 1 << max(0, int(x) - 1).bit_length()


def _row_block(m: int, num_groups: int, sublanes: int, block_m: int | None) -> int:
  """Rows per tile: about the mean group size (a tile is computed whole once per group
  it touches), a power of two in [sublanes, MAX_BLOCK_M], or all rows if fewer."""
  if block_m is None:
    block_m = min(max(_next_pow2(-(-m // max(num_groups, 1))), sublanes), MAX_BLOCK_M)
  elif block_m < m and block_m % sublanes:
    raise ValueError(f"block_m={block_m} must be a multiple of {sublanes} (or cover all "
                     f"{m} rows)")
  return m if m <= block_m else block_m


def _lane_block_candidates(size: int, fixed: int | None, must_divide: int | None):
  """Block sizes along a lane-mapped axis, largest first: the whole axis, then
  multiples of 256 (then 128) below it that leave at most 1/8 of the last block empty
  (a padded block moves and multiplies padding); where no multiple of 256 below the axis
  divides it (gpt-oss's 5760 = 22.5 x 256), also the multiples of 128 that do (1152,
  1920, ...); with `must_divide`, only its divisors."""
  if fixed is not None:
    if fixed < size and fixed % 128:
      raise ValueError(f"a block of {fixed} along an axis of {size} must be a multiple of 128")
    return [min(fixed, size)]
  cands = []
  if must_divide is None and size <= MAX_BLOCK_K:
    cands.append(size)
  top = min(vmem.round_down(size, 128), MAX_BLOCK_K)
  wide_divides = any(size % c == 0 for c in range(_LANE_STEP, top + 1, _LANE_STEP))
  for b in range(top, 127, -128):
    if b % _LANE_STEP and b > _LANE_STEP and (size % b or wide_divides):
      continue
    if must_divide is not None and must_divide % b:
      continue
    if vmem.round_up(size, b) - size > size // 8:
      continue
    if b not in cands:
      cands.append(b)
  return cands


def _best_blocks(bm_cands, k_cands, n_cands, n, plan, budget, whole_k=None):
  """The largest block_m with any (block_k, block_n) in budget; among those, block_n at
  least one MXU width (256) where n allows, then (with `whole_k`, the k of 1-byte weights)
  a block_k that divides it, then the fewest padded columns (round_up(n, block_n)), then
  the largest block_k * block_n (fewer grid steps, more MXU work per byte), then the
  larger block_k (fewer weight refetches).

  Why padding before size: a padded last block is fetched and multiplied whole. gpt-oss's
  gate/up (n = 5760, the experts layer's float32-out call at T=64, v6e) rates 655 us at
  block_n 1152 (5 whole blocks) against 728 at 1280 (5 blocks, the last half empty).

  Why whole_k: a partial last k block is masked (a select on the lhs and the weight
  block, `_gmm_kernel`) and splits the dot. For 1-byte weights, whose blocks are cheap to
  fetch, that shows: gpt-oss down fp8, m=64, v6e rates 10,224 cycles per visit at
  block_k 1536 over k = 2880 against 8,226 at the whole k (int8 11,361 against 9,292)."""
  for bm in bm_cands:
    fits = [(bk, bn) for bk in k_cands for bn in n_cands if plan(bm, bk, bn) <= budget]
    if fits:
      wide = min(_LANE_STEP, n)
      bk, bn = max(fits, key=lambda c: (c[1] >= wide, whole_k is None or whole_k % c[0] == 0,
                                        -vmem.round_up(n, c[1]),
                                        c[0] * c[1], c[0]))
      return bm, bk, bn
  return None


def _one_k_block_tiling(bm_cands, k, k_cands, n_cands, n, plan, chip) -> Tiling | None:
  """(block_m, k, block_n) under a raised scoped-VMEM limit: the largest block_m of
  `bm_cands` at which one k block fits under _ONE_K_BLOCK_MAX_LIMIT, block_n ranked as
  `_best_blocks` ranks it (at least one MXU width where n allows, the fewest padded
  columns, then the widest). None where k is cut into blocks (beyond MAX_BLOCK_K) or no
  one-k-block tiling fits.

  Why: under the default scoped limit (16 MiB on v5e, 32 on v6e) `_best_blocks` splits k
  or narrows n at most expert shapes. A split k fetches a group's weights at every visit,
  and under real routing a group boundary inside a row tile adds a visit, so those
  weights are read about twice; a narrow n reads the rows once per n tile. Every tuned
  entry of the shapes whose k fits takes the whole k. Rated at the 57 keys of
  benchmarks/results/ragged_tuning.jsonl (static estimates), this tiling is never slower
  than `_best_blocks`' at balanced routing (median 1.03x, up to 1.97x faster: Mixtral-8x7B's
  gate/up at 8192 rows on v6e, (512, 4096, 512) against (512, 2304, 256)), and at
  unaligned routing a median 1.13x faster (0.94x to 1.95x; the slower one Qwen3-30B-A3B's
  down at 65,536 rows on v6e, block_n 2048 against 1024)."""
  if k not in k_cands:
    return None
  wide = min(_LANE_STEP, n)
  budget = vmem.vmem_budget(chip, min(chip.max_vmem_limit_bytes, _ONE_K_BLOCK_MAX_LIMIT))
  for bm in bm_cands:
    fits = [bn for bn in n_cands if plan(bm, k, bn) <= budget]
    if fits:
      bn = max(fits, key=lambda b: (b >= wide, -vmem.round_up(n, b), b))
      limit, _ = _resolve_limit(chip, plan(bm, k, bn), None)
      return Tiling(bm, k, bn, limit, plan(bm, k, bn))
  return None


# `_paired_tiling` pairs visits up to this many rows (decode: T * top_k rows up to 64
# tokens x top-8, the quantized rows rated). Beyond it (prefill) a visit is long on the MXU,
# and a grid step's fixed cost does not show.
PAIRED_MAX_ROWS = 512


def _paired_tiling(t: Tiling, *, m, k, num_groups, quantized, plan, chip) -> Tiling:
  """`t` with two visits per grid step where the weights are 1-byte, m is at most
  PAIRED_MAX_ROWS, a row tile holds more than one group's rows on average (m / groups <
  block_m), one k block covers k and the chip holds the plan (under `t`'s limit, or one
  raised no further than `_one_k_block_tiling` raises); else `t`.

  Why: a grid step has a fixed cost (the pipeline's index maps, DMA issue and wait, the
  table reads), about 490 cycles by the static estimate on v6e. A 1-byte weight block
  takes half the DMA time of a bf16 one for about the same widening and dot, so at decode
  that cost makes a visit compute-bound: Qwen3-30B-A3B's down at m=64 with int8 weights
  rated 1,867 cycles per visit on v6e, against the block's 1,678 at HBM bandwidth; paired,
  1,708 (m=512: 1,869 -> 1,710; docs/performance.md, "Quantized decode"). Two visits per
  step, each with weight blocks of its own, halve the steps. The paired visit
  table (`_metadata_kernel`) keeps a step's visits on one row tile, and a group that goes
  on into the next tile in slot 0, so no weight block is fetched more often than with one
  visit per step. Where a tile holds about one group (m / groups >= block_m) nearly every
  step would hold one visit and a no-op. bf16 weight blocks are DMA-bound at decode, so
  they keep one visit per step."""
  if (not quantized or m > PAIRED_MAX_ROWS or m >= num_groups * t.block_m
      or not _one_k_block(k, t.block_k)):
    return t
  paired_plan = plan(t.block_m, t.block_k, t.block_n, visits_per_step=2)
  limit, _ = _resolve_limit(chip, max(paired_plan, t.vmem_plan_bytes), None)
  limit = max(limit, t.vmem_limit_bytes)
  if limit > max(_ONE_K_BLOCK_MAX_LIMIT, t.vmem_limit_bytes) or \
      paired_plan > vmem.vmem_budget(chip, limit):
    return t
  return dataclasses.replace(t, vmem_limit_bytes=limit, vmem_plan_bytes=paired_plan,
                             visits_per_step=2)


def _whole_weight_tiling(best, k, n, plan, chip) -> Tiling | None:
  """(block_m, k, n), under a raised scoped-VMEM limit, where `best` pads n and the
  chip can hold that plan; else None.

  Why: where no lane block in the default budget divides n, every visit fetches and
  multiplies a padded last block. gpt-oss's down (n = 2880 = 22.5 x 128) at T=64 on v6e,
  float32 out, rates 349.8 us at (16, 2880, 1024), 192 of its 3072 columns padding, against
  326.3 at the whole weight (16, 2880, 2880), which needs a 68 MiB limit. Only the whole
  weight: split-k tilings at the whole n rate worse than the padded one (375.9 - 407.9 us).
  """
  bm, _, bn = best
  if vmem.round_up(n, bn) == n:
    return None
  whole_plan = plan(bm, k, n)
  if whole_plan > vmem.vmem_budget(chip, chip.max_vmem_limit_bytes):
    return None
  limit, _ = _resolve_limit(chip, whole_plan, None)
  return Tiling(bm, k, n, limit, whole_plan)


@dataclasses.dataclass(frozen=True, order=True)
class TuningKey:
  """The bucket of a forward call shape in the tuning table (tuned/ragged_dot.<chip>.json)."""

  chip: str
  dtype: str          # lhs, and output unless f32_out
  weight_dtype: str   # dtype, or int8 / float8_e4m3fn (with a scale)
  num_rhs: int        # 2: the gated gate/up (two weight column sets); 1: plain
  m_bucket: int       # rows rounded up to a power of two
  k: int
  n: int              # output columns per weight column set (I for gate/up)
  num_groups: int     # local groups
  # gate/up columns interleaved in one weight (gpt-oss at prefill, the "lanes" route): a
  # different kernel body (2 * block_n weight columns per tile, the de-interleave)
  interleaved: bool = False
  # a float32 output of a call in another dtype (moe_experts' down projection, summed in
  # float32 by the combine): twice the output bytes, so a tiling of its own
  f32_out: bool = False

  @property
  def quantized(self) -> bool:
    """1-byte weights with a scale (bf16 activations)."""
    return self.weight_dtype != self.dtype

  @property
  def out_dtype(self) -> str:
    return "float32" if self.f32_out else self.dtype

  @property
  def n_must_divide(self) -> int | None:
    """`gmm_tiling`'s n_must_divide for the key's calls: the halves of a concatenated
    gate/up weight are addressed in whole blocks; interleaved columns are not."""
    return self.n if self.num_rhs == 2 and not self.interleaved else None


TUNED_VALUE_FIELDS = ("block_m", "block_k", "block_n")
# {(chip, dtype, weight_dtype, num_rhs, m_bucket, k, n, num_groups, interleaved, f32_out):
#  (block_m, block_k, block_n)}
TUNED_BLOCKS = tuning_tables.load("ragged_dot", TuningKey, TUNED_VALUE_FIELDS)


def tuning_key(m, k, n, *, num_groups, lhs_dtype, rhs_dtype, out_dtype, num_rhs,
               chip, interleaved=False) -> TuningKey | None:
  """The table key of a forward call, or None when the output's dtype is neither lhs's
  nor float32, or the weights' dtype is neither lhs's nor a quantized one. An int8 lhs
  (`lhs_quant`) with int8 weights and a bfloat16 output is keyed as bfloat16 rows."""
  lhs, rhs, out = (np.dtype(d).name for d in (lhs_dtype, rhs_dtype, out_dtype))
  if lhs == "int8" and rhs == "int8" and out == "bfloat16":
    # int8 rows (lhs_quant) take the tiles tuned for the bf16 rows they were quantized
    # from: the same weight traffic per visit, half the row bytes (the plan checks the fit)
    lhs = out
  f32_out = out == "float32" and lhs != "float32"
  if (out != lhs and not f32_out) or (rhs != lhs and rhs not in QUANTIZED_DTYPE_NAMES):
    return None
  return TuningKey(chips.get_chip(chip).name, lhs, rhs, num_rhs, _next_pow2(m), k, n,
                   num_groups, interleaved, f32_out)


def tuned_blocks(m, k, n, **key_args) -> tuple[int, int, int] | None:
  """The table's (block_m, block_k, block_n) for a forward call (`tuning_key`'s
  arguments), or None."""
  key = tuning_key(m, k, n, **key_args)
  return None if key is None else TUNED_BLOCKS.get(dataclasses.astuple(key))


def _resolve_limit(chip, plan_bytes_min, vmem_limit_bytes):
  limit = vmem.resolve_vmem_limit(chip, vmem_limit_bytes)
  if vmem_limit_bytes is None and plan_bytes_min > vmem.vmem_budget(chip, None):
    needed = vmem.round_up(int(plan_bytes_min / vmem.BUDGET_FRACTION), vmem.MiB)
    limit = min(needed, chip.max_vmem_limit_bytes)
  return limit, int(limit * vmem.BUDGET_FRACTION)


def _one_k_block(k: int, block_k: int) -> bool:
  """Whether one k block covers the contraction: the kernel then keeps no float32
  accumulator (`_gmm_kernel`'s single-k path), and `gmm_tiling`'s plan reserves none."""
  return block_k >= k


def gmm_tiling(m, k, n, *, num_groups, lhs_dtype, rhs_dtype, out_dtype, num_rhs=1,
               n_must_divide=None, chip=chips.DEFAULT_CHIP, block_m=None, block_k=None,
               block_n=None, vmem_limit_bytes=None, interleaved=False) -> Tiling:
  """Tiles of the forward kernel: out (m, n) per rhs operand from lhs (m, k).

  VMEM plan: double-buffered lhs, rhs (x num_rhs), out, scale and bias blocks (and an int8
  lhs's row scales), the f32 accumulators (none where one k block covers k), and f32
  temporaries (dot result, epilogue). With no block or limit given, the tuning table's
  blocks (`tuned_blocks`) when the call's bucket has an entry the kernel accepts (the
  scoped-VMEM limit is raised to its plan if need be, up to the chip's maximum);
  otherwise the heuristic: one k block under a limit raised up to _ONE_K_BLOCK_MAX_LIMIT
  where k fits one (`_one_k_block_tiling`), else the best tiles under the default limit
  (`_best_blocks`), and the whole weight where those pad n (`_whole_weight_tiling`). On
  either, two visits per grid step at decode with 1-byte weights (`_paired_tiling`).
  `n_must_divide`: block_n must divide it (the gate/up halves of one concatenated weight
  are addressed in whole blocks).
  `interleaved` (with num_rhs=2): gate/up columns interleaved in one weight, de-interleaved
  in the epilogue (`_deinterleave_lanes`: the two gathered halves, float32).
  """
  chip_ = chips.get_chip(chip)
  lb, rb, ob = (np.dtype(d).itemsize for d in (lhs_dtype, rhs_dtype, out_dtype))
  sub = max(vmem.sublane_multiple(d) for d in (lhs_dtype, out_dtype))
  rsub = vmem.sublane_multiple(rhs_dtype)
  quantized = rb == 1
  bm0 = _row_block(m, num_groups, sub, block_m)

  def plan(bm, bk, bn, visits_per_step=1):
    bm_p, bk_p, bn_p = vmem.round_up(bm, sub), vmem.lane_padded(bk), vmem.lane_padded(bn)
    weights = num_rhs * visits_per_step   # weight blocks per grid step
    total = 2 * bm_p * bk_p * lb + 2 * bm_p * bn_p * ob
    total += weights * 2 * vmem.round_up(bk, rsub) * bn_p * rb
    total += weights * 2 * 2 * 8 * bn_p * 4                 # scale, bias blocks
    # the dot result, and the float32 accumulator unless one k block covers k (the
    # kernel's single-k path keeps no accumulator: `_gmm_kernel`)
    total += weights * (1 if _one_k_block(k, bk) else 2) * bm_p * bn_p * 4
    total += 3 * visits_per_step * bm_p * bn_p * 4           # epilogue temporaries
    if interleaved:   # `_deinterleave_lanes`: the gathered halves, float32
      total += 2 * visits_per_step * bm_p * bn_p * 4
    if quantized:
      total += weights * vmem.round_up(bk, 8) * bn_p * lb    # dequantised weight block
    if lb == 1:   # int8 lhs (lhs_quant): its [bm, 1] float32 row scales, lane-padded
      total += 2 * bm_p * vmem.lane_padded(1) * 4
    return total

  k_cands = _lane_block_candidates(k, block_k, None)
  n_cands = _lane_block_candidates(n, block_n, n_must_divide)
  if not n_cands:
    raise ValueError(f"no block_n divides {n_must_divide}")
  bm_cands = [bm0]
  while block_m is None and bm_cands[-1] > sub and bm_cands[-1] % (2 * sub) == 0:
    bm_cands.append(bm_cands[-1] // 2)
  smallest = plan(bm_cands[-1], k_cands[-1], n_cands[-1])
  limit, budget = _resolve_limit(chip_, smallest, vmem_limit_bytes)
  if block_n is None:
    n_cands = [b for b in n_cands if b <= MAX_BLOCK_N] or n_cands[-1:]
  explicit = any(b is not None for b in (block_m, block_k, block_n, vmem_limit_bytes))
  paired = functools.partial(_paired_tiling, m=m, k=k, num_groups=num_groups,
                             quantized=quantized, plan=plan, chip=chip_)
  if not explicit:
    tuned = tuned_blocks(m, k, n, num_groups=num_groups, lhs_dtype=lhs_dtype,
                         rhs_dtype=rhs_dtype, out_dtype=out_dtype, num_rhs=num_rhs,
                         chip=chip_.name, interleaved=interleaved)
    # A tuned block_k may be the whole k past MAX_BLOCK_K (the tuner rates it; the
    # heuristic never proposes it): Mixtral-8x7B's down, k = 14336.
    if (tuned and tuned[0] % sub == 0 and (tuned[1] in k_cands or tuned[1] == k)
        and tuned[2] in n_cands):
      bm, bk, bn = min(tuned[0], m), tuned[1], tuned[2]
      tuned_limit, tuned_budget = _resolve_limit(chip_, max(plan(bm, bk, bn), smallest), None)
      if plan(bm, bk, bn) <= tuned_budget:
        return paired(Tiling(bm, bk, bn, tuned_limit, plan(bm, bk, bn)))
  best = _best_blocks(bm_cands, k_cands, n_cands, n, plan, budget,
                      whole_k=k if quantized else None)
  if best and not explicit:
    one_k = _one_k_block_tiling(bm_cands, k, k_cands, n_cands, n, plan, chip_)
    if one_k:
      best = one_k.block_m, one_k.block_k, one_k.block_n
    whole = _whole_weight_tiling(best, k, n, plan, chip_)
    return paired(whole or one_k or Tiling(*best, limit, plan(*best)))
  if best:
    return Tiling(*best, limit, plan(*best))
  if block_m is not None or block_k is not None or block_n is not None:
    bm, bk, bn = bm_cands[-1], k_cands[-1], n_cands[-1]
    return Tiling(bm, bk, bn, limit, plan(bm, bk, bn))
  raise ValueError(f"grouped matmul m={m} k={k} n={n} needs {smallest} bytes of VMEM at its "
                   f"smallest tiles, more than the budget of {budget} bytes on {chip_.name}")


def tgmm_tiling(m, k, n, *, num_groups, lhs_dtype, grad_dtype, out_dtype,
                chip=chips.DEFAULT_CHIP, block_m=None, block_k=None, block_n=None,
                vmem_limit_bytes=None) -> Tiling:
  """Tiles of the weight-gradient kernel: out (k, n) per group from lhs (m, k), dz (m, n)."""
  chip_ = chips.get_chip(chip)
  lb, gb, ob = (np.dtype(d).itemsize for d in (lhs_dtype, grad_dtype, out_dtype))
  sub = max(vmem.sublane_multiple(d) for d in (lhs_dtype, grad_dtype))
  bm0 = _row_block(m, num_groups, sub, block_m)

  def plan(bm, bk, bn):
    bm_p, bk_p, bn_p = vmem.round_up(bm, sub), vmem.lane_padded(bk), vmem.lane_padded(bn)
    total = 2 * bm_p * bk_p * lb + 2 * bm_p * bn_p * gb
    total += 2 * vmem.round_up(bk, 8) * bn_p * ob
    total += 2 * vmem.round_up(bk, 8) * bn_p * 4                 # accumulator + dot result
    total += bm_p * (bk_p + bn_p) * 4 + bm_p * bk_p * 4          # masked f32 copies, transpose
    return total

  k_cands = [b for b in _lane_block_candidates(k, block_k, None) if b <= 2048 or b == k]
  n_cands = [b for b in _lane_block_candidates(n, block_n, None) if b <= MAX_BLOCK_N or b == n]
  bm_cands = [bm0]
  while block_m is None and bm_cands[-1] > sub and bm_cands[-1] % (2 * sub) == 0:
    bm_cands.append(bm_cands[-1] // 2)
  smallest = plan(bm_cands[-1], k_cands[-1], n_cands[-1])
  limit, budget = _resolve_limit(chip_, smallest, vmem_limit_bytes)
  best = _best_blocks(bm_cands, k_cands, n_cands, n, plan, budget)
  if best:
    return Tiling(*best, limit, plan(*best))
  bm, bk, bn = bm_cands[-1], k_cands[-1], n_cands[-1]
  if block_m is not None or block_k is not None or block_n is not None:
    return Tiling(bm, bk, bn, limit, plan(bm, bk, bn))
  raise ValueError(f"weight gradient m={m} k={k} n={n} needs {smallest} bytes of VMEM at its "
                   f"smallest tiles, more than the budget of {budget} bytes on {chip_.name}")


# ----------------------------------------------------------------------------- visits

# Fields of the visit table, one int32 row each (flattened into one SMEM array).
_GROUP, _TILE, _ROW_START, _ROW_END, _RHS_GROUP, _LHS_TILE, _K_PIN = range(7)
_NUM_FIELDS = 7


def max_visits(m: int, block_m: int, num_local_groups: int, paired: bool = False) -> int:
  """Entries of a visit table: at most cdiv(m, block_m) + num_local_groups + 1 visits,
  in a paired table up to two no-op entries per row tile among them, then the no-op
  entry after the last (`_metadata_kernel`)."""
  tiles_m = pl.cdiv(m, block_m)
  return tiles_m + num_local_groups + 2 + (2 * tiles_m if paired else 0)


def _metadata_kernel(sizes_ref, offset_ref, table_ref, count_ref, *, num_total, g_local, m,
                     block_m, num_k_tiles, zero_visits, num_v, paired=False):
  """Scalar-core kernel: walks the groups once and writes the visit table to SMEM.

  `paired` (two visits per grid step, entries 2s and 2s + 1 in step s): a no-op entry
  (group g_local) goes before any visit that must open a step, so that
    * a step's two visits share a row tile (the lhs and out blocks are the step's), and
    * a visit whose group goes on into the next row tile sits in slot 0, as the next
      visit (the first of that tile) does: the group's weight block stays in slot 0 and
      is fetched once, as with one visit per step.
  A no-op keeps its slot's blocks of the step before (no DMA)."""
  tiles_m = pl.cdiv(m, block_m)
  offset = offset_ref[0, 0]
  i32 = lambda x: jnp.asarray(x, jnp.int32)
  # Truncating division (the operands are >= 0 wherever the result is used): floor
  # division lowers through sign(), which makes Mosaic ask the runtime for its TPU
  # generation (there is none when compiling ahead of time).
  div = lambda a, b: jax.lax.div(a, i32(b))

  def local_size(i):
    g = offset + i
    return jnp.where(g < num_total, sizes_ref[0, jnp.minimum(g, num_total - 1)], 0)

  before = jax.lax.fori_loop(
      0, num_total, lambda g, acc: acc + jnp.where(g < offset, sizes_ref[0, g], 0), i32(0))
  first_row = jnp.minimum(before, m)

  # One pass for the last local row and the first / last non-empty local group (the
  # groups whose blocks the zero visits pin theirs to).
  def scan(i, carry):
    end, first_g, last_g, last_tile = carry
    start = end
    end = jnp.minimum(start + local_size(i), m)
    nonempty = end > start
    first_g = jnp.where(jnp.logical_and(nonempty, first_g < 0), i, first_g)
    last_g = jnp.where(nonempty, i, last_g)
    last_tile = jnp.where(nonempty, div(end - 1, block_m), last_tile)
    return end, first_g, last_g, last_tile

  last_row, first_g, last_g, last_tile = jax.lax.fori_loop(
      0, g_local, scan, (first_row, i32(-1), i32(0), i32(0)))
  any_real = first_g >= 0
  first_g = jnp.maximum(first_g, 0)
  first_tile = jnp.where(any_real, jnp.minimum(div(first_row, block_m), tiles_m - 1), 0)

  def put(v, group, tile, row_start, row_end, rhs_group, lhs_tile, k_pin):
    for field, value in ((_GROUP, group), (_TILE, tile), (_ROW_START, row_start),
                         (_ROW_END, row_end), (_RHS_GROUP, rhs_group),
                         (_LHS_TILE, lhs_tile), (_K_PIN, k_pin)):
      table_ref[field, v] = value

  def no_op(v):   # the tile of the entry before, the blocks of its slot's last entry
    prev, src = jnp.maximum(v - 1, 0), jnp.maximum(v - 2, 0)
    put(v, g_local, table_ref[_TILE, prev], 0, 0, table_ref[_RHS_GROUP, src],
        table_ref[_LHS_TILE, prev], table_ref[_K_PIN, src])

  def write(v, group, tile, row_start, row_end, rhs_group, lhs_tile, k_pin, goes_on=False):
    """Writes one visit at v (after a no-op where a paired table needs one); returns
    the next free entry. goes_on: the visit's group has rows in the next row tile.
    group g_local: a zero visit (head or tail tile)."""
    if paired:
      opens = jnp.logical_or(table_ref[_TILE, jnp.maximum(v - 1, 0)] != tile, goes_on)
      pad = jnp.logical_and(v % 2 == 1, opens)
      pl.when(pad)(lambda: no_op(v))
      v = v + pad.astype(jnp.int32)
      # A zero visit (it opens a step, so it is in slot 0) keeps its slot's weight block,
      # as a no-op does.
      if isinstance(group, int) and group == g_local:
        rhs_group = jnp.where(v >= 2, table_ref[_RHS_GROUP, jnp.maximum(v - 2, 0)], rhs_group)
    put(v, group, tile, row_start, row_end, rhs_group, lhs_tile, k_pin)
    return v + 1

  v = i32(0)
  all_zero = first_row == last_row
  if zero_visits:   # head: tiles wholly before the first local row (all tiles if none)
    head_tiles = jnp.where(all_zero, tiles_m, div(first_row, block_m))

    def head(t, v):
      return write(v, g_local, t, 0, 0, first_g, first_tile, 0)
    v = jax.lax.fori_loop(0, head_tiles, head, v)

  def group(i, carry):
    v, start = carry
    end = jnp.minimum(start + local_size(i), m)
    tile0 = jnp.minimum(div(start, block_m), tiles_m - 1)
    count = jnp.where(end > start, div(end - 1, block_m) - tile0 + 1, 0 if zero_visits else 1)

    def visit(j, v):
      return write(v, i, tile0 + j, start, end, i, tile0 + j, -1, goes_on=j < count - 1)
    return jax.lax.fori_loop(0, count, visit, v), end

  v, _ = jax.lax.fori_loop(0, g_local, group, (v, first_row))

  if zero_visits:   # tail: tiles wholly after the last local row
    tail_first = jnp.minimum(div(last_row + block_m - 1, block_m), tiles_m)
    tail_tiles = jnp.where(all_zero, 0, tiles_m - tail_first)

    def tail(t, v):
      return write(v, g_local, tail_first + t, 0, 0, last_g, last_tile, num_k_tiles - 1)
    v = jax.lax.fori_loop(0, tail_tiles, tail, v)
  # Past the last visit, a no-op: the second slot of a last step with one visit reads it.
  no_op(v)
  count_ref[0, 0] = v


def group_metadata(group_sizes, group_offset, *, num_local_groups: int, m: int,
                   block_m: int, num_k_tiles: int, zero_visits: bool, paired: bool = False,
                   interpret: bool = False):
  """The visit table of one call and the number of visits (a traced int32).

  Returns (table, num_visits): table is int32 (_NUM_FIELDS * V,), V = max_visits(...),
  row f * V + v giving field f of visit v; entry num_visits is a no-op (group
  num_local_groups), and the entries past it are unused (the grid stops at num_visits).
  `paired`: laid out for two visits per grid step (`_metadata_kernel`); num_visits then
  counts the no-op entries among the visits.

  zero_visits=True (forward): the head and tail row ranges with no local group are
  visited as group num_local_groups (store nothing; the tile is cleared), and empty
  groups are not visited. zero_visits=False (weight gradient): only local groups are
  visited, an empty one once (its gradient is zero).

  One small scalar-core kernel (`_metadata_kernel`) builds it in one launch. Built from
  XLA ops, the same table took about 30 small ops (~45 us on v6e by the static estimate).
  """
  num_v = max_visits(m, block_m, num_local_groups, paired)
  smem = pl.BlockSpec(memory_space=pltpu.SMEM)
  table, count = pl.pallas_call(
      functools.partial(_metadata_kernel, num_total=group_sizes.shape[0],
                        g_local=num_local_groups, m=m, block_m=block_m,
                        num_k_tiles=num_k_tiles, zero_visits=zero_visits, num_v=num_v,
                        paired=paired),
      in_specs=[smem, smem],
      out_specs=[smem, smem],
      out_shape=[jax.ShapeDtypeStruct((_NUM_FIELDS, num_v), jnp.int32),
                 jax.ShapeDtypeStruct((1, 1), jnp.int32)],
      interpret=interpret,
      name=VISIT_TABLE_KERNEL,
  )(group_sizes.astype(jnp.int32).reshape(1, -1),
    jnp.asarray(group_offset, jnp.int32).reshape(1, 1))
  return table.reshape(-1), count[0, 0]


# ----------------------------------------------------------------------------- kernels


def _field(table_ref, field, v, num_v):
  return table_ref[field * num_v + v]


def _mask_k_tail(x, axis, k_rem, in_f32):
  """Zero the part of the last k block past the array end (stale VMEM, maybe NaN).
  in_f32: in f32 on chips without a bf16 vector unit (`masking`): else libtpu's static
  estimator aborts on v5e, and no tiling with a k tail could be rated."""
  idx = jax.lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return masking.zero_unless(idx < k_rem, x, in_f32=in_f32)


# Lanes of one de-interleave step: 256 columns of z -> 128 gate and 128 up columns.
_DEINTERLEAVE_CHUNK = 256


def _deinterleave_lanes(z):
  """(gate, up) = (even, odd) columns of z [bm, 2 * bn] float32, each [bm, bn], bit for bit.

  Mosaic has no lane-strided load from a block this wide ("The last dim size is not 128
  in original base memref"), and its lane gather (`jnp.take_along_axis`, Mosaic's
  dynamic_gather) reads within one 128-lane vreg ("Multiple source vregs along gather
  dimension"). So z goes in chunks of 256 columns, and chunk c gives gate and up columns
  [128 c, 128 c + 128): the first 64 gathered from its first 128 columns, the last 64 from
  its second 128, joined by a select (a narrower last chunk, where 2 * bn is not a
  multiple of 256, the same over the columns it has). Pure data movement: every value,
  NaN and denormals included, lands in its own column unchanged, and the stale columns
  past the weight's end in the last n block only reach output columns the masked write
  drops. (Until 2026-12-06 the columns were picked on the MXU, z cut into three bfloat16
  parts times 0/1 selection matrices: 3x the cycles of the gathers at 16 rows on v6e.)
  """
  rows, width = z.shape
  half = 128   # the first half of a chunk: one vreg of lanes
  gates, ups = [], []
  for c in range(0, width, _DEINTERLEAVE_CHUNK):
    cols = min(_DEINTERLEAVE_CHUNK, width - c)   # even: width is 2 bn
    first = z[:, c:c + min(cols, half)]
    second = z[:, c + half:c + cols] if cols > half else None
    lane = jax.lax.broadcasted_iota(jnp.int32, (rows, cols // 2), 1)

    def pick(parity, first=first, second=second, lane=lane):
      # output column j is input column 2 j + parity of the chunk: in `first` for j < 64,
      # else column 2 j + parity - 128 of `second` (the select discards the other gather,
      # whose indices only need to be in range).
      gather = lambda x, idx: jnp.take_along_axis(x, idx, axis=1, mode="promise_in_bounds")
      got = gather(first, (2 * lane + parity) % first.shape[1])
      if second is None:
        return got
      return jnp.where(lane < half // 2, got,
                       gather(second, jnp.maximum(2 * lane + parity - half, 0)))

    gates.append(pick(0))
    ups.append(pick(1))
  join = lambda xs: xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
  return join(gates), join(ups)


def _gmm_kernel(table_ref, lhs_ref, *refs, num_v, num_local_groups, num_rhs, has_scale, has_bias,
                transpose_rhs, k_rem, mask_in_f32, block_m, epilogue, compute_dtype,
                interleaved=False, single_k=False, has_lhs_scale=False, visits_per_step=1):
  """One grid step (n tile j, step s, k tile kk): visits s * P .. s * P + P - 1, P =
  visits_per_step; visit s * P + p reads weight slot p (its own weight, scale and bias
  blocks). P > 1 only with one k block (`_paired_tiling`); a step's visits share a row tile."""
  per_slot = lambda rs: [rs[p * num_rhs:(p + 1) * num_rhs] for p in range(visits_per_step)]
  n_weights = num_rhs * visits_per_step
  rhs_slots = per_slot(refs[:n_weights])
  refs = refs[n_weights:]
  scale_slots = per_slot(refs[:n_weights]) if has_scale else [()] * visits_per_step
  refs = refs[n_weights if has_scale else 0:]
  bias_slots = per_slot(refs[:n_weights]) if has_bias else [()] * visits_per_step
  refs = refs[n_weights if has_bias else 0:]
  lhs_scale_ref = refs[0] if has_lhs_scale else None   # [bm, 1] float32, int8 lhs only
  refs = refs[1 if has_lhs_scale else 0:]
  out_ref, acc_refs = refs[0], refs[1:]
  # int8 lhs (`lhs_quant`): int8 x int8 products in int32, exact, converted in the epilogue.
  acc_dtype = jnp.int32 if has_lhs_scale else jnp.float32
  assert single_k or visits_per_step == 1

  j, step, kk = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  last_k = pl.num_programs(2) - 1

  def products(rhs_refs, masked):
    """lhs block @ each weight block, [bm, wn] each in acc_dtype."""
    x = lhs_ref[...]
    if masked:
      x = _mask_k_tail(x, 1, k_rem, mask_in_f32)
    out = []
    for rhs_ref in rhs_refs:
      w = rhs_ref[...]
      # int8 / fp8 weights go into the dot as they are, beside the bf16 / f32 lhs: Mosaic
      # widens them on the way to the MXU (exact: every code is a bf16 value). Converting
      # the block with astype first, as before, rated 1.4-2.0x the cycles per visit for
      # fp8 (v6e: 3,362 -> 1,894 for a [G, n, k] block; v5e 3,820 -> 2,740) and the same
      # for int8 (docs/performance.md, "Quantized decode"); tpu-inference's gmm does this.
      # The masked k tail selects in the weights' own dtype too (exact: it picks codes).
      # Widening the tail block first, as before, cost fp8 1.8x the cycles per visit
      # (gpt-oss down, m=64, block_k 1536 over k=2880: v6e 18,036 -> 10,224, v5e
      # 21,876 -> 15,576); int8 rates within 1% either way.
      if masked:
        w = _mask_k_tail(w, 1 if transpose_rhs else 0, k_rem, mask_in_f32)
      dims = (((1,), (1,)), ((), ())) if transpose_rhs else (((1,), (0,)), ((), ()))
      out.append(jax.lax.dot_general(x, w, dims, preferred_element_type=acc_dtype))
    return out

  if not single_k:
    real = _field(table_ref, _GROUP, step, num_v) < num_local_groups

    @pl.when(kk == 0)
    def _():
      for acc in acc_refs:
        acc[...] = jnp.zeros_like(acc)

    def accumulate(masked):
      for acc, p in zip(acc_refs, products(rhs_slots[0], masked)):
        acc[...] += p

    if k_rem:   # mask only the last k block; the others go straight to the MXU
      pl.when(jnp.logical_and(real, kk < last_k))(lambda: accumulate(False))
      pl.when(jnp.logical_and(real, kk == last_k))(lambda: accumulate(True))
    else:
      pl.when(real)(lambda: accumulate(False))

  def finish(slot):   # the epilogue and masked store of visit step * P + slot
    v = step * visits_per_step + slot
    real = _field(table_ref, _GROUP, v, num_v) < num_local_groups
    prev = jnp.maximum(v - 1, 0)
    tile = _field(table_ref, _TILE, v, num_v)
    first_visit = jnp.logical_or(v == 0, _field(table_ref, _TILE, prev, num_v) != tile)

    @pl.when(first_visit)
    def _():
      out_ref[...] = jnp.zeros_like(out_ref)

    @pl.when(real)
    def _():
      zs = []
      sums = (products(rhs_slots[slot], bool(k_rem)) if single_k
              else [acc[...] for acc in acc_refs])
      for i, z in enumerate(sums):
        z = z.astype(jnp.float32)
        if has_lhs_scale:
          z = z * lhs_scale_ref[...]
        if has_scale:
          z = z * scale_slots[slot][i][...].astype(jnp.float32)
        if has_bias:
          z = z + bias_slots[slot][i][...].astype(jnp.float32)
        zs.append(z)
      if interleaved:   # one [bm, 2 * bn] block of interleaved gate/up
        zs = _deinterleave_lanes(zs[0])
      y = epilogue(*zs)
      rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, y.shape, 0)
      mask = jnp.logical_and(rows >= _field(table_ref, _ROW_START, v, num_v),
                             rows < _field(table_ref, _ROW_END, v, num_v))
      out_ref[...] = jnp.where(mask, y.astype(out_ref.dtype), out_ref[...])

  @pl.when(kk == last_k)
  def _():
    for slot in range(visits_per_step):
      finish(slot)


def _tgmm_kernel(table_ref, lhs_ref, dz_ref, out_ref, acc_ref, *, num_v, block_m,
                 compute_dtype):
  v = pl.program_id(2)
  last_v = pl.num_programs(2) - 1
  group = _field(table_ref, _GROUP, v, num_v)
  first = jnp.logical_or(v == 0, _field(table_ref, _GROUP, jnp.maximum(v - 1, 0), num_v) != group)
  last = jnp.logical_or(v == last_v,
                        _field(table_ref, _GROUP, jnp.minimum(v + 1, last_v), num_v) != group)

  @pl.when(first)
  def _():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  tile = _field(table_ref, _TILE, v, num_v)
  rows = tile * block_m + jax.lax.broadcasted_iota(jnp.int32, (lhs_ref.shape[0], 1), 0)
  mask = jnp.logical_and(rows >= _field(table_ref, _ROW_START, v, num_v),
                         rows < _field(table_ref, _ROW_END, v, num_v))
  # Select, not multiply: rows of other groups, or past m, may hold NaN.
  x = jnp.where(mask, lhs_ref[...].astype(jnp.float32), 0.0)
  dz = jnp.where(mask, dz_ref[...].astype(jnp.float32), 0.0)
  acc_ref[...] += jax.lax.dot(x.swapaxes(0, 1).astype(compute_dtype), dz.astype(compute_dtype),
                              preferred_element_type=jnp.float32)

  @pl.when(last)
  def _():
    out_ref[...] = acc_ref[...].astype(out_ref.dtype)


# ----------------------------------------------------------------------------- calls


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything static about one call (hashable)."""

  transpose_rhs: bool
  epilogue: Epilogue
  layout: str
  out_dtype: str
  chip: str
  block_m: int | None
  block_k: int | None
  block_n: int | None
  vmem_limit_bytes: int | None
  interpret: bool
  lhs_quant: str | None = None   # "int8": lhs quantized per row (`quantize_rows`)


def _gmm(lhs, rhs_ops, scale_ops, bias_ops, group_sizes, group_offset, *, n_out,
         transpose_rhs, epilogue, out_dtype, tiling_n_divides, st: _Static,
         interleaved=False, lhs_scale=None):
  """One forward pallas_call. rhs_ops: [(array, n block offset)], 1 or 2 of them (gate, up);
  scale_ops / bias_ops: the same for [G, N] arrays, or empty. `interleaved`: one weight
  whose 2 * n_out columns alternate gate, up (the gated epilogue de-interleaves them)."""
  m, k = lhs.shape
  g_local = rhs_ops[0][0].shape[0]
  rhs_dtype = rhs_ops[0][0].dtype
  t = gmm_tiling(m, k, n_out, num_groups=g_local, lhs_dtype=lhs.dtype, rhs_dtype=rhs_dtype,
                 out_dtype=out_dtype, num_rhs=2 if interleaved else len(rhs_ops),
                 n_must_divide=tiling_n_divides, chip=st.chip, block_m=st.block_m,
                 block_k=st.block_k, block_n=st.block_n,
                 vmem_limit_bytes=st.vmem_limit_bytes, interleaved=interleaved)
  return _gmm_call(lhs, rhs_ops, scale_ops, bias_ops, group_sizes, group_offset, t,
                   n_out=n_out, transpose_rhs=transpose_rhs, epilogue=epilogue,
                   out_dtype=out_dtype, chip=st.chip, interpret=st.interpret,
                   interleaved=interleaved, lhs_scale=lhs_scale)


def _gmm_call(lhs, rhs_ops, scale_ops, bias_ops, group_sizes, group_offset, t: Tiling, *,
              n_out, transpose_rhs, epilogue, out_dtype, chip, interpret, num_visits=None,
              interleaved=False, lhs_scale=None):
  """`interleaved`: rhs_ops is one weight of 2 * n_out interleaved gate/up columns; each
  n tile j reads its columns [2 j bn, 2 (j + 1) bn) (and those of scale and bias) into one
  [bm, 2 bn] accumulator, and the epilogue de-interleaves it (`_deinterleave_lanes`).
  `lhs_scale`: [m, 1] float32 row scales of an int8 lhs (`quantize_rows`), else None."""
  m, k = lhs.shape
  g_local = rhs_ops[0][0].shape[0]
  bm, bk, bn = t.block_m, t.block_k, t.block_n
  if interleaved and (not epilogue.gated or len(rhs_ops) != 1):
    raise ValueError("interleaved gate/up columns take one weight and a gated epilogue")
  wn = 2 * bn if interleaved else bn   # weight (and scale, bias) columns per n tile
  tiles_k = pl.cdiv(k, bk)
  # One k block: the product goes straight to the epilogue, with no float32 accumulator
  # to zero, add into and read back (v6e, Qwen3 down at m=64: 1,892 -> 1,867 cycles per
  # visit for int8 weights, 1,702 -> 1,677 for fp8, the HBM floor being 1,678).
  single_k = _one_k_block(k, bk)
  visits_per_step = t.visits_per_step
  if visits_per_step not in (1, 2) or (visits_per_step == 2 and not single_k):
    raise ValueError("two visits per grid step take one k block")
  paired = visits_per_step == 2
  num_v = max_visits(m, bm, g_local, paired)
  table, visits = group_metadata(group_sizes, group_offset, num_local_groups=g_local, m=m,
                                 block_m=bm, num_k_tiles=tiles_k, zero_visits=True,
                                 paired=paired, interpret=interpret)
  if num_visits is not None:   # a static count (static performance estimates)
    visits = num_visits

  # Index maps read the table through `_field` (benchmarks/rating/ragged_dot.py substitutes
  # it to let the static estimator see a table). Grid step s holds visits s * P + p.
  def k_index(v, kk, tab):
    pin = _field(tab, _K_PIN, v, num_v)
    return jnp.where(pin < 0, kk, pin)

  def lhs_map(j, s, kk, tab):
    v = s * visits_per_step
    return _field(tab, _LHS_TILE, v, num_v), k_index(v, kk, tab)

  def rhs_spec(offset, slot):
    def index(j, s, kk, tab):
      v = s * visits_per_step + slot
      group, k_block = _field(tab, _RHS_GROUP, v, num_v), k_index(v, kk, tab)
      return (group, j + offset, k_block) if transpose_rhs else (group, k_block, j + offset)
    return pl.BlockSpec((None, wn, bk) if transpose_rhs else (None, bk, wn), index)

  def row_spec(offset, slot):   # scale / bias, as [G, 1, N]
    return pl.BlockSpec((None, 1, wn), lambda j, s, kk, tab: (
        _field(tab, _RHS_GROUP, s * visits_per_step + slot, num_v), 0, j + offset))

  slots = range(visits_per_step)
  in_specs = [pl.BlockSpec((bm, bk), lhs_map)]
  in_specs += [rhs_spec(off, p) for p in slots for _, off in rhs_ops]
  in_specs += [row_spec(off, p) for p in slots for _, off in scale_ops]
  in_specs += [row_spec(off, p) for p in slots for _, off in bias_ops]
  as_rows = lambda a: a.reshape(a.shape[0], 1, a.shape[-1])   # [G, N] -> [G, 1, N]
  operands = ([lhs] + [a for _ in slots for a, _ in rhs_ops] +
              [as_rows(a) for _ in slots for a, _ in scale_ops] +
              [as_rows(a) for _ in slots for a, _ in bias_ops])
  if lhs_scale is not None:   # the row scales of lhs's row tile
    in_specs.append(pl.BlockSpec((bm, 1), lambda j, s, kk, tab: (
        _field(tab, _LHS_TILE, s * visits_per_step, num_v), 0)))
    operands.append(lhs_scale)
  kernel = functools.partial(
      _gmm_kernel, num_v=num_v, num_local_groups=g_local, num_rhs=len(rhs_ops),
      has_scale=bool(scale_ops), has_bias=bool(bias_ops), transpose_rhs=transpose_rhs,
      k_rem=k % bk, mask_in_f32=masking.selects_in_f32(chip), block_m=bm,
      epilogue=epilogue, compute_dtype=lhs.dtype,
      interleaved=interleaved, single_k=single_k, has_lhs_scale=lhs_scale is not None,
      visits_per_step=visits_per_step)
  acc_dtype = jnp.int32 if lhs_scale is not None else jnp.float32
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(pl.cdiv(n_out, bn), visits if visits_per_step == 1
                else (visits + visits_per_step - 1) // visits_per_step, tiles_k),
          in_specs=in_specs,
          out_specs=pl.BlockSpec((bm, bn), lambda j, s, kk, tab: (
              _field(tab, _TILE, s * visits_per_step, num_v), j)),
          scratch_shapes=[] if single_k else [pltpu.VMEM((bm, wn), acc_dtype)
                                              for _ in rhs_ops]),
      out_shape=jax.ShapeDtypeStruct((m, n_out), out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "arbitrary", "arbitrary"),
          vmem_limit_bytes=t.vmem_limit_bytes),
      interpret=interpret,
      name="ragged_dot_gated" if epilogue.gated else "ragged_dot",
  )(table, *operands)


def _tgmm(lhs, dz, group_sizes, group_offset, *, num_local_groups, out_dtype, st: _Static,
          num_visits=None):
  """d_rhs[i] = lhs_i.T @ dz_i for each local group: (G_local, k, n) from (m, k), (m, n)."""
  m, k = lhs.shape
  n = dz.shape[1]
  t = tgmm_tiling(m, k, n, num_groups=num_local_groups, lhs_dtype=lhs.dtype,
                  grad_dtype=dz.dtype, out_dtype=out_dtype, chip=st.chip,
                  vmem_limit_bytes=st.vmem_limit_bytes)
  bm, bk, bn = t.block_m, t.block_k, t.block_n
  num_v = max_visits(m, bm, num_local_groups)
  table, visits = group_metadata(group_sizes, group_offset, num_local_groups=num_local_groups,
                                 m=m, block_m=bm, num_k_tiles=1, zero_visits=False,
                                 interpret=st.interpret)
  if num_visits is not None:
    visits = num_visits
  kernel = functools.partial(_tgmm_kernel, num_v=num_v, block_m=bm,
                             compute_dtype=lhs.dtype)
  return pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(pl.cdiv(k, bk), pl.cdiv(n, bn), visits),
          in_specs=[pl.BlockSpec((bm, bk), lambda i, j, v, tab: (tab[_TILE * num_v + v], i)),
                    pl.BlockSpec((bm, bn), lambda i, j, v, tab: (tab[_TILE * num_v + v], j))],
          out_specs=pl.BlockSpec((None, bk, bn),
                                 lambda i, j, v, tab: (tab[_GROUP * num_v + v], i, j)),
          scratch_shapes=[pltpu.VMEM((bk, bn), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct((num_local_groups, k, n), out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=t.vmem_limit_bytes),
      interpret=st.interpret,
      name="ragged_dot_weight_grad",
  )(table, lhs, dz)


# From this many rows v5e's static estimate rates the strided gate ahead (`_gated_halves`).
_V5E_STRIDED_GATE_MIN_ROWS = 128


def _split_columns(a, layout, half, axis):
  """(gate, up) column sets of a [.., 2I ..] array along `axis` (a copy, in XLA)."""
  if layout == "interleaved":
    idx = [slice(None)] * a.ndim
    gate_idx, up_idx = list(idx), list(idx)
    gate_idx[axis], up_idx[axis] = slice(0, None, 2), slice(1, None, 2)
    return a[tuple(gate_idx)], a[tuple(up_idx)]
  return (jax.lax.slice_in_dim(a, 0, half, axis=axis),
          jax.lax.slice_in_dim(a, half, 2 * half, axis=axis))


def _gated_halves(z, layout, half, chip):
  """(gate, up) of the gate/up kernel's float32 output z [S, 2I], as two [S, I] arrays for
  XLA to gate: `gate_pass` for concatenated halves, and for interleaved columns where its
  kernel's rows do not fit the VMEM budget.

  Interleaved columns go through the pair view [S, I, 2] -> [S, 2, I] where libtpu's
  static estimate rates it ahead of two lane-strided slices (`_split_columns`): at every
  row count rated on v6e (gpt-oss at S = 256: 42 against 220 us), and below
  `_V5E_STRIDED_GATE_MIN_ROWS` on v5e. The rated cells: docs/performance.md, "The whole
  experts layer".
  """
  if layout != "interleaved" or (chips.get_chip(chip).name == "v5e"
                                 and z.shape[0] >= _V5E_STRIDED_GATE_MIN_ROWS):
    return _split_columns(z, layout, half, 1)
  pairs = z.reshape(z.shape[0], half, 2).transpose(0, 2, 1)
  return pairs[:, 0], pairs[:, 1]


# Rows per grid step of the interleaved gate pass, the first whose plan fits the VMEM
# budget. v6e, gpt-oss-20b at 256 rows (static estimate): 32 -> 11.9 us, 64 -> 10.8,
# 128 -> 11.0, 256 -> 12.7.
_GATE_PASS_ROWS = (64, 32, 16)


def gate_pass_rows(m: int, half: int, layout: str, out_dtype, chip: str) -> int | None:
  """Rows per step of `gate_pass`'s kernel (all m when fewer: a block of the whole array),
  or None where gate_pass gates by XLA instead: concatenated halves, or not even
  min(m, 16) rows within the chip's VMEM budget. Counted: the double-buffered [rows, 2I]
  float32 input and [rows, I] output blocks, the two de-interleaved halves and three
  epilogue temporaries."""
  if layout != "interleaved":
    return None
  budget = vmem.vmem_budget(chips.get_chip(chip), None)
  width = vmem.lane_padded(half)
  for rows in dict.fromkeys(min(r, m) for r in _GATE_PASS_ROWS):
    r = vmem.round_up(rows, 8)
    plan = r * (2 * 2 * width * 4 + 2 * width * jnp.dtype(out_dtype).itemsize + 5 * width * 4)
    if plan <= budget:
      return rows
  return None


def gate_pass(z, layout: str, epilogue: Epilogue, out_dtype, chip: str, interpret=False):
  """The "gate_pass" route's second pass: epilogue(gate, up) of the plain kernel's float32
  z [m, 2I] -> [m, I] out_dtype. Interleaved columns (gpt-oss) by a Pallas kernel that
  splits them with lane gathers (`_deinterleave_lanes`) and gates each block of rows;
  concatenated halves, or where no row block fits the VMEM budget, by XLA
  (`_gated_halves`). Static estimates, gpt-oss-20b at 256 rows: v6e 10.8 us against
  XLA's 42.1, v5e 18.2 against 39.1 (docs/performance.md).
  Rows of no local group are 0 in z and stay 0: every gated unit maps (0, 0) to 0."""
  m, half = z.shape[0], z.shape[1] // 2
  rows = gate_pass_rows(m, half, layout, out_dtype, chip)
  if rows is None:
    return epilogue(*_gated_halves(z, layout, half, chip)).astype(out_dtype)

  def kernel(z_ref, out_ref):
    out_ref[...] = epilogue(*_deinterleave_lanes(z_ref[...])).astype(out_ref.dtype)

  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(m, rows),),
      in_specs=[pl.BlockSpec((rows, 2 * half), lambda i: (i, 0))],
      out_specs=pl.BlockSpec((rows, half), lambda i: (i, 0)),
      out_shape=jax.ShapeDtypeStruct((m, half), out_dtype),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=interpret,
      name="ragged_dot_gate_pass",
  )(z)


def _join_columns(gate, up, layout):
  if layout == "interleaved":
    return jnp.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])
  return jnp.concatenate([gate, up], axis=-1)


def gate_up_route(m: int, n_full: int, layout: str, weight_bytes: int) -> str:
  """How the gated forward runs for (m, 2I = n_full) and weights of `weight_bytes`:

  "blocks":   concatenated layout with I a multiple of 128: gate and up are whole blocks
              of the same weight array (no copy); one gated kernel.
  Otherwise (gpt-oss's interleaved columns, or halves not whole 128-lane blocks), gate
  and up cannot be addressed as blocks of one array:
  "gate_pass": the plain kernel writes a float32 (m, 2I) intermediate and a second pass
              gates it (`gate_pass`: a Pallas kernel for interleaved columns; named
              "xla_gate" until 2026-12-06, when that pass was XLA's),
              where that intermediate is smaller than the weights (decode);
  above that (prefill):
  "lanes":    interleaved columns: one gated kernel reads blocks of 2 bn interleaved
              columns and de-interleaves its accumulator (`_deinterleave_lanes`);
  "split":    concatenated halves off the 128-lane grid: the weights are split in XLA (a
              copy of all of them) and fed to the gated kernel.
  At decode "lanes" rates slower than "gate_pass" (gpt-oss-20b at 64 tokens x top-4,
  gate/up with the gate: v6e 743 against 666 us, v5e 1,500 against 1,338; static
  estimates, docs/performance.md): it is HBM-bound on its n blocks, which pad 2880 to
  whole 128-lane blocks, so the threshold stays where it was.
  """
  if layout == "concatenated" and (n_full // 2) % 128 == 0:
    return "blocks"
  if 2 * m * n_full * 4 < weight_bytes:
    return "gate_pass"
  return "lanes" if layout == "interleaved" else "split"


LHS_QUANTS = ("int8",)
_INT8_MAX = 127


def _quantized_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The definition of `quantize_rows` on x [rows, k]: one home for the math, traced by
  XLA (the fallback) and inside the kernel (one block of rows), so both give the same
  codes."""
  x = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
  # NaN iff the row holds an inf or a NaN (a max may drop a NaN: XLA:CPU's does), else 0.
  # A sum beside the max is one reduction fusion: 3 XLA ops in all, where an isfinite mask
  # made 4 (v6e's static estimate at [64, 768]: 7,241 against 9,713 cycles).
  poison = jnp.sum(x * 0.0, axis=1, keepdims=True)
  scale = jnp.where(amax > 0, amax / _INT8_MAX, 1.0)
  codes = jnp.clip(jnp.round(x / scale), -_INT8_MAX, _INT8_MAX)
  return codes.astype(jnp.int8), scale + poison


# quantize_rows' kernel: rows per grid step, the largest of these whose input block is at
# most _QUANTIZE_BLOCK_BYTES (all m when fewer), and at least the int8 codes' 32-row tile.
# Static estimates, cycles on v6e / v5e: [512, 2048] bf16 at 128 / 256 rows 5,340 / 5,559
# and 7,850 / 7,723 (512 rows 7,404 and 10,608); [4096, 2048] at 256 / 512 rows 27,658 /
# 26,765 and 40,930 / 38,756, at HBM bandwidth; [64, 14336] at 32 rows 5,505 and 7,804, at
# 64 rows (one step, no overlap of its DMAs) 7,052 and 10,599.
_QUANTIZE_ROWS = (256, 128, 64, 32)
_QUANTIZE_BLOCK_BYTES = 1 * vmem.MiB


def quantize_rows_plan(m: int, k: int, dtype, chip: str) -> tuple[int, int | None] | None:
  """(rows per step, scoped-VMEM limit or None for the chip's default) of `quantize_rows`'
  kernel for x [m, k] of `dtype`, or None where XLA's form runs: an empty x, or a row
  block that does not fit even the chip's largest limit. Counted per row: the
  double-buffered input and codes blocks, two float32 temporaries of the row (x widened,
  and x / scale) and the double-buffered [rows, 1] float32 scale block, lane-padded."""
  if m == 0 or k == 0:
    return None
  c = chips.get_chip(chip)
  itemsize = jnp.dtype(dtype).itemsize
  rows = next((r for r in _QUANTIZE_ROWS if r * k * itemsize <= _QUANTIZE_BLOCK_BYTES),
              _QUANTIZE_ROWS[-1])
  rows = min(rows, m)
  width = vmem.lane_padded(k)
  plan = vmem.round_up(rows, vmem.sublane_multiple(jnp.int8)) * (
      width * (2 * itemsize + 2 * 1 + 2 * 4) + 2 * 128 * 4)
  if plan <= vmem.vmem_budget(c, None):
    return rows, None
  limit = vmem.round_up(math.ceil(plan / vmem.BUDGET_FRACTION), vmem.MiB)
  if limit > c.max_vmem_limit_bytes:
    return None
  return rows, limit


def quantize_rows(x: jax.Array, *, chip: str = chips.DEFAULT_CHIP,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Symmetric per-row int8 quantization (`lhs_quant="int8"`): x [m, k] float32 /
  bfloat16 -> (codes int8 [m, k], scale float32 [m, 1]) with x ~ codes * scale.

  scale[r] = max_j |x[r, j]| / 127 (1 for a row of zeros), codes = x / scale rounded half
  to even, in [-127, 127]: each element is off by at most scale[r] / 2 (and the float32
  rounding of the division). A row holding an inf or a NaN gets a NaN scale, so its
  output comes out NaN, never a finite wrong value.

  A Pallas kernel over blocks of whole rows (`quantize_rows_plan`): one read of x and one
  write of the codes, where XLA's form of the same math (`_quantized_rows`, kept where no
  row block fits) took three ops and read x more than once. Static estimates, Mixtral-
  8x7B's down rows [512, 14336] bf16: v6e 124,530 -> 27,114 cycles, v5e 226,919 ->
  40,811 (docs/performance.md, "Quantized decode")."""
  m, k = x.shape
  plan = quantize_rows_plan(m, k, x.dtype, chip)
  if plan is None:
    return _quantized_rows(x)
  rows, limit = plan

  def kernel(x_ref, codes_ref, scale_ref):
    codes_ref[...], scale_ref[...] = _quantized_rows(x_ref[...])

  return pl.pallas_call(
      kernel,
      grid=(pl.cdiv(m, rows),),
      in_specs=[pl.BlockSpec((rows, k), lambda i: (i, 0))],
      out_specs=[pl.BlockSpec((rows, k), lambda i: (i, 0)),
                 pl.BlockSpec((rows, 1), lambda i: (i, 0))],
      out_shape=[jax.ShapeDtypeStruct((m, k), jnp.int8),
                 jax.ShapeDtypeStruct((m, 1), jnp.float32)],
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",),
                                           vmem_limit_bytes=limit),
      interpret=interpret,
      name=QUANTIZE_ROWS_KERNEL,
  )(x)


def _forward(lhs, rhs, scale, bias, group_sizes, group_offset, st: _Static, *,
             epilogue=None, out_dtype=None, lhs_scale=None):
  """The fused forward: epilogue(lhs @ W * scale + bias) per group, [m, n_out].
  With st.lhs_quant, lhs is quantized here (`quantize_rows`) unless it already is
  (int8 codes with their lhs_scale [m, 1])."""
  epilogue = st.epilogue if epilogue is None else epilogue
  out_dtype = jnp.dtype(st.out_dtype if out_dtype is None else out_dtype)
  if st.lhs_quant and lhs_scale is None:
    lhs, lhs_scale = quantize_rows(lhs, chip=st.chip, interpret=st.interpret)
  n_axis = 1 if st.transpose_rhs else 2
  n_full = rhs.shape[n_axis]
  common = dict(transpose_rhs=st.transpose_rhs, epilogue=epilogue, out_dtype=out_dtype, st=st,
                lhs_scale=lhs_scale)
  if not epilogue.gated:
    return _gmm(lhs, [(rhs, 0)], [] if scale is None else [(scale, 0)],
                [] if bias is None else [(bias, 0)], group_sizes, group_offset,
                n_out=n_full, tiling_n_divides=None, **common)
  half = n_full // 2
  route = gate_up_route(lhs.shape[0], n_full, st.layout, rhs.size * rhs.dtype.itemsize)
  if route == "blocks":
    t = gmm_tiling(lhs.shape[0], lhs.shape[1], half, num_groups=rhs.shape[0],
                   lhs_dtype=lhs.dtype, rhs_dtype=rhs.dtype, out_dtype=out_dtype, num_rhs=2,
                   n_must_divide=half, chip=st.chip, block_m=st.block_m, block_k=st.block_k,
                   block_n=st.block_n, vmem_limit_bytes=st.vmem_limit_bytes)
    up = half // t.block_n
    ops = lambda a: [] if a is None else [(a, 0), (a, up)]
    return _gmm_call(lhs, ops(rhs), ops(scale), ops(bias), group_sizes, group_offset, t,
                     n_out=half, transpose_rhs=st.transpose_rhs, epilogue=epilogue,
                     out_dtype=out_dtype, chip=st.chip, interpret=st.interpret,
                     lhs_scale=lhs_scale)
  if route == "gate_pass":
    z = _forward(lhs, rhs, scale, bias, group_sizes, group_offset, st, epilogue=Epilogue(),
                 out_dtype=jnp.float32, lhs_scale=lhs_scale)
    return gate_pass(z, st.layout, epilogue, out_dtype, st.chip, st.interpret)
  if route == "lanes":
    ops = lambda a: [] if a is None else [(a, 0)]
    return _gmm(lhs, ops(rhs), ops(scale), ops(bias), group_sizes, group_offset,
                n_out=half, tiling_n_divides=None, interleaved=True, **common)
  pairs = lambda a, axis: [] if a is None else list(zip(_split_columns(a, st.layout, half, axis),
                                                        (0, 0)))
  return _gmm(lhs, pairs(rhs, n_axis), pairs(scale, 1), pairs(bias, 1), group_sizes,
              group_offset, n_out=half, tiling_n_divides=None, **common)


def _local_row_groups(group_sizes, group_offset, num_local_groups, m):
  """Local group of each row, int32 [m]; num_local_groups for rows of no local group."""
  sizes = group_sizes.astype(jnp.int32)
  before = jnp.sum(jnp.where(jnp.arange(sizes.shape[0]) < group_offset, sizes, 0))
  local_sizes = jax.lax.dynamic_slice(
      jnp.concatenate([sizes, jnp.zeros((num_local_groups,), jnp.int32)]), (group_offset,),
      (num_local_groups,))
  ends = before + jnp.cumsum(local_sizes)
  rows = jnp.arange(m, dtype=jnp.int32)
  ids = jnp.searchsorted(ends, rows, side="right", method="compare_all").astype(jnp.int32)
  return jnp.where(rows < before, num_local_groups, ids)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _ragged_dot(lhs, rhs, scale, bias, group_sizes, group_offset, st):
  return _forward(lhs, rhs, scale, bias, group_sizes, group_offset, st)


def _ragged_dot_fwd(lhs, rhs, scale, bias, group_sizes, group_offset, st):
  out = _forward(lhs, rhs, scale, bias, group_sizes, group_offset, st)
  return out, (lhs, rhs, scale, bias, group_sizes, group_offset)


def _ragged_dot_bwd(st, saved, g):
  if st.lhs_quant:
    raise NotImplementedError(
        f"lhs_quant={st.lhs_quant!r} is inference only: rounding the activations has no "
        "gradient (use lhs_quant=None to differentiate)")
  lhs, rhs, scale, bias, group_sizes, group_offset = saved
  ep = st.epilogue
  m = lhs.shape[0]
  g_local = rhs.shape[0]
  g = g.astype(jnp.float32)
  if ep.activation is None and not ep.gated:
    dz = g
  else:
    z = _forward(lhs, rhs, scale, bias, group_sizes, group_offset, st,
                 epilogue=Epilogue(), out_dtype=jnp.float32)
    if ep.gated:
      half = z.shape[1] // 2
      zg, zu = _split_columns(z, st.layout, half, 1)
      _, vjp = jax.vjp(lambda a, b: ep(a, b), zg, zu)
      dz = _join_columns(*vjp(g), st.layout)
    else:
      _, vjp = jax.vjp(ep, z)
      dz, = vjp(g)
  row_groups = _local_row_groups(group_sizes, group_offset, g_local, m)
  in_local = (row_groups < g_local)[:, None]
  dz = jnp.where(in_local, dz, 0.0)
  dz_lhs = dz
  if scale is not None:
    dz_lhs = dz * scale[jnp.minimum(row_groups, g_local - 1)].astype(jnp.float32)
  transposed = dataclasses.replace(st, transpose_rhs=not st.transpose_rhs, epilogue=Epilogue(),
                                   block_m=None, block_k=None, block_n=None)
  d_lhs = _forward(dz_lhs.astype(lhs.dtype), rhs, None, None, group_sizes, group_offset,
                   transposed, out_dtype=lhs.dtype)
  d_rhs = None
  if rhs.dtype in FLOAT_DTYPES:
    dz_c = dz.astype(lhs.dtype)
    if st.transpose_rhs:
      d_rhs = _tgmm(dz_c, lhs, group_sizes, group_offset, num_local_groups=g_local,
                    out_dtype=rhs.dtype, st=st)
    else:
      d_rhs = _tgmm(lhs, dz_c, group_sizes, group_offset, num_local_groups=g_local,
                    out_dtype=rhs.dtype, st=st)
  d_bias = None
  if bias is not None:
    d_bias = jax.ops.segment_sum(dz, row_groups, num_segments=g_local + 1)[:g_local]
    d_bias = d_bias.astype(bias.dtype)
  return d_lhs, d_rhs, None, d_bias, None, None


_ragged_dot.defvjp(_ragged_dot_fwd, _ragged_dot_bwd)


# ----------------------------------------------------------------------------- JAX API


def _check(lhs, rhs, group_sizes, rhs_scale, bias, transpose_rhs, out_dtype, n_full,
           lhs_quant=None):
  if lhs.ndim != 2:
    raise ValueError(f"lhs must be 2-D (m, k), got shape {lhs.shape}")
  if rhs.ndim != 3:
    raise ValueError(f"rhs must be 3-D (groups, k, n), got shape {rhs.shape}")
  if lhs.dtype not in FLOAT_DTYPES:
    raise TypeError(f"lhs must be float32 or bfloat16, got {lhs.dtype}")
  k = rhs.shape[2] if transpose_rhs else rhs.shape[1]
  if lhs.shape[1] != k:
    raise ValueError(f"lhs has k={lhs.shape[1]} but rhs {rhs.shape} "
                     f"(transpose_rhs={transpose_rhs}) has k={k}")
  if k == 0:
    raise ValueError("k must be positive")
  if rhs.shape[0] == 0:
    raise ValueError("rhs must hold at least one group")
  if group_sizes.ndim != 1 or group_sizes.dtype != jnp.int32:
    raise TypeError(f"group_sizes must be a 1-D int32 array, got {group_sizes.dtype} "
                    f"{group_sizes.shape}")
  if group_sizes.shape[0] < rhs.shape[0]:
    raise ValueError(f"group_sizes has {group_sizes.shape[0]} groups, fewer than the "
                     f"{rhs.shape[0]} of rhs")
  if rhs.dtype in QUANTIZED_DTYPES:
    if rhs_scale is None:
      raise ValueError(f"rhs of dtype {rhs.dtype} needs rhs_scale of shape "
                       f"({rhs.shape[0]}, {n_full})")
  elif rhs.dtype != lhs.dtype:
    raise TypeError(f"rhs must have lhs's dtype {lhs.dtype} (or be int8 / float8_e4m3fn "
                    f"with rhs_scale), got {rhs.dtype}; no silent casts")
  elif rhs_scale is not None:
    raise ValueError("rhs_scale applies only to int8 / float8_e4m3fn rhs")
  for name, a in (("rhs_scale", rhs_scale), ("bias", bias)):
    if a is not None and a.shape != (rhs.shape[0], n_full):
      raise ValueError(f"{name} must have shape ({rhs.shape[0]}, {n_full}), got {a.shape}")
    if a is not None and a.dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32 or bfloat16, got {a.dtype}")
  if out_dtype is not None and jnp.dtype(out_dtype) not in FLOAT_DTYPES:
    raise TypeError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
  if lhs_quant is not None:
    if lhs_quant not in LHS_QUANTS:
      raise ValueError(f"lhs_quant must be None or one of {LHS_QUANTS}, got {lhs_quant!r}")
    if rhs.dtype != jnp.int8:
      raise TypeError(f"lhs_quant={lhs_quant!r} multiplies int8 codes on the MXU: rhs must "
                      f"be int8 with rhs_scale, got {rhs.dtype}")


def _run(lhs, rhs, group_sizes, group_offset, rhs_scale, bias, st, n_out):
  m = lhs.shape[0]
  if m == 0 or n_out == 0:
    return jnp.zeros((m, n_out), st.out_dtype)
  return _ragged_dot(lhs, rhs, rhs_scale, bias, group_sizes,
                     jnp.asarray(group_offset, jnp.int32), st)


def ragged_dot(lhs, rhs, group_sizes, *, group_offset=0, transpose_rhs=False, rhs_scale=None,
               bias=None, activation=None, out_dtype=None, chip=chips.DEFAULT_CHIP,
               block_m=None, block_k=None, block_n=None, vmem_limit_bytes=None,
               interpret=False, lhs_quant=None):
  """Grouped matmul: rows of group g times rhs[g - group_offset], differentiable.

  Args:
    lhs: (m, k) f32 / bf16, rows sorted by group.
    rhs: (G_local, k, n), or (G_local, n, k) with transpose_rhs; lhs's dtype, or int8 /
      float8_e4m3fn with rhs_scale (weights dequantised in the kernel, frozen).
    group_sizes: (G_total,) int32, G_total >= G_local; rows of group g are
      [sum(group_sizes[:g]), sum(group_sizes[:g+1])), clipped to m.
    group_offset: int or int32 scalar (traceable, e.g. under shard_map): rhs[i] is
      global group group_offset + i. Rows of other groups, and rows past
      sum(group_sizes), come out as zeros.
    rhs_scale: (G_local, n) per-output-channel scale of quantized rhs.
    bias: (G_local, n), added after the scale.
    activation: None or one of SUPPORTED_ACTIVATIONS, applied in the kernel's epilogue.
    out_dtype: f32 / bf16, default lhs.dtype. Accumulation is f32 (int32 with lhs_quant).
    chip: tiles and VMEM limit for "v5e", "v6e", "v5p" or "v7".
    block_m, block_k, block_n, vmem_limit_bytes: override the chosen tiling.
    interpret: run in Pallas interpret mode (CPU).
    lhs_quant: None, or "int8" with int8 rhs: lhs quantized per row (`quantize_rows`) and
      multiplied as int8 codes (inference only: no gradient; the module docstring).
  Returns:
    (m, n) in out_dtype.
  """
  n_full = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  _check(lhs, rhs, group_sizes, rhs_scale, bias, transpose_rhs, out_dtype, n_full, lhs_quant)
  if activation is not None and activation not in SUPPORTED_ACTIVATIONS:
    raise ValueError(f"activation must be None or one of {SUPPORTED_ACTIVATIONS}, "
                     f"got {activation!r}")
  st = _Static(bool(transpose_rhs), Epilogue(activation=activation), "concatenated",
               jnp.dtype(out_dtype or lhs.dtype).name, chip, block_m, block_k, block_n,
               vmem_limit_bytes, bool(interpret), lhs_quant)
  chips.get_chip(chip)
  return _run(lhs, rhs, group_sizes, group_offset, rhs_scale, bias, st, n_full)


def gated_ragged_dot(lhs, rhs, group_sizes, *, activation="silu", layout="concatenated",
                     alpha=1.702, limit=7.0, group_offset=0, transpose_rhs=False,
                     rhs_scale=None, bias=None, out_dtype=None, chip=chips.DEFAULT_CHIP,
                     block_m=None, block_k=None, block_n=None, vmem_limit_bytes=None,
                     interpret=False, lhs_quant=None):
  """Gated MoE up-projection: act(z_gate) * z_up, with z = lhs @ W (+ bias) per group.

  The gate/up product is formed in the kernel's epilogue, so the (m, 2I) projection
  never reaches HBM. rhs is (G_local, k, 2I) (or (G_local, 2I, k) with transpose_rhs);
  layout "concatenated": gate = the first I of the 2I columns, up = the last I;
  "interleaved" (gpt-oss): gate = even columns, up = odd. activation: one of
  GATED_ACTIVATIONS; "gpt_oss" is (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g)
  with g = min(gate, limit); "clamped_silu" is silu(g) * clip(up, -limit, limit).
  rhs_scale and bias are (G_local, 2I) in rhs's column layout.
  Other arguments as in `ragged_dot`. Returns (m, I) in out_dtype.
  """
  n_full = rhs.shape[1] if transpose_rhs else rhs.shape[2]
  _check(lhs, rhs, group_sizes, rhs_scale, bias, transpose_rhs, out_dtype, n_full, lhs_quant)
  if activation not in GATED_ACTIVATIONS:
    raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if n_full % 2:
    raise ValueError(f"the gate/up axis of rhs must be even, got {n_full}")
  st = _Static(bool(transpose_rhs),
               Epilogue(activation=activation, gated=True, alpha=float(alpha),
                        limit=float(limit)),
               layout, jnp.dtype(out_dtype or lhs.dtype).name, chip, block_m, block_k,
               block_n, vmem_limit_bytes, bool(interpret), lhs_quant)
  chips.get_chip(chip)
  return _run(lhs, rhs, group_sizes, group_offset, rhs_scale, bias, st, n_full // 2)
