"""Grouped-matmul Pallas kernels in interpret mode against the float64 reference (JAX only).

Interpret mode leaves output the kernel never writes as NaN, so the finiteness check
in `assert_close` catches rows (rows past sum(group_sizes), other shards' rows, empty
groups' weight gradients) that a kernel forgets to write.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, strategies as st

import reference as ref
from tpu_kernels import chips, ragged_dot as K, vmem

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
QUANT = {"int8": (jnp.int8, 127.0), "float8_e4m3fn": (jnp.float8_e4m3fn, 448.0)}
# k / n: lane-aligned and not, below and above one 128 block.
SIZES = [1, 3, 16, 100, 128, 130, 200, 256, 300]


@st.composite
def groupings(draw, max_m=80):
  """(m, group_sizes, group_offset, num_local): sizes may be empty, and may sum below m."""
  m = draw(st.integers(1, max_m))
  num_total = draw(st.integers(1, 6))
  num_local = draw(st.integers(1, num_total))
  offset = draw(st.integers(0, num_total - num_local))
  cuts = sorted(draw(st.lists(st.integers(0, m), min_size=num_total, max_size=num_total)))
  sizes = np.diff([0] + cuts).astype(np.int32)   # sum = cuts[-1] <= m
  return m, sizes, offset, num_local


@st.composite
def problems(draw, gated=False):
  m, sizes, offset, num_local = draw(groupings())
  p = dict(m=m, sizes=sizes, offset=offset, num_local=num_local,
           k=draw(st.sampled_from(SIZES)),
           dtype=draw(st.sampled_from(["float32", "bfloat16"])),
           transpose_rhs=draw(st.booleans()),
           quant=draw(st.sampled_from([None, None, "int8", "float8_e4m3fn"])),
           bias=draw(st.booleans()),
           # None: the tiling's own choice (one block here); forced small blocks give
           # several tiles, groups spanning tile boundaries and partial last blocks.
           block_m=draw(st.sampled_from([None, 16, 32])),
           block_k=draw(st.sampled_from([None, 128])),
           block_n=draw(st.sampled_from([None, 128])),
           # v5e masks a k tail in f32 (no bf16 vector unit), v6e in the input dtype.
           chip=draw(st.sampled_from(["v6e", "v5e"])),
           seed=draw(st.integers(0, 2**31 - 1)))
  if gated:
    half = draw(st.sampled_from([1, 50, 128, 200]))
    p.update(n=2 * half, layout=draw(st.sampled_from(K.LAYOUTS)),
             activation=draw(st.sampled_from(K.GATED_ACTIVATIONS)))
  else:
    p.update(n=draw(st.sampled_from(SIZES)),
             activation=draw(st.sampled_from([None, None, *K.SUPPORTED_ACTIVATIONS])))
  return p


def _inputs(p):
  """(lhs, rhs, scale, bias): unit normal lhs and bias, weights scaled by 1 / sqrt(k); or,
  with p["data"] == "uniform", all uniform in [0, 1) and unscaled (the peers' test data)."""
  rng = np.random.default_rng(p["seed"])
  uniform = p.get("data") == "uniform"
  draw = rng.random if uniform else rng.standard_normal
  dt = NP[p["dtype"]]
  lhs = draw((p["m"], p["k"])).astype(dt)
  wshape = ((p["num_local"], p["n"], p["k"]) if p["transpose_rhs"]
            else (p["num_local"], p["k"], p["n"]))
  rhs = (draw(wshape) / (1.0 if uniform else np.sqrt(p["k"]))).astype(np.float32)
  scale = None
  if p["quant"]:
    qdtype, qmax = QUANT[p["quant"]]
    amax = np.abs(rhs).max(axis=2 if p["transpose_rhs"] else 1)        # (G, n)
    scale = (np.maximum(amax, 1e-6) / qmax).astype(np.float32)
    bscale = scale[:, :, None] if p["transpose_rhs"] else scale[:, None, :]
    q = rhs / bscale
    rhs = np.round(q).astype(np.int8) if p["quant"] == "int8" else q.astype(ml_dtypes.float8_e4m3fn)
  else:
    rhs = rhs.astype(dt)
  bias = (0.5 * draw((p["num_local"], p["n"]))).astype(dt) if p["bias"] else None
  return lhs, rhs, scale, bias


def _legal(p, dtype_sub):
  block_m = p["block_m"] if p["block_m"] is None or p["block_m"] % dtype_sub == 0 else None
  return dict(block_m=block_m, block_k=p["block_k"], block_n=p["block_n"])


def _call(p, lhs, rhs, scale, bias, **extra):
  j = lambda a: None if a is None else jnp.asarray(a)
  kw = dict(group_offset=p["offset"], transpose_rhs=p["transpose_rhs"], rhs_scale=j(scale),
            bias=j(bias), chip=p["chip"], interpret=True,
            **_legal(p, vmem.sublane_multiple(lhs.dtype)),
            **extra)
  gs = jnp.asarray(p["sizes"])
  if "layout" in p:
    return lambda x, w, b: K.gated_ragged_dot(
        x, w, gs, activation=p["activation"], layout=p["layout"],
        **{**kw, "bias": b})
  return lambda x, w, b: K.ragged_dot(x, w, gs, activation=p["activation"],
                                      **{**kw, "bias": b})


def _reference(p, lhs, rhs, scale, bias):
  common = dict(group_offset=p["offset"], transpose_rhs=p["transpose_rhs"], scale=scale,
                bias=bias)
  if "layout" in p:
    return dict(gated_name=p["activation"], layout=p["layout"], **common)
  return dict(activation_name=p["activation"], **common)


def _check_forward(p, lhs_quant=None):
  """The kernel against the float64 grouped matmul. lhs_quant="int8" (int8 weights): against
  that of the dequantized lhs (codes * row scale, `ref.quantize_rows_int8`), at lhs's
  tolerance, with block_m a multiple of int8's 32 rows."""
  if lhs_quant:
    p = dict(p, quant="int8")
  lhs, rhs, scale, bias = _inputs(p)
  ref_lhs, extra = lhs, {}
  if lhs_quant:
    codes, row_scale = ref.quantize_rows_int8(lhs)
    ref_lhs, extra = codes * row_scale, dict(lhs_quant=lhs_quant)
    p = dict(p, **_legal(p, vmem.sublane_multiple(jnp.int8)))
  fn = _call(p, lhs, rhs, scale, bias, **extra)
  out = fn(jnp.asarray(lhs), jnp.asarray(rhs), None if bias is None else jnp.asarray(bias))
  assert out.dtype == lhs.dtype
  expected = ref.ragged_dot(ref_lhs, rhs, p["sizes"], **_reference(p, lhs, rhs, scale, bias))
  ref.assert_close(out, expected, ref.RAGGED_TOLERANCE[p["dtype"]], f"out {p}")
  # Rows of no local group are exact zeros, whatever the tolerance.
  ids = ref.local_row_groups(p["sizes"], p["offset"], p["num_local"], p["m"])
  assert not np.asarray(out, np.float64)[ids >= p["num_local"]].any()


@given(problems())
def test_ragged_dot_matches_reference(p):
  _check_forward(p)


@given(problems(gated=True))
def test_gated_ragged_dot_matches_reference(p):
  _check_forward(p)


@given(problems())
def test_int8_activations_match_reference(p):
  _check_forward(p, lhs_quant="int8")


@given(problems(gated=True))
def test_gated_int8_activations_match_reference(p):
  _check_forward(p, lhs_quant="int8")


def test_quantize_rows_edges():
  """Zero rows get scale 1 and zero codes; each row's largest magnitude maps to +-127;
  every element is within half a step; a row with an inf or a NaN gets a NaN scale."""
  x = np.array([[0.0, 0.0, 0.0, 0.0], [1.0, -2.0, 0.5, 3.0], [-4.0, 1e-3, 2.0, 0.0],
                [1.0, np.inf, 0.0, 0.0], [np.nan, 1.0, 0.0, 0.0]], np.float32)
  codes, scale = (np.asarray(a) for a in K.quantize_rows(jnp.asarray(x), interpret=True))
  assert codes.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (5, 1)
  assert scale[0, 0] == 1.0 and not codes[0].any()
  assert codes[1, 3] == 127 and codes[2, 0] == -127
  assert np.abs(codes[1:3] * scale[1:3] - x[1:3]).max() <= scale[1:3].max() / 2
  assert np.isnan(scale[3:]).all()
  want_codes, want_scale = ref.quantize_rows_int8(x[:3])
  assert (codes[:3] == want_codes).all() and (scale[:3] == want_scale).all()


@pytest.mark.parametrize("m, k, dtype, rows", [
    (5, 200, jnp.float32, 5),       # fewer rows than the codes' 32-row tile: one block
    (40, 130, jnp.bfloat16, 40),    # k off the 128 lanes
    (300, 768, jnp.bfloat16, 256),  # 256-row blocks, a partial last one
    (64, 14336, jnp.bfloat16, 32),  # Mixtral's down rows: 32 rows make a block of <= 1 MiB
    (1000, 96, jnp.float32, 256),
])
def test_quantize_rows_kernel_matches_its_definition(m, k, dtype, rows):
  """`quantize_rows`' kernel (interpret mode) against the definition in float64:
  scale = max|row| / 127 within one float32 ulp, every code within half a step (and the
  float32 division's rounding) of x / scale, each row's largest magnitude at +-127, a row
  with an inf or a NaN a NaN scale and the rows beside it unaffected. It also equals the
  XLA form (`_quantized_rows`) bit for bit: one definition, the same platform."""
  assert K.quantize_rows_plan(m, k, jnp.dtype(dtype), "v6e") == (rows, None)
  rng = np.random.default_rng(m * k)
  x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-8, 8, (m, 1)))
  x[0] = 0.0
  x[2, 3], x[m - 1, k - 1] = np.inf, np.nan
  x = jnp.asarray(x, jnp.float32).astype(dtype)
  codes, scale = K.quantize_rows(x, interpret=True)
  xla_codes, xla_scale = jax.jit(K._quantized_rows)(x)   # as XLA compiles it
  codes, scale = np.asarray(codes), np.asarray(scale)
  assert codes.dtype == np.int8 and codes.shape == (m, k) and scale.shape == (m, 1)
  assert (codes == np.asarray(xla_codes)).all()
  assert np.array_equal(scale, np.asarray(xla_scale), equal_nan=True)
  finite = np.zeros(m, bool)
  finite[[r for r in range(m) if r not in (2, m - 1)]] = True
  assert np.isnan(scale[~finite]).all() and np.isfinite(scale[finite]).all()
  x64 = np.asarray(x.astype(jnp.float32), np.float64)[finite]
  amax = np.abs(x64).max(axis=1, keepdims=True)
  want = np.where(amax > 0, amax / 127, 1.0)
  got = scale[finite].astype(np.float64)
  assert (np.abs(got - want) <= np.spacing(want.astype(np.float32))).all()
  c = codes[finite].astype(np.float64)
  assert (np.abs(c - x64 / got) <= 0.5 + 2.0 ** -16).all()
  peak = np.abs(x64).argmax(axis=1)
  nonzero = amax[:, 0] > 0
  assert (np.abs(c[np.arange(len(c)), peak])[nonzero] == 127).all()
  assert not c[~nonzero].any()


