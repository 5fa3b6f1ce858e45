"""moe_combine.gather_weighted_sum (kernels/tpu_kernels/moe_combine.py) against a float64
NumPy sum written from the definition, out[t] = sum_k weights[t, k] * y[ids[t, k]], in
Pallas interpret mode; its VMEM plan and fallback; moe.combine's gradient; and the kernel
compiled ahead of time for v5e / v6e at Qwen3-30B-A3B's prefill.

Tolerances, |got - ref| <= atol + rtol * |ref| on unit-scale y and weights in [0, 1):
float32 out 1e-5 (a float32 sum of K products); bfloat16 out 2^-8 relative (one rounding of
the float32 sum), plus 1e-5 absolute.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

from tpu_kernels import aot, chips, moe, moe_combine

OUT_TOL = {"float32": dict(rtol=1e-5, atol=1e-5), "bfloat16": dict(rtol=2 ** -8, atol=1e-5)}


def _reference(y, ids, weights):
  return np.einsum("tk,tkh->th", weights.astype(np.float64), y.astype(np.float64)[ids])


@given(tokens=st.integers(1, 80), top_k=st.sampled_from([1, 2, 4, 8]),
       hidden=st.sampled_from([128, 130, 256]), out_dtype=st.sampled_from(["float32", "bfloat16"]),
       permutation=st.booleans(), seed=st.integers(0, 2 ** 16))
def test_matches_float64_reference(tokens, top_k, hidden, out_dtype, permutation, seed):
  """Any T (a last, partial block of 32 from T = 33), any in-range ids (a permutation as
  moe.combine passes, or repeats), H off the lane width."""
  rng = np.random.default_rng(seed)
  rows = tokens * top_k
  y = rng.standard_normal((rows, hidden)).astype(np.float32)
  ids = (rng.permutation(rows) if permutation else rng.integers(0, rows, rows)).astype(
      np.int32).reshape(tokens, top_k)
  weights = rng.random((tokens, top_k)).astype(np.float32)
  got = moe_combine.gather_weighted_sum(jnp.asarray(y), jnp.asarray(ids), jnp.asarray(weights),
                                        out_dtype=jnp.dtype(out_dtype), interpret=True)
  assert got.shape == (tokens, hidden) and got.dtype == jnp.dtype(out_dtype)
  np.testing.assert_allclose(np.asarray(got, np.float64), _reference(y, ids, weights),
                             **OUT_TOL[out_dtype])


def test_bfloat16_weights_are_applied_in_float32():
  rng = np.random.default_rng(1)
  y = rng.standard_normal((12, 128)).astype(np.float32)
  ids = rng.permutation(12).astype(np.int32).reshape(3, 4)
  weights = jnp.asarray(rng.random((3, 4)), jnp.bfloat16)
  got = moe_combine.gather_weighted_sum(jnp.asarray(y), jnp.asarray(ids), weights,
                                        interpret=True)
  want = _reference(y, ids, np.asarray(weights, np.float64))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-6)


def test_block_tokens_fits_the_budget_or_says_none():
  assert moe_combine.block_tokens(7, 8, 2048, jnp.bfloat16, "v6e") == 7     # fewer than 32
  assert moe_combine.block_tokens(8192, 8, 2048, jnp.bfloat16, "v6e") == 32
  # v5e's budget is 8 MiB: K = 8, H = 8192 float32 scratch is 8 MiB at 32 tokens.
  assert moe_combine.block_tokens(8192, 8, 8192, jnp.bfloat16, "v5e") == 16
  assert moe_combine.block_tokens(8192, 64, 16384, jnp.bfloat16, "v5e") is None
  with pytest.raises(ValueError, match="VMEM budget"):
    moe_combine.gather_weighted_sum(jnp.zeros((8 * 64, 16384)), jnp.zeros((8, 64), jnp.int32),
                                    jnp.zeros((8, 64)), chip="v5e", interpret=True)


def test_bad_input_raises():
  y, ids, w = jnp.zeros((8, 128)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
  with pytest.raises(TypeError, match="float32"):
    moe_combine.gather_weighted_sum(y.astype(jnp.bfloat16), ids, w, interpret=True)
  with pytest.raises(ValueError, match="weights"):
    moe_combine.gather_weighted_sum(y, ids, w[:, :1], interpret=True)
  with pytest.raises(TypeError, match="integer"):
    moe_combine.gather_weighted_sum(y, ids.astype(jnp.float32), w, interpret=True)
  with pytest.raises(ValueError, match="fewer than"):     # 2 rows of y, 4 tokens a step
    moe_combine.gather_weighted_sum(y[:2], ids, w, interpret=True)


def test_no_tokens_gives_an_empty_result():
  got = moe_combine.gather_weighted_sum(jnp.zeros((0, 128)), jnp.zeros((0, 8), jnp.int32),
                                        jnp.zeros((0, 8)), out_dtype=jnp.bfloat16,
                                        interpret=True)
  assert got.shape == (0, 128) and got.dtype == jnp.bfloat16


@pytest.mark.parametrize("chip", ["v6e", "v5e"])
def test_combine_takes_xla_where_the_kernel_does_not_fit(chip):
  """moe.combine's fallback gives the same sum (K = 64 rows of 16384 per token)."""
  rng = np.random.default_rng(3)
  tokens, top_k, hidden = 2, 64, 16384
  assert moe_combine.block_tokens(tokens, top_k, hidden, jnp.float32, chip) is None
  y = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
  pos = rng.permutation(tokens * top_k).astype(np.int32)    # pair -> its row of y
  w = rng.random((tokens, top_k)).astype(np.float32)
  got = moe.combine(jnp.asarray(y), jnp.asarray(pos), jnp.asarray(w), chip=chip,
                    interpret=True)
  ids = pos.reshape(tokens, top_k)
  np.testing.assert_allclose(np.asarray(got), _reference(y, ids, w), rtol=1e-5, atol=1e-4)


