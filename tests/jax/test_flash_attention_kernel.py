"""Flash attention Pallas kernels in interpret mode against the float64 reference (JAX only).

Every check goes through `reference.attention_mismatches`: out, lse (with -inf exactly on
fully masked rows) and the gradients of q, k, v and sinks, taken with `jax.vjp` of
`flash_attention(..., return_lse=True)` so that lse's cotangent is exercised too.
Interpret mode leaves output the kernel never writes as NaN, and `assert_close` insists
on finite values, so forgotten rows, skipped blocks that should have run and 0 * inf on
fully masked rows all fail.

Interpret mode compiles each new (shape, option) combination: shapes come from short
lists so that examples share compilations, and everything runs under one `jax.jit`.
"""

import functools
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

import reference as ref
from tpu_kernels import flash_attention as FA

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}
CHIP = "v6e"
# Sequence lengths: 1, not multiples of 8 (5, 100, 300) or of 128 (64, 200), one block
# exactly (128); with block 128 forced, 200 and 300 give several blocks and a tail.
SEQ = [1, 5, 64, 100, 128, 200, 300]
HEAD_DIMS = [64, 80, 96, 128, 192, 256]
# Most examples use small head dims (interpret mode is slow); every one of HEAD_DIMS
# runs in `test_every_head_dim`.
PROPERTY_HEAD_DIMS = [64, 64, 64, 80, 128]


# ----------------------------------------------------------------------------- running


@functools.partial(jax.jit, static_argnames=("static",))
def _forward_and_grads(q, k, v, sinks, segment_ids, q_offset, grad_out, grad_lse, static):
  """(out, lse, grads) with q_offset traced (or, if None, the Python int in `static`);
  static: a tuple of the other options."""
  options = dict(static)
  if q_offset is None:
    q_offset = options.pop("q_offset")

  def f(q, k, v, sinks):
    return FA.flash_attention(q, k, v, sinks=sinks, segment_ids=segment_ids,
                              q_offset=q_offset, return_lse=True, interpret=True,
                              chip=CHIP, **options)

  (out, lse), vjp = jax.vjp(f, q, k, v, sinks)
  dq, dk, dv, dsinks = vjp((grad_out, grad_lse))
  return out, lse, dict(dq=dq, dk=dk, dv=dv, dsinks=dsinks)


def _static(p):
  keys = ("causal", "sm_scale", "sliding_window", "soft_cap", "block_q", "block_k")
  return tuple((key, p[key]) for key in keys if p.get(key) is not None)


def _segments(rng, batch, length, num_segments, first_id=0):
  """Runs of ascending segment ids, [batch, length] int32."""
  out = np.empty((batch, length), np.int32)
  for b in range(batch):
    cuts = np.sort(rng.choice(np.arange(1, length), size=min(num_segments - 1, length - 1),
                              replace=False)) if length > 1 else []
    out[b] = first_id + np.searchsorted(cuts, np.arange(length), side="right")
  return out


def _inputs(p):
  """numpy arrays: q, k, v, grad_out in the dtype; grad_lse, sinks f32; segment ids.
  q, k, v, grad_out and grad_lse are unit normal, or with p["data"] == "uniform" uniform
  in [0, 1) (the peers' test data: splash attention's, tokamax's)."""
  rng = np.random.default_rng(p["seed"])
  draw = rng.random if p.get("data") == "uniform" else rng.standard_normal
  dt = NP[p["dtype"]]
  num_q_heads = p["num_kv_heads"] * p["group"]
  q = draw((p["batch"], num_q_heads, p["q_len"], p["head_dim"])).astype(dt)
  k, v = (draw((p["batch"], p["num_kv_heads"], p["kv_len"], p["head_dim"])).astype(dt)
          for _ in range(2))
  grad_out = draw(q.shape).astype(dt)
  grad_lse = draw(q.shape[:3]).astype(np.float32)
  sinks = None
  if p["sinks"] is not None:
    sinks = (2.0 * rng.standard_normal(num_q_heads)).astype(np.float32)
    if p["sinks"] == "large":   # a sink that takes (almost) all the mass, one that takes none
      sinks[::2] = 40.0
      sinks[1::2] = -40.0
  segment_ids = None
  seg = p["segments"]
  if seg is not None:
    kv_seg = _segments(rng, p["batch"], p["kv_len"], p["num_segments"])
    if seg == "shared":
      segment_ids = kv_seg
    elif seg == "pair_consistent":   # the chunk's own slice of the packed key sequence
      pos = np.minimum(p["q_offset"] + np.arange(p["q_len"]), p["kv_len"] - 1)
      segment_ids = (kv_seg[:, pos], kv_seg)
    else:                            # unrelated runs; ids past the keys' see nothing
      segment_ids = (_segments(rng, p["batch"], p["q_len"], p["num_segments"] + 1), kv_seg)
  return dict(q=q, k=k, v=v, grad_out=grad_out, grad_lse=grad_lse, sinks=sinks,
              segment_ids=segment_ids)