def test_quantize_rows_plan_raises_the_limit_then_falls_back_to_xla():
  """Rows too wide for the default scoped VMEM at 32 rows compile under a raised limit;
  rows too wide for the chip's largest limit (and an empty x) take XLA's form, with the
  same result."""
  v5e = chips.get_chip("v5e")
  rows, limit = K.quantize_rows_plan(512, 49152, jnp.dtype(jnp.bfloat16), "v5e")
  assert rows == 32 and v5e.default_scoped_vmem_bytes < limit <= v5e.max_vmem_limit_bytes
  assert K.quantize_rows_plan(512, 14336, jnp.dtype(jnp.bfloat16), "v6e") == (32, None)
  assert K.quantize_rows_plan(2, 1 << 20, jnp.dtype(jnp.float32), "v6e") is None
  assert K.quantize_rows_plan(0, 128, jnp.dtype(jnp.float32), "v6e") is None
  x = jnp.asarray(np.random.default_rng(0).standard_normal((2, 1 << 20)), jnp.float32)
  codes, scale = K.quantize_rows(x, chip="v6e")   # XLA's form: no interpret needed
  xla_codes, xla_scale = K._quantized_rows(x)
  assert (np.asarray(codes) == np.asarray(xla_codes)).all()
  assert (np.asarray(scale) == np.asarray(xla_scale)).all()


