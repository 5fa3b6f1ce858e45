"""moe_experts (kernels/tpu_kernels/moe.py) against the float64 per-token NumPy loop of
tests/reference_moe.py, in Pallas interpret mode.

Tolerances, |got - ref| <= atol * max|ref| + rtol * |ref| (inputs of unit scale, weights
scaled by 1/sqrt(fan-in)): float32 1e-4 (f32 accumulation over H and I, sums of K terms);
bfloat16 3e-2 (inputs rounded to bf16 before the reference sees them, so the error is the
bf16 rounding of the [S, I] intermediate, 2^-8 relative, amplified by the down projection's
sum over I, plus the output's rounding).
Gradients: jax.vjp of moe_experts against a central finite difference of the float64
reference along random directions (independent of jax's autodiff and of the kernel).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference_moe as ref
from tpu_kernels import moe

TOL = {"float32": dict(rtol=1e-4, atol=1e-4), "bfloat16": dict(rtol=3e-2, atol=3e-2)}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


def _problem(rng, *, tokens, hidden, inter, experts, top_k, dtype, has_gate=True,
             is_transposed=False, has_bias=False, placeholders=0):
  width = 2 * inter if has_gate else inter
  gu_shape = (experts, hidden, width) if is_transposed else (experts, width, hidden)
  dn_shape = (experts, inter, hidden) if is_transposed else (experts, hidden, inter)
  np_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
  cast = lambda a: np.asarray(a, np.float32).astype(np_dtype)
  idx = np.stack([rng.choice(experts + placeholders, top_k, replace=False)
                  for _ in range(tokens)]).astype(np.int32)
  p = dict(
      hidden=cast(rng.standard_normal((tokens, hidden))),
      top_k_index=idx,
      top_k_weights=cast(rng.dirichlet(np.ones(top_k), tokens)),
      gate_up_weight=cast(rng.standard_normal(gu_shape) / np.sqrt(hidden)),
      down_weight=cast(rng.standard_normal(dn_shape) / np.sqrt(inter)),
  )
  if has_bias:
    p["gate_up_bias"] = cast(0.1 * rng.standard_normal((experts, width)))
    p["down_bias"] = cast(0.1 * rng.standard_normal((experts, hidden)))
  return p


def _run(p, **flags):
  arrays = {k: jnp.asarray(v) for k, v in p.items()}
  return moe.moe_experts(**arrays, **flags, interpret=True)


def _reference(p, activation="silu", **flags):
  return ref.moe_experts(**p, activation_name=activation, **flags)


@st.composite
def cases(draw):
  has_gate = draw(st.booleans())
  activation = draw(st.sampled_from(
      ["silu", "gelu_tanh", "gpt_oss", "clamped_silu", "gelu", "relu2"] if has_gate else
      ["relu2", "silu", "gelu_tanh"]))
  experts = draw(st.integers(1, 6))
  return dict(
      tokens=draw(st.integers(1, 12)), hidden=draw(st.sampled_from([8, 24, 64, 130])),
      inter=draw(st.sampled_from([8, 16, 40])), experts=experts,
      top_k=draw(st.integers(1, min(experts, 3))), dtype=draw(st.sampled_from(list(DTYPES))),
      has_gate=has_gate, activation=activation, is_transposed=draw(st.booleans()),
      is_concatenated=(draw(st.booleans()) if activation in ("gpt_oss", "clamped_silu")
                       else True),
      has_bias=draw(st.booleans()), placeholders=draw(st.sampled_from([0, 0, 2])),
      seed=draw(st.integers(0, 2**31 - 1)))


@given(cases())
def test_moe_experts_matches_reference(case):
  c = dict(case)
  rng = np.random.default_rng(c.pop("seed"))
  dtype, activation = c["dtype"], c.pop("activation")
  is_concatenated = c.pop("is_concatenated")
  p = _problem(rng, **c)
  flags = dict(num_experts=c["experts"], has_gate=c["has_gate"],
               is_transposed=c["is_transposed"], is_concatenated=is_concatenated)
  got = _run(p, activation=activation, **flags)
  assert got.dtype == DTYPES[dtype] and got.shape == p["hidden"].shape
  ref.assert_close(np.asarray(got.astype(jnp.float32)), _reference(p, activation, **flags),
                   **TOL[dtype])


def test_placeholder_ids_contribute_nothing():
  """Ids >= num_experts (experts on other shards) add nothing: same as dropping them."""
  rng = np.random.default_rng(0)
  p = _problem(rng, tokens=6, hidden=32, inter=16, experts=4, top_k=2, dtype="float32",
               placeholders=3)
  p["top_k_index"][0] = [4, 6]  # a token routed only to other shards: output row 0
  got = np.asarray(_run(p, num_experts=4))
  assert np.all(got[0] == 0)
  ref.assert_close(got, _reference(p, num_experts=4), **TOL["float32"])


def test_negative_ids_contribute_nothing():
  """A negative id (a dropped pair) adds nothing, like a placeholder: it sorts past the
  groups instead of into the first one, and no group counts it."""
  rng = np.random.default_rng(4)
  p = _problem(rng, tokens=6, hidden=32, inter=16, experts=4, top_k=2, dtype="float32")
  p["top_k_index"][1] = [-1, 2]
  p["top_k_index"][3] = [-4, -1]   # a token with every pair dropped: output row 3
  got = np.asarray(_run(p, num_experts=4))
  assert np.all(got[3] == 0)
  ref.assert_close(got, _reference(p, num_experts=4), **TOL["float32"])


def test_all_pairs_on_one_expert_and_empty_experts():
  rng = np.random.default_rng(1)
  p = _problem(rng, tokens=5, hidden=16, inter=8, experts=5, top_k=1, dtype="float32")
  p["top_k_index"][:] = 3
  ref.assert_close(np.asarray(_run(p, num_experts=5)), _reference(p, num_experts=5),
                   **TOL["float32"])


def test_quantized_weights_match_dequantized_reference():
  """int8 / fp8 weights with per-output-channel scales: the reference dequantizes."""
  rng = np.random.default_rng(2)
  p = _problem(rng, tokens=7, hidden=32, inter=16, experts=3, top_k=2, dtype="bfloat16")
  for qdtype, qmax in ((jnp.int8, 127.0), (jnp.float8_e4m3fn, 448.0)):
    q = dict(p)
    for name, key in (("gate_up", "gate_up_weight"), ("down", "down_weight")):
      w = p[key].astype(np.float32)                      # [E, out, in]
      scale = np.abs(w).max(axis=2) / qmax
      wq = w / scale[:, :, None]
      wq = np.round(wq) if qdtype == jnp.int8 else wq
      q[key] = np.asarray(jnp.asarray(wq).astype(qdtype))
      q[f"{name}_scale"] = scale.astype(np.float32)
    got = _run(q, num_experts=3)
    ref.assert_close(np.asarray(got.astype(jnp.float32)), _reference(q, num_experts=3),
                     **TOL["bfloat16"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("flags", [
    dict(has_gate=True, is_transposed=False, activation="silu"),
    dict(has_gate=True, is_transposed=True, activation="gpt_oss", is_concatenated=False),
    dict(has_gate=False, is_transposed=False, activation="relu2"),
], ids=["qwen", "gpt_oss", "no_gate"])
def test_int8_activations_match_the_quantized_reference(flags, dtype):
  """lhs_quant="int8" with int8 weights: the reference quantizes each token's row and
  each expert's h by the definition (`reference_moe.quantize_row_int8`), at the dtype's
  tolerance. (A code of h could round the other way where h / scale sits at a tie within
  the last float32 bits, moving its row by ~max|h| / 127 / sqrt(I); this fixed problem
  has none, and interpret mode is deterministic.) In float32 the unquantized layer is
  ~1e-2 away, 100x the tolerance: the check sees the quantization."""
  rng = np.random.default_rng(5)
  flags = dict(flags)
  activation = flags.pop("activation")
  p = _problem(rng, tokens=9, hidden=64, inter=40, experts=4, top_k=2, dtype=dtype,
               has_gate=flags["has_gate"], is_transposed=flags["is_transposed"],
               has_bias=True)
  for name, key in (("gate_up", "gate_up_weight"), ("down", "down_weight")):
    w = p[key].astype(np.float32)
    out_axis = 2 if flags["is_transposed"] else 1           # the output channel's axis
    scale = np.abs(w).max(axis=3 - out_axis) / 127.0      # [E, out]
    p[key] = np.round(w / np.expand_dims(scale, 3 - out_axis)).astype(np.int8)
    p[f"{name}_scale"] = scale.astype(np.float32)
  flags.update(num_experts=4, activation=activation)
  got = _run(p, lhs_quant="int8", **flags)
  want = _reference(p, activation, lhs_quant="int8",
                    **{k: v for k, v in flags.items() if k != "activation"})
  ref.assert_close(np.asarray(got.astype(jnp.float32)), want, **TOL[dtype])
  if dtype == "float32":
    plain = _reference(p, activation, **{k: v for k, v in flags.items() if k != "activation"})
    assert np.abs(want - plain).max() > 20 * TOL[dtype]["atol"] * np.abs(plain).max()


@pytest.mark.parametrize("flags", [
    dict(has_gate=True, is_transposed=False, has_bias=False, activation="silu"),
    dict(has_gate=True, is_transposed=True, has_bias=True, activation="gpt_oss",
         is_concatenated=False),
    dict(has_gate=False, is_transposed=False, has_bias=False, activation="relu2"),
    dict(has_gate=True, is_transposed=False, has_bias=False, activation="clamped_silu"),
], ids=["qwen", "gpt_oss", "no_gate", "clamped_silu"])
def test_gradients_match_finite_differences(flags):
  """<vjp(g), v> == d/de <g, ref(theta + e v)> for random directions v (float64 FD)."""
  flags = dict(flags)
  activation = flags.pop("activation")
  is_concatenated = flags.pop("is_concatenated", True)
  rng = np.random.default_rng(3)
  p = _problem(rng, tokens=5, hidden=16, inter=8, experts=3, top_k=2, dtype="float32",
               placeholders=1, **flags)
  static = dict(num_experts=3, has_gate=flags["has_gate"], is_transposed=flags["is_transposed"],
                is_concatenated=is_concatenated)
  diff_keys = [k for k in p if k != "top_k_index"]

  def f(*arrays):
    kw = dict(zip(diff_keys, arrays))
    return moe.moe_experts(top_k_index=jnp.asarray(p["top_k_index"]), **kw, **static,
                           activation=activation, interpret=True)

  out, vjp = jax.vjp(f, *(jnp.asarray(p[k]) for k in diff_keys))
  g = rng.standard_normal(out.shape)
  grads = vjp(jnp.asarray(g, jnp.float32))
  for key, grad in zip(diff_keys, grads):
    v = rng.standard_normal(p[key].shape)
    eps = 1e-5
    plus = {**p, key: p[key].astype(np.float64) + eps * v}
    minus = {**p, key: p[key].astype(np.float64) - eps * v}
    fd = np.sum(g * (_reference(plus, activation, **static)
                     - _reference(minus, activation, **static))) / (2 * eps)
    got = float(np.sum(np.asarray(grad, np.float64) * v))
    magnitude = float(np.sum(np.abs(np.asarray(grad, np.float64) * v))) + 1e-6
    assert abs(got - fd) <= 1e-3 * magnitude, (key, got, fd)
