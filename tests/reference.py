"""Independent float64 NumPy references, written from the definitions (no kernel code).

    rms_norm(x)[r, j] = x[r, j] / sqrt(mean_k x[r, k]^2 + eps) * (offset + w[j])

Gradients come from the explicit per-row Jacobian of that definition, a different
route from the closed form the kernel uses.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

# Tolerances per dtype of x (inputs of unit scale). Both bounds apply as
# |kernel - reference| <= atol * max|reference| + rtol * |reference|.
# float32: f32 math vs f64; bfloat16 / float16: one rounding of the output (2^-8 / 2^-11)
# plus f32 math, with margin for the residual sum's double rounding.
TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "bfloat16": dict(rtol=1.6e-2, atol=1.6e-2),
    "float16": dict(rtol=2e-3, atol=2e-3),
}
# Gradients sum over a row (dx) or over rows (dweight) before their one rounding.
GRAD_TOLERANCE = {
    "float32": dict(rtol=1e-4, atol=1e-4),
    "bfloat16": dict(rtol=3e-2, atol=3e-2),
    "float16": dict(rtol=4e-3, atol=4e-3),
}

NP_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def f64(a) -> np.ndarray:
  return np.asarray(a).astype(np.float64)


def rms_norm(x, weight, eps, offset=0.0) -> np.ndarray:
  x, w = f64(x), f64(weight)
  return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * (offset + w)


def residual_sum(x, residual, dtype: str) -> np.ndarray:
  """x + residual, rounded to x's dtype (as the unfused model would store it)."""
  return (f64(x) + f64(residual)).astype(NP_DTYPES[dtype]).astype(np.float64)


def rms_norm_grads(x, weight, grad_out, eps, offset=0.0):
  """(dx, dweight) of sum(grad_out * rms_norm(x)).

  dx comes from each row's explicit Jacobian of the definition (a different route from
  the kernel's closed form) while rows are at most JACOBIAN_MAX_HIDDEN wide; wider rows
  (an H x H Jacobian would not fit) use the closed form, which `test_reference.py`
  checks against the Jacobian route and against finite differences.

  Also returns the magnitudes the two gradients are computed from (the largest term
  |g * scale * inv| of dx, the largest column sum of |g * x * inv| of dweight): a
  gradient that cancels to ~0 is judged against those, not against its own size.
  """
  x, w, g = f64(x), f64(weight), f64(grad_out)
  hidden = x.shape[-1]
  x2, g2 = x.reshape(-1, hidden), g.reshape(-1, hidden)
  scale = offset + w
  inv = 1.0 / np.sqrt(np.mean(x2 * x2, axis=-1, keepdims=True) + eps)
  if hidden <= JACOBIAN_MAX_HIDDEN:
    dx = np.empty_like(x2)
    for r in range(x2.shape[0]):
      # J[j, k] = d y_j / d x_k = scale_j * (inv * delta_jk - x_j * x_k * inv^3 / hidden)
      jac = scale[:, None] * (inv[r] * np.eye(hidden)
                              - np.outer(x2[r], x2[r]) * inv[r] ** 3 / hidden)
      dx[r] = g2[r] @ jac
  else:
    dx = rms_norm_dx_closed_form(x2, w, g2, eps, offset)
  dweight = np.sum(g2 * x2 * inv, axis=0)
  dx_terms = float(np.max(np.abs(g2 * scale * inv), initial=0.0))
  dweight_terms = float(np.max(np.sum(np.abs(g2 * x2 * inv), axis=0), initial=0.0))
  return dx.reshape(x.shape), dweight, dx_terms, dweight_terms


JACOBIAN_MAX_HIDDEN = 1024


def rms_norm_dx_closed_form(x, weight, grad_out, eps, offset=0.0):
  """dx = inv * (g*s - x * inv^2 * mean(g*s*x)), s = offset + w: the chain rule, by hand."""
  x, w, g = f64(x), f64(weight), f64(grad_out)
  inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  gs = g * (offset + w)
  return inv * (gs - x * inv**2 * np.mean(gs * x, axis=-1, keepdims=True))


def assert_close(actual, expected, tolerance, what="", scale=None):
  """|actual - expected| <= atol * scale + rtol * |expected|, and every element finite.

  scale defaults to max|expected|; pass the magnitude of the terms a value is summed
  from where it may cancel.
  """
  actual, expected = f64(actual), f64(expected)
  assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
  assert np.isfinite(actual).all(), f"{what}: non-finite output (an unwritten element?)"
  if scale is None:
    scale = float(np.max(np.abs(expected), initial=0.0))
  scale = max(scale, 1e-30)
  bound = tolerance["atol"] * scale + tolerance["rtol"] * np.abs(expected)
  err = np.abs(actual - expected)
  worst = np.unravel_index(np.argmax(err - bound), err.shape) if err.size else None
  assert (err <= bound).all(), (
      f"{what}: max error {err.max():.3g} at {worst} exceeds bound "
      f"{bound[worst]:.3g} (scale {scale:.3g})")