def test_int8_activations_never_hide_a_non_finite_row():
  """A row of lhs with an inf or a NaN comes out NaN under lhs_quant; the other rows of
  its tile are unaffected."""
  lhs = np.ones((32, 256), np.float32)
  lhs[3, 7], lhs[9, 0] = np.inf, np.nan
  rhs = np.ones((1, 256, 128), np.int8)
  out = np.asarray(K.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray([32], jnp.int32),
                                rhs_scale=jnp.ones((1, 128)), lhs_quant="int8", interpret=True))
  assert np.isnan(out[[3, 9]]).all()
  rest = np.delete(out, [3, 9], axis=0)
  np.testing.assert_allclose(rest, 256.0, rtol=1e-6)


def test_int8_activations_have_no_gradient():
  lhs, rhs = jnp.ones((16, 128)), jnp.ones((1, 128, 128), jnp.int8)
  f = lambda x: K.ragged_dot(x, rhs, jnp.asarray([16], jnp.int32), rhs_scale=jnp.ones((1, 128)),
                             lhs_quant="int8", interpret=True).sum()
  with pytest.raises(NotImplementedError, match="inference only"):
    jax.grad(f)(lhs)


@given(problems(), st.booleans())
def test_gradients_match_reference(p, gated):
  if gated:   # a gated problem: the same draw, with an even n and a gated activation
    p = {**p, "n": 2 * max(p["n"] // 2, 1), "layout": "interleaved" if p["seed"] % 2 else
         "concatenated", "activation": K.GATED_ACTIVATIONS[p["seed"] % len(K.GATED_ACTIVATIONS)]}
  lhs, rhs, scale, bias = _inputs(p)
  fn = _call(p, lhs, rhs, scale, bias)
  rng = np.random.default_rng(p["seed"] + 1)
  n_out = p["n"] // 2 if gated else p["n"]
  grad_out = rng.standard_normal((p["m"], n_out)).astype(NP[p["dtype"]])
  quantized = p["quant"] is not None
  args = [jnp.asarray(lhs), jnp.asarray(rhs), None if bias is None else jnp.asarray(bias)]
  argnums = (0, 2) if quantized else (0, 1, 2)
  if bias is None:
    argnums = argnums[:-1]
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * jnp.asarray(grad_out, jnp.float32))
  grads = jax.grad(loss, argnums)(*args)
  d_lhs, d_w, d_bias = ref.ragged_dot_grads(lhs, rhs, p["sizes"], grad_out,
                                            **_reference(p, lhs, rhs, scale, bias))
  expected = {0: d_lhs, 1: d_w, 2: d_bias}
  tol = ref.RAGGED_GRAD_TOLERANCE[p["dtype"]]
  for i, g in zip(argnums, grads):
    assert g.dtype == args[i].dtype
    ref.assert_close(g, expected[i], tol, f"grad {['lhs', 'rhs', 'bias'][i]} {p}")


@pytest.mark.parametrize("dtype, quant, activation, gated", [
    ("float32", None, "silu", True), ("bfloat16", "int8", "silu", True),
    ("bfloat16", "float8_e4m3fn", "gelu_tanh", False)])
def test_peer_style_inputs_match_reference(dtype, quant, activation, gated):
  """The peers' kinds of test data (tokamax's and tpu-inference's grouped-matmul tests):
  uniform [0, 1) lhs, weights and bias, unscaled, with k = 1024 (outputs ~k / 4), a
  zero-sized local group, and NaN in every row of no local group (another shard's group,
  rows past sum(group_sizes)): forward and gradients within RAGGED_TOLERANCE /
  RAGGED_GRAD_TOLERANCE, and those rows exactly 0 in the output and in d_lhs."""
  sizes = np.array([7, 9, 0, 20, 4], np.int32)     # offset 1: 3 local groups, sum 40 < m 48
  p = dict(m=48, sizes=sizes, offset=1, num_local=3, k=1024, n=256 if gated else 200,
           dtype=dtype, transpose_rhs=False, quant=quant, bias=True, block_m=16,
           block_k=None, block_n=None, chip="v6e", seed=61, data="uniform",
           activation=activation, **({"layout": "concatenated"} if gated else {}))
  lhs, rhs, scale, bias = _inputs(p)
  elsewhere = ref.local_row_groups(sizes, 1, 3, 48) >= 3
  lhs_nan = lhs.copy()
  lhs_nan[elsewhere] = np.nan
  fn = _call(p, lhs, rhs, scale, bias)
  args = [jnp.asarray(lhs_nan), jnp.asarray(rhs), jnp.asarray(bias)]
  out = np.asarray(fn(*args))
  kw = _reference(p, lhs, rhs, scale, bias)
  ref.assert_close(out, ref.ragged_dot(lhs, rhs, sizes, **kw), ref.RAGGED_TOLERANCE[dtype],
                   "out")
  assert not out.astype(np.float64)[elsewhere].any()
  grad_out = np.random.default_rng(62).random(out.shape).astype(NP[dtype])
  argnums = (0, 2) if quant else (0, 1, 2)
  loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * jnp.asarray(grad_out, jnp.float32))
  grads = dict(zip(argnums, jax.grad(loss, argnums)(*args)))
  want = dict(enumerate(ref.ragged_dot_grads(lhs, rhs, sizes, grad_out, **kw)))
  for i, g in grads.items():
    ref.assert_close(g, want[i], ref.RAGGED_GRAD_TOLERANCE[dtype], ["lhs", "rhs", "bias"][i])
  assert not np.asarray(grads[0], np.float64)[elsewhere].any()


