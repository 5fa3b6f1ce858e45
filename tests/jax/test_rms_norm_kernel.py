"""RMSNorm Pallas kernels in interpret mode against the float64 reference (JAX only).

Interpret mode leaves output memory the kernel never writes as NaN, so the
finiteness check inside `assert_close` catches rows or columns a kernel forgets.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference as ref
from tpu_kernels import chips, rms_norm as K, vmem

DTYPES = ["float32", "bfloat16", "float16"]
# Hidden sizes: lane-aligned and not (1, 3, 100, 200, 1000), small enough for interpret mode.
HIDDEN = [1, 3, 8, 100, 128, 200, 256, 384, 896, 1000]


@st.composite
def problems(draw, max_rows=70):
  lead = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
  rows = int(np.prod(lead)) if lead else 1
  if rows > max_rows:
    lead = [max_rows]
  hidden = draw(st.sampled_from(HIDDEN))
  dtype = draw(st.sampled_from(DTYPES))
  weight_dtype = draw(st.sampled_from([dtype, "float32"]))
  # None: the tiling's own choice (one block at these sizes); a small forced block gives
  # several grid steps and, usually, a partial last block.
  block_rows = draw(st.sampled_from([None, 8, 16, 32]))
  offset = draw(st.sampled_from([0.0, 1.0]))
  eps = draw(st.sampled_from([1e-6, 1e-5, 0.1]))
  seed = draw(st.integers(0, 2**31 - 1))
  return dict(shape=(*lead, hidden), dtype=dtype, weight_dtype=weight_dtype,
              block_rows=block_rows, offset=offset, eps=eps, seed=seed)


def _arrays(p, *names):
  rng = np.random.default_rng(p["seed"])
  out = []
  for name in names:
    dtype = p["weight_dtype"] if name == "weight" else p["dtype"]
    shape = p["shape"][-1:] if name == "weight" else p["shape"]
    a = rng.standard_normal(shape).astype(np.float32)
    if name == "weight" and p["offset"]:
      a *= 0.1  # Gemma weights sit around 0, the scale around 1
    out.append(jnp.asarray(a.astype(ref.NP_DTYPES[dtype])))
  return out


def _legal_block_rows(p):
  """Forced block_rows must be a multiple of the sublane tile of the kernel's dtypes."""
  if p["block_rows"] is None:
    return None
  rows = int(np.prod(p["shape"][:-1]))
  sub = max(vmem.sublane_multiple(K._kernel_dtype(jnp.dtype(d)))
            for d in (p["dtype"], p["weight_dtype"]))
  return None if p["block_rows"] % sub else p["block_rows"]


def _kwargs(p):
  return dict(eps=p["eps"], offset=p["offset"], block_rows=_legal_block_rows(p),
              interpret=True)


@given(problems())
def test_forward_matches_reference(p):
  x, w = _arrays(p, "x", "weight")
  out = K.rms_norm(x, w, **_kwargs(p))
  assert out.dtype == jnp.promote_types(x.dtype, w.dtype)
  expected = ref.rms_norm(x, w, p["eps"], p["offset"])
  tol_dtype = jnp.dtype(out.dtype).name
  ref.assert_close(out, expected, ref.TOLERANCE[tol_dtype], "rms_norm")


@given(problems())
def test_fused_add_matches_reference(p):
  x, residual, w = _arrays(p, "x", "residual", "weight")
  out, residual_out = K.fused_add_rms_norm(x, residual, w, **_kwargs(p))
  assert residual_out.dtype == x.dtype
  s = ref.residual_sum(x, residual, p["dtype"])
  # One rounding of an exact sum vs f32 sum then rounding: at most one ulp apart.
  ulp_tol = dict(rtol=2 * float(jnp.finfo(x.dtype).eps), atol=0.0)
  ref.assert_close(residual_out, s, ulp_tol, "residual")
  ref.assert_close(out, ref.rms_norm(s, w, p["eps"], p["offset"]),
                   ref.TOLERANCE[jnp.dtype(out.dtype).name], "fused out")