# ----------------------------------------------------------------------------- grouped matmul
#
#   rows of group g = [start_g, end_g), start = cumsum(sizes) - sizes, clipped to m
#   z[r] = lhs[r] @ W_i * scale_i + bias_i        for r in global group offset + i
#   out[r] = epilogue(z[r]); rows of no local group are 0
#
# Tolerances, as |kernel - reference| <= atol * max|reference| + rtol * |reference|:
# float32: f32 accumulation over k (about sqrt(k) * 2^-24 of the terms' size) vs f64;
# bfloat16: products of bf16 inputs are exact in f32, so one rounding of the output
# (2^-8) dominates. Gradients: the kernel rounds dz to the input dtype before the
# backward matmuls (as every bf16 MoE backward does), one more 2^-8 per term.
RAGGED_TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "bfloat16": dict(rtol=8e-3, atol=4e-3),
}
RAGGED_GRAD_TOLERANCE = {
    "float32": dict(rtol=1e-4, atol=1e-4),
    "bfloat16": dict(rtol=3e-2, atol=2e-2),
}

_ERF = np.vectorize(math.erf)


def activation(name, x):
  """Activations from their definitions (float64)."""
  x = f64(x)
  if name in (None, "identity"):
    return x
  if name == "silu":
    return x / (1.0 + np.exp(-x))
  if name == "gelu_tanh":
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
  if name == "gelu":
    return 0.5 * x * (1.0 + _ERF(x / math.sqrt(2.0)))
  if name == "relu":
    return np.maximum(x, 0.0)
  if name == "relu2":
    return np.maximum(x, 0.0) ** 2
  raise ValueError(name)


def gated(name, gate, up, alpha=1.702, limit=7.0):
  gate, up = f64(gate), f64(up)
  if name == "gpt_oss":  # transformers' GptOssExperts._apply_gate
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    return (up + 1.0) * gate / (1.0 + np.exp(-gate * alpha))
  if name == "clamped_silu":  # transformers' DeepseekV4Experts._apply_gate (act_fn silu)
    return activation("silu", np.minimum(gate, limit)) * np.clip(up, -limit, limit)
  return activation(name, gate) * up


def local_row_groups(group_sizes, group_offset, num_local, m):
  """Local group of each row (num_local for rows of no local group)."""
  sizes = np.asarray(group_sizes, np.int64)
  ends = np.minimum(np.cumsum(sizes), m)
  starts = np.minimum(np.cumsum(sizes) - sizes, m)
  ids = np.full(m, num_local, np.int64)
  for i in range(num_local):
    g = group_offset + i
    ids[starts[g]:ends[g]] = i
  return ids


def _weights(rhs, scale, transpose_rhs):
  w = f64(rhs)
  if transpose_rhs:
    w = np.swapaxes(w, 1, 2)
  if scale is not None:
    w = w * f64(scale)[:, None, :]
  return w   # (G_local, k, n)


def quantize_rows_int8(x):
  """Symmetric per-row int8 quantization, from its definition (ragged_dot's lhs_quant):
  scale = max|row| / 127 in float32 (1 for a zero row), codes = x / scale in float32
  (IEEE division, as XLA's on CPU) rounded half to even. Returns (codes float64 [m, k],
  scale float64 [m, 1]): the dequantized lhs is codes * scale."""
  x32 = np.asarray(x, np.float32)
  amax = np.abs(x32).max(axis=1, keepdims=True)
  scale = np.where(amax > 0, amax / np.float32(127), np.float32(1)).astype(np.float32)
  codes = np.clip(np.rint(x32 / scale), -127, 127)
  return codes.astype(np.float64), scale.astype(np.float64)


def ragged_pre_activation(lhs, rhs, group_sizes, group_offset=0, transpose_rhs=False,
                          scale=None, bias=None):
  """z (m, n) in float64, zeros for rows of no local group; also the row groups."""
  x = f64(lhs)
  w = _weights(rhs, scale, transpose_rhs)
  ids = local_row_groups(group_sizes, group_offset, w.shape[0], x.shape[0])
  z = np.zeros((x.shape[0], w.shape[2]))
  for r in range(x.shape[0]):
    if ids[r] < w.shape[0]:
      z[r] = x[r] @ w[ids[r]] + (0.0 if bias is None else f64(bias)[ids[r]])
  return z, ids


def split_columns(z, layout):
  half = z.shape[-1] // 2
  if layout == "interleaved":
    return z[..., 0::2], z[..., 1::2]
  return z[..., :half], z[..., half:]