@pytest.mark.parametrize("in_f32", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32, jnp.int8, jnp.float8_e4m3fn])
def test_k_tail_mask_zeroes_stale_data_exactly(dtype, in_f32):
  """The last k block past the array end may hold NaN (int8: any code): the mask makes it
  exactly 0 and keeps the rest bit for bit, in the input dtype (1-byte weights are masked
  as codes, not widened first), along either axis (lhs: 1, rhs: 0)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((16, 256)).astype(np.float32) * 8
  x[:, 200:] = -128 if dtype == jnp.int8 else np.nan
  for axis, block in ((1, x), (0, x.T)):
    stored = jnp.asarray(block).astype(dtype)
    out = K._mask_k_tail(stored, axis, 200, in_f32)
    assert out.dtype == dtype
    kept = np.asarray(stored.astype(jnp.float32))
    got = np.asarray(out.astype(jnp.float32))
    tail = (slice(None), slice(200, None)) if axis == 1 else (slice(200, None), slice(None))
    head = (slice(None), slice(None, 200)) if axis == 1 else (slice(None, 200), slice(None))
    assert (kept[tail] != 0).all() and (got[tail] == 0).all()
    np.testing.assert_array_equal(got[head], kept[head])


@pytest.mark.parametrize("quant", sorted(QUANT))
def test_every_weight_code_dequantizes_exactly(quant):
  """All 256 codes of a 1-byte weight, one per output column (k = 1, lhs 1, scale 1), come
  out as their exact values by ml_dtypes' own conversion: float8_e4m3fn's subnormals, its
  largest normals (+-448) and both NaN codes (0x7F, 0xFF; it has no inf) included. Zero's
  sign is the f32 accumulator's (0 + -0 = +0), so +-0 compare equal."""
  codes = np.arange(256, dtype=np.uint8).view(np.int8 if quant == "int8"
                                               else ml_dtypes.float8_e4m3fn)
  expected = codes.astype(np.float32)
  assert np.isnan(expected).sum() == (2 if quant != "int8" else 0)
  scale = jnp.ones((1, 256), jnp.float32)
  for dtype, transpose_rhs in ((jnp.float32, False), (jnp.bfloat16, True)):   # both layouts
    rhs = jnp.asarray(codes.reshape((1, 256, 1) if transpose_rhs else (1, 1, 256)))
    out = K.ragged_dot(jnp.ones((1, 1), dtype), rhs, jnp.ones(1, jnp.int32),
                       transpose_rhs=transpose_rhs, rhs_scale=scale, interpret=True)
    assert out.dtype == dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32))[0], expected,
                                  f"{quant} {dtype.__name__} transpose_rhs={transpose_rhs}")


@pytest.mark.parametrize("block_k", [128, 256])   # two k blocks, the last a tail; one of all k
def test_rows_outside_local_groups_never_leak(block_k):
  """NaN / inf in rows of other groups or past sum(group_sizes) stay out of the results,
  through the float32 accumulator (two k blocks) and without it (one block covers k)."""
  m, k, n = 40, 130, 70
  sizes = np.array([6, 9, 0, 11], np.int32)    # sum 26 < m
  rng = np.random.default_rng(0)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  lhs[:6] = np.nan                                   # group 0: another shard's
  lhs[26:] = np.inf                                  # past the end
  rhs = rng.standard_normal((2, k, n)).astype(np.float32)
  gs = jnp.asarray(sizes)
  fn = lambda x, w: K.ragged_dot(x, w, gs, group_offset=1, interpret=True, block_m=8,
                                 block_k=block_k)
  out = np.asarray(fn(jnp.asarray(lhs), jnp.asarray(rhs)))
  expected = ref.ragged_dot(np.nan_to_num(lhs, posinf=0.0), rhs, sizes, group_offset=1)
  ref.assert_close(out, expected, ref.RAGGED_TOLERANCE["float32"], "out")
  assert not out[:6].any() and not out[15:].any()
  d_lhs, d_rhs = jax.grad(lambda x, w: jnp.sum(fn(x, w)), (0, 1))(jnp.asarray(lhs),
                                                               jnp.asarray(rhs))
  assert np.isfinite(np.asarray(d_rhs)).all()
  assert not np.asarray(d_lhs)[:6].any() and not np.asarray(d_lhs)[15:].any()
  assert not np.asarray(d_rhs)[1].any()   # the empty group's gradient is exactly 0


def _weight_fetches(table, slots):
  """Weight-block DMAs of a grid over `table`'s entries [fields, entries], `slots` visits
  per step: a slot fetches when its block index differs from its last one (every slot
  fetches at the first step)."""
  held, fetches = {}, 0
  for v in range(table.shape[1]):
    block = table[K._RHS_GROUP, v]
    if held.get(v % slots) != block:
      held[v % slots], fetches = block, fetches + 1
  return fetches