def _options(p, x):
  """The keyword options of `reference.attention` for problem p."""
  return dict(causal=p["causal"], sm_scale=p["sm_scale"], sliding_window=p["sliding_window"],
              soft_cap=p["soft_cap"], segment_ids=x["segment_ids"], sinks=x["sinks"],
              q_offset=p["q_offset"])


def _run(p, x):
  j = lambda a: None if a is None else jnp.asarray(a)
  seg = x["segment_ids"]
  seg = tuple(map(j, seg)) if isinstance(seg, tuple) else j(seg)
  return _forward_and_grads(j(x["q"]), j(x["k"]), j(x["v"]), j(x["sinks"]), seg,
                            jnp.int32(p["q_offset"]), j(x["grad_out"]), j(x["grad_lse"]),
                            static=_static(p))


def _run_static_offset(p, x):
  """_run with q_offset a Python int: only then may the forward take the folded causal
  grid (flash_attention._fold_causal)."""
  j = lambda a: None if a is None else jnp.asarray(a)
  seg = x["segment_ids"]
  seg = tuple(map(j, seg)) if isinstance(seg, tuple) else j(seg)
  return _forward_and_grads(j(x["q"]), j(x["k"]), j(x["v"]), j(x["sinks"]), seg, None,
                            j(x["grad_out"]), j(x["grad_lse"]),
                            static=_static(p) + (("q_offset", p["q_offset"]),))


def _masked_rows(p, x):
  """[B, Hq, Sq] bool: rows with no visible key."""
  vis = ref.attention_visible(p["batch"], p["q_len"], p["kv_len"], causal=p["causal"],
                              sliding_window=p["sliding_window"],
                              segment_ids=x["segment_ids"], q_offset=p["q_offset"])
  num_q_heads = p["num_kv_heads"] * p["group"]
  return np.broadcast_to(~vis.any(-1)[:, None], (p["batch"], num_q_heads, p["q_len"]))


def _check(p, x, out, lse, grads):
  """Everything against the reference, plus the exact values on fully masked rows."""
  num_q_heads = p["num_kv_heads"] * p["group"]
  assert out.shape == x["q"].shape and out.dtype == x["q"].dtype, (out.shape, out.dtype)
  assert lse.shape == x["q"].shape[:3] and lse.dtype == jnp.float32, (lse.shape, lse.dtype)
  for name, like in (("dq", "q"), ("dk", "k"), ("dv", "v")):
    assert grads[name].shape == x[like].shape and grads[name].dtype == x[like].dtype, name
  if x["sinks"] is None:
    assert grads["dsinks"] is None
  else:
    assert grads["dsinks"].shape == (num_q_heads,) and grads["dsinks"].dtype == jnp.float32
  failures = ref.attention_mismatches(p["dtype"], x["q"], x["k"], x["v"], out, lse, grads,
                                      grad_out=x["grad_out"], grad_lse=x["grad_lse"],
                                      **_options(p, x))
  assert not failures, "\n".join([f"problem {p}", *failures.values()])
  # Fully masked rows: exactly zero output and dq, lse exactly -inf (the sink with sinks).
  masked = _masked_rows(p, x)
  out, lse, dq = (np.asarray(a, np.float64) for a in (out, lse, grads["dq"]))
  assert not out[masked].any() and not dq[masked].any(), "fully masked row not zero"
  if x["sinks"] is None:
    assert np.isneginf(lse[masked]).all()
  else:
    sink = np.broadcast_to(x["sinks"][None, :, None], masked.shape)
    assert (lse[masked] == sink[masked]).all(), "fully masked row's lse is not the sink"


# ----------------------------------------------------------------------------- properties


def _examples(fraction):
  """A share of the loaded hypothesis profile's example count (tests/conftest.py)."""
  return max(1, round(settings.default.max_examples * fraction))


