"""XLA's own ops as a peer: the XLA-native baseline of each case kind, the program a user
gets without our kernels, rated in benchmarks/estimate.py's child process.

    case kind (cases/)  row                             program
    RmsNorm             xla (jnp)                       rms_norm.rms_norm_reference (plain jnp,
                                                        f32 math): the static estimate of the
                                                        whole program, as ours
    RmsNormGated        xla (jnp)                       rms_norm.rms_norm_gated_reference
                                                        (Qwen3.5's roundings), the same way
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
    GdnChunked          xla (chunked jnp, lax.scan)     gated_delta_rule.chunk_gated_delta_rule_xla
                                                        (the same WY algorithm in jnp, f32 HIGHEST,
                                                        a scan over chunks; training: its autodiff)
    GdnDecode           xla (recurrent jnp, as          one token of Transformers'
                        Transformers')                  torch_recurrent_gated_delta_rule in jnp
    ConvPrefill         xla (jnp)                       causal_conv1d.causal_conv1d_reference
                                                        (training: its autodiff)
    ConvUpdate          xla (jnp, as Transformers')     Transformers' causal_conv1d_update in jnp
and none beside a w8a8 grouped matmul: lax.ragged_dot has no int8 x int8 with row and column
scales (the int8 row's XLA baseline, which dequantizes the weights, is the comparison).

RMSNorm's and the conv's programs are rated by the static estimate of the whole program;
the chunked gated delta rule by XLA's cost_analysis at 2 and 4 chunks, extrapolated linearly
(CHUNKED: its cost_analysis counts a loop body once, not once per chunk, so the scan is
unrolled at 2 and 4 chunks, checked linear); every other program (estimator/xla_cost.py: the
static estimator crashes on ragged_dot and takes >300 s / 19 GB on attention): a lower
bound for XLA. A new case kind gets its XLA row by an entry in `PROGRAMS` (its row name, its
program builder, and STATIC or COST).
"""

from __future__ import annotations

import functools

from benchmarks.cases.causal_conv1d import ConvPrefill, ConvUpdate
from benchmarks.cases.diffusion import JointAttention
from benchmarks.cases.gated_delta_rule import CHUNK, GdnChunked, GdnDecode
from benchmarks.cases.experts_layer import ExpertsLayer
from benchmarks.cases.headline import (Attention, GroupedMatmul, PagedDecode, RmsNorm,
                                       RmsNormGated)
from benchmarks.estimator import static_estimate
from benchmarks.estimator.xla_cost import xla_cost
from benchmarks.peers import protocol


def rms_norm_gated_program(case: RmsNormGated):
  """Transformers' RMSNormGated (Qwen3.5's roundings) in plain jnp, as XLA fuses it."""
  from tpu_kernels import rms_norm
  return rms_norm.rms_norm_gated_reference, case.specs()


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


def gdn_chunked_program(case: GdnChunked, tokens: int | None = None):
  """(fn, specs): chunk_gated_delta_rule_xla on the case (or its first `tokens` tokens), as
  our kernel is called (l2-normalised q and k); training: o and jax.vjp's gradients."""
  import functools
  import jax
  from tpu_kernels import gated_delta_rule as G
  _, specs = case.program("v6e", tokens)   # the same inputs as ours (the chip is unused)
  forward = functools.partial(G.chunk_gated_delta_rule_xla, use_qk_l2norm_in_kernel=True)
  if not case.training:
    return forward, specs

  def train(q, k, v, g, beta, do):
    o, vjp = jax.vjp(lambda *a: forward(*a)[0], q, k, v, g, beta)
    return o, vjp(do)

  return train, specs


def gdn_decode_program(case: GdnDecode):
  """(fn, specs): one token of Transformers' torch_recurrent_gated_delta_rule in jnp (q and
  k repeated to the value heads, f32, l2-normalised, scaled by K^-0.5; the state decayed,
  S^T k, the delta, the rank-1 update, S^T q), as XLA compiles the default torch path."""
  import jax.numpy as jnp
  from jax import lax
  _, specs = case.program("v6e")   # the same inputs as ours (the chip is unused)

  def step(q, k, v, g, beta, state):
    group = v.shape[2] // q.shape[2]
    l2norm = lambda x: x * lax.rsqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)
    q, k = (l2norm(jnp.repeat(x, group, axis=2)[:, 0].astype(jnp.float32)) for x in (q, k))
    q = q / q.shape[-1] ** 0.5
    state = state * jnp.exp(g[:, 0])[..., None, None]
    delta = (v[:, 0].astype(jnp.float32) - (state * k[..., None]).sum(-2)) \
        * beta[:, 0].astype(jnp.float32)[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2)[:, None].astype(v.dtype), state

  return step, specs


def conv_prefill_program(case: ConvPrefill):
  """(fn, specs): causal_conv1d_reference (f32 math) on the channels-last input; training: out
  and jax.vjp's gradients."""
  import jax
  import jax.numpy as jnp
  from tpu_kernels import causal_conv1d as C
  _, specs = case.program("v6e")   # the same inputs as ours (the chip is unused)

  def conv(x, w):
    return jnp.swapaxes(C.causal_conv1d_reference(jnp.swapaxes(x, 1, 2), w, None, "silu"), 1, 2)

  if not case.training:
    return conv, specs

  def train(x, w, dout):
    out, vjp = jax.vjp(conv, x, w)
    return out, vjp(dout)

  return train, specs