@given(groupings(max_m=300), st.sampled_from([8, 16, 64, 128]), st.booleans(), st.booleans())
def test_visit_table_covers_every_tile_once_in_order(grouping, block_m, zero_visits, paired):
  m, sizes, offset, num_local = grouping
  metadata = lambda paired: K.group_metadata(
      jnp.asarray(sizes), offset, num_local_groups=num_local, m=m, block_m=block_m,
      num_k_tiles=3, zero_visits=zero_visits, paired=paired, interpret=True)
  table, num_visits = metadata(paired)
  num_v = K.max_visits(m, block_m, num_local, paired)
  full = np.asarray(table).reshape(K._NUM_FIELDS, num_v)
  assert int(num_visits) < num_v
  table = full[:, : int(num_visits)]
  # No-op entries keep the blocks of their slot's last entry, so their slot fetches
  # nothing: the one after the last visit, and in a paired table those at odd entries with
  # no group (there, a zero visit opens a step: it is never at an odd entry).
  no_ops = [int(num_visits)]
  if paired:
    no_ops += [v for v in range(1, table.shape[1], 2) if table[K._GROUP, v] == num_local]
  for v in no_ops:
    src = max(v - 2, 0)
    assert full[K._GROUP, v] == num_local
    assert full[K._RHS_GROUP, v] == full[K._RHS_GROUP, src]
    assert full[K._K_PIN, v] == full[K._K_PIN, src]
    assert full[K._TILE, v] == full[K._TILE, max(v - 1, 0)]
  if paired:
    steps = full[:, : 2 * (-(-int(num_visits) // 2))].reshape(K._NUM_FIELDS, -1, 2)
    # A step's two entries share a row tile (its lhs and out blocks) ...
    assert (steps[K._TILE, :, 0] == steps[K._TILE, :, 1]).all()
    # ... and the weights are fetched no more often than with one visit per step (plus,
    # at most, the second slot's first fetch).
    one, one_count = metadata(False)
    one = np.asarray(one).reshape(K._NUM_FIELDS, -1)[:, : int(one_count)]
    assert _weight_fetches(steps.reshape(K._NUM_FIELDS, -1), 2) <= _weight_fetches(one, 1) + 1
    # The real visits are the unpaired table's, in order.
    real = table[:, table[K._GROUP] < num_local]
    np.testing.assert_array_equal(real, one[:, one[K._GROUP] < num_local])
  group, tile, start, end = table[K._GROUP], table[K._TILE], table[K._ROW_START], table[K._ROW_END]
  ids = ref.local_row_groups(sizes, offset, num_local, m)
  tiles_m = -(-m // block_m)
  assert (np.diff(tile) >= 0).all() and tile.min() >= 0 and tile.max() < tiles_m
  for v in range(table.shape[1]):
    if group[v] < num_local:   # a real visit: its rows are exactly its group's rows in the tile
      rows = np.arange(tile[v] * block_m, min((tile[v] + 1) * block_m, m))
      mine = rows[(rows >= start[v]) & (rows < end[v])]
      assert (ids[mine] == group[v]).all()
  # Every row of a local group is covered by exactly one visit of its group.
  covered = np.zeros(m, int)
  for v in range(table.shape[1]):
    if group[v] < num_local:
      lo, hi = max(start[v], tile[v] * block_m), min(end[v], (tile[v] + 1) * block_m)
      covered[lo:hi] += 1
  assert (covered == (ids < num_local)).all()
  if zero_visits:
    assert set(tile) == set(range(tiles_m))          # every output tile is written
    assert (np.diff(group[group < num_local]) >= 0).all()
  else:
    visited = group[group < num_local] if paired else group   # (a paired table's no-ops)
    assert set(visited) == set(range(num_local))     # every group's gradient is written
    assert (np.diff(visited) >= 0).all()


def test_empty_problems():
  gs = jnp.asarray([0, 0], jnp.int32)
  out = K.ragged_dot(jnp.zeros((0, 8)), jnp.ones((2, 8, 5)), gs, interpret=True)
  assert out.shape == (0, 5)
  out = K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)), gs, interpret=True)
  assert out.shape == (4, 5) and not np.asarray(out).any()


@pytest.mark.parametrize("call, message", [
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 9, 5)), jnp.ones(2, jnp.int32)), "k=8"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5), jnp.bfloat16),
                          jnp.ones(2, jnp.int32)), "no silent casts"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)), jnp.ones(2)), "int32"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((3, 8, 5)), jnp.ones(2, jnp.int32)),
     "fewer than"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5), jnp.int8),
                          jnp.ones(2, jnp.int32)), "rhs_scale"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)), jnp.ones(2, jnp.int32),
                          bias=jnp.ones((2, 4))), "bias must have shape"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)), jnp.ones(2, jnp.int32),
                          activation="swish"), "activation"),
    (lambda: K.gated_ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)),
                                jnp.ones(2, jnp.int32)), "even"),
    (lambda: K.gated_ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 6)), jnp.ones(2, jnp.int32),
                                layout="blocked"), "layout"),
    (lambda: K.ragged_dot(jnp.ones((4, 8), jnp.float16), jnp.ones((2, 8, 5), jnp.float16),
                          jnp.ones(2, jnp.int32)), "float32 or bfloat16"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)), jnp.ones(2, jnp.int32),
                          vmem_limit_bytes=10**12), "exceeds"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5), jnp.float8_e4m3fn),
                          jnp.ones(2, jnp.int32), rhs_scale=jnp.ones((2, 5)), lhs_quant="int8"),
     "rhs must be int8"),
    (lambda: K.ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 5)), jnp.ones(2, jnp.int32),
                          lhs_quant="int8"), "rhs must be int8"),
    (lambda: K.gated_ragged_dot(jnp.ones((4, 8)), jnp.ones((2, 8, 6), jnp.int8),
                                jnp.ones(2, jnp.int32), rhs_scale=jnp.ones((2, 6)),
                                lhs_quant="int4"), "lhs_quant"),
])
def test_bad_input_gives_clear_error(call, message):
  with pytest.raises((ValueError, TypeError), match=message):
    call()


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p", "v7"])
@pytest.mark.parametrize("m, k, n, groups", [
    (8, 2048, 768, 128), (65536, 2048, 768, 128), (512, 4096, 14336, 8),
    (65536, 14336, 4096, 8), (4096, 2880, 2880, 32), (1, 1, 1, 1)])
