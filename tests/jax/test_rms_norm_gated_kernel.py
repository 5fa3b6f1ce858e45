"""Gated RMSNorm Pallas kernels (Transformers' `RMSNormGated`) in interpret mode against the
float64 reference of tests/reference_linear.py (JAX only).

Tolerances: the RMSNorm's `reference.TOLERANCE` / `GRAD_TOLERANCE`, keyed by x's dtype
(the output's): one rounding of the output after f32 math (forward), a row sum (dx) or a
column sum (dweight) before one rounding (backward). The reference rounds norm(x) and
w * norm(x) as the definition does, so the kernel's only extra error is f32 arithmetic and a
possible 1-ulp neighbour choice at those roundings (reference_linear's docstring). Interpret
mode leaves unwritten output as NaN, which `assert_close` catches.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference as ref
import reference_linear as rl
from tpu_kernels import chips, rms_norm as K, vmem

DTYPES = ["float32", "bfloat16"]
# Head dims: lane-aligned and not; 128 is Qwen3.5 / Qwen3-Next / Kimi's value head dim.
HIDDEN = [1, 3, 8, 100, 128, 200, 256]


@st.composite
def problems(draw, max_rows=70):
  lead = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
  rows = int(np.prod(lead)) if lead else 1
  if rows > max_rows:
    lead = [max_rows]
  return dict(shape=(*lead, draw(st.sampled_from(HIDDEN))),
              x_dtype=draw(st.sampled_from(DTYPES)), gate_dtype=draw(st.sampled_from(DTYPES)),
              w_dtype=draw(st.sampled_from(DTYPES)),
              activation=draw(st.sampled_from(K.GATE_ACTIVATIONS)),
              norm_in_input_dtype=draw(st.booleans()),
              block_rows=draw(st.sampled_from([None, 16, 32])),
              eps=draw(st.sampled_from([1e-6, 1e-5, 0.1])), seed=draw(st.integers(0, 2**31 - 1)))


def _arrays(p):
  rng = np.random.default_rng(p["seed"])
  shape = p["shape"]
  x = rng.standard_normal(shape).astype(ref.NP_DTYPES[p["x_dtype"]])
  gate = (2 * rng.standard_normal(shape)).astype(ref.NP_DTYPES[p["gate_dtype"]])
  w = (1 + 0.5 * rng.standard_normal(shape[-1:])).astype(ref.NP_DTYPES[p["w_dtype"]])
  dy = rng.standard_normal(shape).astype(ref.NP_DTYPES[p["x_dtype"]])
  return [jnp.asarray(a) for a in (x, gate, w, dy)]


_STATIC = ("eps", "activation", "norm_in_input_dtype", "block_rows")


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated(x, gate, w, **static):
  return K.rms_norm_gated(x, gate, w, interpret=True, **static)


@functools.partial(jax.jit, static_argnames=_STATIC)
def gated_vjp(x, gate, w, dy, **static):
  return jax.vjp(functools.partial(gated, **static), x, gate, w)[1](dy)


def _static(p):
  return {k: p[k] for k in _STATIC}


@given(problems())
def test_forward_matches_reference(p):
  x, gate, w, _ = _arrays(p)
  out = gated(x, gate, w, **_static(p))
  assert out.shape == x.shape and out.dtype == x.dtype
  expected, scale = rl.rms_norm_gated(x, gate, w, p["eps"], p["activation"],
                                      p["norm_in_input_dtype"])
  ref.assert_close(out, expected, ref.TOLERANCE[p["x_dtype"]], "out", scale)


@given(problems(max_rows=24))
def test_gradients_match_reference(p):
  x, gate, w, dy = _arrays(p)
  dx, dgate, dw = gated_vjp(x, gate, w, dy, **_static(p))
  assert (dx.dtype, dgate.dtype, dw.dtype) == (x.dtype, gate.dtype, w.dtype)
  rdx, rdgate, rdw, scales = rl.rms_norm_gated_grads(x, gate, w, dy, p["eps"], p["activation"])
  ref.assert_close(dx, rdx, ref.GRAD_TOLERANCE[p["x_dtype"]], "dx", scales["dx"])
  ref.assert_close(dgate, rdgate, ref.GRAD_TOLERANCE[rl.coarsest(p["gate_dtype"], p["x_dtype"])],
                   "dgate", scales["dgate"])
  ref.assert_close(dw, rdw, ref.GRAD_TOLERANCE[rl.coarsest(p["w_dtype"], p["x_dtype"])],
                   "dweight", scales["dweight"])


def test_transformers_roundings_are_kept():
  """bf16, norm_in_input_dtype: the kernel equals the float64 definition with Transformers'
  roundings to within one bf16 ulp of the output, and differs from the all-f32 variant."""
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
  gate = jnp.asarray(rng.standard_normal((64, 128)), jnp.bfloat16)
  w = jnp.asarray(1 + 0.3 * rng.standard_normal(128), jnp.bfloat16)
  rounded = gated(x, gate, w, eps=1e-6, activation="silu", norm_in_input_dtype=True,
                  block_rows=None)
  strict = gated(x, gate, w, eps=1e-6, activation="silu", norm_in_input_dtype=False,
                 block_rows=None)
  expected, _ = rl.rms_norm_gated(x, gate, w, 1e-6, "silu", True)
  err = np.abs(ref.f64(rounded) - expected)
  assert (err <= 2.0**-8 * np.abs(expected) + 1e-30).all(), err.max()
  assert not np.array_equal(np.asarray(rounded), np.asarray(strict))


@pytest.mark.parametrize("norm_in_input_dtype", [True, False])
def test_plain_xla_baseline_matches_reference(norm_in_input_dtype):
  """rms_norm_gated_reference (the benchmarks' XLA baseline) computes the same norm."""
  p = dict(shape=(20, 128), x_dtype="bfloat16", gate_dtype="bfloat16", w_dtype="float32",
           seed=8)
  x, gate, w, _ = _arrays(p)
  expected, scale = rl.rms_norm_gated(x, gate, w, 1e-6, "sigmoid", norm_in_input_dtype)
  out = K.rms_norm_gated_reference(x, gate, w, activation="sigmoid",
                                   norm_in_input_dtype=norm_in_input_dtype)
  ref.assert_close(out, expected, ref.TOLERANCE["bfloat16"], "baseline", scale)


def test_reference_gradients_match_finite_differences():
  """The reference's Jacobian gradients against central differences of its forward (f64)."""
  rng = np.random.default_rng(2)
  x, gate = rng.standard_normal((3, 6)), rng.standard_normal((3, 6))
  w, dy = rng.standard_normal(6), rng.standard_normal((3, 6))
  for act in K.GATE_ACTIVATIONS:
    grads = rl.rms_norm_gated_grads(x, gate, w, dy, 1e-3, act)[:3]

    def loss(x_, g_, w_):
      return float(np.sum(dy * rl.rms_norm_gated(x_, g_, w_, 1e-3, act, False)[0]))

    args = [x, gate, w]
    for which, grad in enumerate(grads):
      numeric = np.zeros_like(args[which])
      for idx in np.ndindex(numeric.shape):
        plus = [a.copy() for a in args]
        minus = [a.copy() for a in args]
        plus[which][idx] += 1e-6
        minus[which][idx] -= 1e-6
        numeric[idx] = (loss(*plus) - loss(*minus)) / 2e-6
      np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=f"{act} {which}")


