"""Mixture-of-Experts experts block on the grouped matmul kernels (`ragged_dot.py`).

    moe_experts(hidden[T, H], top_k_index[T, K], top_k_weights[T, K], gate_up_weight,
                down_weight, *, num_experts, ...) -> [T, H]

The same computation as Transformers' `grouped_mm_experts_forward`
(`transformers/integrations/moe.py`), step for step:

  1. Flatten the T*K (token, expert) pairs: expert id `ids[s]`, weight `w[s]`, token `s // K`.
  2. Sort the pairs by expert id (stable, so rows of one expert keep token order): at decode
     by index arithmetic in one Pallas kernel (`moe_route`), which also does step 4, else
     by XLA's argsort. Expert-parallel placeholder ids (>= num_experts: experts on another shard)
     and negative ids (a dropped pair) sort to the tail.
  3. group_sizes[e] = number of pairs routed to expert e, counting real experts only. The
     placeholder rows lie past sum(group_sizes): in no group, so the kernel writes zeros for
     them and they contribute nothing (neither to the output nor to any gradient).
  4. Gather the token rows in sorted order: x[S, H].
  5. Gate/up projection with the activation fused into the kernel's epilogue
     (`gated_ragged_dot`: act(gate) * up, [S, I]; the [S, 2I] intermediate never leaves the
     kernel). Without a gate (Nemotron-H): `ragged_dot(..., activation=act)`, [S, I].
  6. Down projection (`ragged_dot`) to [S, H], in float32.
  7. Restore the token order, multiply each row by its routing weight (float32), sum over
     the K experts of each token in float32, and cast to hidden's dtype: one Pallas kernel
     of row DMAs (`moe_combine.gather_weighted_sum`), XLA's gather where its VMEM plan
     does not fit.

Weight layouts (Transformers' experts modules):
  is_transposed=False: gate_up (E, 2I, H) [or up (E, I, H)], down (E, H, I)  -> transpose_rhs
  is_transposed=True:  gate_up (E, H, 2I) [or up (E, H, I)], down (E, I, H)
  is_concatenated: gate = first I columns of 2I, up = last I; False: interleaved
  (gate = even, up = odd columns, as gpt-oss stores them).
Quantized weights (int8 / float8_e4m3fn) come with per-output-channel float32 scales
(gate_up_scale [E, 2I], down_scale [E, H]) and are dequantized inside the kernel. With int8
weights, `lhs_quant="int8"` also quantizes the rows fed to both projections (x, then h) per
row and multiplies int8 by int8 (`ragged_dot`'s lhs_quant: inference only).

Differentiable with jax.vjp w.r.t. hidden, top_k_weights, float weights and biases
(top_k_index is integer and is not). Quantized weights are frozen: no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import chips, moe_combine, moe_route, ragged_dot

# The gate activation names moe_experts takes: the kernel's, plus the clamped gates
# (gpt-oss's, and the clamped SwiGLU "clamped_silu").
GATED_ACTIVATIONS = ragged_dot.GATED_ACTIVATIONS


def moe_experts(hidden: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array,
                gate_up_weight: jax.Array, down_weight: jax.Array, *,
                gate_up_bias: jax.Array | None = None, down_bias: jax.Array | None = None,
                gate_up_scale: jax.Array | None = None, down_scale: jax.Array | None = None,
                num_experts: int, has_gate: bool = True, is_transposed: bool = False,
                is_concatenated: bool = True, activation: str = "silu", alpha: float = 1.702,
                limit: float = 7.0, chip: str = chips.DEFAULT_CHIP,
                interpret: bool = False, lhs_quant: str | None = None) -> jax.Array:
  """The experts block of an MoE layer: sum_k w[t, k] * expert_{idx[t, k]}(hidden[t]).

  Args:
    hidden: [T, H] float32 / bfloat16.
    top_k_index: [T, K] int32 expert ids; ids outside [0, num_experts) (expert-parallel
      placeholders, dropped pairs) contribute nothing.
    top_k_weights: [T, K] routing weights (any float dtype; applied in float32).
    gate_up_weight: has_gate: [E, 2I, H] (or [E, H, 2I] if is_transposed); without a gate
      the up projection [E, I, H] (or [E, H, I]). hidden's dtype, or int8 / float8_e4m3fn
      with gate_up_scale.
    down_weight: [E, H, I] (or [E, I, H] if is_transposed), same rules.
    gate_up_bias, down_bias: [E, 2I] (or [E, I]) and [E, H], optional.
    gate_up_scale, down_scale: float32 per-output-channel scales, iff the weight is quantized.
    num_experts: E.
    activation: one of GATED_ACTIVATIONS (the clamped gates "gpt_oss" and "clamped_silu"
      need has_gate; alpha is gpt_oss's, limit the clamp of both).
    lhs_quant: None, or "int8" with int8 weights: both projections take their rows as
      int8 codes with per-row scales (`ragged_dot.quantize_rows`); no gradient.
  Returns:
    [T, H] in hidden's dtype.
  """
  tokens, hidden_size = hidden.shape
  if top_k_index.ndim != 2 or top_k_index.shape[0] != tokens:
    raise ValueError(f"top_k_index must be [{tokens}, K], got {top_k_index.shape}")
  if top_k_weights.shape != top_k_index.shape:
    raise ValueError(f"top_k_weights must have top_k_index's shape {top_k_index.shape}, "
                     f"got {top_k_weights.shape}")
  if not jnp.issubdtype(top_k_index.dtype, jnp.integer):
    raise TypeError(f"top_k_index must be integer, got {top_k_index.dtype}")
  for name, w in (("gate_up_weight", gate_up_weight), ("down_weight", down_weight)):
    if w.ndim != 3 or w.shape[0] != num_experts:
      raise ValueError(f"{name} must be [num_experts={num_experts}, ., .], got {w.shape}")
  if activation not in GATED_ACTIVATIONS:
    raise ValueError(f"activation must be one of {GATED_ACTIVATIONS}, got {activation!r}")
  if activation not in ragged_dot.SUPPORTED_ACTIVATIONS and not has_gate:
    raise ValueError(f"activation {activation!r} needs a gate (has_gate=True)")
  kernel_args = dict(chip=chip, interpret=interpret)
  gmm_args = dict(kernel_args, lhs_quant=lhs_quant)

  x, pos, group_sizes = route(hidden, top_k_index, num_experts, **kernel_args)  # 1-4

  # 5. gate/up projection, activation fused.
  if has_gate:
    h = ragged_dot.gated_ragged_dot(
        x, gate_up_weight, group_sizes, activation=activation,
        layout="concatenated" if is_concatenated else "interleaved", alpha=alpha, limit=limit,
        transpose_rhs=not is_transposed, rhs_scale=gate_up_scale, bias=gate_up_bias,
        **gmm_args)                                                      # [S, I]
  else:
    h = ragged_dot.ragged_dot(
        x, gate_up_weight, group_sizes, activation=activation, transpose_rhs=not is_transposed,
        rhs_scale=gate_up_scale, bias=gate_up_bias, **gmm_args)           # [S, I]

  # 6. down projection, kept in float32 for the weighted sum.
  y = ragged_dot.ragged_dot(h, down_weight, group_sizes, transpose_rhs=not is_transposed,
                            rhs_scale=down_scale, bias=down_bias, out_dtype=jnp.float32,
                            **gmm_args)                                  # [S, H] f32
  if y.shape[1] != hidden_size:
    raise ValueError(f"down_weight produces width {y.shape[1]}, hidden has {hidden_size}")

  return combine(y, pos, top_k_weights, out_dtype=hidden.dtype, **kernel_args)  # step 7


# The glue around the two kernels, as functions of their own so that the static estimate of
# the whole layer (benchmarks/rating/experts_layer.py) rates exactly these ops.


def route(hidden: jax.Array, top_k_index: jax.Array, num_experts: int, *,
          chip: str = chips.DEFAULT_CHIP, interpret: bool = False):
  """Steps 1-4: hidden [T, H], top_k_index [T, K] int -> (x [S, H] hidden's dtype, the
  token rows in expert order; pos [S] int32, pair index t * K + k -> its sorted row;
  group_sizes [num_experts] int32), S = T * K. Ids outside [0, num_experts) (expert-parallel
  placeholders, or a negative id for a dropped pair) sort to the tail, in no group.

  At decode one Pallas kernel computes pos and the group sizes without a sort, and gathers
  the rows too (`moe_route.route_rows`; where its VMEM plan does not fit,
  `moe_route.route_indices` and XLA's gather); elsewhere XLA's stable argsort sorts, and a
  second argsort inverts it. All give the same order and the same rows, bit for bit, with
  route_rows' two caveats (its module docstring): in interpret mode a bfloat16 NaN keeps
  no payload, and whether the chip keeps a denormal bfloat16 is not checked here."""
  tokens, top_k = top_k_index.shape
  if moe_route.fits_rows(tokens, top_k, num_experts, hidden.shape[1], hidden.dtype, chip):
    return moe_route.route_rows(hidden, top_k_index, num_experts, interpret=interpret)
  if moe_route.fits(tokens, top_k, num_experts, chip):
    pos, src, group_sizes = moe_route.route_indices(top_k_index, num_experts,
                                                    interpret=interpret)
  else:
    pos, src, group_sizes = sort_pairs_xla(top_k_index, num_experts)
  # 4. token rows in expert order. src < T always: "promise_in_bounds" spares the
  # out-of-bounds select jnp.take adds over all of [S, H] (811 us of v6e's static estimate
  # at S = 65536 rows of 2048).
  x = hidden.at[src].get(mode="promise_in_bounds")                      # [S, H]
  return x, pos, group_sizes


def sort_pairs_xla(top_k_index: jax.Array, num_experts: int):
  """Steps 1-3 by XLA's stable argsort: top_k_index [T, K] int -> (pos [S] int32, pair ->
  its sorted row; src [S] int32, sorted row -> its token; group_sizes [num_experts] int32).
  `route` away from decode, and the route of the XLA baseline layer
  (benchmarks/rating/experts_layer.py)."""
  top_k = top_k_index.shape[1]
  # Flatten, sort by expert (every id outside the experts as one past the last), count.
  expert_ids = top_k_index.reshape(-1).astype(jnp.int32)                 # [S]
  in_range = (expert_ids >= 0) & (expert_ids < num_experts)
  perm = jnp.argsort(jnp.where(in_range, expert_ids, num_experts), stable=True)
  # Counted by a compare-and-sum over [S, E], not a scatter-add: XLA offloads that scatter
  # on TPU, where libtpu's static estimate cannot rate it (v6e: INT64_MAX cycles; v5e:
  # aborts). The compare rates 80 us on v6e at S = 65536, E = 128.
  group_sizes = jnp.sum(expert_ids[:, None] == jnp.arange(num_experts, dtype=jnp.int32),
                        axis=0, dtype=jnp.int32)
  pos = jnp.argsort(perm).astype(jnp.int32)            # perm is a permutation: its inverse
  return pos, (perm // top_k).astype(jnp.int32), group_sizes


def combine(y: jax.Array, pos: jax.Array, top_k_weights: jax.Array, *,
            out_dtype=jnp.float32, chip: str = chips.DEFAULT_CHIP,
            interpret: bool = False) -> jax.Array:
  """Step 7: y [S, H] float32 (rows in expert order), pos [S] from `route`,
  top_k_weights [T, K] -> [T, H] out_dtype: back to token order, routing weights applied,
  summed over the K experts of each token in float32. The Pallas kernel
  (`moe_combine.gather_weighted_sum`) where its plan fits the chip's VMEM, else
  `combine_xla`; differentiable w.r.t. y and top_k_weights either way."""
  tokens, top_k = top_k_weights.shape
  ids = pos.astype(jnp.int32).reshape(tokens, top_k)    # (t, k) -> its row of y
  if moe_combine.block_tokens(tokens, top_k, y.shape[1], out_dtype, chip) is None:
    return combine_xla(y, ids, top_k_weights).astype(out_dtype)
  return _combine_kernel(y, ids, top_k_weights, jnp.dtype(out_dtype), chip, interpret)


def combine_xla(y: jax.Array, ids: jax.Array, top_k_weights: jax.Array) -> jax.Array:
  """The same sum by XLA's gather: y [S, H] float32, ids [T, K] (pair -> sorted position),
  top_k_weights [T, K] -> [T, H] float32. The kernel's backward, its fallback, and the
  combine of the XLA baseline layer (benchmarks/rating/experts_layer.py)."""
  tokens, top_k = ids.shape
  # Gathered k-major, [K, T, H], so the sum over K adds whole [T, H] slabs (token-major
  # [T, K, H] sums across sublanes: libtpu's static estimate rates it 1.4x the cycles at
  # T=64). ids < S always: "promise_in_bounds" spares jnp.take's out-of-bounds select.
  rows = y.at[ids.T.reshape(-1)].get(mode="promise_in_bounds").reshape(top_k, tokens, -1)
  return jnp.sum(rows * top_k_weights.astype(jnp.float32).T[:, :, None], axis=0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _combine_kernel(y, ids, top_k_weights, out_dtype, chip, interpret):
  return moe_combine.gather_weighted_sum(y, ids, top_k_weights, out_dtype=out_dtype,
                                         chip=chip, interpret=interpret)


def _combine_kernel_fwd(y, ids, top_k_weights, out_dtype, chip, interpret):
  out = _combine_kernel(y, ids, top_k_weights, out_dtype, chip, interpret)
  return out, (y, ids, top_k_weights)


def _combine_kernel_bwd(out_dtype, chip, interpret, residuals, g):
  """The cotangents of XLA's combine (the same function): y's is a scatter-add of the
  weighted rows, the weights' a row-wise dot; ids (integer) get none."""
  y, ids, top_k_weights = residuals
  _, vjp = jax.vjp(lambda y_, w_: combine_xla(y_, ids, w_).astype(out_dtype), y,
                   top_k_weights)
  dy, dw = vjp(g)
  return dy, None, dw


_combine_kernel.defvjp(_combine_kernel_fwd, _combine_kernel_bwd)