def test_default_tiles_fit_the_chip_budget(chip, m, k, n, groups):
  c = chips.get_chip(chip)
  for dtype, rhs_dtype, num_rhs in [(jnp.bfloat16, jnp.bfloat16, 1), (jnp.bfloat16, jnp.bfloat16, 2),
                                    (jnp.bfloat16, jnp.int8, 2), (jnp.float32, jnp.float32, 1)]:
    t = K.gmm_tiling(m, k, n, num_groups=groups, lhs_dtype=dtype, rhs_dtype=rhs_dtype,
                     out_dtype=dtype, num_rhs=num_rhs, chip=chip)
    tuned = K.tuned_blocks(m, k, n, num_groups=groups, lhs_dtype=dtype, rhs_dtype=rhs_dtype,
                           out_dtype=dtype, num_rhs=num_rhs, chip=chip)
    # The heuristic stays in the chip's default limit but for one k block (a limit raised
    # up to _ONE_K_BLOCK_MAX_LIMIT) and the whole weight per visit (an n no lane block
    # divides, gpt-oss's 2880); a tuning-table entry may ask for more too (all in
    # test_ragged_dot_tiling.py), never past the chip's maximum.
    whole_weight = (t.block_k, t.block_n) == (k, n)
    one_k_block = t.block_k == k and t.vmem_limit_bytes <= K._ONE_K_BLOCK_MAX_LIMIT
    assert (t.vmem_limit_bytes == c.default_scoped_vmem_bytes or tuned or whole_weight
            or one_k_block)
    assert t.vmem_limit_bytes <= c.max_vmem_limit_bytes
    assert t.vmem_plan_bytes <= vmem.vmem_budget(c, t.vmem_limit_bytes)
    assert t.block_m == m or t.block_m % vmem.sublane_multiple(dtype) == 0
    assert t.block_k == k or t.block_k % 128 == 0
    assert t.block_n == n or t.block_n % 128 == 0
  for num_rhs in (1, 2):   # int8 rows (lhs_quant): 32-row int8 tiles, bf16 out
    t = K.gmm_tiling(m, k, n, num_groups=groups, lhs_dtype=jnp.int8, rhs_dtype=jnp.int8,
                     out_dtype=jnp.bfloat16, num_rhs=num_rhs, chip=chip)
    assert t.vmem_limit_bytes <= c.max_vmem_limit_bytes
    assert t.vmem_plan_bytes <= vmem.vmem_budget(c, t.vmem_limit_bytes)
    assert t.block_m == m or t.block_m % vmem.sublane_multiple(jnp.int8) == 0
  t = K.tgmm_tiling(m, k, n, num_groups=groups, lhs_dtype=jnp.bfloat16,
                    grad_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip=chip)
  assert t.vmem_plan_bytes <= vmem.vmem_budget(c, None)


def test_concatenated_gate_up_blocks_divide_the_half():
  t = K.gmm_tiling(4096, 2048, 768, num_groups=128, lhs_dtype=jnp.bfloat16,
                   rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, num_rhs=2,
                   n_must_divide=768, chip="v5e")
  assert 768 % t.block_n == 0


def test_decode_rows_get_small_tiles_and_prefill_large():
  decode = K.gmm_tiling(64, 2048, 768, num_groups=128, lhs_dtype=jnp.bfloat16,
                        rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip="v6e")
  prefill = K.gmm_tiling(65536, 2048, 768, num_groups=128, lhs_dtype=jnp.bfloat16,
                         rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip="v6e")
  assert decode.block_m == 16 and prefill.block_m == K.MAX_BLOCK_M
  assert decode.block_k == 2048   # whole k: weights fetched once per group


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_decode_rows_with_one_byte_weights_take_two_visits_per_step(chip):
  """`_paired_tiling`: 1-byte weights at decode (m <= PAIRED_MAX_ROWS, several groups per
  row tile, one k block) get two visits per grid step, within the chip's budget; bf16
  weights, more rows, groups as large as a row tile and explicit blocks keep one."""
  shape = dict(lhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip=chip)
  for m in (64, 512):
    for quant in (jnp.int8, jnp.float8_e4m3fn):
      t = K.gmm_tiling(m, 768, 2048, num_groups=128, rhs_dtype=quant, **shape)
      assert (t.visits_per_step, t.block_k) == (2, 768) and t.block_m < m, t
      assert t.vmem_plan_bytes <= vmem.vmem_budget(chips.get_chip(chip), t.vmem_limit_bytes)
  one = lambda m, groups=128, **kw: K.gmm_tiling(
      m, 768, 2048, num_groups=groups, **{"rhs_dtype": jnp.int8, **shape, **kw})
  assert one(64, rhs_dtype=jnp.bfloat16).visits_per_step == 1
  assert one(2 * K.PAIRED_MAX_ROWS).visits_per_step == 1
  assert one(512, groups=8).visits_per_step == 1         # 64 rows a group
  assert one(64, block_m=16).visits_per_step == 1


_PAIRED_CASES = [   # (sizes, offset, num_local, gated, lhs_quant): m = 64 rows
    # groups across row-tile boundaries, an empty one, other shards' rows before and
    # after the local groups, rows past the end
    ([3, 20, 1, 0, 9, 17, 2, 5, 4, 1], 1, 8, False, None),
    ([3, 20, 1, 0, 9, 17, 2, 5, 4, 1], 1, 8, True, None),
    ([1] * 40, 0, 40, False, None),                 # decode: one row a group
    ([2, 30, 1, 1, 1, 1, 25], 0, 7, False, "int8"),  # a group over two 32-row tiles
    ([2, 30, 1, 1, 1, 1, 25], 0, 7, True, "int8"),
]


@pytest.mark.parametrize("sizes,offset,num_local,gated,lhs_quant,quant", [
    (*case, quant) for case in _PAIRED_CASES
    for quant in (("int8",) if case[-1] else ("int8", "float8_e4m3fn"))])