def conv_update_program(case: ConvUpdate):
  """(fn, specs): Transformers' causal_conv1d_update in jnp: cat(state, x), the new state its
  last S columns, the conv over its last W columns (f32 sums), SiLU."""
  import jax
  import jax.numpy as jnp

  def update(x, state, w):
    full = jnp.concatenate([state, x], axis=-1)
    window = full[..., -w.shape[1]:].astype(jnp.float32)
    out = jnp.sum(window * w.astype(jnp.float32)[None], -1, keepdims=True)
    return jax.nn.silu(out).astype(x.dtype), full[..., -state.shape[-1]:]

  return update, case.specs()


def unrolled(fn, specs):
  """(fn with every lax.scan it traces fully unrolled, specs): XLA's cost_analysis counts a
  while loop's body once, whatever its trip count; unrolled, it counts every chunk."""
  import jax
  from unittest import mock
  scan = jax.lax.scan

  def run(*args):
    with mock.patch.object(jax.lax, "scan", functools.partial(scan, unroll=True)):
      return fn(*args)

  return run, specs


def cost_in_chunks(case: GdnChunked, chip: str, chunks=(2, 4)) -> dict:
  """A partial row: XLA's cost_analysis of gdn_chunked_program at `chunks` chunks (its
  optimal_seconds and bytes accessed), extrapolated linearly to the case's chunks. XLA's
  cost analysis counts a while loop's body once: at the case's 64 chunks its flops are
  those of about one chunk and its optimal_seconds is invalid. So the scan is unrolled
  (`unrolled`) at 2 and 4 chunks (the flops double: checked here)."""
  parts = [xla_cost(lambda n=n: unrolled(*gdn_chunked_program(case, n * CHUNK)), chip)
           for n in chunks]
  failed = next((p for p in parts if not p["compiled"]), None)
  if failed:
    return failed
  (n1, n2), (p1, p2) = chunks, parts
  ratio = p2["xla_flops"] / p1["xla_flops"]
  if not 1.8 < ratio < 2.2:
    return dict(compiled=True, error=f"cost_analysis's flops at {n1} and {n2} chunks are not "
                                     f"linear ({ratio:.2f}x): the scan was not unrolled")
  total = -(-case.tokens // CHUNK)
  extend = lambda key: p1[key] + (p2[key] - p1[key]) / (n2 - n1) * (total - n1)
  # hbm_bytes: cost_analysis's bytes, extrapolated, at least the case's roofline bytes
  invalid = [p for p in parts if "invalid" in p["method"]]
  basis = ("its flops at peak (its optimal_seconds is invalid there: a lower bound) and "
           "bytes accessed" if invalid else "optimal_seconds, bytes accessed")
  return dict(compiled=True, error=None, estimated_cycles=None,
              compute_us=extend("compute_us"),
              hbm_bytes=max(int(extend("hbm_bytes")), case.min_bytes()),
              xla_flops=extend("xla_flops"),
              method=f"XLA cost_analysis ({basis}) at {n1} and {n2} chunks, extrapolated "
                     f"linearly to {total}, the scan unrolled (its cost analysis counts a loop's "
                     "body once)")


# How an XLA program is rated: the static estimate of the whole program, as ours (where the
# estimator takes it), or XLA's cost_analysis (it crashes on ragged_dot and takes >300 s /
# 19 GB on attention).
STATIC, COST, CHUNKED = "static estimate", "cost_analysis", "cost_analysis in chunks"
# case kind -> (row name, program builder, how it is rated)
PROGRAMS = {
    RmsNorm: ("xla (jnp)", rms_norm_program, STATIC),
    RmsNormGated: ("xla (jnp)", rms_norm_gated_program, STATIC),
    GroupedMatmul: ("xla (lax.ragged_dot)", grouped_matmul_program, COST),
    Attention: ("xla (nn.dot_product_attention)", attention_program, COST),
    JointAttention: ("xla (nn.dot_product_attention)", attention_program, COST),
    PagedDecode: ("xla (gather + softmax)", paged_decode_program, COST),
    ExpertsLayer: ("xla (lax.ragged_dot layer)", experts_layer_program, COST),
    GdnChunked: ("xla (chunked jnp, lax.scan)", gdn_chunked_program, CHUNKED),
    GdnDecode: ("xla (recurrent jnp, as Transformers')", gdn_decode_program, COST),
    ConvPrefill: ("xla (jnp)", conv_prefill_program, STATIC),
    ConvUpdate: ("xla (jnp, as Transformers')", conv_update_program, STATIC),
}


def implementations(case) -> list[protocol.Implementation]:
  if type(case) not in PROGRAMS or getattr(case, "lhs_quant", None):
    return []
  name, program, rated_by = PROGRAMS[type(case)]
  if rated_by == STATIC:
    rate = lambda chip: static_estimate.whole_program(*program(case), chip, case.min_bytes())
    return [protocol.Implementation(case.name, name, protocol.XLA, rate)]
  if rated_by == CHUNKED:
    rate = lambda chip: cost_in_chunks(case, chip)
  else:
    rate = lambda chip: xla_cost(lambda: program(case), chip, case.min_bytes())
  return [protocol.Implementation(case.name, name, protocol.XLA, rate, static_profile=False)]