@given(problems(max_rows=24))
def test_gradients_match_reference(p):
  x, w = _arrays(p, "x", "weight")
  out_dtype = jnp.promote_types(x.dtype, w.dtype)
  g = jnp.asarray(np.random.default_rng(p["seed"] + 1).standard_normal(p["shape"])
                  .astype(ref.NP_DTYPES[jnp.dtype(out_dtype).name]))
  _, vjp = jax.vjp(lambda a, b: K.rms_norm(a, b, **_kwargs(p)), x, w)
  dx, dw = vjp(g)
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  dx_ref, dw_ref, dx_scale, dw_scale = ref.rms_norm_grads(x, w, g, p["eps"], p["offset"])
  ref.assert_close(dx, dx_ref, ref.GRAD_TOLERANCE[p["dtype"]], "dx", dx_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE[p["weight_dtype"]], "dweight", dw_scale)


@given(problems(max_rows=24), st.sampled_from(["both", "out_only", "residual_only"]))
def test_fused_gradients_match_reference(p, used):
  x, residual, w = _arrays(p, "x", "residual", "weight")
  rng = np.random.default_rng(p["seed"] + 2)
  out_dtype = ref.NP_DTYPES[jnp.dtype(jnp.promote_types(x.dtype, w.dtype)).name]
  g_out = rng.standard_normal(p["shape"]).astype(out_dtype) * (used != "residual_only")
  g_res = rng.standard_normal(p["shape"]).astype(ref.NP_DTYPES[p["dtype"]]) * (used != "out_only")
  _, vjp = jax.vjp(lambda a, r, b: K.fused_add_rms_norm(a, r, b, **_kwargs(p)), x, residual, w)
  dx, dres, dw = vjp((jnp.asarray(g_out), jnp.asarray(g_res)))
  s = ref.residual_sum(x, residual, p["dtype"])
  ds_ref, dw_ref, ds_scale, dw_scale = ref.rms_norm_grads(s, w, g_out, p["eps"], p["offset"])
  ds_ref = ds_ref + ref.f64(g_res)
  ds_scale = max(ds_scale, float(np.max(np.abs(ref.f64(g_res)), initial=0.0)))
  tol = ref.GRAD_TOLERANCE[p["dtype"]]
  ref.assert_close(dx, ds_ref, tol, "dx", ds_scale)
  ref.assert_close(dres, ds_ref, tol, "dresidual", ds_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE[p["weight_dtype"]], "dweight", dw_scale)


@pytest.mark.parametrize("dtype, offset", [("float32", 0.0), ("bfloat16", 1.0),
                                           ("float16", 0.0)])
def test_peer_style_inputs_match_reference(dtype, offset):
  """Uniform [0, 1) x, residual, weight and dout (the peers' kind of test data; all
  positive, so each row of dx is a difference of terms of one sign): the plain and fused
  forms, forward and gradients, within the stated tolerances."""
  rng = np.random.default_rng(61)
  x, residual, w, g = (jnp.asarray(rng.random(shape).astype(ref.NP_DTYPES[dtype]))
                       for shape in ((37, 1000), (37, 1000), (1000,), (37, 1000)))
  eps = 1e-6
  (out, res_out), vjp = jax.vjp(
      lambda a, r, b: K.fused_add_rms_norm(a, r, b, eps=eps, offset=offset, interpret=True),
      x, residual, w)
  s = ref.residual_sum(x, residual, dtype)
  ref.assert_close(out, ref.rms_norm(s, w, eps, offset), ref.TOLERANCE[dtype], "fused out")
  dx, _, dw = vjp((g, jnp.zeros_like(g)))
  ds_ref, dw_ref, ds_scale, dw_scale = ref.rms_norm_grads(s, w, g, eps, offset)
  ref.assert_close(dx, ds_ref, ref.GRAD_TOLERANCE[dtype], "fused dx", ds_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE[dtype], "fused dweight", dw_scale)
  out, vjp = jax.vjp(lambda a, b: K.rms_norm(a, b, eps=eps, offset=offset, interpret=True),
                     x, w)
  ref.assert_close(out, ref.rms_norm(x, w, eps, offset), ref.TOLERANCE[dtype], "out")
  dx, dw = vjp(g)
  dx_ref, dw_ref, dx_scale, dw_scale = ref.rms_norm_grads(x, w, g, eps, offset)
  ref.assert_close(dx, dx_ref, ref.GRAD_TOLERANCE[dtype], "dx", dx_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE[dtype], "dweight", dw_scale)