@st.composite
def problems(draw, head_dims=PROPERTY_HEAD_DIMS, seq=SEQ, blocks=(None, 128), windows=None):
  mask = draw(st.sampled_from(["causal", "causal_window", "window", "none"]))
  segments = draw(st.sampled_from([None, None, "shared", "pair_consistent", "pair_random"]))
  q_len = draw(st.sampled_from(seq))
  kv_len = q_len if segments == "shared" else draw(st.sampled_from(seq))
  # q_offset: 0 (prefill); a chunk inside the keys (q_offset + Sq <= Skv, chunked
  # prefill); or anywhere up to past the keys, where causal + window rows see no key.
  where = draw(st.sampled_from(["zero", "inside", "inside", "anywhere"]))
  if where == "inside" and kv_len >= q_len:
    q_offset = draw(st.integers(0, kv_len - q_len))
  elif where == "anywhere":
    q_offset = draw(st.integers(0, kv_len + 20))
  else:
    q_offset = 0
  return dict(
      dtype=draw(st.sampled_from(["float32", "bfloat16"])),
      batch=draw(st.integers(1, 2)), num_kv_heads=draw(st.integers(1, 2)),
      group=draw(st.integers(1, 4)), q_len=q_len, kv_len=kv_len,
      head_dim=draw(st.sampled_from(head_dims)),
      causal=mask in ("causal", "causal_window"), q_offset=q_offset,
      sliding_window=(draw(windows if windows is not None else st.integers(1, kv_len + 10))
                      if mask in ("window", "causal_window") else None),
      soft_cap=draw(st.sampled_from([None, None, 1.0, 5.0, 30.0])),
      # None: 1/sqrt(D); 1.0 gives very peaked rows (logits ~ +-sqrt(D)).
      sm_scale=draw(st.sampled_from([None, None, 0.05, 0.3, 1.0])),
      segments=segments, num_segments=draw(st.integers(1, 4)),
      sinks=draw(st.sampled_from([None, None, "normal", "large"])),
      # None: the tiling's choice (one block up to 512); 128 forces several blocks, block
      # skipping under causal / window, and a partial last block.
      block_q=draw(st.sampled_from(blocks)), block_k=draw(st.sampled_from(blocks)),
      seed=draw(st.integers(0, 2**31 - 1)))


