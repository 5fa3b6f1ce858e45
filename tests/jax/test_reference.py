"""The references themselves: the two gradient routes agree, and match finite differences."""

import numpy as np
import pytest

import reference as ref


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("hidden", [1, 7, 64])
def test_gradient_routes_agree_with_finite_differences(hidden, offset):
  rng = np.random.default_rng(hidden)
  x, w, g = rng.standard_normal((3, hidden)), rng.standard_normal(hidden), rng.standard_normal((3, hidden))
  eps = 1e-3
  dx, dw, _, _ = ref.rms_norm_grads(x, w, g, eps, offset)
  np.testing.assert_allclose(ref.rms_norm_dx_closed_form(x, w, g, eps, offset), dx,
                             rtol=1e-10, atol=1e-12)

  def loss(x_, w_):
    return float(np.sum(g * ref.rms_norm(x_, w_, eps, offset)))

  h = 1e-6
  for r, j in [(0, 0), (2, hidden - 1), (1, hidden // 2)]:
    e = np.zeros_like(x)
    e[r, j] = h
    np.testing.assert_allclose((loss(x + e, w) - loss(x - e, w)) / (2 * h), dx[r, j],
                               rtol=1e-5, atol=1e-7)
  for j in {0, hidden - 1}:
    e = np.zeros_like(w)
    e[j] = h
    np.testing.assert_allclose((loss(x, w + e) - loss(x, w - e)) / (2 * h), dw[j],
                               rtol=1e-5, atol=1e-7)


def test_forward_definition():
  x = np.array([[3.0, 4.0]])  # mean square 12.5
  out = ref.rms_norm(x, np.array([1.0, 2.0]), eps=0.0)
  np.testing.assert_allclose(out, [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]])
  np.testing.assert_allclose(ref.rms_norm(x, np.array([0.0, 1.0]), 0.0, offset=1.0),
                             [[3 / np.sqrt(12.5), 8 / np.sqrt(12.5)]])
