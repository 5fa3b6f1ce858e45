"""XLA's own ops as a peer: the XLA-native baseline of each case kind, the program a user
gets without our kernels, rated in benchmarks/estimate.py's child process.

    case kind (cases/)  row                             program
    RmsNorm             xla (jnp)                       rms_norm.rms_norm_reference (plain jnp,
                                                        f32 math): the static estimate of the
                                                        whole program, as ours
    GroupedMatmul       xla (lax.ragged_dot)            jax.lax.ragged_dot on weights in its
                                                        native (G, k, n) layout (no transpose
                                                        charged to it), the gate fused
    Attention,          xla (nn.dot_product_attention)  jax.nn.dot_product_attention in its
    JointAttention                                      [B, S, H, D] layout (GQA by its own
                                                        head grouping)
    PagedDecode         xla (gather + softmax)          paged_attention.paged_attention_xla
                                                        (gathers each sequence's pages)
    ExpertsLayer        xla (lax.ragged_dot layer)      XLA's route and combine around two
                                                        lax.ragged_dot calls, one program
    PagedBatch          none: the gathering baseline materialises every token's whole context
and none beside a w8a8 grouped matmul: lax.ragged_dot has no int8 x int8 with row and column
scales (the int8 row's XLA baseline, which dequantizes the weights, is the comparison).

Every program but RMSNorm's is rated by XLA's cost_analysis (estimator/xla_cost.py: the
static estimator crashes on ragged_dot and takes >300 s / 19 GB on attention): a lower
bound for XLA. A new case kind gets its XLA row by an entry in `PROGRAMS` (its row name, its
program builder, and STATIC or COST).
"""

from __future__ import annotations

import functools

from benchmarks.cases.diffusion import JointAttention
from benchmarks.cases.experts_layer import ExpertsLayer
from benchmarks.cases.headline import Attention, GroupedMatmul, PagedDecode, RmsNorm
from benchmarks.estimator import static_estimate
from benchmarks.estimator.xla_cost import xla_cost
from benchmarks.peers import protocol


def rms_norm_program(case: RmsNorm):
  """(fn, specs): plain-jnp RMSNorm (f32 math), XLA's fusion of it."""
  import jax
  from tpu_kernels import rms_norm
  x = jax.ShapeDtypeStruct((case.rows, case.hidden), case.dtype)
  w = jax.ShapeDtypeStruct((case.hidden,), case.dtype)
  return rms_norm.rms_norm_reference, [x, w]


def grouped_matmul_program(case: GroupedMatmul):
  """(fn, specs): jax.lax.ragged_dot with weights in its native (G, k, n) layout (no transpose
  charged to it), and the gated epilogue as a fused elementwise op where ragged_dot gates in
  its kernel (ragged_dot.gate_up_route "blocks"; where it gates in a second pass, gpt-oss's
  "gate_pass" at decode, neither side's gate is rated). Quantized weights are dequantised
  first (w * scale in bf16: lax.ragged_dot takes one dtype), an XLA op of its own or fused,
  as XLA decides."""
  import jax
  import jax.numpy as jnp
  from tpu_kernels import ragged_dot as R
  gated = case.gated and R.gate_up_route(case.m, case.n_weight, case.layout,
                                         case.weight_bytes) != "gate_pass"

  def fn(lhs, w, *rest):
    *scale, group_sizes = rest
    if scale:
      w = (w.astype(jnp.float32) * scale[0][:, None, :]).astype(lhs.dtype)
    z = jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)
    if gated:
      z = jax.nn.silu(z[:, :case.n_out]) * z[:, case.n_out:]
    return z.astype(lhs.dtype)

  dt = jnp.dtype(case.dtype)
  scale = [jax.ShapeDtypeStruct((case.groups, case.n_weight), jnp.float32)] \
      if case.quantized else []
  specs = [jax.ShapeDtypeStruct((case.m, case.k), dt),
           jax.ShapeDtypeStruct((case.groups, case.k, case.n_weight),
                                jnp.dtype(case.weight_dtype)), *scale,
           jax.ShapeDtypeStruct((case.groups,), jnp.int32)]
  return fn, specs