def _events(p, x):
  """Coverage, shown by pytest --hypothesis-show-statistics."""
  blocks = lambda n, b: -(-n // b) if b and b < n else 1
  event(f"q blocks {blocks(p['q_len'], p['block_q'])}, kv blocks "
        f"{blocks(p['kv_len'], p['block_k'])}")
  event(f"causal={p['causal']} window={'none' if p['sliding_window'] is None else 'set'}")
  if _masked_rows(p, x).any():
    event("some rows see no key")


@given(problems())
def test_matches_reference(p):
  x = _inputs(p)
  _events(p, x)
  _check(p, x, *_run(p, x))


@st.composite
def blocked_problems(draw):
  """Longer sequences cut into 128 / 256 blocks (up to 5 per axis), windows often at a
  block's edges or narrower than a block; the other options are the main test's."""
  edges = st.sampled_from([1, 2, 127, 128, 129, 255, 256, 257])
  p = draw(problems(head_dims=[64], seq=[100, 300, 520, 520], blocks=(128, 256),
                    windows=st.one_of(edges, st.integers(1, 530))))
  p["batch"], p["num_kv_heads"] = 1, 1
  return p


@settings(max_examples=_examples(0.6))
@given(blocked_problems())
def test_block_skipping_matches_reference(p):
  """The kv range of each q block (forward, dq), the q range of each kv block (dkv),
  the steps past them, and the band of a causal window."""
  x = _inputs(p)
  _events(p, x)
  _check(p, x, *_run(p, x))


@st.composite
def saturated_problems(draw):
  """Issue 61's regime: the peers' test data (uniform [0, 1) q, k, v, dout, lse
  cotangent) with sm_scale 1, so logits of ~D / 4 (16 to 64) that a cap of 1 to 10
  saturates (|logit| / cap from ~2 to ~60), at every head_dim up to 256."""
  mask = draw(st.sampled_from(["none", "causal", "causal_window", "window"]))
  q_len = draw(st.sampled_from([5, 64, 130, 200]))
  shared = draw(st.booleans())
  kv_len = q_len if shared else draw(st.sampled_from([5, 64, 130, 200]))
  return dict(
      data="uniform", dtype=draw(st.sampled_from(["float32", "bfloat16"])),
      batch=1, num_kv_heads=1, group=draw(st.integers(1, 2)), q_len=q_len, kv_len=kv_len,
      head_dim=draw(st.sampled_from([64, 128, 256])), causal=mask.startswith("causal"),
      q_offset=0, sliding_window=(draw(st.integers(1, kv_len + 10))
                                  if mask.endswith("window") else None),
      soft_cap=draw(st.sampled_from([1.0, 1.5, 2.0, 3.0, 5.0, 7.0, 10.0])), sm_scale=1.0,
      segments="shared" if shared and draw(st.booleans()) else None,
      num_segments=draw(st.integers(1, 3)), sinks=draw(st.sampled_from([None, "normal"])),
      block_q=draw(st.sampled_from([None, 128])), block_k=draw(st.sampled_from([None, 128])),
      seed=draw(st.integers(0, 2**31 - 1)))


def _check_float32_grads_against_their_largest(p, x, grads):
  """float32 gradients within 1e-4 of max|gradient| itself (plus 1e-4 of |gradient|),
  the bound the card states for unit-scale uniform inputs with unscaled logits; the
  general bound (`_check`) judges against max(max|gradient|, the reach of rowsum(dO * O)'s
  rounding), which is 10-240x max|gradient| on these inputs."""
  want = ref.attention_grads(x["q"], x["k"], x["v"], x["grad_out"], grad_lse=x["grad_lse"],
                             **_options(p, x))
  for name in ("dq", "dk", "dv", "dsinks"):
    if want[name] is not None:
      ref.assert_close(grads[name], want[name], ref.ATTENTION_GRAD_TOLERANCE["float32"],
                       f"{name} against max|{name}| {p}")


@settings(max_examples=_examples(0.5))
@given(saturated_problems())
def test_saturated_soft_cap_matches_reference(p):
  """Unscaled uniform inputs under a saturating cap, forward and backward: the soft cap's
  slope sech^2(x) runs from ~0.2 down to ~1e-55 here, and taken as 1 - tanh^2 it lost its
  digits (dq 2e-3 of max|dq| off at cap 5, all of it at caps 1-2: issue 61)."""
  x = _inputs(p)
  _events(p, x)
  event(f"{p['dtype']} soft_cap {p['soft_cap']} head_dim {p['head_dim']}")
  out, lse, grads = _run(p, x)
  _check(p, x, out, lse, grads)
  if p["dtype"] == "float32":
    _check_float32_grads_against_their_largest(p, x, grads)


def test_issue_61_reproduction_float32_gradients_keep_their_digits():
  """The issue's reproduction: uniform [0, 1) q, k, v, dout [1, 1, 256, 128] float32,
  sm_scale 1, cap 5 (logits ~32, |x| ~ 6: tanh within 1e-5 of 1). dq, dk and dv within
  1e-4 of their largest magnitude (with the old 1 - tanh^2 slope dq was 3.0e-3 of
  max|dq| off here, 29x that bound)."""
  p = _problem(data="uniform", batch=1, num_kv_heads=1, group=1, q_len=256, kv_len=256,
               head_dim=128, sm_scale=1.0, soft_cap=5.0, seed=61)
  x = _inputs(p)
  x["grad_lse"] = np.zeros_like(x["grad_lse"])      # the issue's loss: sum(out * dout)
  out, lse, grads = _run(p, x)
  _check(p, x, out, lse, grads)
  _check_float32_grads_against_their_largest(p, x, grads)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("window", [1, 129])
def test_windows_across_many_blocks(causal, window):
  """A window narrower than the blocks with 5 kv blocks (a left window without causal
  still shows every later key, so its q blocks visit all of them), and the chunk
  offset not a block multiple."""
  p = _problem(causal=causal, sliding_window=window, q_len=300, kv_len=520, q_offset=150,
               batch=1, num_kv_heads=1, group=2, block_q=128, block_k=128, sinks="normal")
  x = _inputs(p)
  _check(p, x, *_run(p, x))


@pytest.mark.parametrize("head_dim, dtype", [
    (d, ["float32", "bfloat16"][i % 2]) for i, d in enumerate(HEAD_DIMS)] + [
    (d, ["bfloat16", "float32"][i % 2]) for i, d in enumerate(HEAD_DIMS) if d in (128, 256)])
def test_every_head_dim(head_dim, dtype):
  """Each supported head_dim with every feature on, several blocks and tails."""
  p = dict(dtype=dtype, batch=1, num_kv_heads=2, group=2, q_len=200, kv_len=300,
           head_dim=head_dim, causal=True, q_offset=60, sliding_window=150, soft_cap=30.0,
           sm_scale=None, segments="pair_consistent", num_segments=2, sinks="normal",
           block_q=128, block_k=128, seed=head_dim)
  x = _inputs(p)
  _check(p, x, *_run(p, x))


@pytest.mark.parametrize("block_q, block_k", [(1024, 512), (512, 512)])
def test_dq_layouts_match_reference(block_q, block_k):
  """The dq kernel works transposed (keys on sublanes) from block_q = 1024 and q-major
  below (FA._dq_transposed): each, with everything that masks inside a block (chunk
  offset, causal window, segment ids, padded queries and keys) plus soft-cap, sinks and
  GQA, matches the reference."""
  assert FA._dq_transposed(types.SimpleNamespace(block_q=block_q)) == (block_q >= 1024)
  p = dict(dtype="float32", batch=1, num_kv_heads=1, group=2, q_len=1100, kv_len=1300,
           head_dim=64, causal=True, q_offset=200, sliding_window=700, soft_cap=30.0,
           sm_scale=None, segments="pair_consistent", num_segments=2, sinks="normal",
           block_q=block_q, block_k=block_k, seed=block_q)
  x = _inputs(p)
  _check(p, x, *_run(p, x))


# ----------------------------------------------------------------------------- explicit cases


def _problem(**overrides):
  p = dict(dtype="float32", batch=2, num_kv_heads=2, group=2, q_len=100, kv_len=100,
           head_dim=64, causal=False, q_offset=0, sliding_window=None, soft_cap=None,
           sm_scale=None, segments=None, num_segments=1, sinks=None, block_q=None,
           block_k=None, seed=0)
  p.update(overrides)
  return p


@pytest.mark.parametrize("case", [
    # one block (336 rows) over 333: the tail of 3 rows and 3 keys, SD3.5's 333 text tokens
    dict(q_len=333, kv_len=333),
    # 4429 / 512 blocks scaled to 128: two whole blocks and a tail of 83 = 0.65 of a block,
    # queries and keys; with causal, segments and sinks the tails also meet every mask
    dict(q_len=339, kv_len=339, block_q=128, block_k=128),
    dict(q_len=339, kv_len=339, block_q=128, block_k=128, causal=True, segments="shared",
         num_segments=3, sinks="normal", soft_cap=30.0, dtype="bfloat16"),
    # cross-attention: the q tail (83 rows) and the kv tail (72 keys) in different blocks
    dict(q_len=339, kv_len=200, block_q=128, block_k=128, group=3, num_kv_heads=1),
], ids=["one-block", "4429-like", "4429-like-all-masks", "cross"])
def test_partial_last_blocks(case):
  """Sequences that are not block multiples go into the kernels unpadded: the last q and
  kv blocks are partial, and Pallas reads their tails from past the arrays' ends.
  Interpret mode fills those tails with NaN (as a TPU may hold anything there), so a tail
  key's value row or a tail query row's dout / lse reaching a matmul with weight 0 gives
  NaN (0 * NaN), and `_check` insists on finite results that match the reference:
  forward, lse and dq / dk / dv."""
  p = _problem(**case)
  assert p["q_len"] % (p["block_q"] or 8) and p["kv_len"] % (p["block_k"] or 8)
  x = _inputs(p)
  _check(p, x, *_run(p, x))


def test_q_k_v_are_not_padded_in_xla():
  """Tails are masked in the kernels (test_partial_last_blocks): q, k and v reach the
  pallas_calls as they are (a free reshape of q), and no pad or slice of them, or of the
  output, runs in XLA. Only the [B, S] segment ids and the [B, Hkv, G, S] lse / di rows
  have whole blocks (lane rows, which blocks of 336 could not tile otherwise)."""
  q = jnp.zeros((1, 4, 333, 64), jnp.bfloat16)
  k = jnp.zeros((1, 2, 333, 64), jnp.bfloat16)
  seg = jnp.zeros((1, 333), jnp.int32)

  def loss(q, k, v):
    out = FA.flash_attention(q, k, v, segment_ids=seg, interpret=True, chip=CHIP)
    return jnp.sum(out.astype(jnp.float32))

  jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, k)
  kernels, copies = [], []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.primitive.name == "pallas_call":
        kernels.append(str(eqn.params["name"]))
        continue
      if eqn.primitive.name in ("pad", "slice", "dynamic_slice", "concatenate"):
        copies.extend((eqn.primitive.name, v.aval.shape) for v in eqn.invars
                      if getattr(v, "aval", None) is not None and v.aval.ndim >= 4
                      and v.aval.shape[-1] == 64)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (list, tuple)) else [param]:
          sub = getattr(sub, "jaxpr", sub)
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jaxpr.jaxpr)
  assert sorted(kernels) == sorted([FA.FORWARD_KERNEL, FA.DQ_KERNEL, FA.DKV_KERNEL]), kernels
  assert not copies, copies


