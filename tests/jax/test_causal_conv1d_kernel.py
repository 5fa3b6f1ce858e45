"""Causal conv1d Pallas kernels (forward, backward, decode update) in interpret mode against
the float64 token-loop references of tests/reference_linear.py (JAX only).

Tolerances are reference_linear's CONV_TOLERANCE / CONV_GRAD_TOLERANCE, keyed by the
coarsest dtype among x and the weight; why each holds is written there. Interpret mode
leaves output memory a kernel never writes as NaN, so `assert_close`'s finiteness check
catches rows or channels a kernel forgets.

Shapes are tiny (D <= 260, T <= 70) but forced tiles (block_t of 1-3 halos, block_d 128)
give several T and channel blocks, halos on both sides, and partial last blocks.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference as ref
import reference_linear as rl
from tpu_kernels import causal_conv1d as K, chips, vmem

DTYPES = ["float32", "bfloat16"]
# Widths: Transformers' families use 2 (tests), 3 (LFM2), 4 (most), 7 (LFM3); 1 is the edge.
WIDTHS = [1, 2, 3, 4, 4, 7]
# Channels: below, at and past one 128-lane block, and over two with block_d = 128.
DIMS = [1, 3, 8, 100, 128, 130, 260]
# Packed-sequence lengths: 0 (an empty sequence), many of 1, some longer than W.
SEQ_LENGTHS = [0, 1, 1, 1, 2, 3, 5, 9, 17]


def _array(rng, shape, dtype, scale=1.0):
  return jnp.asarray((rng.standard_normal(shape) * scale).astype(ref.NP_DTYPES[dtype]))


@st.composite
def conv_problems(draw, max_t=70, max_b=3):
  packing = draw(st.sampled_from([None, None, "cu_seqlens", "seq_idx"]))
  batch = 1 if packing == "cu_seqlens" else draw(st.integers(1, max_b))
  seqlen = draw(st.integers(1, max_t))
  width = draw(st.sampled_from(WIDTHS))
  x_dtype = draw(st.sampled_from(DTYPES))
  halo = K.halo_rows(width, jnp.dtype(x_dtype))
  multiple = draw(st.sampled_from([None, 1, 2, 3]))
  p = dict(batch=batch, seqlen=seqlen, dim=draw(st.sampled_from(DIMS)), width=width,
           x_dtype=x_dtype, w_dtype=draw(st.sampled_from(DTYPES)),
           bias=draw(st.booleans()), activation=draw(st.sampled_from([None, "silu", "swish"])),
           block_t=None if multiple is None else multiple * halo,
           block_d=draw(st.sampled_from([None, 128])), packing=packing,
           cu_seqlens=None, seq_idx=None, seed=draw(st.integers(0, 2**31 - 1)))
  if packing == "cu_seqlens":
    lengths = draw(st.lists(st.sampled_from(SEQ_LENGTHS), min_size=1, max_size=12))
    cu = np.minimum(np.concatenate([[0], np.cumsum(lengths)]), seqlen)
    if draw(st.booleans()):   # no trailing padding: the last sequence ends at T
      cu[-1] = seqlen
    p["cu_seqlens"] = cu.astype(np.int32)
  elif packing == "seq_idx":
    ids = []
    for _ in range(batch):
      lengths = draw(st.lists(st.sampled_from(SEQ_LENGTHS[1:]), min_size=1, max_size=12))
      row = np.repeat(np.arange(len(lengths)), lengths)[:seqlen]
      ids.append(np.concatenate([row, np.full(seqlen - len(row), len(lengths))]))
    p["seq_idx"] = np.stack(ids).astype(np.int32)
  return p


def _inputs(p):
  rng = np.random.default_rng(p["seed"])
  x = _array(rng, (p["batch"], p["dim"], p["seqlen"]), p["x_dtype"])
  w = _array(rng, (p["dim"], p["width"]), p["w_dtype"], 0.5)
  b = _array(rng, (p["dim"],), p["w_dtype"], 0.5) if p["bias"] else None
  return rng, x, w, b


# Jitted once per module: interpret mode run eagerly dispatches the whole grid op by op on
# every call (about 0.3 s even for a shape seen before); jitted, a seen shape costs nothing.
_STATIC = ("activation", "block_t", "block_d", "channels_last")


@functools.partial(jax.jit, static_argnames=_STATIC)
def conv(x, w, b, cu_seqlens=None, seq_idx=None, *, activation=None, block_t=None,
         block_d=None, channels_last=False):
  return K.causal_conv1d_fn(x, w, b, activation, cu_seqlens=cu_seqlens, seq_idx=seq_idx,
                            channels_last=channels_last, block_t=block_t, block_d=block_d,
                            interpret=True)


@functools.partial(jax.jit, static_argnames=_STATIC)
def conv_vjp(x, w, b, g, cu_seqlens=None, seq_idx=None, **static):
  """(out, (dx, dweight, dbias or None)) of sum(g * conv)."""
  out, vjp = jax.vjp(lambda a, c, d: conv(a, c, d, cu_seqlens, seq_idx, **static), x, w, b)
  return out, vjp(g)


@functools.partial(jax.jit, static_argnames=("activation", "block_b", "block_d"))
def update(x, state, w, b, *, activation=None, block_b=None, block_d=None):
  return K.causal_conv1d_update(x, state, w, b, activation, block_b=block_b, block_d=block_d,
                                interpret=True)


def _static(p):
  return dict(activation=p["activation"], block_t=p["block_t"], block_d=p["block_d"])


def _tol(p, table):
  return table[rl.coarsest(p["x_dtype"], p["w_dtype"])]


def _a_third_of_the_examples():
  """For the tests whose every example compiles several new shapes in interpret mode
  (~5 s each): a third of the profile's examples (4 in CI, 50 in the thorough profile)."""
  return settings(max_examples=max(2, settings.default.max_examples // 3))


@given(conv_problems())
def test_forward_matches_reference(p):
  _, x, w, b = _inputs(p)
  out = conv(x, w, b, p["cu_seqlens"], p["seq_idx"], **_static(p))
  assert out.shape == x.shape and out.dtype == x.dtype
  expected, _, scale = rl.causal_conv1d(x, w, b, p["activation"], p["cu_seqlens"],
                                        p["seq_idx"])
  ref.assert_close(out, expected, _tol(p, rl.CONV_TOLERANCE), "out", scale)


@_a_third_of_the_examples()
@given(conv_problems(max_t=40))
def test_gradients_match_reference(p):
  rng, x, w, b = _inputs(p)
  g = _array(rng, x.shape, p["x_dtype"])
  _, (dx, dw, db) = conv_vjp(x, w, b, g, p["cu_seqlens"], p["seq_idx"], **_static(p))
  assert dx.dtype == x.dtype and dw.dtype == w.dtype
  rdx, rdw, rdb, scales = rl.causal_conv1d_grads(x, w, b, p["activation"], g,
                                                 p["cu_seqlens"], p["seq_idx"])
  tol = _tol(p, rl.CONV_GRAD_TOLERANCE)
  ref.assert_close(dx, rdx, tol, "dx", scales["dx"])
  ref.assert_close(dw, rdw, tol, "dweight", scales["dweight"])
  if b is not None:
    assert db.dtype == b.dtype
    ref.assert_close(db, rdb, tol, "dbias", scales["dbias"])


@st.composite
def update_problems(draw):
  width = draw(st.sampled_from(WIDTHS))
  return dict(batch=draw(st.sampled_from([1, 3, 5, 17])), dim=draw(st.sampled_from(DIMS)),
              width=width,
              state_len=max(width - 1, 0) + draw(st.sampled_from([0, 0, 1, 3])),
              seqlen=draw(st.sampled_from([1, 1, 2, 3])), two_d=draw(st.booleans()),
              x_dtype=draw(st.sampled_from(DTYPES)), w_dtype=draw(st.sampled_from(DTYPES)),
              s_dtype=draw(st.sampled_from(DTYPES)), bias=draw(st.booleans()),
              activation=draw(st.sampled_from([None, "silu"])),
              block_b=draw(st.sampled_from([None, 2, 8, 16])),
              block_d=draw(st.sampled_from([None, 128])), seed=draw(st.integers(0, 2**31 - 1)))


@given(update_problems())
def test_update_matches_reference(p):
  rng = np.random.default_rng(p["seed"])
  state_len = max(p["state_len"], 1)
  x = _array(rng, (p["batch"], p["dim"], p["seqlen"]), p["x_dtype"])
  state = _array(rng, (p["batch"], p["dim"], state_len), p["s_dtype"])
  w = _array(rng, (p["dim"], p["width"]), p["w_dtype"], 0.5)
  b = _array(rng, (p["dim"],), p["w_dtype"], 0.5) if p["bias"] else None
  two_d = p["two_d"] and p["seqlen"] == 1
  block_b = p["block_b"]
  if (p["seqlen"] == 1 and block_b is not None and block_b < p["batch"]
      and block_b % vmem.sublane_multiple(x.dtype)):
    block_b = None   # one-step updates take (block_b, block_d) x blocks: whole sublane tiles
  out, new_state = update(x[:, :, 0] if two_d else x, state, w, b,
                          activation=p["activation"], block_b=block_b,
                          block_d=p["block_d"])
  expected, expected_state, scale = rl.causal_conv1d_update(x, state, w, b, p["activation"])
  assert out.dtype == x.dtype and new_state.dtype == state.dtype
  assert new_state.shape == state.shape
  if two_d:
    assert out.shape == x.shape[:2]
    out = out[:, :, None]
  ref.assert_close(out, expected, rl.CONV_TOLERANCE[rl.coarsest(p["x_dtype"], p["w_dtype"])],
                   "out", scale)
  # The state is data movement and casts only: exact.
  np.testing.assert_array_equal(ref.f64(new_state), expected_state)


@_a_third_of_the_examples()
@given(st.sampled_from([1, 2, 5, 17, 30]), st.integers(1, 6), st.sampled_from([2, 3, 4]),
       st.sampled_from([0, 1]), st.sampled_from(DTYPES), st.sampled_from(DTYPES),
       st.booleans(), st.integers(0, 2**31 - 1))
def test_prefill_then_updates_equal_one_pass(prefill, steps, width, extra_state, x_dtype,
                                             w_dtype, bias, seed):
  """Transformers' cached generation: causal_conv1d_fn over the prompt, the cache keeping the
  last S inputs (zero-padded), then causal_conv1d_update one or two tokens at a time: the
  outputs equal one causal_conv1d_fn over the whole sequence."""
  rng = np.random.default_rng(seed)
  batch, dim, state_len = 2, 130, width - 1 + extra_state
  chunks = [int(c) for c in rng.choice([1, 2], steps)]
  total = prefill + sum(chunks)
  x = _array(rng, (batch, dim, total), x_dtype)
  w = _array(rng, (dim, width), w_dtype, 0.5)
  b = _array(rng, (dim,), w_dtype, 0.5) if bias else None
  one_pass = conv(x, w, b, activation="silu", block_t=16)
  outs = [conv(x[:, :, :prefill], w, b, activation="silu")]
  state = K.conv_state_from_prefill(x[:, :, :prefill], state_len)
  assert state.shape == (batch, dim, state_len) and state.dtype == x.dtype
  t = prefill
  for c in chunks:
    out, state = update(x[:, :, t:t + c], state, w, b, activation="silu")
    outs.append(out)
    t += c
  tol = rl.CONV_TOLERANCE[rl.coarsest(x_dtype, w_dtype)]
  _, _, scale = rl.causal_conv1d(x, w, b, "silu")
  ref.assert_close(jnp.concatenate(outs, axis=2), one_pass, tol, "prefill + updates", scale)
  if jnp.dtype(w_dtype).itemsize >= jnp.dtype(x_dtype).itemsize:
    # Rounding through the weight's dtype is exact: the state holds the inputs themselves.
    np.testing.assert_array_equal(np.asarray(state),
                                  np.asarray(K.conv_state_from_prefill(x, state_len)))


@_a_third_of_the_examples()
@given(st.lists(st.sampled_from([1, 1, 2, 3, 6, 7]), min_size=1, max_size=7),
       st.sampled_from([2, 4, 7]), st.sampled_from(DTYPES), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_packed_row_equals_separate_sequences(lengths, width, dtype, trailing_pad, seed):
  """A row packed by cu_seqlens gives each sequence exactly what it gets alone, forward and
  backward (an independent check of the boundaries, without the reference). "Alone": the
  sequences as rows of one batch, right-padded with zeros (causal: padding after a
  sequence changes nothing before it)."""
  # Fixed shapes (T = 52, 9 cu_seqlens entries, 9 rows alone) so that examples share the
  # compiled programs: unused entries repeat the end (empty sequences, themselves a case).
  rng = np.random.default_rng(seed)
  dim, total = 100, 52
  end = sum(lengths) if trailing_pad else total
  x = _array(rng, (1, dim, total), dtype)
  w = _array(rng, (dim, width), dtype, 0.5)
  b = _array(rng, (dim,), dtype, 0.5)
  g = _array(rng, (1, dim, total), dtype)
  cu = np.concatenate([[0], np.cumsum(lengths)[:-1], [end]]).astype(np.int32)
  cu = np.concatenate([cu, np.full(9 - len(cu), end)]).astype(np.int32)
  out, (dx, dw, db) = conv_vjp(x, w, b, g, cu, activation="silu", block_t=16)
  bounds = list(cu) + [total]   # tokens past cu[-1]: one more sequence
  pieces = list(zip(bounds[:-1], bounds[1:]))

  def rows(a):
    return jnp.concatenate([jnp.pad(a[:, :, s:e], ((0, 0), (0, 0), (0, total - (e - s))))
                            for s, e in pieces])

  alone, (adx, adw, adb) = conv_vjp(rows(x), w, b, rows(g), activation="silu", block_t=16)
  tol, grad_tol = rl.CONV_TOLERANCE[dtype], rl.CONV_GRAD_TOLERANCE[dtype]
  for i, (s, e) in enumerate(pieces):
    ref.assert_close(out[0, :, s:e], alone[i, :, :e - s], tol, f"out [{s}, {e})")
    ref.assert_close(dx[0, :, s:e], adx[i, :, :e - s], grad_tol, f"dx [{s}, {e})")
  ref.assert_close(dw, adw, grad_tol, "dweight", float(np.max(np.abs(ref.f64(adw)))) + 1.0)
  ref.assert_close(db, adb, grad_tol, "dbias", float(np.max(np.abs(ref.f64(adb)))) + 1.0)


def test_length_one_sequences_see_only_themselves():
  """Every sequence of length 1: out = act(w[:, W-1] * x + bias), token by token."""
  rng = np.random.default_rng(3)
  x = _array(rng, (1, 8, 20), "float32")
  w = _array(rng, (8, 4), "float32")
  b = _array(rng, (8,), "float32")
  out = conv(x, w, b, np.arange(21, dtype=np.int32), activation="silu", block_t=8)
  z = ref.f64(w)[:, 3, None] * ref.f64(x)[0] + ref.f64(b)[:, None]
  ref.assert_close(out[0], rl.silu(z), rl.CONV_TOLERANCE["float32"], "out")


def test_cu_seqlens_and_seq_idx_agree():
  rng = np.random.default_rng(4)
  x = _array(rng, (1, 16, 30), "float32")
  w = _array(rng, (16, 4), "float32")
  cu = np.array([0, 1, 4, 5, 19, 30], np.int32)
  seq_idx = np.repeat(np.arange(5), np.diff(cu))[None].astype(np.int32)
  a = conv(x, w, None, cu)
  b = conv(x, w, None, None, seq_idx)
  np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(K.positions_from_cu_seqlens(cu, 30))[0, :, 0],
                                np.concatenate([np.arange(n) for n in np.diff(cu)]))


def test_channels_last_is_the_same_conv():
  rng = np.random.default_rng(5)
  x = _array(rng, (2, 130, 37), "bfloat16")
  w = _array(rng, (130, 4), "bfloat16")
  b = _array(rng, (130,), "bfloat16")
  g = _array(rng, (2, 130, 37), "bfloat16")
  out, grads = conv_vjp(x, w, b, g, activation="silu", block_t=16)
  out_cl, grads_cl = conv_vjp(jnp.swapaxes(x, 1, 2), w, b, jnp.swapaxes(g, 1, 2),
                              activation="silu", block_t=16, channels_last=True)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(jnp.swapaxes(out_cl, 1, 2)))
  for a, c in zip(grads, grads_cl):
    c = jnp.swapaxes(c, 1, 2) if c.ndim == 3 else c
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_reference_gradients_match_finite_differences():
  """The reference's adjoint loop against central differences of its own forward (float64,
  packed, with bias and silu): the gradients the kernels are judged by are right."""
  rng = np.random.default_rng(6)
  x = rng.standard_normal((1, 3, 9))
  w = rng.standard_normal((3, 3))
  b = rng.standard_normal(3)
  g = rng.standard_normal((1, 3, 9))
  cu = np.array([0, 1, 5, 9])
  dx, dw, db, _ = rl.causal_conv1d_grads(x, w, b, "silu", g, cu_seqlens=cu)

  def loss(x_, w_, b_):
    return float(np.sum(g * rl.causal_conv1d(x_, w_, b_, "silu", cu_seqlens=cu)[0]))

  h = 1e-6
  for value, grad, name in ((x, dx, "dx"), (w, dw, "dweight"), (b, db, "dbias")):
    numeric = np.zeros_like(value)
    for idx in np.ndindex(value.shape):
      plus, minus = value.copy(), value.copy()
      plus[idx] += h
      minus[idx] -= h
      args = {"dx": (x, w, b), "dweight": (x, w, b), "dbias": (x, w, b)}[name]
      which = {"dx": 0, "dweight": 1, "dbias": 2}[name]
      numeric[idx] = (loss(*[plus if i == which else a for i, a in enumerate(args)])
                      - loss(*[minus if i == which else a for i, a in enumerate(args)])) / (2 * h)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_xla_baseline_matches_reference(dtype):
  """causal_conv1d_reference (the benchmarks' XLA baseline) computes the same conv."""
  rng = np.random.default_rng(7)
  x = _array(rng, (2, 50, 33), dtype)
  w = _array(rng, (50, 4), dtype, 0.5)
  b = _array(rng, (50,), dtype, 0.5)
  expected, _, scale = rl.causal_conv1d(x, w, b, "silu")
  ref.assert_close(K.causal_conv1d_reference(x, w, b, "silu"), expected,
                   rl.CONV_TOLERANCE[dtype], "baseline", scale)


def test_zero_sizes():
  w = jnp.ones((8, 4), jnp.float32)
  assert K.causal_conv1d_fn(jnp.zeros((0, 8, 5)), w, interpret=True).shape == (0, 8, 5)
  assert K.causal_conv1d_fn(jnp.zeros((2, 8, 0)), w, interpret=True).shape == (2, 8, 0)
  state = jnp.ones((2, 8, 3))
  out, new = K.causal_conv1d_update(jnp.zeros((2, 8, 0)), state, w, interpret=True)
  assert out.shape == (2, 8, 0) and np.array_equal(np.asarray(new), np.asarray(state))


# ----------------------------------------------------------------------------- errors

_X = jnp.ones((1, 8, 10), jnp.float32)
_W = jnp.ones((8, 4), jnp.float32)


@pytest.mark.parametrize("kwargs, error, exc", [
    (dict(x=_X.astype(jnp.float16)), "x must be float32 or bfloat16", TypeError),
    (dict(x=jnp.ones((1, 8, 10), jnp.int32)), "x must be float32 or bfloat16", TypeError),
    (dict(weight=_W.astype(jnp.float16)), "weight must be float32 or bfloat16", TypeError),
    (dict(x=_X[0]), "x must be 3-D", ValueError),
    (dict(weight=jnp.ones((7, 4))), r"weight must have shape \(8, W\)", ValueError),
    (dict(weight=jnp.ones((8, 17))), "conv width W=17 is not supported", ValueError),
    (dict(bias=jnp.ones(7)), r"bias must have shape \(8,\)", ValueError),
    (dict(bias=jnp.ones(8, jnp.bfloat16)), "bias dtype bfloat16 must match", TypeError),
    (dict(activation="gelu"), "activation must be one of", ValueError),
    (dict(chip="v9"), "unknown TPU chip", ValueError),
    (dict(block_t=12, x=jnp.ones((1, 8, 40))), "block_t=12 must be a multiple of 8",
     ValueError),
    (dict(block_t=0), "block_t must be a positive int", ValueError),
    (dict(block_d=64, x=jnp.ones((1, 300, 10)), weight=jnp.ones((300, 4))),
     "block_d=64 must be a multiple of 128", ValueError),
    (dict(vmem_limit_bytes=10**9), "exceeds what v6e allows", ValueError),
    (dict(x=jnp.ones((2, 8, 10)), cu_seqlens=np.array([0, 4, 10])),
     "x must have batch 1", ValueError),
    (dict(cu_seqlens=np.array([0, 4, 10]), seq_idx=np.zeros((1, 10), np.int32)),
     "not both", ValueError),
    (dict(cu_seqlens=np.array([0.0, 10.0])), "cu_seqlens must be integers", TypeError),
    (dict(cu_seqlens=np.array([10])), "cu_seqlens must be 1-D with N", ValueError),
    (dict(seq_idx=np.zeros((1, 9), np.int32)), r"seq_idx must have shape \(1, 10\)",
     ValueError),
])
def test_bad_conv_inputs_are_rejected(kwargs, error, exc):
  args = dict(x=_X, weight=_W, interpret=True)
  args.update(kwargs)
  with pytest.raises(exc, match=error):
    K.causal_conv1d_fn(**args)


def test_float64_is_refused_not_cast():
  with jax.enable_x64(True):
    x = jnp.ones((1, 8, 10), jnp.float64)
    with pytest.raises(TypeError, match="float64"):
      K.causal_conv1d_fn(x, _W, interpret=True)
    with pytest.raises(TypeError, match="float64"):
      K.causal_conv1d_update(x, jnp.ones((1, 8, 3), jnp.float64), _W, interpret=True)


@pytest.mark.parametrize("kwargs, error", [
    (dict(conv_state=jnp.ones((1, 8, 2))), "fewer than W-1 = 3"),
    (dict(conv_state=jnp.ones((2, 8, 4))), r"conv_state must have shape \(1, 8, S\)"),
    (dict(conv_state=jnp.ones((1, 8, 4), jnp.float16)), "conv_state must be float32"),
    (dict(x=jnp.ones((1, 8, 1, 1))), r"x must be \[B, D, T\] or \[B, D\]"),
    (dict(activation="relu"), "activation must be one of"),
    (dict(x=jnp.ones((40, 8, 1)), conv_state=jnp.ones((40, 8, 4)), block_b=12),
     "block_b=12 must be a multiple of 8"),
])
def test_bad_update_inputs_are_rejected(kwargs, error):
  args = dict(x=jnp.ones((1, 8, 1)), conv_state=jnp.ones((1, 8, 4)), weight=_W,
              interpret=True)
  args.update(kwargs)
  with pytest.raises((TypeError, ValueError), match=error):
    K.causal_conv1d_update(**args)


# ----------------------------------------------------------------------------- tiling


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p", "v7"])
@pytest.mark.parametrize("dim", [1, 100, 2048, 6144, 8192, 10240, 16384])
@pytest.mark.parametrize("width", [2, 4, 7])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_default_tiling_fits_budget(chip, dim, width, dtype):
  config = K.CausalConv1dConfig(chip=chip)
  for seqlen in (1, 7, 300, 4096, 65536):
    for tiling in (K.forward_tiling(1, seqlen, dim, width, dtype, dtype, True, config),
                   K.backward_tiling(1, seqlen, dim, width, dtype, dtype, True, config)):
      assert tiling.vmem_plan_bytes <= tiling.vmem_limit_bytes * vmem.BUDGET_FRACTION
      assert tiling.vmem_limit_bytes <= chips.get_chip(chip).max_vmem_limit_bytes
      assert tiling.block_d == dim or tiling.block_d % 128 == 0
      if tiling.block_t < seqlen:   # several T blocks: whole halos, the halo covers W-1
        assert tiling.halo >= width - 1 and tiling.halo % vmem.sublane_multiple(dtype) == 0
        assert tiling.block_t % tiling.halo == 0 and tiling.block_t <= K.MAX_BLOCK_T
      else:
        assert tiling.block_t == seqlen and tiling.halo == 0
  for batch in (1, 12, 64, 256):
    for steps in (1, 3):
      t = K.update_tiling(batch, steps, width, dim, width, dtype, dtype, dtype, config)
      assert 1 <= t.block_b <= min(batch, K.MAX_BLOCK_B)
      if steps == 1:   # 2-D (block_b, block_d) x blocks
        assert t.block_b == batch or t.block_b % vmem.sublane_multiple(dtype) == 0
      assert t.vmem_plan_bytes <= t.vmem_limit_bytes * vmem.BUDGET_FRACTION


def test_explicit_vmem_limit_shrinks_the_blocks():
  small = K.forward_tiling(1, 4096, 8192, 4, jnp.bfloat16, jnp.bfloat16, False,
                           K.CausalConv1dConfig(chip="v6e", vmem_limit_bytes=4 * vmem.MiB))
  default = K.forward_tiling(1, 4096, 8192, 4, jnp.bfloat16, jnp.bfloat16, False,
                             K.CausalConv1dConfig(chip="v6e"))
  assert small.vmem_limit_bytes == 4 * vmem.MiB
  assert small.block_t * small.block_d < default.block_t * default.block_d
  assert small.vmem_plan_bytes <= 2 * vmem.MiB