def test_combine_gradient_matches_finite_differences():
  """moe.combine's custom VJP (the kernel forward, XLA's backward) against a central
  finite difference of the float64 reference, along a random direction."""
  rng = np.random.default_rng(4)
  tokens, top_k, hidden = 5, 3, 128
  y = rng.standard_normal((tokens * top_k, hidden))
  pos = rng.permutation(tokens * top_k).astype(np.int32)    # pair -> its row of y
  w = rng.random((tokens, top_k))
  g = rng.standard_normal((tokens, hidden))
  ids = pos.reshape(tokens, top_k)
  _, vjp = jax.vjp(lambda y_, w_: moe.combine(y_, jnp.asarray(pos), w_, interpret=True),
                   jnp.asarray(y, jnp.float32), jnp.asarray(w, jnp.float32))
  dy, dw = vjp(jnp.asarray(g, jnp.float32))
  vy, vw = rng.standard_normal(y.shape), rng.standard_normal(w.shape)
  eps = 1e-4
  f = lambda e: np.sum(g * _reference(y + e * vy, ids, w + e * vw))
  want = (f(eps) - f(-eps)) / (2 * eps)
  got = float(np.sum(np.asarray(dy, np.float64) * vy) + np.sum(np.asarray(dw, np.float64) * vw))
  assert abs(got - want) <= 1e-4 * (abs(want) + 1)


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_compiles_for_the_chip_at_decode_with_bfloat16_weights(chip, tokens):
  """Decode (one step of all T tokens, or of 32): the bfloat16 weights are cast in the
  kernel, and XLA's convert op is gone."""
  device = aot.topology_device(chip)
  specs = [jax.ShapeDtypeStruct((tokens * 8, 2048), jnp.float32),
           jax.ShapeDtypeStruct((tokens, 8), jnp.int32),
           jax.ShapeDtypeStruct((tokens, 8), jnp.bfloat16)]
  fn = lambda y, ids, w: moe_combine.gather_weighted_sum(y, ids, w, out_dtype=jnp.bfloat16,
                                                         chip=chip)
  text = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower().compile(
  ).as_text()
  assert "tpu_custom_call" in text and " convert(" not in text


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_compiles_for_the_chip_at_qwen3_prefill(chip):
  """Mosaic's verdict at 8192 tokens x top-8 x 2048 (65,536 row copies): compiles within
  the default scoped-VMEM limit."""
  device = aot.topology_device(chip)
  specs = [jax.ShapeDtypeStruct((65536, 2048), jnp.float32),
           jax.ShapeDtypeStruct((8192, 8), jnp.int32),
           jax.ShapeDtypeStruct((8192, 8), jnp.bfloat16)]
  fn = lambda y, ids, w: moe_combine.gather_weighted_sum(y, ids, w, out_dtype=jnp.bfloat16,
                                                         chip=chip)
  compiled = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower().compile()
  limits = aot.scoped_vmem_per_kernel(compiled.as_text())
  assert len(limits) == 1
  assert limits[0] <= chips.get_chip(chip).default_scoped_vmem_bytes


def test_row_major_spec_keeps_y_where_the_down_kernel_writes_it():
  """aot.RowMajor, as the layer estimate rates the combine: gpt-oss's y [256, 2880] float32
  left free gets the TPU's column-major layout and a copy into VMEM (on which libtpu's
  static estimate aborts); pinned row-major, it goes to the kernel as is."""
  device = aot.topology_device("v6e")
  fn = lambda y, ids, w: moe_combine.gather_weighted_sum(y, ids, w, chip="v6e")
  rest = [jax.ShapeDtypeStruct((64, 4), jnp.int32), jax.ShapeDtypeStruct((64, 4), jnp.float32)]

  def y_copies(y_spec):
    specs = [aot._on_device(s, device) for s in [y_spec, *rest]]
    text = jax.jit(fn).trace(*specs).lower().compile().as_text()
    return [line for line in text.splitlines() if " copy(%y" in line]

  assert y_copies(jax.ShapeDtypeStruct((256, 2880), jnp.float32))          # the artefact
  assert not y_copies(aot.RowMajor((256, 2880), jnp.float32))