@pytest.mark.parametrize("sinks", [None, "normal"])
@pytest.mark.parametrize("how", ["segments", "window_past_keys"])
def test_fully_masked_rows_are_zero_never_nan(how, sinks):
  """Rows that see no key: out exactly 0, lse -inf (or the sink), no gradient to q, and
  keys nobody sees get no gradient; nothing is NaN."""
  if how == "segments":   # batch 0: query rows 30.. in segment 7, which no key has
    p = _problem(causal=True, q_len=130, kv_len=200, q_offset=40, sinks=sinks,
                 block_q=128, block_k=128)
    x = _inputs(p)
    q_seg = np.zeros((2, 130), np.int32)
    q_seg[0, 30:] = 7
    kv_seg = np.zeros((2, 200), np.int32)
    kv_seg[1, 150:] = 3       # batch 1: keys 150.. in a segment no query has
    x["segment_ids"] = (q_seg, kv_seg)
  else:                   # causal window 3: rows at positions >= 102 see no key
    p = _problem(causal=True, q_len=100, kv_len=100, q_offset=60, sliding_window=3,
                 sinks=sinks, block_q=None, block_k=None)
    x = _inputs(p)
  masked = _masked_rows(p, x)
  assert masked.any() and not masked.all()
  out, lse, grads = _run(p, x)
  _check(p, x, out, lse, grads)
  if how == "segments":   # keys 150.. of batch 1 are seen by nobody
    assert not np.asarray(grads["dk"])[1, :, 150:].any()
    assert not np.asarray(grads["dv"])[1, :, 150:].any()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_of_one_sees_only_itself(dtype):
  p = _problem(dtype=dtype, causal=True, sliding_window=1, q_len=100, kv_len=300,
               q_offset=150, block_q=128, block_k=128)
  x = _inputs(p)
  out, lse, grads = _run(p, x)
  _check(p, x, out, lse, grads)
  # Weight exactly 1 on key q_offset + i: out is that key's value row, bit for bit.
  kv = np.repeat(x["v"], p["group"], axis=1)[:, :, 150:250]
  np.testing.assert_array_equal(np.asarray(out), kv)