def ragged_dot(lhs, rhs, group_sizes, group_offset=0, transpose_rhs=False, scale=None,
               bias=None, activation_name=None, gated_name=None, layout="concatenated",
               alpha=1.702, limit=7.0):
  """The grouped matmul and its epilogue, float64."""
  z, ids = ragged_pre_activation(lhs, rhs, group_sizes, group_offset, transpose_rhs,
                                 scale, bias)
  if gated_name is not None:
    out = gated(gated_name, *split_columns(z, layout), alpha, limit)
  else:
    out = activation(activation_name, z)
  out[ids >= np.asarray(rhs).shape[0]] = 0.0
  return out


def ragged_dot_grads(lhs, rhs, group_sizes, grad_out, group_offset=0, transpose_rhs=False,
                     scale=None, bias=None, activation_name=None, gated_name=None,
                     layout="concatenated", alpha=1.702, limit=7.0):
  """(d_lhs, d_rhs, d_bias) of sum(grad_out * ragged_dot(...)).

  The epilogue's elementwise derivative comes from float64 central differences (not
  from a hand-derived formula, nor from the kernel's autodiff); the matrix chain rule
  is written out per row.
  """
  z, ids = ragged_pre_activation(lhs, rhs, group_sizes, group_offset, transpose_rhs,
                                 scale, bias)
  g = f64(grad_out)
  h = 1e-6
  if gated_name is not None:
    zg, zu = split_columns(z, layout)
    f = lambda a, b: gated(gated_name, a, b, alpha, limit)
    dg = g * (f(zg + h, zu) - f(zg - h, zu)) / (2 * h)
    du = g * (f(zg, zu + h) - f(zg, zu - h)) / (2 * h)
    dz = np.empty_like(z)
    if layout == "interleaved":
      dz[:, 0::2], dz[:, 1::2] = dg, du
    else:
      dz[:, : zg.shape[1]], dz[:, zg.shape[1]:] = dg, du
  else:
    f = lambda a: activation(activation_name, a)
    dz = g * (f(z + h) - f(z - h)) / (2 * h)
  w = _weights(rhs, scale, transpose_rhs)
  num_local = w.shape[0]
  x = f64(lhs)
  d_lhs = np.zeros_like(x)
  d_w = np.zeros((num_local, x.shape[1], z.shape[1]))
  d_bias = np.zeros((num_local, z.shape[1]))
  for r in range(x.shape[0]):
    i = ids[r]
    if i < num_local:
      d_lhs[r] = w[i] @ dz[r]
      d_w[i] += np.outer(x[r], dz[r])
      d_bias[i] += dz[r]
  if transpose_rhs:
    d_w = np.swapaxes(d_w, 1, 2)
  return d_lhs, d_w, d_bias


