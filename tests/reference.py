"""Independent float64 NumPy references, written from the definitions (no kernel code).

    rms_norm(x)[r, j] = x[r, j] / sqrt(mean_k x[r, k]^2 + eps) * (offset + w[j])

Gradients come from the explicit per-row Jacobian of that definition, a different
route from the closed form the kernel uses.
"""

from __future__ import annotations

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