def test_gqa_equals_each_head_with_repeated_kv():
  p = _problem(num_kv_heads=2, group=4, q_len=200, kv_len=300, q_offset=100, causal=True,
               sinks="normal", soft_cap=5.0, block_q=128, block_k=128)
  x = _inputs(p)
  out, lse, grads = _run(p, x)
  _check(p, x, out, lse, grads)
  mha = dict(p, num_kv_heads=8, group=1)
  xr = dict(x, k=np.repeat(x["k"], 4, axis=1), v=np.repeat(x["v"], 4, axis=1))
  out_r, lse_r, grads_r = _run(mha, xr)
  tol = ref.ATTENTION_TOLERANCE["float32"]
  ref.assert_close(out, out_r, tol, "out")
  ref.assert_close(lse, lse_r, ref.ATTENTION_LSE_TOLERANCE["float32"], "lse")
  ref.assert_close(grads["dq"], grads_r["dq"], ref.ATTENTION_GRAD_TOLERANCE["float32"], "dq")
  ref.assert_close(grads["dsinks"], grads_r["dsinks"], ref.ATTENTION_GRAD_TOLERANCE["float32"],
                   "dsinks")
  for name in ("dk", "dv"):   # a KV head's gradient is the sum over its query heads'
    folded = np.asarray(grads_r[name]).reshape(2, 2, 4, 300, 64).sum(axis=2)
    ref.assert_close(grads[name], folded, ref.ATTENTION_GRAD_TOLERANCE["float32"], name)