def test_two_visits_per_step_match_reference(sizes, offset, num_local, gated, lhs_quant, quant,
                                             monkeypatch):
  """The paired kernel (`_paired_tiling`) against the float64 grouped matmul: row tiles
  with odd and even visit counts, groups across tiles, an empty group, rows of other
  groups and rows past the end (exact zeros, checked by `_check_forward`)."""
  m, k, half = 64, 130, (128 if gated else 100)   # a gated call's block_n divides half
  p = dict(m=m, sizes=np.array(sizes, np.int32), offset=offset, num_local=num_local, k=k,
           dtype="bfloat16", transpose_rhs=False, quant=quant, bias=True, block_m=None,
           block_k=None, block_n=None, chip="v6e", seed=3)
  if gated:
    p.update(n=2 * half, layout="concatenated", activation="silu")
  else:
    p.update(n=half, activation="gelu_tanh")
  calls = []   # the tilings the op's kernel calls ran with
  real_call = K._gmm_call
  monkeypatch.setattr(K, "_gmm_call", lambda *a, **kw: calls.append(a[6]) or real_call(*a, **kw))
  _check_forward(p, lhs_quant=lhs_quant)
  assert calls and all(t.visits_per_step == 2 for t in calls), calls


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32])
def test_an_axis_no_multiple_of_256_divides_gets_a_whole_number_of_blocks(chip, out_dtype):
  """gpt-oss's gate/up (n = 2I = 5760 = 22.5 x 256): the heuristic takes a multiple of 128
  that divides n rather than leave the last block partly empty; an axis a multiple of 256
  divides (Mixtral's 14336) keeps multiples of 256."""
  t = K.gmm_tiling(64, 2880, 5760, num_groups=32, lhs_dtype=jnp.bfloat16,
                   rhs_dtype=jnp.bfloat16, out_dtype=out_dtype, chip=chip)
  assert 5760 % t.block_n == 0 and t.block_n >= 256
  assert all(b % 256 == 0 or b in (128, 14336) for b in K._lane_block_candidates(14336, None, None))
  assert {1152, 1920} <= set(K._lane_block_candidates(5760, None, None))


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("quant", [None, "int8"])
def test_the_whole_weight_over_an_n_no_lane_block_divides_matches_reference(chip, quant):
  """n = 2100 (> MAX_BLOCK_N, not a multiple of 128): the heuristic takes the whole weight
  per visit, a 2100-column block that ends mid-lane, over groups that share row tiles."""
  sizes = np.array([5, 0, 19, 8], np.int32)
  p = dict(m=40, sizes=sizes, offset=0, num_local=4, k=200, n=2100, dtype="bfloat16",
           transpose_rhs=False, quant=quant, bias=True, block_m=None, block_k=None,
           block_n=None, chip=chip, seed=7, activation=None)
  t = K.gmm_tiling(40, 200, 2100, num_groups=4, lhs_dtype=jnp.bfloat16,
                   rhs_dtype=QUANT[quant][0] if quant else jnp.bfloat16,
                   out_dtype=jnp.bfloat16, chip=chip)
  assert (t.block_k, t.block_n) == (200, 2100)
  _check_forward(p)


def test_vmem_limit_is_passed_through():
  t = K.gmm_tiling(4096, 2048, 768, num_groups=8, lhs_dtype=jnp.bfloat16,
                   rhs_dtype=jnp.bfloat16, out_dtype=jnp.bfloat16, chip="v6e",
                   vmem_limit_bytes=64 * vmem.MiB)
  assert t.vmem_limit_bytes == 64 * vmem.MiB
  assert t.vmem_plan_bytes <= 32 * vmem.MiB


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("rows", [4, K._V5E_STRIDED_GATE_MIN_ROWS - 1,
                                  K._V5E_STRIDED_GATE_MIN_ROWS])
@pytest.mark.parametrize("layout", ["interleaved", "concatenated"])
def test_gated_halves_are_the_gate_and_up_columns(chip, rows, layout):
  """The XLA gate's (gate, up) split (gate_pass's fallback, and its route for concatenated
  halves), on either side of v5e's strided threshold,
  equals the columns picked by index (a permutation: exact)."""
  half = 6
  z = np.arange(rows * 2 * half, dtype=np.float32).reshape(rows, 2 * half)
  gate_cols = np.arange(0, 2 * half, 2) if layout == "interleaved" else np.arange(half)
  gate, up = K._gated_halves(jnp.asarray(z), layout, half, chip)
  np.testing.assert_array_equal(np.asarray(gate), z[:, gate_cols])
  np.testing.assert_array_equal(np.asarray(up), z[:, gate_cols + (1 if layout == "interleaved"
                                                                  else half)])


@pytest.mark.parametrize("m, k, half, groups, fused", [
    (8, 256, 64, 4, False),    # decode-like: the gate pass on a small f32 intermediate
    (64, 3, 8, 2, True),       # prefill-like: one gated kernel de-interleaves ("lanes")
])
@pytest.mark.parametrize("activation", ["silu", "gpt_oss", "clamped_silu"])
def test_interleaved_gate_up_picks_the_cheaper_route(m, k, half, groups, fused, activation):
  rng = np.random.default_rng(m)
  sizes = np.array([m // 2] + [m // (2 * (groups - 1))] * (groups - 1), np.int32)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((groups, k, 2 * half)) / np.sqrt(k)).astype(np.float32)
  b = rng.standard_normal((groups, 2 * half)).astype(np.float32)
  fn = lambda x, w, b: K.gated_ragged_dot(x, w, jnp.asarray(sizes), activation=activation,
                                          layout="interleaved", bias=b, interpret=True)
  jaxpr = str(jax.make_jaxpr(fn)(x, w, b))
  assert ("ragged_dot_gated" in jaxpr) == fused
  assert ("ragged_dot_gate_pass" in jaxpr) != fused
  expected = ref.ragged_dot(x, w, sizes, bias=b, gated_name=activation, layout="interleaved")
  ref.assert_close(fn(x, w, b), expected, ref.RAGGED_TOLERANCE["float32"], "out")
  g = rng.standard_normal((m, half)).astype(np.float32)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a) * g), (0, 1, 2))(x, w, b)
  for got, want, what in zip(grads, ref.ragged_dot_grads(
      x, w, sizes, g, bias=b, gated_name=activation, layout="interleaved"), "xwb"):
    ref.assert_close(got, want, ref.RAGGED_GRAD_TOLERANCE["float32"], what)