def test_garbage_in_partial_block_does_not_reach_weight_gradient():
  """Rows past the end of a partial last block must not leak into dweight (even as NaN)."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((37, 256)), jnp.float32)  # 37 = 4 * 8 + 5
  w = jnp.asarray(rng.standard_normal(256), jnp.float32)
  g = jnp.asarray(rng.standard_normal((37, 256)), jnp.float32)
  dx, dw = K.rms_norm_backward(x, w, g, config=K.RmsNormConfig(block_rows=8, interpret=True))
  dx_ref, dw_ref, dx_scale, dw_scale = ref.rms_norm_grads(x, w, g, 1e-6)
  ref.assert_close(dx, dx_ref, ref.GRAD_TOLERANCE["float32"], "dx", dx_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE["float32"], "dweight", dw_scale)


def test_zero_rows():
  x = jnp.zeros((0, 3, 64), jnp.bfloat16)
  w = jnp.ones(64, jnp.bfloat16)
  assert K.rms_norm(x, w, interpret=True).shape == (0, 3, 64)
  out, res = K.fused_add_rms_norm(x, x, w, interpret=True)
  assert out.shape == res.shape == (0, 3, 64)


def test_zero_input_gives_zero_not_nan():
  x = jnp.zeros((4, 128), jnp.float32)
  out = K.rms_norm(x, jnp.ones(128), eps=1e-6, interpret=True)
  assert np.array_equal(np.asarray(out), np.zeros((4, 128)))


@pytest.mark.parametrize("kwargs, error", [
    (dict(eps=float("nan")), "eps must be finite"),
    (dict(eps=-1.0), "eps must be finite and >= 0"),
    (dict(offset=float("inf")), "offset must be finite"),
    (dict(chip="v9"), "unknown TPU chip"),
    (dict(block_rows=0), "block_rows must be positive"),
    (dict(block_rows=12), "must be a multiple of 8"),
    (dict(vmem_limit_bytes=0), "vmem_limit_bytes must be a positive int"),
    (dict(vmem_limit_bytes=10**9), "exceeds what v6e allows"),
])
def test_bad_configuration_is_rejected(kwargs, error):
  x = jnp.ones((40, 128), jnp.float32)
  with pytest.raises(ValueError, match=error):
    K.rms_norm(x, jnp.ones(128), interpret=True, **kwargs)


@pytest.mark.parametrize("x_shape, x_dtype, w_shape, w_dtype, error", [
    ((4, 128), jnp.int32, (128,), jnp.float32, "x must be float32, bfloat16 or float16"),
    ((4, 128), jnp.float32, (64,), jnp.float32, r"weight must have shape \(128,\)"),
    ((4, 128), jnp.float32, (128,), jnp.int8, "weight must be float32"),
])
def test_bad_inputs_are_rejected(x_shape, x_dtype, w_shape, w_dtype, error):
  with pytest.raises((TypeError, ValueError), match=error):
    K.rms_norm(jnp.ones(x_shape, x_dtype), jnp.ones(w_shape, w_dtype), interpret=True)


# ----------------------------------------------------------------------------- tiling


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p", "v7"])
@pytest.mark.parametrize("hidden", [896, 1000, 2048, 2880, 4096, 5120, 8192, 16384, 32768])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_tiling_fits_budget(chip, hidden, dtype):
  config = K.RmsNormConfig(chip=chip)
  for rows in (1, 7, 100, 65536):
    for tiling in (K.forward_tiling(rows, hidden, dtype, dtype, True, config),
                   K.backward_tiling(rows, hidden, dtype, dtype, True, config)):
      assert tiling.block_rows == rows or tiling.block_rows % vmem.sublane_multiple(dtype) == 0
      assert 1 <= tiling.block_rows <= min(rows, K.MAX_BLOCK_ROWS)
      assert tiling.vmem_plan_bytes <= tiling.vmem_limit_bytes * vmem.BUDGET_FRACTION
      assert tiling.vmem_limit_bytes <= chips.get_chip(chip).max_vmem_limit_bytes


def test_wide_rows_raise_the_vmem_limit_only_when_needed():
  narrow = K.backward_tiling(65536, 4096, jnp.bfloat16, jnp.bfloat16, True,
                             K.RmsNormConfig(chip="v5e"))
  assert narrow.vmem_limit_bytes == chips.get_chip("v5e").default_scoped_vmem_bytes
  wide = K.backward_tiling(65536, 32768, jnp.float32, jnp.float32, True,
                           K.RmsNormConfig(chip="v5e"))
  assert wide.vmem_limit_bytes > chips.get_chip("v5e").default_scoped_vmem_bytes
  with pytest.raises(ValueError, match="needs .* bytes of VMEM"):  # beyond any chip
    K.backward_tiling(64, 1 << 20, jnp.float32, jnp.float32, True, K.RmsNormConfig(chip="v6e"))


def test_explicit_vmem_limit_is_respected():
  small = K.forward_tiling(65536, 4096, jnp.bfloat16, jnp.bfloat16, False,
                           K.RmsNormConfig(chip="v6e", vmem_limit_bytes=4 * vmem.MiB))
  default = K.forward_tiling(65536, 4096, jnp.bfloat16, jnp.bfloat16, False,
                             K.RmsNormConfig(chip="v6e"))
  assert small.vmem_limit_bytes == 4 * vmem.MiB
  assert small.block_rows < default.block_rows
  with pytest.raises(ValueError, match="needs .* bytes of VMEM"):
    K.forward_tiling(64, 1 << 20, jnp.float32, jnp.float32, False,
                     K.RmsNormConfig(chip="v6e", vmem_limit_bytes=4 * vmem.MiB))


@pytest.mark.parametrize("shape, dtype, weight_dtype, offset", [
    ((1000, 64), "bfloat16", "bfloat16", 1.0),   # SD3.5's q / k norms: head_dim 64
    ((2, 500, 64), "float32", "float32", 0.0),
    ((700, 48), "bfloat16", "float32", 0.0),     # out promoted to f32
    ((3000, 8), "float16", "float16", 1.0),      # f16 travels as f32
    ((2, 3, 1000, 64), "bfloat16", "bfloat16", 0.0),   # Diffusers' [B, H, S, D]: 6 slabs
])
def test_narrow_rows_run_on_the_transpose(shape, dtype, weight_dtype, offset):
  """Rows narrower than 128 that the TPU stores column-major run the forward on the
  transpose of the last two axes; a small VMEM limit gives several lane blocks per slab and
  a partial last one, which must leave no row unwritten (interpret mode fills unwritten
  output with NaN)."""
  rows, hidden = shape[-2], shape[-1]     # the transposed axes: the last two
  config = K.RmsNormConfig(chip="v6e", vmem_limit_bytes=vmem.MiB)
  tiling = K.column_tiling(rows, hidden, K._kernel_dtype(jnp.dtype(dtype)),
                           K._kernel_dtype(jnp.promote_types(dtype, weight_dtype)), config)
  assert tiling is not None and tiling.block_rows % 128 == 0 and rows % tiling.block_rows
  assert tiling.vmem_plan_bytes <= vmem.vmem_budget(chips.get_chip("v6e"), vmem.MiB)
  p = dict(shape=shape, dtype=dtype, weight_dtype=weight_dtype, offset=offset, seed=rows)
  x, w = _arrays(p, "x", "weight")
  out = K.rms_norm(x, w, eps=1e-6, offset=offset, chip="v6e", vmem_limit_bytes=vmem.MiB,
                   interpret=True)
  assert out.dtype == jnp.promote_types(x.dtype, w.dtype) and out.shape == x.shape
  expected = ref.rms_norm(x, w, 1e-6, offset)
  ref.assert_close(out, expected, ref.TOLERANCE[jnp.dtype(out.dtype).name], "rms_norm")
  # The backward on the transpose too: dx in every row of every block, dweight summed over
  # blocks and slabs with the partial block's garbage lanes left out.
  backward = K.column_backward_tiling(rows, hidden, K._kernel_dtype(jnp.dtype(dtype)),
                                      K._kernel_dtype(out.dtype), config)
  assert backward is not None and rows % backward.block_rows
  g = jnp.asarray(np.random.default_rng(1).standard_normal(shape), out.dtype)
  dx, dw = K.rms_norm_backward(x, w, g, config=K.RmsNormConfig(
      eps=1e-6, offset=offset, chip="v6e", vmem_limit_bytes=vmem.MiB, interpret=True))
  assert dx.shape == x.shape and dx.dtype == x.dtype and dw.dtype == w.dtype
  dx_ref, dw_ref, dx_scale, dw_scale = ref.rms_norm_grads(x, w, g, 1e-6, offset)
  ref.assert_close(dx, dx_ref.reshape(shape), ref.GRAD_TOLERANCE[dtype], "dx", dx_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE[jnp.dtype(w.dtype).name], "dweight",
                   dw_scale)


@pytest.mark.parametrize("rows, hidden, kwargs", [
    (8, 64, {}),                   # the TPU keeps [8, 64] row-major
    (4096, 128, {}),               # full lane tiles
    (4096, 2880, {}),              # column-major, but rows this wide keep the row kernel
    (1000, 64, dict(block_rows=16)),   # the caller fixed row blocks
])
def test_the_row_layout_stays_where_the_transpose_does_not_apply(rows, hidden, kwargs):
  config = K.RmsNormConfig(chip="v6e", **kwargs)
  assert K.column_tiling(rows, hidden, jnp.bfloat16, jnp.bfloat16, config) is None


@pytest.mark.parametrize("hidden", [2880, 5120, 8192, 16384])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_widths(hidden, dtype):
  """Real hidden sizes (gpt-oss, Qwen3-14B, Llama-70B, Llama-405B), a few rows, fwd and bwd."""
  p = dict(shape=(3, hidden), dtype=dtype, weight_dtype=dtype, block_rows=None, offset=0.0,
           eps=1e-6, seed=hidden)
  x, residual, w = _arrays(p, "x", "residual", "weight")
  (out, residual_out), vjp = jax.vjp(
      lambda a, r, b: K.fused_add_rms_norm(a, r, b, interpret=True), x, residual, w)
  s = ref.residual_sum(x, residual, dtype)
  ref.assert_close(out, ref.rms_norm(s, w, 1e-6), ref.TOLERANCE[dtype], "out")
  g = jnp.asarray(np.random.default_rng(1).standard_normal((3, hidden)), x.dtype)
  dx, _, dw = vjp((g, jnp.zeros_like(g)))
  dx_ref, dw_ref, dx_scale, dw_scale = ref.rms_norm_grads(s, w, g, 1e-6)
  ref.assert_close(dx, dx_ref, ref.GRAD_TOLERANCE[dtype], "dx", dx_scale)
  ref.assert_close(dw, dw_ref, ref.GRAD_TOLERANCE[dtype], "dweight", dw_scale)