@pytest.mark.parametrize("group, dtype, sinks, segments, soft_cap, block_q, block_k, seq", [
    (2, "float32", None, None, None, 256, 128, 1024),        # 2 kv blocks per q block
    (1, "bfloat16", "normal", None, None, 128, 128, 512),    # one per q block
    (4, "float32", None, "shared", None, 256, 128, 512),     # one grid row
    (2, "float32", "normal", None, 5.0, 512, 128, 1024),     # 4 per q block, soft-cap
    (1, "float32", None, None, None, 1024, 1024, 2048),      # diagonal tiles in 2 strips
    (2, "bfloat16", "normal", None, 5.0, 1024, 1024, 2048),   # ... sinks, soft-cap, bf16
])
def test_folded_causal_grid(group, dtype, sinks, segments, soft_cap, block_q, block_k, seq):
  """Causal self-attention with a static zero offset runs all three kernels on folded
  grids (rows pairing q blocks i and nq - 1 - i; for dkv, kv blocks j and nk - 1 - j):
  they match the reference, and the rectangular grids (a traced offset) bit for bit,
  since each block accumulates its partners in the same order."""
  assert FA._fold_causal(True, None, 0, seq, seq, block_q, block_k)
  p = _problem(batch=1, num_kv_heads=2, group=group, q_len=seq, kv_len=seq, causal=True,
               dtype=dtype, sinks=sinks, segments=segments, num_segments=3,
               soft_cap=soft_cap, block_q=block_q, block_k=block_k)
  x = _inputs(p)
  out, lse, grads = _run_static_offset(p, x)
  _check(p, x, out, lse, grads)
  out_unfolded, lse_unfolded, grads_unfolded = _run(p, x)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(out_unfolded))
  np.testing.assert_array_equal(np.asarray(lse), np.asarray(lse_unfolded))
  for name in ("dq", "dk", "dv", "dsinks"):
    if grads[name] is not None:
      np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(grads_unfolded[name]),
                                    err_msg=name)


@pytest.mark.parametrize("q_offset, q_len, kv_len, window, block_q, block_k", [
    (jnp.int32(0), 512, 512, None, 128, 128),   # traced offset
    (1, 512, 512, None, 128, 128),              # offset
    (0, 512, 1024, None, 128, 128),             # not self-attention
    (0, 500, 500, None, 128, 128),              # padded
    (0, 384, 384, None, 128, 128),              # odd number of q blocks
    (0, 512, 512, 64, 128, 128),                # window
    (0, 512, 512, None, 128, 256),              # block_k larger than block_q
])
def test_fold_only_where_it_holds(q_offset, q_len, kv_len, window, block_q, block_k):
  assert not FA._fold_causal(True, window, q_offset, q_len, kv_len, block_q, block_k)
  assert not FA._fold_causal(False, None, 0, 512, 512, 128, 128)


def test_static_and_traced_q_offset_agree_and_lse_is_optional():
  p = _problem(causal=True, q_len=64, kv_len=200, q_offset=100, sliding_window=50,
               sinks="normal")
  x = _inputs(p)
  q, k, v, sinks = (jnp.asarray(x[n]) for n in ("q", "k", "v", "sinks"))
  common = dict(causal=True, sliding_window=50, sinks=sinks, interpret=True, chip=CHIP)
  static = FA.flash_attention(q, k, v, q_offset=100, **common)
  assert isinstance(static, jax.Array)   # return_lse=False: the output alone
  traced = jax.jit(lambda o: FA.flash_attention(q, k, v, q_offset=o, **common))(jnp.int32(100))
  np.testing.assert_array_equal(np.asarray(static), np.asarray(traced))
  want_out, _ = ref.attention(x["q"], x["k"], x["v"], **_options(p, x))
  ref.assert_close(static, want_out, ref.ATTENTION_TOLERANCE["float32"], "out")
  # Without lse, the gradients are those of sum(grad_out * out) alone.
  loss = lambda q, k, v, s: jnp.sum(
      FA.flash_attention(q, k, v, q_offset=100, **{**common, "sinks": s})
      * jnp.asarray(x["grad_out"]))
  dq, dk, dv, ds = jax.grad(loss, (0, 1, 2, 3))(q, k, v, sinks)
  failures = ref.attention_mismatches(
      "float32", x["q"], x["k"], x["v"], static, None, dict(dq=dq, dk=dk, dv=dv, dsinks=ds),
      grad_out=x["grad_out"], grad_lse=None, **_options(p, x))
  assert not failures, failures