@pytest.mark.parametrize("m, half", [(5, 32), (64, 128), (70, 200)])
@pytest.mark.parametrize("activation, out_dtype", [("gpt_oss", "bfloat16"), ("silu", "float32")])
def test_gate_pass_matches_float64_reference(m, half, activation, out_dtype):
  """The gate pass's kernel on interleaved columns: fewer rows than a step, one step, a
  partial last step (64-row steps); half under a vreg, one vreg, and a partial chunk.
  Against the float64 gate of the columns picked by index, at the output dtype's
  rounding; rows of zeros (no group) give zeros."""
  rng = np.random.default_rng(m + half)
  z = (rng.standard_normal((m, 2 * half)) * 4).astype(np.float32)
  z[0] = 0.0
  ep = K.Epilogue(activation=activation, gated=True)
  assert K.gate_pass_rows(m, half, "interleaved", jnp.dtype(out_dtype), "v5e") == min(m, 64)
  fn = lambda z: K.gate_pass(z, "interleaved", ep, jnp.dtype(out_dtype), "v5e",
                             interpret=True)
  assert "ragged_dot_gate_pass" in str(jax.make_jaxpr(fn)(z))
  got = np.asarray(fn(jnp.asarray(z)).astype(jnp.float32), np.float64)
  want = ref.gated(activation, z[:, 0::2], z[:, 1::2])
  rtol = 2.0 ** -8 if out_dtype == "bfloat16" else 1e-5
  np.testing.assert_allclose(got, want, rtol=rtol, atol=1e-6)
  np.testing.assert_array_equal(got[0], 0.0)


def test_gate_pass_takes_xla_where_no_row_block_fits():
  """A width whose 16-row block overflows the VMEM budget goes to XLA's gate: the same
  values, no kernel."""
  half = 1 << 17
  assert K.gate_pass_rows(16, half, "interleaved", jnp.dtype("float32"), "v5e") is None
  ep = K.Epilogue(activation="silu", gated=True)
  z = jax.ShapeDtypeStruct((16, 2 * half), jnp.float32)
  fn = lambda z: K.gate_pass(z, "interleaved", ep, jnp.float32, "v5e", interpret=True)
  assert "pallas_call" not in str(jax.make_jaxpr(fn)(z))


@pytest.mark.parametrize("width", [64, 128, 192, 256, 400, 512])
def test_deinterleave_lanes_is_exact(width):
  """The "lanes" route's epilogue split: the even / odd columns of z bit for bit, over every
  float32 exponent (denormals, zeros of both signs, infinities and NaNs included) and
  widths of one vreg or less, one chunk and a part, and whole chunks. A NaN stays in its
  own column (the stale columns past the weight's end reach only dropped output columns)."""
  rng = np.random.default_rng(width)
  bits = rng.integers(0, 2 ** 32, (16, width), dtype=np.uint64).astype(np.uint32)
  bits[0, :8] = [0, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 1, 0x807FFFFF, 0x7F7FFFFF]
  z = bits.view(np.float32)
  gate, up = K._deinterleave_lanes(jnp.asarray(z))
  np.testing.assert_array_equal(np.asarray(gate).view(np.uint32), bits[:, 0::2])
  np.testing.assert_array_equal(np.asarray(up).view(np.uint32), bits[:, 1::2])


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_lanes_route_partial_last_block_matches_reference(transpose_rhs, dtype):
  """gpt-oss-like interleaved gate/up at prefill proportions ("lanes": weights smaller
  than the float32 intermediate), half = 200 over block_n 128: the last n tile reads 144
  of its 256 weight columns, the rest past the array's end. Either weight layout, bias
  and gpt_oss's clamped gate, forward and gradients."""
  m, k, half, groups = 96, 40, 200, 3
  assert K.gate_up_route(m, 2 * half, "interleaved", groups * k * 2 * half * 4) == "lanes"
  rng = np.random.default_rng(7)
  dt = NP[dtype]
  sizes = np.array([40, 0, 50], np.int32)   # an empty group; 6 rows past the groups
  x = rng.standard_normal((m, k)).astype(dt)
  w = (rng.standard_normal((groups, 2 * half, k) if transpose_rhs else (groups, k, 2 * half))
       / np.sqrt(k)).astype(dt)
  b = rng.standard_normal((groups, 2 * half)).astype(dt)
  fn = lambda x, w, b: K.gated_ragged_dot(
      x, w, jnp.asarray(sizes), activation="gpt_oss", layout="interleaved", bias=b,
      transpose_rhs=transpose_rhs, block_n=128, interpret=True)
  assert "ragged_dot_gated" in str(jax.make_jaxpr(fn)(x, w, b))
  common = dict(bias=b, gated_name="gpt_oss", layout="interleaved",
                transpose_rhs=transpose_rhs)
  out = fn(x, w, b)
  ref.assert_close(out, ref.ragged_dot(x, w, sizes, **common), ref.RAGGED_TOLERANCE[dtype],
                   "out")
  assert not np.asarray(out, np.float64)[sizes.sum():].any()
  g = rng.standard_normal((m, half)).astype(dt)
  grads = jax.grad(lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * g), (0, 1, 2))(x, w, b)
  for got, want, what in zip(grads, ref.ragged_dot_grads(x, w, sizes, g, **common), "xwb"):
    ref.assert_close(got, want, ref.RAGGED_GRAD_TOLERANCE[dtype], what)
