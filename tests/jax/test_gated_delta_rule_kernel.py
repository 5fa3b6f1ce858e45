"""Gated delta rule Pallas kernels in interpret mode against the float64 references (JAX only).

References (tests/reference_gdn.py): a NumPy float64 token-by-token forward, and its
gradients by the hand-written float64 reverse recurrence; the last section of this module
checks those against JAX autodiff (float64) of a second token-by-token implementation and
against finite differences (`tests/jax/test_reference.py` holds the other kernels' checks).

Tolerances. A value x passes if |x - ref| <= rtol |ref| + atol max|ref| (max over the
array), and every value is finite (interpret mode fills output a kernel never writes, and
rows read past an array's end, with NaN: a forgotten row or a leaked tail fails here).
  * float32 results (everything with float32 inputs; the final state, dg and dh0 always;
    dbeta when beta is float32): rtol 1e-5, atol 1e-4. The kernels compute in float32
    (inputs widened on load, HIGHEST-precision matmuls), so the error is float32
    rounding, accumulated over chunks, relative to the array's scale. Measured (inputs of
    unit scale, keys of about unit norm, beta in [0, 1), decays in [exp(-1), 1] with a
    few near-total resets): over the ci profile's examples at most 6.3e-6 of max|ref| (dg,
    a sum of terms that cancel); over 40 random examples per property at most 9.0e-6
    (dbeta), 7.5e-6 for the final state, 4.7e-6 for o: the bound leaves 11x.
  * bfloat16 results (o, dq, dk, dv, and dbeta when beta is bfloat16): the same float32
    math on the bf16 inputs (which the reference takes exactly, as float64), then one
    rounding to bfloat16: at most 2^-8 relative (round to nearest, 8 significant bits),
    so rtol 2^-8, atol 1e-4 (measured beyond the rounding: at most 3.1e-7 of max|ref|).

Cost. Interpret mode compiles every new shape and option set (1-3 s for a forward, 4-8 s
for forward + backward with XLA:CPU's backend optimisations off, `_FAST_COMPILE`; about
twice that with them on): shapes come from short lists, the gradient and packing
properties draw half the profile's examples, and HYPOTHESIS_PROFILE=thorough draws 150
(75) for depth.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import reference_gdn as ref
from tpu_kernels import chips, gated_delta_rule as GDN

CHIP = "v6e"
NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
# Sequence lengths: 1, below one chunk (5), one chunk exactly (64), a partial second chunk
# (100), three chunks with a short tail (130).
SEQ = [1, 5, 64, 100, 130]
# (key heads, value heads per key head): equal heads, grouped values, several groups, 3
# value heads per key head (an odd group: one value head per step is impossible there).
HEADS = [(1, 1), (1, 2), (2, 2), (2, 1), (1, 3)]
DIMS = [16, 32]
TOL = {"float32": dict(rtol=1e-5, atol=1e-4), "bfloat16": dict(rtol=2.0 ** -8, atol=1e-4)}
# XLA:CPU options for the interpret-mode programs: codegen only (semantics unchanged); about
# halves their compile time.
_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}
_PROGRAMS = {}


@pytest.fixture(autouse=True, scope="module")
def _drop_programs():
  yield
  _PROGRAMS.clear()


def _run(fn, *args, **static):
  """fn(*args, **static) jitted and compiled once per (fn, static options, argument shapes)."""
  key = (fn.__name__, tuple(sorted(static.items())),
         tuple(None if a is None else (a.shape, str(a.dtype)) for a in args))
  if key not in _PROGRAMS:
    _PROGRAMS[key] = jax.jit(functools.partial(fn, **static)).lower(*args).compile(
        compiler_options=_FAST_COMPILE)
  return _PROGRAMS[key](*args)


def _chunk_forward(q, k, v, g, beta, h0, cu, **options):
  return GDN.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                    interpret=True, chip=CHIP, **options)


def _chunk_grads(q, k, v, g, beta, h0, cu, do, dht, **options):
  def f(q, k, v, g, beta, h0):
    return GDN.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu,
                                      output_final_state=True, interpret=True, chip=CHIP,
                                      **options)

  out, vjp = jax.vjp(f, q, k, v, g, beta, h0)
  return out, vjp((do, dht))


def _recurrent(q, k, v, g, beta, h0, cu, **options):
  return GDN.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                              cu_seqlens=cu, interpret=True, chip=CHIP,
                                              **options)


def _recurrent_grads(q, k, v, g, beta, h0, do, dht, **options):
  def f(q, k, v, g, beta, h0):
    return GDN.fused_recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                                output_final_state=True, interpret=True,
                                                chip=CHIP, **options)

  out, vjp = jax.vjp(f, q, k, v, g, beta, h0)
  return out, vjp((do, dht))


# ----------------------------------------------------------------------------- problems


def _inputs(p):
  """NumPy inputs of problem p, in the dtypes the kernel gets (the reference widens them)."""
  rng = np.random.default_rng(p["seed"])
  batch, seq, hk, hv = p["batch"], p["seq"], p["hk"], p["hk"] * p["group"]
  kd, vd = p["k_dim"], p["v_dim"]
  dt = NP[p["dtype"]]
  q = rng.standard_normal((batch, seq, hk, kd))
  k = rng.standard_normal((batch, seq, hk, kd))
  if not p["l2norm"]:
    k /= np.sqrt(kd)          # keys of about unit norm, as after the l2 norm
  v = rng.standard_normal((batch, seq, hv, vd))
  g = -rng.uniform(0.0, 1.0, (batch, seq, hv))
  g[rng.random(g.shape) < 0.05] = -20.0      # a few near-total resets
  beta = rng.uniform(0.0, 1.0, (batch, seq, hv))
  num_states = batch if p.get("lengths") is None else len(p["lengths"])
  h0 = 0.5 * rng.standard_normal((num_states, hv, kd, vd)) if p["initial"] else None
  do = rng.standard_normal((batch, seq, hv, vd))
  dht = rng.standard_normal((num_states, hv, kd, vd))
  cu = None
  if p.get("lengths") is not None:
    cu = np.concatenate([[0], np.cumsum(p["lengths"])]).astype(np.int32)
  beta_dt = dt if p["beta_in_dtype"] else np.float32
  return dict(q=q.astype(dt), k=k.astype(dt), v=v.astype(dt), g=g.astype(np.float32),
              beta=beta.astype(beta_dt), h0=None if h0 is None else h0.astype(np.float32),
              do=do.astype(dt), dht=dht.astype(np.float32), cu=cu)


def _jnp(x):
  return {n: None if a is None else jnp.asarray(a) for n, a in x.items()}


@st.composite
def problems(draw, packed: bool = False):
  hk, group = draw(st.sampled_from(HEADS))
  dtype = draw(st.sampled_from(["float32", "bfloat16"]))
  p = dict(hk=hk, group=group, dtype=dtype, k_dim=draw(st.sampled_from(DIMS)),
           v_dim=draw(st.sampled_from(DIMS)), l2norm=draw(st.booleans()),
           initial=draw(st.booleans()), beta_in_dtype=draw(st.booleans()),
           heads_per_step=draw(st.sampled_from([None, group])),
           seed=draw(st.integers(0, 2**16)))
  if packed:
    # Several sequences, among them empty and one-token ones and one past a chunk.
    p["lengths"] = draw(st.lists(st.sampled_from([0, 1, 3, 40, 64, 70]), min_size=1,
                                 max_size=4))
    p["batch"], p["seq"] = 1, max(1, sum(p["lengths"]))
    if sum(p["lengths"]) == 0:
      p["lengths"][-1] = 1
  else:
    p["batch"] = draw(st.sampled_from([1, 2]))
    p["seq"] = draw(st.sampled_from(SEQ))
  return p


def _assert_close(name, got, want, dtype: str):
  got = np.asarray(jnp.asarray(got, jnp.float32)).astype(np.float64)
  assert got.shape == want.shape, f"{name}: shape {got.shape}, reference {want.shape}"
  assert np.all(np.isfinite(got)), f"{name}: non-finite values (unwritten or leaked rows)"
  tol = TOL[dtype]
  scale = float(np.max(np.abs(want), initial=0.0))
  err = np.abs(got - want)
  bad = err > tol["rtol"] * np.abs(want) + tol["atol"] * scale
  if bad.any():
    i = np.unravel_index(np.argmax(err - tol["rtol"] * np.abs(want)), err.shape)
    raise AssertionError(f"{name} ({dtype}): {int(bad.sum())} of {bad.size} values off; "
                         f"worst at {i}: got {got[i]}, reference {want[i]} "
                         f"(max|ref| {scale:.3g}, max err {err.max():.3g})")


def _dtype_of(array) -> str:
  return "bfloat16" if np.dtype(array.dtype) == np.dtype(ml_dtypes.bfloat16) else "float32"


def _options(p, **extra):
  return dict(use_qk_l2norm_in_kernel=p["l2norm"], heads_per_step=p["heads_per_step"], **extra)


def _reference(p, x):
  return ref.gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                              use_qk_l2norm=p["l2norm"], cu_seqlens=x["cu"])


def _reference_grads(p, x):
  return ref.gated_delta_rule_grads(x["q"], x["k"], x["v"], x["g"], x["beta"], x["do"],
                                    initial_state=x["h0"], dht=x["dht"],
                                    use_qk_l2norm=p["l2norm"], cu_seqlens=x["cu"])


def _check_forward(p, x, o, final):
  want_o, want_final = _reference(p, x)
  _assert_close("o", o, want_o, p["dtype"])
  assert o.dtype == x["q"].dtype
  if final is not None:
    assert final.dtype == jnp.float32
    _assert_close("final state", final, want_final, "float32")


def _check_grads(p, x, grads, *, with_h0: bool = True):
  want = _reference_grads(p, x)
  names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
  primal = dict(dq=x["q"], dk=x["k"], dv=x["v"], dg=x["g"], dbeta=x["beta"], dh0=x["h0"])
  for name, got in zip(names, grads):
    if name == "dh0" and not with_h0:
      continue
    if primal[name] is not None:
      assert got.dtype == primal[name].dtype, f"{name}: dtype {got.dtype}"
    _assert_close(name, got, want[name], "float32" if name in ("dg", "dh0")
                  else _dtype_of(primal[name]))


def _a_third_of_the_examples():
  return settings(max_examples=max(2, settings.default.max_examples // 3))


# ----------------------------------------------------------------------------- chunked


@given(p=problems(), final=st.booleans())
def test_chunked_forward_matches_reference(p, final):
  x = _inputs(p)
  j = _jnp(x)
  o, state = _run(_chunk_forward, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"], None,
                  output_final_state=final, **_options(p))
  assert (state is None) == (not final)
  _check_forward(p, x, o, state)


@_a_third_of_the_examples()
@given(p=problems())
def test_chunked_gradients_match_reference(p):
  """All six gradients (q, k, v, g, beta, initial state), with cotangents on both the
  output and the final state; the initial state is zeros when absent (its gradient is
  still checked: the chunked VJP always takes one)."""
  x = _inputs(p)
  if x["h0"] is None:
    x["h0"] = np.zeros((p["batch"], p["hk"] * p["group"], p["k_dim"], p["v_dim"]), np.float32)
  j = _jnp(x)
  (o, state), grads = _run(_chunk_grads, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"],
                           None, j["do"], j["dht"], **_options(p))
  _check_forward(p, x, o, state)
  _check_grads(p, x, grads)


def test_gradients_without_initial_state_or_final_cotangent():
  """No initial state (no dh0 output in the kernel) and no final state (no dS seed)."""
  p = dict(hk=1, group=2, dtype="float32", k_dim=16, v_dim=32, l2norm=True, initial=False,
           beta_in_dtype=False, heads_per_step=None, seed=7, batch=2, seq=100)
  x = _inputs(p)
  j = _jnp(x)

  def f(q, k, v, g, beta):
    o, _ = GDN.chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                      interpret=True, chip=CHIP)
    return o

  def grads(q, k, v, g, beta, do):
    return jax.vjp(f, q, k, v, g, beta)[1](do)

  got = _run(grads, j["q"], j["k"], j["v"], j["g"], j["beta"], j["do"])
  x["dht"] = None
  _check_grads(p, x, got, with_h0=False)


@_a_third_of_the_examples()
@given(p=problems(packed=True))
def test_packed_sequences_match_reference(p):
  """cu_seqlens (traced, under jit): each sequence from its own initial state, one final
  state each (an empty sequence's final state is its initial state), forward and all six
  gradients."""
  x = _inputs(p)
  if x["h0"] is None:
    x["h0"] = np.zeros((len(p["lengths"]), p["hk"] * p["group"], p["k_dim"], p["v_dim"]),
                       np.float32)
  j = _jnp(x)
  (o, state), grads = _run(_chunk_grads, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"],
                           j["cu"], j["do"], j["dht"], **_options(p))
  _check_forward(p, x, o, state)
  _check_grads(p, x, grads)


def test_xla_baseline_matches_reference():
  p = dict(hk=2, group=2, dtype="float32", k_dim=16, v_dim=32, l2norm=True, initial=True,
           beta_in_dtype=False, heads_per_step=None, seed=3, batch=2, seq=100)
  x = _inputs(p)
  j = _jnp(x)
  o, final = jax.jit(functools.partial(GDN.chunk_gated_delta_rule_xla,
                                       use_qk_l2norm_in_kernel=True))(
      j["q"], j["k"], j["v"], j["g"], j["beta"], initial_state=j["h0"])
  _check_forward(p, x, o, final)


# ----------------------------------------------------------------------------- decode


@st.composite
def decode_problems(draw):
  hk, group = draw(st.sampled_from(HEADS))
  return dict(hk=hk, group=group, dtype=draw(st.sampled_from(["float32", "bfloat16"])),
              k_dim=draw(st.sampled_from(DIMS)), v_dim=draw(st.sampled_from(DIMS)),
              l2norm=draw(st.booleans()), initial=draw(st.booleans()),
              beta_in_dtype=draw(st.booleans()), heads_per_step=None,
              seed=draw(st.integers(0, 2**16)), batch=draw(st.sampled_from([1, 3])),
              seq=draw(st.sampled_from([1, 1, 2, 3])))


@given(p=decode_problems(), final=st.booleans())
def test_recurrent_matches_reference(p, final):
  """The decode kernel: a batch of sequences, 1-3 tokens each, from their states."""
  x = _inputs(p)
  j = _jnp(x)
  o, state = _run(_recurrent, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"], None,
                  output_final_state=final, **_options(p))
  assert (state is None) == (not final)
  _check_forward(p, x, o, state)


@pytest.mark.parametrize("tokens", [1, 2])
def test_recurrent_with_several_head_blocks(tokens):
  """16 key heads, 32 value heads, 16 per step: two head blocks per sequence, each reading
  its own rows of q, k, v, g, beta and the state (the property above always fits every
  head in one step)."""
  p = dict(hk=16, group=2, dtype="bfloat16", k_dim=16, v_dim=16, l2norm=True, initial=True,
           beta_in_dtype=True, heads_per_step=16, seed=9, batch=2, seq=tokens)
  x = _inputs(p)
  j = _jnp(x)
  o, state = _run(_recurrent, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"], None,
                  output_final_state=True, **_options(p))
  _check_forward(p, x, o, state)


def test_recurrent_gradients_are_the_chunked_backward():
  p = dict(hk=2, group=2, dtype="bfloat16", k_dim=32, v_dim=16, l2norm=True, initial=True,
           beta_in_dtype=True, heads_per_step=None, seed=11, batch=3, seq=1)
  x = _inputs(p)
  j = _jnp(x)
  (o, state), grads = _run(_recurrent_grads, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"],
                           j["do"], j["dht"], use_qk_l2norm_in_kernel=True)
  _check_forward(p, x, o, state)
  _check_grads(p, x, grads)


def test_packed_recurrent_matches_reference():
  """cu_seqlens in the recurrent path: sequences of 0-3 tokens re-packed to max_seqlen
  rows; and a call past MAX_RECURRENT_TOKENS, which runs the chunked kernel."""
  p = dict(hk=1, group=2, dtype="float32", k_dim=16, v_dim=16, l2norm=False, initial=True,
           beta_in_dtype=False, heads_per_step=None, seed=5, lengths=[2, 0, 1, 3])
  p["batch"], p["seq"] = 1, 6
  x = _inputs(p)
  j = _jnp(x)
  o, state = _run(_recurrent, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"], j["cu"],
                  output_final_state=True, max_seqlen=3)
  _check_forward(p, x, o, state)
  long = dict(p, lengths=None, batch=1, seq=GDN.MAX_RECURRENT_TOKENS + 1)
  x = _inputs(long)
  j = _jnp(x)
  o, state = _run(_recurrent, j["q"], j["k"], j["v"], j["g"], j["beta"], j["h0"], None,
                  output_final_state=True)
  _check_forward(long, x, o, state)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prefill_then_decode_equals_one_pass(dtype):
  """Prefill 70 tokens with the chunked kernel, then decode 3 single tokens and one step of
  3 tokens with the recurrent kernel, each from the state the previous call returned: the
  outputs and the final state equal one chunked pass over all 76 tokens (and the
  reference)."""
  p = dict(hk=2, group=2, dtype=dtype, k_dim=32, v_dim=32, l2norm=True, initial=True,
           beta_in_dtype=True, heads_per_step=None, seed=1, batch=2, seq=76)
  x = _inputs(p)
  j = _jnp(x)
  opts = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)

  def part(a, b):
    return [j[n][:, a:b] for n in ("q", "k", "v", "g", "beta")]

  outs = []
  o, state = _run(_chunk_forward, *part(0, 70), j["h0"], None, **opts)
  outs.append(o)
  for start, end in ((70, 71), (71, 72), (72, 73), (73, 76)):
    o, state = _run(_recurrent, *part(start, end), state, None, **opts)
    outs.append(o)
  stepped = jnp.concatenate(outs, axis=1)
  whole, whole_state = _run(_chunk_forward, *part(0, 76), j["h0"], None, **opts)
  _check_forward(p, x, stepped, state)
  _check_forward(p, x, whole, whole_state)
  # The two routes against each other: both within float32 noise of one another, up to the
  # one bf16 rounding of each output.
  _assert_close("stepped vs one pass", stepped, np.asarray(whole.astype(jnp.float32),
                                                           np.float64), dtype)


def test_recurrent_state_is_aliased():
  """The decode kernel's state operand is aliased to its new state (so a caller that
  donates the state updates it in place; the compiled TPU program's alias table is checked
  in test_gated_delta_rule_aot.py)."""
  q = jnp.zeros((4, 1, 2, 128), jnp.bfloat16)
  v = jnp.zeros((4, 1, 4, 128), jnp.bfloat16)
  g = jnp.zeros((4, 1, 4), jnp.float32)
  h0 = jnp.zeros((4, 4, 128, 128), jnp.float32)
  jaxpr = jax.make_jaxpr(functools.partial(GDN.fused_recurrent_gated_delta_rule,
                                           output_final_state=True, chip=CHIP))(
      q, q, v, g, g, initial_state=h0)
  text = str(jaxpr)
  assert text.count("pallas_call[") == 1 and "input_output_aliases=((5, 1),)" in text


# ----------------------------------------------------------------------------- tiling


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_tilings_at_model_shapes(chip):
  """Qwen3.5-9B / Qwen3-Next-80B GDN (16 key, 32 value heads of 128): the chunk kernels
  take 4 value heads (two whole groups) per step, decode all 32; each plan fills at most
  half the limit it asks for, which is the chip's default where that suffices (v6e) and
  just what the plan needs elsewhere (v5e)."""
  chip_ = chips.get_chip(chip)
  for t, heads in ((GDN.gdn_tiling(16, 32, 128, 128, dtype=jnp.bfloat16, chip=chip), 4),
                   (GDN.decode_tiling(16, 32, 128, 128, 1, dtype=jnp.bfloat16, chip=chip), 32)):
    assert t.heads_per_step == heads
    assert t.vmem_plan_bytes <= t.vmem_limit_bytes // 2
    default = chip_.default_scoped_vmem_bytes
    assert t.vmem_limit_bytes == max(default, -(-2 * t.vmem_plan_bytes // (1 << 20)) << 20)
    assert t.vmem_limit_bytes <= chip_.max_vmem_limit_bytes


def test_tiling_raises_the_limit_only_when_needed():
  t = GDN.gdn_tiling(1, 1, 512, 512, dtype=jnp.float32, chip="v5e")
  assert t.vmem_limit_bytes > chips.get_chip("v5e").default_scoped_vmem_bytes
  assert t.vmem_plan_bytes <= t.vmem_limit_bytes // 2
  with pytest.raises(ValueError, match="VMEM"):
    GDN.gdn_tiling(1, 1, 512, 512, dtype=jnp.float32, chip="v5e", vmem_limit_bytes=1 << 20)


# ----------------------------------------------------------------------------- errors


def _good(batch=1, seq=8, hk=2, hv=4, kd=16, vd=16, dtype=jnp.float32):
  return dict(q=jnp.zeros((batch, seq, hk, kd), dtype), k=jnp.zeros((batch, seq, hk, kd), dtype),
              v=jnp.zeros((batch, seq, hv, vd), dtype), g=jnp.zeros((batch, seq, hv), jnp.float32),
              beta=jnp.zeros((batch, seq, hv), jnp.float32))


def _with(**changes):
  x = _good()
  x.update(changes)
  return x


BAD = [
    ("float64 q", dict(q=np.zeros((1, 8, 2, 16)), k=np.zeros((1, 8, 2, 16)),
                       v=np.zeros((1, 8, 4, 16))), {}, TypeError, "float32 or bfloat16"),
    ("int q", dict(q=jnp.zeros((1, 8, 2, 16), jnp.int32)), {}, TypeError, "float32 or bfloat16"),
    ("k dtype", dict(k=jnp.zeros((1, 8, 2, 16), jnp.bfloat16)), {}, TypeError, "no silent"),
    ("v dtype", dict(v=jnp.zeros((1, 8, 4, 16), jnp.bfloat16)), {}, TypeError, "no silent"),
    ("bf16 g", dict(g=jnp.zeros((1, 8, 4), jnp.bfloat16)), {}, TypeError, "log-decay"),
    ("float64 g", dict(g=np.zeros((1, 8, 4))), {}, TypeError, "log-decay"),
    ("float64 beta", dict(beta=np.zeros((1, 8, 4))), {}, TypeError, "beta"),
    ("3-D q", dict(q=jnp.zeros((8, 2, 16))), {}, ValueError, "4-D"),
    ("k shape", dict(k=jnp.zeros((1, 8, 2, 32))), {}, ValueError, "same shape"),
    ("v length", dict(v=jnp.zeros((1, 9, 4, 16))), {}, ValueError, "sequence length"),
    ("heads", dict(v=jnp.zeros((1, 8, 3, 16)), g=jnp.zeros((1, 8, 3)), beta=jnp.zeros((1, 8, 3))),
     {}, ValueError, "multiple"),
    ("g shape", dict(g=jnp.zeros((1, 8, 2))), {}, ValueError, "g must have shape"),
    ("beta shape", dict(beta=jnp.zeros((1, 8))), {}, ValueError, "beta must have shape"),
    ("state shape", {}, dict(initial_state=jnp.zeros((1, 4, 16, 32))), ValueError,
     "initial_state must have shape"),
    ("bf16 state", {}, dict(initial_state=jnp.zeros((1, 4, 16, 16), jnp.bfloat16)), TypeError,
     "initial_state must be float32"),
    ("float64 state", {}, dict(initial_state=np.zeros((1, 4, 16, 16))), TypeError,
     "initial_state must be float32"),
    ("packed batch", {k: jnp.zeros((2,) + a.shape[1:], a.dtype) for k, a in _good().items()},
     dict(cu_seqlens=jnp.array([0, 8], jnp.int32)), ValueError, "batch 1"),
    ("cu_seqlens end", {}, dict(cu_seqlens=jnp.array([0, 3, 7], jnp.int32)), ValueError,
     "rise from 0"),
    ("cu_seqlens falls", {}, dict(cu_seqlens=jnp.array([0, 5, 3, 8], jnp.int32)), ValueError,
     "rise from 0"),
    ("cu_seqlens float", {}, dict(cu_seqlens=jnp.array([0.0, 8.0])), TypeError, "integers"),
    ("cu_seqlens 2-D", {}, dict(cu_seqlens=jnp.array([[0, 8]], jnp.int32)), ValueError, "1-D"),
    ("packed state count", {}, dict(cu_seqlens=jnp.array([0, 3, 8], jnp.int32),
                                    initial_state=jnp.zeros((1, 4, 16, 16))), ValueError,
     r"\(2, 4, 16, 16\)"),
    ("scale", {}, dict(scale=-1.0), ValueError, "scale"),
    ("chip", {}, dict(chip="v9"), ValueError, "unknown TPU chip"),
    ("heads_per_step", {}, dict(heads_per_step=1), ValueError, "heads_per_step"),
    ("vmem limit", {}, dict(vmem_limit_bytes=-5), ValueError, "vmem_limit_bytes"),
]


@pytest.mark.parametrize("fn", [GDN.chunk_gated_delta_rule,
                                GDN.fused_recurrent_gated_delta_rule],
                         ids=["chunk", "recurrent"])
@pytest.mark.parametrize("name, arrays, kwargs, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_inputs_raise_clear_errors(fn, name, arrays, kwargs, error, match):
  x = _with(**arrays)
  with pytest.raises(error, match=match):
    fn(x["q"], x["k"], x["v"], x["g"], x["beta"], interpret=True, **kwargs)


def test_traced_cu_seqlens_needs_max_seqlen_for_decode():
  x = _good()

  def f(cu):
    return GDN.fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                cu_seqlens=cu, interpret=True)

  with pytest.raises(ValueError, match="max_seqlen"):
    jax.jit(f)(jnp.array([0, 3, 8], jnp.int32))


def test_empty_sequence():
  x = _good(seq=0)
  h0 = jnp.ones((1, 4, 16, 16), jnp.float32)
  for fn in (GDN.chunk_gated_delta_rule, GDN.fused_recurrent_gated_delta_rule):
    o, state = fn(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                  output_final_state=True, interpret=True)
    assert o.shape == (1, 0, 4, 16) and np.array_equal(np.asarray(state), np.asarray(h0))


# ----------------------------------------------------------------------------- the references


def _tiny(seed, cu=None, l2norm=True):
  rng = np.random.default_rng(seed)
  batch = 2 if cu is None else 1
  seq = 5 if cu is None else cu[-1]
  ns = batch if cu is None else len(cu) - 1
  x = dict(q=rng.standard_normal((batch, seq, 1, 3)), k=0.7 * rng.standard_normal((batch, seq, 1, 3)),
           v=rng.standard_normal((batch, seq, 2, 2)), g=-rng.uniform(0.1, 1.0, (batch, seq, 2)),
           beta=rng.uniform(0.0, 1.0, (batch, seq, 2)))
  extra = dict(initial_state=rng.standard_normal((ns, 2, 3, 2)), use_qk_l2norm=l2norm,
               cu_seqlens=cu)
  cot = dict(do=rng.standard_normal((batch, seq, 2, 2)), dht=rng.standard_normal((ns, 2, 3, 2)))
  return x, extra, cot


@pytest.mark.parametrize("cu", [None, [0, 2, 2, 5]], ids=["batch", "packed"])
def test_reference_routes_agree(cu):
  """NumPy forward = jnp float64 forward; hand-written reverse recurrence = jax.vjp."""
  x, extra, cot = _tiny(0, cu)
  o1, f1 = ref.gated_delta_rule(**x, **extra)
  o2, f2 = ref.gated_delta_rule_jax(**x, **extra)
  np.testing.assert_allclose(o1, o2, rtol=1e-12, atol=1e-14)
  np.testing.assert_allclose(f1, f2, rtol=1e-12, atol=1e-14)
  a = ref.gated_delta_rule_vjp(*x.values(), cot["do"], dht=cot["dht"], **extra)
  b = ref.gated_delta_rule_grads(*x.values(), cot["do"], dht=cot["dht"], **extra)
  for name in a:
    np.testing.assert_allclose(b[name], a[name], rtol=1e-11, atol=1e-13, err_msg=name)


def test_reference_grads_match_finite_differences():
  x, extra, cot = _tiny(1, [0, 3, 5], l2norm=True)
  grads = ref.gated_delta_rule_grads(*x.values(), cot["do"], dht=cot["dht"], **extra)
  names = ("q", "k", "v", "g", "beta", "initial_state")

  def loss(**changed):
    args = {**x, **extra, **changed}
    o, final = ref.gated_delta_rule(**args)
    return float(np.sum(o * cot["do"]) + np.sum(final * cot["dht"]))

  h = 1e-6
  rng = np.random.default_rng(2)
  for name, key in zip(names, ("dq", "dk", "dv", "dg", "dbeta", "dh0")):
    base = x[name] if name in x else extra[name]
    for _ in range(3):
      i = tuple(rng.integers(0, n) for n in base.shape)
      e = np.zeros_like(base)
      e[i] = h
      fd = (loss(**{name: base + e}) - loss(**{name: base - e})) / (2 * h)
      np.testing.assert_allclose(grads[key][i], fd, rtol=1e-5, atol=1e-7, err_msg=f"{name}{i}")


def test_reference_definition_by_hand():
  """One token from a zero state: S = beta k v^T, o = (scale q . k) beta v."""
  q = np.array([[[[1.0, 2.0]]]])
  k = np.array([[[[0.5, -1.0]]]])
  v = np.array([[[[3.0]]]])
  o, final = ref.gated_delta_rule(q, k, v, np.array([[[-0.3]]]), np.array([[[0.5]]]))
  qk = (1.0 * 0.5 + 2.0 * -1.0) / np.sqrt(2.0)
  np.testing.assert_allclose(o, [[[[qk * 0.5 * 3.0]]]])
  np.testing.assert_allclose(final, [[[[0.5 * 3.0 * 0.5], [0.5 * 3.0 * -1.0]]]])