def test_bfloat16_sinks():
  """sinks may also come in q's dtype; d_sinks comes back in it."""
  p = _problem(dtype="bfloat16", causal=True, q_len=64, kv_len=130, q_offset=30,
               sinks="normal", sliding_window=40)
  x = _inputs(p)
  x["sinks"] = x["sinks"].astype(ml_dtypes.bfloat16)
  out, lse, grads = _run(p, x)
  assert grads["dsinks"].dtype == jnp.bfloat16
  failures = ref.attention_mismatches("bfloat16", x["q"], x["k"], x["v"], out, lse, grads,
                                      grad_out=x["grad_out"], grad_lse=x["grad_lse"],
                                      **_options(p, x))
  assert not failures, failures


def test_empty_sequences():
  q = jnp.ones((1, 2, 0, 64))
  k = jnp.ones((1, 1, 5, 64))
  out, lse = FA.flash_attention(q, k, k, return_lse=True, interpret=True)
  assert out.shape == (1, 2, 0, 64) and lse.shape == (1, 2, 0)
  sinks = jnp.array([0.5, -1.0])
  out, lse = FA.flash_attention(jnp.ones((1, 2, 3, 64)), k[:, :, :0], k[:, :, :0],
                                sinks=sinks, return_lse=True, interpret=True)
  assert not np.asarray(out).any()
  np.testing.assert_array_equal(np.asarray(lse), np.broadcast_to([[[0.5], [-1.0]]], (1, 2, 3)))


# ----------------------------------------------------------------------------- bad inputs


def _bad(q_shape=(1, 4, 8, 64), kv_shape=(1, 2, 8, 64), v_shape=None, dtype=np.float32,
         k_dtype=None, **options):
  q = np.zeros(q_shape, dtype)
  k = np.zeros(kv_shape, k_dtype or dtype)
  v = np.zeros(v_shape or kv_shape, k_dtype or dtype)
  return lambda: FA.flash_attention(q, k, v, interpret=True, **options)


BAD_INPUTS = {
    "heads_not_a_multiple": (_bad(q_shape=(1, 3, 8, 64)), "heads"),
    "k_v_shapes_differ": (_bad(v_shape=(1, 2, 9, 64)), r"\bk\b.*\bv\b"),
    "head_dim_differs": (_bad(kv_shape=(1, 2, 8, 32)), "head_dim"),
    "k_dtype_differs": (_bad(k_dtype=ml_dtypes.bfloat16), "dtype"),
    "float16": (_bad(dtype=np.float16), r"\bq\b.*float32 or bfloat16"),
    "float64": (_bad(dtype=np.float64), r"\bq\b.*float32 or bfloat16"),
    "q_rank_3": (_bad(q_shape=(4, 8, 64)), r"\bq\b.*4-D"),
    "k_rank_5": (_bad(kv_shape=(1, 2, 1, 8, 64)), r"\bk\b.*4-D"),
    "window_0": (_bad(sliding_window=0), "sliding_window"),
    "window_negative": (_bad(sliding_window=-1), "sliding_window"),
    "soft_cap_0": (_bad(soft_cap=0.0), "soft_cap"),
    "soft_cap_negative": (_bad(soft_cap=-1.0), "soft_cap"),
    "sinks_per_kv_head": (_bad(sinks=jnp.zeros((2,))), "sinks"),
    "sinks_2d": (_bad(sinks=jnp.zeros((1, 4))), "sinks"),
    "segment_ids_length": (_bad(segment_ids=jnp.zeros((1, 9), jnp.int32)), "segment_ids"),
    "segment_ids_pair_batch": (_bad(segment_ids=(jnp.zeros((1, 8), jnp.int32),
                                                 jnp.zeros((2, 8), jnp.int32))), "segment_ids"),
    "segment_ids_single_with_sq_ne_skv": (
        _bad(kv_shape=(1, 2, 16, 64), segment_ids=jnp.zeros((1, 8), jnp.int32)), "segment_ids"),
    "q_offset_negative": (_bad(q_offset=-1), "q_offset"),
}


# Wrong dtypes raise TypeError (as ragged_dot does), everything else ValueError.
DTYPE_CASES = {"k_dtype_differs", "float16", "float64"}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_clear_error(case):
  call, message = BAD_INPUTS[case]
  with pytest.raises(TypeError if case in DTYPE_CASES else ValueError, match=message):
    call()