def attention_program(case):
  """(fn, specs): jax.nn.dot_product_attention (causal as the case), in its [B, S, H, D]
  layout (GQA by its own head grouping)."""
  import jax
  import jax.numpy as jnp
  dtype = jnp.dtype(case.dtype)
  q = jax.ShapeDtypeStruct((case.batch, case.seq, case.q_heads, case.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((case.batch, case.seq, case.kv_heads, case.head_dim), dtype)
  return functools.partial(jax.nn.dot_product_attention, is_causal=case.causal), [q, kv, kv]


def paged_decode_program(case: PagedDecode):
  """(fn, specs): paged_attention_xla (gathers each sequence's pages) on the decode batch."""
  import jax
  import jax.numpy as jnp
  from tpu_kernels import paged_attention as PA
  S = jax.ShapeDtypeStruct
  pages_per_seq = -(-case.context // case.page_size)
  num_pages = case.batch * pages_per_seq
  cache = S((num_pages, case.kv_heads, case.page_size, case.head_dim), jnp.dtype(case.kv_dtype))
  specs = [S((case.batch, case.q_heads, case.head_dim), jnp.dtype(case.q_dtype)), cache, cache,
           S((case.batch,), jnp.int32), S((case.batch, pages_per_seq), jnp.int32),
           S((case.batch + 1,), jnp.int32)]
  return PA.paged_attention_xla, specs


def experts_layer_program(case: ExpertsLayer):
  """(fn, specs): the XLA baseline of the whole layer: moe's XLA sort (`sort_pairs_xla`), the
  gather and XLA's combine around two jax.lax.ragged_dot calls (weights in their native
  (E, k, n) layout) and the case's gate (columns and activation), one program."""
  import jax
  import jax.numpy as jnp
  from tpu_kernels import moe
  from tpu_kernels import ragged_dot as R
  dt = jnp.dtype(case.dtype)

  def fn(hidden, ids, weights, gate_up, down):
    pos, src, sizes = moe.sort_pairs_xla(ids, case.experts)
    x = hidden.at[src].get(mode="promise_in_bounds")
    z = jax.lax.ragged_dot(x, gate_up, sizes, preferred_element_type=jnp.float32)
    epilogue = R.Epilogue(activation=case.activation, gated=True)
    h = epilogue(*R._split_columns(z, case.layout, case.width, 1)).astype(dt)
    y = jax.lax.ragged_dot(h, down, sizes, preferred_element_type=jnp.float32)
    return moe.combine_xla(y, pos.reshape(case.tokens, case.top_k), weights).astype(dt)

  specs = [jax.ShapeDtypeStruct((case.tokens, case.hidden), dt),
           jax.ShapeDtypeStruct((case.tokens, case.top_k), jnp.int32),
           jax.ShapeDtypeStruct((case.tokens, case.top_k), dt),
           jax.ShapeDtypeStruct((case.experts, case.hidden, 2 * case.width), dt),
           jax.ShapeDtypeStruct((case.experts, case.width, case.hidden), dt)]
  return fn, specs


# How an XLA program is rated: the static estimate of the whole program, as ours (where the
# estimator takes it), or XLA's cost_analysis (it crashes on ragged_dot and takes >300 s /
# 19 GB on attention).
STATIC, COST = "static estimate", "cost_analysis"
# case kind -> (row name, program builder, how it is rated)
PROGRAMS = {
    RmsNorm: ("xla (jnp)", rms_norm_program, STATIC),
    GroupedMatmul: ("xla (lax.ragged_dot)", grouped_matmul_program, COST),
    Attention: ("xla (nn.dot_product_attention)", attention_program, COST),
    JointAttention: ("xla (nn.dot_product_attention)", attention_program, COST),
    PagedDecode: ("xla (gather + softmax)", paged_decode_program, COST),
    ExpertsLayer: ("xla (lax.ragged_dot layer)", experts_layer_program, COST),
}


def implementations(case) -> list[protocol.Implementation]:
  if type(case) not in PROGRAMS or getattr(case, "lhs_quant", None):
    return []
  name, program, rated_by = PROGRAMS[type(case)]
  if rated_by == STATIC:
    rate = lambda chip: static_estimate.whole_program(*program(case), chip, case.min_bytes())
    return [protocol.Implementation(case.name, name, protocol.XLA, rate)]
  rate = lambda chip: xla_cost(lambda: program(case), chip, case.min_bytes())
  return [protocol.Implementation(case.name, name, protocol.XLA, rate, static_profile=False)]