# ----------------------------------------------------------------------------- attention
#
# For batch b, query head h (KV head h // G, G = Hq / Hkv), query row i at position
# p_i = q_offset + i and key j at position j:
#
#   u[i, j] = sm_scale * q[i] . k[j]                      (sm_scale = 1 / sqrt(D) by default)
#   t[i, j] = soft_cap * tanh(u[i, j] / soft_cap)         (t = u without soft_cap)
#   visible(i, j) = (not causal or j <= p_i) and (window is None or p_i - j < window)
#                   and (no segment ids or q_seg[i] == kv_seg[j])
#   lse[i] = log(exp(sink[h]) + sum_{visible j} exp(t[i, j]))   (no sink term without sinks)
#   P[i, j] = exp(t[i, j] - lse[i]) on visible keys, else 0;  P_sink[i] = exp(sink[h] - lse[i])
#   out[i] = sum_j P[i, j] v[j]
#
# A row with no visible key: out = 0, lse = -inf (lse = sink[h] with sinks).
#
# Tolerances, as |kernel - reference| <= atol * max|reference| + rtol * |reference|, for
# inputs of unit scale (logits O(1..30)). The reference sees exactly the kernel's inputs
# (bf16 values widened to f64), so input rounding is no error.
# float32: the kernel's f32 math against f64. A logit is a D-term f32 dot product: its
#   error is a few 2^-24 (~6e-8) of scale * sum_d |q_d k_d| (<= ~10 at D = 256), i.e.
#   ~1e-6 absolute; it moves each P[i, j] by that much relatively, and the online
#   softmax's rescaling and the PV sum over up to ~300 keys add a few more 2^-24 each.
#   1e-6 of sum_j P |v| (~|v| ~ 1..4) is ~1e-6 of max|out| (>~0.2 for unit-normal v):
#   2e-5 leaves ~10x margin over that worst case, and is still far below what any
#   masking mistake gives (a wrong key moves a row by ~P * |v| >> 1e-3).
# bfloat16: bf16 inputs, f32 logits (products of bf16 numbers are exact in f32) and
#   f32 softmax statistics; P is rounded to bf16 (relative error <= 2^-8) before the PV
#   matmul (as this kernel and most flash kernels do; jax's splash attention keeps P in
#   f32 there), and out is rounded to bf16 (<= 2^-8 of |out|).
#   The P roundings move out[i] by <= 2^-8 * sum_j P |v| (if they all add up; they
#   mostly cancel), and sum_j P |v| <= ~4x max|out| for unit-normal v (a row spreading
#   over many keys is smaller than its terms): atol 1.6e-2 (= 4 * 2^-8) covers that
#   worst case; rtol 8e-3 (= 2 * 2^-8) covers the output's own rounding with one ulp of
#   slack for the f32 normalisation before it.
# lse is float32 in both cases and computed from f32 logits (never rounded to bf16):
#   its error is the logits' absolute error (~1e-6, lse is 1-Lipschitz in the logits)
#   plus a few 2^-24 of |lse|. Judge it with scale = max(max|lse|, 1), since logit
#   errors are absolute in logit units (O(1) for these inputs), not relative to lse.
ATTENTION_TOLERANCE = {
    "float32": dict(rtol=2e-5, atol=2e-5),
    "bfloat16": dict(rtol=8e-3, atol=1.6e-2),
}
ATTENTION_LSE_TOLERANCE = {
    "float32": dict(rtol=1e-5, atol=1e-5),
    "bfloat16": dict(rtol=1e-5, atol=1e-5),
}
# Gradients (dq, dk, dv in the input dtype, dsinks float32), each judged against the
# magnitude `attention_grad_scales` gives: max(max|gradient|, the size of the error that
# D = rowsum(dO * O) brings when computed from a rounded O; that error is the same for
# all keys of a row, so it survives the cancellation in dP - D, e.g. on rows attending
# to one key, where the true dS is grad_lse alone).
# float32: two chained f32 matmuls after the softmax (dP = dO V^T, dS = P (dP - D),
#   dQ = dS K, dK = dS^T Q, dV = P^T dO), summing over up to ~300 keys or query rows
#   (times G heads for dK, dV): a few 2^-24 per step, grown by the sums' length.
#   1e-4 (~1700 ulps) covers that with wide margin and still catches any wrong term.
# bfloat16: the backward rounds P and dS to bf16 before its matmuls (2^-8 per term,
#   errors that mostly cancel over the sum), D carries O's rounding (2^-8 of the scale
#   above, plus the forward's P roundings through O) and dq, dk, dv are rounded at the
#   end (2^-8 of |gradient|): atol 1.6e-2 (4 * 2^-8), rtol 8e-3 (final rounding with
#   one ulp of slack). `test_reference.py` runs a NumPy model of exactly these roundings
#   (a blocked online-softmax forward, bf16 P and dS) and checks it lands within these
#   bounds (it uses ~1/5 of them), and that masking mistakes do not.
ATTENTION_GRAD_TOLERANCE = {
    "float32": dict(rtol=1e-4, atol=1e-4),
    "bfloat16": dict(rtol=8e-3, atol=1.6e-2),
}


