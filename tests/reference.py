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