def test_garbage_in_partial_block_does_not_reach_weight_gradient():
  rng = np.random.default_rng(3)
  x, gate, dy = (jnp.asarray(rng.standard_normal((37, 128)), jnp.float32) for _ in range(3))
  w = jnp.asarray(rng.standard_normal(128), jnp.float32)
  config = K.RmsNormGatedConfig(block_rows=8, interpret=True)
  dx, dgate, dw = K.rms_norm_gated_backward(x, gate, w, dy, config=config)
  rdx, rdgate, rdw, scales = rl.rms_norm_gated_grads(x, gate, w, dy, 1e-6)
  tol = ref.GRAD_TOLERANCE["float32"]
  ref.assert_close(dx, rdx, tol, "dx", scales["dx"])
  ref.assert_close(dgate, rdgate, tol, "dgate", scales["dgate"])
  ref.assert_close(dw, rdw, tol, "dweight", scales["dweight"])


def test_zero_rows_and_zero_input():
  w = jnp.ones(128, jnp.bfloat16)
  x = jnp.zeros((0, 3, 128), jnp.bfloat16)
  assert K.rms_norm_gated(x, x, w, interpret=True).shape == (0, 3, 128)
  zeros = jnp.zeros((4, 128), jnp.float32)
  out = K.rms_norm_gated(zeros, jnp.ones((4, 128)), jnp.ones(128), interpret=True)
  assert np.array_equal(np.asarray(out), np.zeros((4, 128)))


@pytest.mark.parametrize("kwargs, error, exc", [
    (dict(eps=float("nan")), "eps must be finite", ValueError),
    (dict(activation="gelu"), "activation must be one of", ValueError),
    (dict(chip="v9"), "unknown TPU chip", ValueError),
    (dict(block_rows=0), "block_rows must be positive", ValueError),
    (dict(block_rows=12), "must be a multiple of 8", ValueError),
    (dict(vmem_limit_bytes=10**9), "exceeds what v6e allows", ValueError),
    (dict(x=jnp.ones((40, 128), jnp.float16)), "x must be float32 or bfloat16", TypeError),
    (dict(gate=jnp.ones((40, 128), jnp.int32)), "gate must be float32 or bfloat16", TypeError),
    (dict(gate=jnp.ones((40, 64))), r"gate must have x's shape \(40, 128\)", ValueError),
    (dict(weight=jnp.ones(64)), r"weight must have shape \(128,\)", ValueError),
])
def test_bad_inputs_are_rejected(kwargs, error, exc):
  args = dict(x=jnp.ones((40, 128)), gate=jnp.ones((40, 128)), weight=jnp.ones(128),
              interpret=True)
  args.update(kwargs)
  with pytest.raises(exc, match=error):
    K.rms_norm_gated(**args)


def test_float64_is_refused_not_cast():
  with jax.enable_x64(True):
    x = jnp.ones((4, 128), jnp.float64)
    with pytest.raises(TypeError, match="nothing is down-cast"):
      K.rms_norm_gated(x, jnp.ones((4, 128), jnp.float32), jnp.ones(128, jnp.float32),
                       interpret=True)


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p", "v7"])
@pytest.mark.parametrize("hidden", [64, 128, 256])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_tiling_fits_budget(chip, hidden, dtype):
  config = K.RmsNormGatedConfig(chip=chip)
  for rows in (1, 7, 2048, 131072):
    for tiling in (K.gated_forward_tiling(rows, hidden, dtype, dtype, config),
                   K.gated_backward_tiling(rows, hidden, dtype, dtype, config)):
      assert tiling.block_rows == rows or tiling.block_rows % vmem.sublane_multiple(dtype) == 0
      assert 1 <= tiling.block_rows <= min(rows, K.MAX_BLOCK_ROWS)
      assert tiling.vmem_plan_bytes <= tiling.vmem_limit_bytes * vmem.BUDGET_FRACTION
      assert tiling.vmem_limit_bytes == chips.get_chip(chip).default_scoped_vmem_bytes