def attention_segments(segment_ids, batch, q_len, kv_len):
  """(q_seg [B, Sq], kv_seg [B, Skv]) from None, one [B, S] array, or a pair."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    q_seg, kv_seg = segment_ids
  else:
    q_seg = kv_seg = segment_ids
  q_seg, kv_seg = np.asarray(q_seg), np.asarray(kv_seg)
  assert q_seg.shape == (batch, q_len) and kv_seg.shape == (batch, kv_len)
  return q_seg, kv_seg


def attention_visible(batch, q_len, kv_len, *, causal=False, sliding_window=None,
                      segment_ids=None, q_offset=0) -> np.ndarray:
  """visible(i, j) as a bool [B, Sq, Skv] array."""
  pos = int(q_offset) + np.arange(q_len)[:, None]
  key = np.arange(kv_len)[None, :]
  vis = np.ones((q_len, kv_len), bool)
  if causal:
    vis &= key <= pos
  if sliding_window is not None:
    vis &= pos - key < sliding_window
  vis = np.broadcast_to(vis, (batch, q_len, kv_len))
  q_seg, kv_seg = attention_segments(segment_ids, batch, q_len, kv_len)
  if q_seg is not None:
    vis = vis & (q_seg[:, :, None] == kv_seg[:, None, :])
  return vis


def _attention_parts(q, k, v, causal, sm_scale, sliding_window, soft_cap, segment_ids,
                     sinks, q_offset):
  q, k, v = f64(q), f64(k), f64(v)
  batch, num_q_heads, q_len, head_dim = q.shape
  group = num_q_heads // k.shape[1]
  k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # head h -> KV h // G
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
  u = scale * (q @ np.swapaxes(k, -1, -2))
  t = u if soft_cap is None else soft_cap * np.tanh(u / soft_cap)
  # The cap's slope dt / du = sech^2(u / soft_cap), as 1 / cosh^2: full relative precision
  # at every u (cosh overflows to inf past |x| ~ 710, where the slope is 0 in float64 too).
  # Never 1 - tanh^2, which cancels once tanh rounds to 1 (|x| ~ 19 in float64, ~ 9 in
  # float32): that would make the reference itself wrong where the cap saturates.
  slope = None
  if soft_cap is not None:
    with np.errstate(over="ignore"):
      slope = 1.0 / np.cosh(u / soft_cap) ** 2
  vis = attention_visible(batch, q_len, k.shape[2], causal=causal,
                          sliding_window=sliding_window, segment_ids=segment_ids,
                          q_offset=q_offset)[:, None]
  m = np.max(np.where(vis, t, -np.inf), axis=-1, initial=-np.inf)
  sink = None if sinks is None else f64(sinks)[None, :, None]
  if sink is not None:
    m = np.maximum(m, sink)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.exp(np.where(vis, t - m[..., None], -np.inf))
  denom = e.sum(-1) + (0.0 if sink is None else np.exp(sink - m))
  lse = np.where(denom > 0, m + np.log(np.where(denom > 0, denom, 1.0)), -np.inf)
  p = e / np.where(denom > 0, denom, 1.0)[..., None]
  p_sink = None if sink is None else np.exp(sink - lse)
  return dict(q=q, k=k, v=v, scale=scale, t=t, slope=slope, p=p, p_sink=p_sink, lse=lse,
              out=p @ v, group=group)


def attention(q, k, v, *, causal=False, sm_scale=None, sliding_window=None, soft_cap=None,
              segment_ids=None, sinks=None, q_offset=0):
  """(out [B, Hq, Sq, D], lse [B, Hq, Sq]), float64, from the definition above."""
  r = _attention_parts(q, k, v, causal, sm_scale, sliding_window, soft_cap, segment_ids,
                       sinks, q_offset)
  return r["out"], r["lse"]


def attention_grads(q, k, v, grad_out, *, causal=False, sm_scale=None, sliding_window=None,
                    soft_cap=None, segment_ids=None, sinks=None, q_offset=0, grad_lse=None):
  """Gradients of L = sum(grad_out * out) + sum(grad_lse * lse), by hand, float64.

  Per row i (dropping i), with the sink as an extra softmax entry that has no value:
  P_a = exp(t_a - lse) over a in {sink} + visible keys, so dP_a / dt_c = P_a (delta_ac -
  P_c) and dlse / dt_c = P_c. With dO = grad_out[i], dP_j = dO . v[j] (0 for the sink)
  and D = sum_j P_j dP_j = dO . out:
    dL/dt_c = sum_a dP_a P_a (delta_ac - P_c) + grad_lse P_c = P_c (dP_c - D + grad_lse)
  for keys (c = j), and P_sink (0 - D + grad_lse) for the sink. Then
    soft-cap: du = dt * sech^2(u / soft_cap)        (d/du c tanh(u / c); as 1 / cosh^2,
              which keeps its digits where the cap saturates)
    dq[i] = sm_scale * sum_j du[i, j] k[j]
    dk[j] = sm_scale * sum_{h in group, i} du[i, j] q[i]
    dv[j] = sum_{h in group, i} P[i, j] dO[i]
    dsinks[h] = -sum_{b, i} P_sink[i] (D[i] - grad_lse[i])
  `test_reference.py` checks these against an explicit Jacobian and finite differences.
  Returns dict(dq, dk, dv, dsinks) (dsinks None without sinks).
  """
  r = _attention_parts(q, k, v, causal, sm_scale, sliding_window, soft_cap, segment_ids,
                       sinks, q_offset)
  g = f64(grad_out)
  gl = 0.0 if grad_lse is None else f64(grad_lse)[..., None]
  p = r["p"]
  dp = g @ np.swapaxes(r["v"], -1, -2)
  d_row = np.sum(p * dp, axis=-1, keepdims=True)
  dt = p * (dp - d_row + gl)
  du = dt if soft_cap is None else dt * r["slope"]
  dq = r["scale"] * (du @ r["k"])
  dk = r["scale"] * (np.swapaxes(du, -1, -2) @ r["q"])
  dv = np.swapaxes(p, -1, -2) @ g
  batch, num_q_heads, kv_len, _ = dk.shape        # dv's head_dim may differ from dk's
  fold = lambda a: a.reshape(batch, num_q_heads // r["group"], r["group"], kv_len,
                             a.shape[-1]).sum(axis=2)
  dsinks = None
  if sinks is not None:
    dsinks = -np.sum(r["p_sink"][..., None] * (d_row - gl), axis=(0, 2, 3))
  return dict(dq=dq, dk=fold(dk), dv=fold(dv), dsinks=dsinks)


def attention_grad_scales(q, k, v, grad_out, *, causal=False, sm_scale=None,
                          sliding_window=None, soft_cap=None, segment_ids=None, sinks=None,
                          q_offset=0, grad_lse=None):
  """The magnitude each gradient is judged against: max(max|gradient|, the size of the
  error that computing D = rowsum(dO * O) from a rounded O brings).

  Every flash backward computes D[i] from the stored output (bf16 for bf16 inputs):
  its error, up to 2^-8 * sum_d |dO[i, d] O[i, d]|, is the same for every key of the
  row, so it does not cancel when the true dS = P (dP - D + grad_lse) does (a row
  attending to one key has dP_j = D exactly: dS is then grad_lse alone while dP and D
  are ~|dO| |v|). That error reaches, through the soft cap's slope c[i, j] =
  sech^2(u[i, j] / soft_cap) (1 without a cap),
    dq[i, d] as sm_scale * Dabs[i] * sum_j P[i, j] c[i, j] |k[j, d]|,
    dk[j, d] as sm_scale * sum_{h in group, i} P[i, j] c[i, j] Dabs[i] |q[i, d]|,
    dsinks[h] as sum_{b, i} P_sink[i] Dabs[i]       (Dabs[i] = sum_d |dO[i, d] O[i, d]|),
  so a gradient is judged against the larger of its own size and that. dv does not
  involve D: its magnitude is max|dv|. Without the slope the reach would be 1e6x max|dq|
  where unscaled logits saturate the cap (uniform [0, 1) inputs, sm_scale 1, cap 5:
  issue 61), and no error of the cap's derivative could fail the comparison.
  """
  r = _attention_parts(q, k, v, causal, sm_scale, sliding_window, soft_cap, segment_ids,
                       sinks, q_offset)
  grads = attention_grads(q, k, v, grad_out, causal=causal, sm_scale=sm_scale,
                          sliding_window=sliding_window, soft_cap=soft_cap,
                          segment_ids=segment_ids, sinks=sinks, q_offset=q_offset,
                          grad_lse=grad_lse)
  d_abs = np.sum(np.abs(f64(grad_out) * r["out"]), axis=-1)                 # [B, Hq, Sq]
  p = r["p"] if r["slope"] is None else r["p"] * r["slope"]
  d_dq = r["scale"] * d_abs[..., None] * (p @ np.abs(r["k"]))
  d_dk = r["scale"] * (np.swapaxes(p * d_abs[..., None], -1, -2) @ np.abs(r["q"]))
  batch, num_q_heads, kv_len, head_dim = d_dk.shape
  d_dk = d_dk.reshape(batch, num_q_heads // r["group"], r["group"], kv_len,
                      head_dim).sum(axis=2)
  top = lambda a: float(np.max(np.abs(a), initial=0.0))
  scales = dict(dq=max(top(grads["dq"]), top(d_dq)), dk=max(top(grads["dk"]), top(d_dk)),
                dv=top(grads["dv"]), dsinks=None)
  if sinks is not None:
    scales["dsinks"] = max(top(grads["dsinks"]),
                           top(np.sum(r["p_sink"] * d_abs, axis=(0, 2))))
  return scales


def attention_mismatches(dtype, q, k, v, out, lse=None, grads=None, *, grad_out=None,
                         grad_lse=None, **options) -> dict:
  """{quantity: message} for every result outside its tolerance (empty when all agree).

  out / lse: the kernel's forward; grads: dict(dq, dk, dv[, dsinks]) of
  sum(grad_out * out) + sum(grad_lse * lse). lse must be -inf exactly where the
  reference's is; its finite entries are judged with scale max(max|lse|, 1) (see the
  tolerances above); each gradient against `attention_grad_scales`.
  """
  failures = {}

  def check(name, *args, **kwargs):
    try:
      assert_close(*args, what=name, **kwargs)
    except AssertionError as e:
      failures[name] = str(e)

  want_out, want_lse = attention(q, k, v, **options)
  check("out", out, want_out, ATTENTION_TOLERANCE[dtype])
  if lse is not None:
    lse = f64(lse)
    if lse.shape != want_lse.shape or (np.isneginf(lse) != np.isneginf(want_lse)).any():
      failures["lse"] = "lse: -inf (fully masked rows) in different places"
    else:
      fin = np.isfinite(want_lse)   # -inf rows agree: compare them as 0 (keeps indices)
      check("lse", np.where(fin, lse, 0.0), np.where(fin, want_lse, 0.0),
            ATTENTION_LSE_TOLERANCE[dtype],
            scale=max(float(np.max(np.abs(want_lse[fin]), initial=0.0)), 1.0))
  if grads is not None:
    want = attention_grads(q, k, v, grad_out, grad_lse=grad_lse, **options)
    scales = attention_grad_scales(q, k, v, grad_out, grad_lse=grad_lse, **options)
    for name in ("dq", "dk", "dv", "dsinks"):
      if want[name] is not None:
        check(name, grads[name], want[name], ATTENTION_GRAD_TOLERANCE[dtype],
              scale=scales[name])
  return failures


# ----------------------------------------------------------------------------- paged attention
#
# Ragged paged attention (the definition in the kernel's API contract). Sequence s owns
# the query tokens q[cu_q_lens[s]:cu_q_lens[s+1]] (q_len[s] of them) and kv_lens[s] KV
# tokens; its queries are the LAST q_len[s] of those, so query i of s is at position
#   p = kv_lens[s] - q_len[s] + i.
# KV token j of s lives at k_pages[page_indices[s, j // page_size], h, j % page_size] (the
# same for v); only the first ceil(kv_lens[s] / page_size) entries of a page-table row are
# used, and cache slots past kv_lens[s] are never read. For query head h (KV head h // G,
# G = Hq / Hkv):
#   visible(p, j) = j <= p and (window is None or p - j < window)
#   t[j] = cap(sm_scale * q . k_real[j]),  k_real = k (float cache) or k * k_scale[h_kv]
#   out = sum_{visible j} exp(t[j] - lse) v_real[j],
#   lse = log(exp(sinks[h]) + sum_{visible j} exp(t[j]))      (no sink term without sinks)
# Query tokens at or past cu_q_lens[-1] (padding) give 0. Every query sees at least its own
# position, so no row is empty.
#
# Tolerances, keyed by q's dtype, as |kernel - reference| <= atol * max|reference| +
# rtol * |reference| (`assert_close`). The kernel's math per query row is flash
# attention's (f32 logits and online-softmax statistics, P rounded to q's dtype before the
# PV matmul, out rounded to q's dtype), so the error analysis of ATTENTION_TOLERANCE applies
# unchanged: the paging only decides which keys a row sees, and a wrong key or page moves a
# row by ~P * |v|, far outside these bounds. A quantized cache (int8 / float8_e4m3fn) is
# compared against this reference on the DEQUANTIZED cache (int8 / e4m3 values, exact in
# float64, times the scale in float64), so quantization error is no part of the
# comparison and q's dtype sets the tolerance:
# int8 and e4m3 values are exact in bf16 and f32, so a kernel that converts them into q's
# dtype and applies the scales to its f32 logits and output (as ours does) adds only f32
# roundings. One that multiplies the scale into the K/V it feeds the matmuls instead adds
# one rounding of each element (float32 q: 2^-24, far below the f32 bound's ~1e-6 budget
# per logit; bfloat16 q: <= 2^-9 relative unless the scale is a power of two, the size of
# the P roundings the bf16 bound already budgets: it moves out by <= 2^-9 * sum_j P |v|
# and each logit by a few 2^-9 of its own terms, errors that mostly cancel).
# `test_reference.py` checks that a NumPy model of that worse case (bf16 K/V, f32 logits,
# blocked online softmax, bf16 P and out) uses ~1/5 of the bf16 bound, and that a causal
# mask one key off lands 30-60x outside it.
PAGED_TOLERANCE = {
    "float32": dict(ATTENTION_TOLERANCE["float32"]),
    "bfloat16": dict(ATTENTION_TOLERANCE["bfloat16"]),
}

QUANTIZED_KV_DTYPES = ("int8", "float8_e4m3fn")
FP8_E4M3_MAX = 448.0
INT8_MAX = 127


def _kv_dtype_name(pages) -> str:
  return np.dtype(np.asarray(pages).dtype).name


def _per_kv_head(scale, num_kv_heads) -> np.ndarray:
  """A python float, 0-d or [Hkv] scale as a float64 [Hkv] array."""
  scale = f64(scale)
  if scale.ndim == 0:
    return np.full(num_kv_heads, float(scale))
  assert scale.shape == (num_kv_heads,), scale.shape
  return scale


def dequantize_tokens(tokens, scale) -> np.ndarray:
  """tokens [Hkv, n, D] of the cache's dtype -> float64, times the per-KV-head scale
  for int8 / float8_e4m3fn caches (exact: every int8 / e4m3 value is a float64)."""
  name = _kv_dtype_name(tokens)
  values = np.asarray(tokens).astype(np.float64)
  if name in QUANTIZED_KV_DTYPES:
    assert scale is not None, f"a {name} cache needs a scale"
    return values * _per_kv_head(scale, values.shape[0])[:, None, None]
  assert scale is None, f"scale given with a {name} cache"
  return values


def gather_kv(pages, page_row, kv_len, page_size) -> np.ndarray:
  """The first kv_len tokens of one sequence, [Hkv, kv_len, D] of the cache's dtype,
  read token by token from the pages its page-table row names (unused entries of the
  row are never looked at)."""
  pages = np.asarray(pages)                       # [num_pages, Hkv, page_size, D]
  num_pages = pages.shape[0]
  out = np.empty((pages.shape[1], kv_len, pages.shape[3]), pages.dtype)
  for j in range(kv_len):
    page = int(page_row[j // page_size])
    assert 0 <= page < num_pages, f"used page id {page} out of range"
    out[:, j] = pages[page, :, j % page_size]
  return out


def paged_visible(q_len, kv_len, sliding_window=None) -> np.ndarray:
  """visible(p, j) for the q_len queries of one sequence, bool [q_len, kv_len]."""
  pos = kv_len - q_len + np.arange(q_len)[:, None]
  key = np.arange(kv_len)[None, :]
  vis = key <= pos
  if sliding_window is not None:
    vis &= pos - key < sliding_window
  return vis


def paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, sinks=None, k_scale=None,
                    v_scale=None) -> np.ndarray:
  """out [T, Hq, D] float64 from the definition above, one sequence at a time."""
  q = f64(q)
  num_tokens, num_q_heads, head_dim = q.shape
  _, num_kv_heads, page_size, _ = np.asarray(k_pages).shape
  assert num_q_heads % num_kv_heads == 0
  group = num_q_heads // num_kv_heads
  kv_lens = np.asarray(kv_lens, np.int64)
  cu = np.asarray(cu_q_lens, np.int64)
  page_indices = np.asarray(page_indices, np.int64)
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
  sink = None if sinks is None else f64(sinks)
  out = np.zeros((num_tokens, num_q_heads, head_dim))
  for s in range(len(kv_lens)):
    start, end = int(cu[s]), int(cu[s + 1])
    q_len, kv_len = end - start, int(kv_lens[s])
    assert 0 <= q_len <= kv_len and end <= num_tokens, (s, q_len, kv_len)
    if q_len == 0:
      continue
    k = dequantize_tokens(gather_kv(k_pages, page_indices[s], kv_len, page_size), k_scale)
    v = dequantize_tokens(gather_kv(v_pages, page_indices[s], kv_len, page_size), v_scale)
    vis = paged_visible(q_len, kv_len, sliding_window)
    for h in range(num_q_heads):
      kv_head = h // group
      t = scale * (q[start:end, h] @ k[kv_head].T)                  # [q_len, kv_len]
      if soft_cap is not None:
        t = soft_cap * np.tanh(t / soft_cap)
      t = np.where(vis, t, -np.inf)
      m = t.max(axis=-1)                  # finite: a query always sees its own position
      if sink is not None:
        m = np.maximum(m, sink[h])
      e = np.exp(t - m[:, None])
      denom = e.sum(-1) + (0.0 if sink is None else np.exp(sink[h] - m))
      out[start:end, h] = (e / denom[:, None]) @ v[kv_head]
  return out


def quantize_kv(x, scale, dtype_name) -> np.ndarray:
  """[..., Hkv, D] new tokens -> the cache's int8 / float8_e4m3fn values:
  int8: clip(round(x / scale), -127, 127) (round half to even); fp8: clip(x / scale,
  -448, 448) cast to e4m3fn (round to nearest even). x / scale is an f32 division (x in
  f32 or bf16, the scale as f32), as the contract's kernel computes it."""
  x = np.asarray(x).astype(np.float32)
  scale = _per_kv_head(scale, x.shape[-2]).astype(np.float32)[:, None]
  y = x / scale
  if dtype_name == "int8":
    return np.clip(np.round(y), -INT8_MAX, INT8_MAX).astype(np.int8)
  if dtype_name == "float8_e4m3fn":
    return np.clip(y, -FP8_E4M3_MAX, FP8_E4M3_MAX).astype(ml_dtypes.float8_e4m3fn)
  raise ValueError(dtype_name)


def write_kv_cache(k_pages, v_pages, new_k, new_v, slot_mapping, *, k_scale=None,
                   v_scale=None):
  """(k_pages, v_pages) after writing token t's K/V [Hkv, D] to slot slot_mapping[t]
  (page slot // page_size, offset slot % page_size) of every head; tokens with a negative
  slot are skipped. New NumPy arrays in the cache's dtype; the inputs are not changed."""
  k_pages, v_pages = np.array(k_pages), np.array(v_pages)
  page_size = k_pages.shape[2]
  name = _kv_dtype_name(k_pages)
  for pages, new, scale in ((k_pages, new_k, k_scale), (v_pages, new_v, v_scale)):
    new = np.asarray(new)
    if name in QUANTIZED_KV_DTYPES:
      values = quantize_kv(new, scale, name)
    else:
      assert scale is None and new.dtype == pages.dtype, (new.dtype, pages.dtype)
      values = new
    for t, slot in enumerate(np.asarray(slot_mapping, np.int64)):
      if slot < 0:
        continue
      assert slot < pages.shape[0] * page_size, f"slot {slot} out of range"
      pages[slot // page_size, :, slot % page_size] = values[t]
  return k_pages, v_pages
