"""Ragged paged attention and the KV-cache write in interpret mode against the float64
reference (JAX only).

Every batch is built page by page: page ids drawn from a shuffled pool, sometimes shared
between sequences (a common prefix) or repeated inside one row; page-table entries past
each sequence's used pages hold junk (-1, ids past the cache); cache slots no sequence
uses hold NaN (float and fp8 caches; int8 has no NaN, its unused slots hold -128 / 127).
`reference.paged_attention` reads only the used slots, so NaN reaching the kernel's output
(or any unwritten output element, which interpret mode leaves as NaN) fails
`assert_close`'s finiteness check. Query tokens past cu_q_lens[-1] must come back exactly 0.

Quantized caches (int8, float8_e4m3fn, scale a python float, 0-d or per KV head) are judged
against the reference on the dequantized cache with q's dtype's tolerance (see
`reference.PAGED_TOLERANCE`).

Interpret mode compiles each new (shape, option) combination, so shapes come from short
lists and everything runs under one `jax.jit`.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

import reference as ref
from tpu_kernels import paged_attention as pa

NP = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16,
      "int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
PAGE_SIZES = [16, 32, 64, 128, 256]
# KV lengths: 1, not multiples of any page size (5, 17, 40, 100, 300), exact multiples
# (16, 64, 256).
KV_LENS = [1, 5, 16, 17, 40, 64, 100, 256, 300]


def _examples(fraction):
  """A share of the loaded hypothesis profile's example count (tests/conftest.py)."""
  return max(1, round(settings.default.max_examples * fraction))


# ----------------------------------------------------------------------------- building a batch


def _layout(rng, kv_lens, page_size, pages_per_seq, share, repeat, spare_pages=2):
  """(page_indices [S, pages_per_seq] int32, num_pages, used [num_pages, page_size] bool).

  Used entries: fresh page ids from a shuffled pool; with `share`, a sequence's first full
  pages may be those of an earlier sequence (prefix caching); with `repeat`, a later page
  of a row may repeat an earlier one of the same row. Unused entries: -1, num_pages or
  a large id (never read)."""
  need = [-(-int(n) // page_size) for n in kv_lens]
  num_pages = sum(need) + spare_pages
  pool = list(rng.permutation(num_pages))
  junk = np.array([-1, num_pages, num_pages + 7, 2**30])
  table = junk[rng.integers(0, len(junk), (len(kv_lens), pages_per_seq))]
  used = np.zeros((num_pages, page_size), bool)
  for s, n in enumerate(kv_lens):
    first = 0
    if share and s > 0 and rng.random() < 0.5:
      donor = int(rng.integers(0, s))
      full = min(int(kv_lens[donor]) // page_size, need[s])
      first = int(rng.integers(0, full + 1)) if full else 0
      table[s, :first] = table[donor, :first]
    for i in range(first, need[s]):
      if repeat and i > 0 and rng.random() < 0.3:
        table[s, i] = table[s, int(rng.integers(0, i))]
      else:
        table[s, i] = pool.pop()
    for j in range(int(n)):
      used[table[s, j // page_size], j % page_size] = True
  return table.astype(np.int32), num_pages, used


def _cache(rng, kv_dtype, num_kv_heads, num_pages, page_size, head_dim, used,
           uniform=False, fp8_raw=False):
  """One cache [num_pages, Hkv, page_size, D]: unit-scale values (times 1/scale for
  quantized caches) in used slots, NaN (int8: -128 / 127) elsewhere. Unit normal, or
  uniform in [0, 1) (int8 codes 0..127); fp8_raw: e4m3 values of that unit scale
  themselves (scale 1.0), as the peers' fp8 caches without scales."""
  shape = (num_pages, num_kv_heads, page_size, head_dim)
  mask = np.broadcast_to(used[:, None, :, None], shape)
  if kv_dtype == "int8":
    values = rng.integers(0 if uniform else -127, 128, shape).astype(np.int8)
    junk = rng.choice(np.array([-128, 127], np.int8), shape)
    return np.where(mask, values, junk)
  values = rng.random(shape) if uniform else rng.standard_normal(shape)
  if kv_dtype == "float8_e4m3fn" and not fp8_raw:
    values = values * 40.0
  return np.where(mask, values, np.nan).astype(NP[kv_dtype])


def _scale(rng, kind, num_kv_heads, kv_dtype):
  """A scale that brings the cache to ~unit scale: python float, 0-d or [Hkv] array
  ("raw": 1.0, for an fp8 cache of unit-scale values)."""
  if kind is None:
    return None
  if kind == "raw":
    return 1.0
  base = {"int8": 1 / 60, "float8_e4m3fn": 1 / 40}[kv_dtype]
  if kind == "per_head":
    return (base * rng.uniform(0.5, 2.0, num_kv_heads)).astype(np.float32)
  s = float(np.float32(base * rng.uniform(0.5, 2.0)))
  return s if kind == "python" else np.float32(s).reshape(())


def _inputs(p):
  """numpy inputs of `ragged_paged_attention` for problem p."""
  rng = np.random.default_rng(p["seed"])
  kv_lens = np.array(p["kv_lens"], np.int32)
  q_lens = np.array(p["q_lens"], np.int32)
  cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
  # At least one token: q with no tokens at all is refused (a ValueError, not tested here).
  num_tokens = max(int(cu[-1]) + p["pad_tokens"], 1)
  page_size = p["page_size"]
  need = max([-(-int(n) // page_size) for n in kv_lens] + [1])
  table, num_pages, used = _layout(rng, kv_lens, page_size, need + p["extra_table"],
                                   p["share"], p["repeat"])
  num_q_heads = p["num_kv_heads"] * p["group"]
  kv_dtype = p["dtype"] if p["kv_dtype"] == "same" else p["kv_dtype"]
  uniform = p.get("data") == "uniform"
  caches = [_cache(rng, kv_dtype, p["num_kv_heads"], num_pages, page_size, p["head_dim"],
                   used, uniform, fp8_raw=p["scale"] == "raw") for _ in range(2)]
  quant = kv_dtype in ref.QUANTIZED_KV_DTYPES
  scales = [_scale(rng, p["scale"] if quant else None, p["num_kv_heads"], kv_dtype)
            for _ in range(2)]
  draw = rng.random if uniform else rng.standard_normal
  q = draw((num_tokens, num_q_heads, p["head_dim"])).astype(NP[p["dtype"]])
  sinks = None
  if p["sinks"] is not None:
    sinks = (2.0 * rng.standard_normal(num_q_heads)).astype(np.float32)
    if p["sinks"] == "large":   # a sink that takes (almost) all the mass, one that takes none
      sinks[::2], sinks[1::2] = 30.0, -30.0
  return dict(q=q, k_pages=caches[0], v_pages=caches[1], kv_lens=kv_lens,
              page_indices=table, cu_q_lens=cu, sinks=sinks, k_scale=scales[0],
              v_scale=scales[1])


# ----------------------------------------------------------------------------- running


@functools.partial(jax.jit, static_argnames=("static",))
def _kernel(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks, k_scale, v_scale,
            static):
  options = dict(static)
  k_scale = options.pop("k_scale", k_scale)   # python-float scales come in as static
  v_scale = options.pop("v_scale", v_scale)
  return pa.ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens,
                                   sinks=sinks, k_scale=k_scale, v_scale=v_scale,
                                   interpret=True, **options)


def _options(p):
  return dict(sm_scale=p["sm_scale"], soft_cap=p["soft_cap"],
              sliding_window=p["sliding_window"])


def _run(p, x):
  static = {**_options(p), "chip": p["chip"], "block_q": p["block_q"],
            "block_kv": p["block_kv"], "items_per_call": p.get("items_per_call"),
            "manual_fetch": p.get("manual_fetch")}
  scales = {}
  for name in ("k_scale", "v_scale"):
    if isinstance(x[name], float):
      static[name] = x[name]
    else:
      scales[name] = None if x[name] is None else jnp.asarray(x[name])
  static = tuple((key, value) for key, value in static.items() if value is not None)
  j = lambda a: None if a is None else jnp.asarray(a)
  return _kernel(j(x["q"]), j(x["k_pages"]), j(x["v_pages"]), j(x["kv_lens"]),
                 j(x["page_indices"]), j(x["cu_q_lens"]), j(x["sinks"]), static=static,
                 k_scale=scales.get("k_scale"), v_scale=scales.get("v_scale"))


def _reference(p, x):
  return ref.paged_attention(x["q"], x["k_pages"], x["v_pages"], x["kv_lens"],
                             x["page_indices"], x["cu_q_lens"], sinks=x["sinks"],
                             k_scale=x["k_scale"], v_scale=x["v_scale"], **_options(p))


def _check(p, x, out):
  assert out.shape == x["q"].shape and out.dtype == x["q"].dtype, (out.shape, out.dtype)
  want = _reference(p, x)
  out = np.asarray(out)
  ref.assert_close(out, want, ref.PAGED_TOLERANCE[p["dtype"]], f"problem {p}\nout")
  end = int(x["cu_q_lens"][-1])
  assert not out[end:].astype(np.float64).any(), "padding tokens past cu_q_lens[-1] not 0"


# ----------------------------------------------------------------------------- properties

SEQ_KINDS = ["decode", "decode", "prefill", "chunk", "chunk", "empty"]


@st.composite
def sequences(draw, kv_lens=KV_LENS, max_seqs=4):
  """(kv_lens, q_lens, kinds): a ragged batch mixing decode, prefill and chunked prefill,
  with empty (padding) sequences that may still have KV."""
  kinds = draw(st.lists(st.sampled_from(SEQ_KINDS), min_size=1, max_size=max_seqs))
  kv, ql = [], []
  for kind in kinds:
    n = draw(st.sampled_from(kv_lens))
    if kind == "empty":
      n = draw(st.sampled_from([0, 0, n]))
      q = 0
    elif kind == "decode":
      q = 1
    elif kind == "prefill":
      q = n
    else:
      q = draw(st.integers(1, n - 1)) if n > 1 else 1
    kv.append(n)
    ql.append(q)
  return kv, ql, kinds


@st.composite
def problems(draw, page_sizes=PAGE_SIZES, head_dims=(64, 64, 128), kv_lens=KV_LENS,
             blocks_q=(None,), pages_per_block=(None,), items_per_call=(None,),
             windows=None, kv_dtypes=("same", "same", "same", "int8", "float8_e4m3fn")):
  """blocks_q: block_q choices (None: the tiling's); pages_per_block: block_kv choices in
  pages (None: the tiling's); items_per_call: work items per kernel call (None: all that
  fit SMEM; small values split the batch into several calls, each with its own rows of
  the page table)."""
  kv, ql, kinds = draw(sequences(kv_lens))
  page_size = draw(st.sampled_from(page_sizes))
  num_kv_heads = draw(st.sampled_from([1, 2]))
  group = draw(st.sampled_from([1, 2, 4, 8] if num_kv_heads == 1 else [1, 2, 4]))
  kv_dtype = draw(st.sampled_from(kv_dtypes))   # "same": q's dtype
  longest = max(kv)
  window = None
  if draw(st.sampled_from([False, True, True])):
    window = draw(windows if windows is not None else st.one_of(
        st.sampled_from([1, 2, page_size - 1, page_size, page_size + 1]),
        st.integers(1, max(longest, 1) + 5)))
  return dict(
      kv_lens=kv, q_lens=ql, kinds=kinds, page_size=page_size,
      pad_tokens=draw(st.sampled_from([0, 0, 1, 7])),
      extra_table=draw(st.sampled_from([0, 1, 3])),
      share=draw(st.booleans()), repeat=draw(st.booleans()),
      dtype=draw(st.sampled_from(["float32", "bfloat16"])), kv_dtype=kv_dtype,
      scale=draw(st.sampled_from(["python", "0d", "per_head"])),
      num_kv_heads=num_kv_heads, group=group, head_dim=draw(st.sampled_from(head_dims)),
      sliding_window=window,
      soft_cap=draw(st.sampled_from([None, None, 1.0, 5.0, 30.0])),
      # None: 1/sqrt(D); 1.0 gives very peaked rows (logits ~ +-sqrt(D)).
      sm_scale=draw(st.sampled_from([None, None, 0.05, 0.3, 1.0])),
      sinks=draw(st.sampled_from([None, None, "normal", "large"])),
      chip=draw(st.sampled_from(["v6e", "v5e"])),
      block_q=draw(st.sampled_from(blocks_q)),
      block_kv=(None if (n := draw(st.sampled_from(pages_per_block))) is None
                else n * page_size),
      items_per_call=draw(st.sampled_from(items_per_call)),
      seed=draw(st.integers(0, 2**31 - 1)))


def _events(p):
  """Coverage, shown by pytest --hypothesis-show-statistics."""
  event(f"kinds {sorted(set(p['kinds']))}")
  event(f"page_size {p['page_size']}, kv {p['kv_dtype']}")
  event(f"window {'none' if p['sliding_window'] is None else 'set'}")
  if any(n % p["page_size"] for n in p["kv_lens"]):
    event("a length not a multiple of the page size")


@settings(max_examples=_examples(1.0))
@given(problems())
def test_matches_reference(p):
  """Random ragged batches with every option, at the chips' default tilings."""
  _events(p)
  x = _inputs(p)
  _check(p, x, _run(p, x))


@settings(max_examples=_examples(0.6))
@given(problems(page_sizes=[16, 32], head_dims=[64], kv_lens=[5, 17, 40, 64, 100, 130],
                blocks_q=(None, 1, 2, 4, 16), pages_per_block=(None, 1, 1, 2),
                items_per_call=(None, None, 1, 2, 3),
                windows=st.sampled_from([1, 2, 3, 8, 15, 16, 17, 31, 33, 50])))
def test_small_blocks_match_reference(p):
  """Small explicit block_q / block_kv: several work items per sequence and kv steps per
  item, windows narrower than a page (pages outside the window skipped), and the batch
  split over several kernel calls (items_per_call)."""
  _events(p)
  event(f"block_q {p['block_q']}, block_kv {p['block_kv']}, "
        f"items_per_call {p['items_per_call']}")
  x = _inputs(p)
  _check(p, x, _run(p, x))


@settings(max_examples=_examples(0.4))
@given(problems(kv_dtypes=("int8", "float8_e4m3fn"), head_dims=[64, 128]))
def test_quantized_cache_matches_reference(p):
  """int8 / float8_e4m3fn caches with scales (python float, 0-d, per KV head) against the
  reference on the dequantized cache."""
  _events(p)
  event(f"scale {p['scale']}, q {p['dtype']}")
  x = _inputs(p)
  _check(p, x, _run(p, x))


# ----------------------------------------------------------------------------- explicit cases


def _problem(**overrides):
  p = dict(kv_lens=[37, 1, 64, 20, 0], q_lens=[1, 1, 64, 7, 0], kinds=["mixed"],
           page_size=16, pad_tokens=5, extra_table=2, share=True, repeat=True,
           dtype="float32", kv_dtype="same", scale="per_head", num_kv_heads=2, group=2,
           head_dim=64, sliding_window=None, soft_cap=None, sm_scale=None, sinks=None,
           chip="v6e", block_q=None, block_kv=None, seed=0)
  p.update(overrides)
  return p


@pytest.mark.parametrize("page_size, head_dim, dtype, kv_dtype", [
    (16, 80, "float32", "same"),
    (32, 128, "bfloat16", "same"),
    (64, 64, "bfloat16", "int8"),
    (128, 128, "float32", "float8_e4m3fn"),
    (256, 256, "bfloat16", "same"),
    (256, 64, "float32", "int8"),
])
def test_page_sizes_and_head_dims(page_size, head_dim, dtype, kv_dtype):
  """Each page size with lengths below, at and across a page, every feature on."""
  p = _problem(kv_lens=[page_size + 3, 1, page_size, 2 * page_size - 1, 0],
               q_lens=[1, 1, page_size, 9, 0], page_size=page_size, head_dim=head_dim,
               dtype=dtype, kv_dtype=kv_dtype, sliding_window=page_size // 2 + 1,
               soft_cap=30.0, sinks="normal", seed=page_size + head_dim)
  x = _inputs(p)
  _check(p, x, _run(p, x))


@pytest.mark.parametrize("dtype, kv_dtype, scale, pages_per_step", [
    ("float32", "same", None, None), ("bfloat16", "int8", "per_head", 1),
    ("float32", "float8_e4m3fn", "raw", None), ("bfloat16", "float8_e4m3fn", "raw", 1)])
def test_peer_style_inputs_match_reference(dtype, kv_dtype, scale, pages_per_step):
  """The peers' kinds of test data (jax's and tpu-inference's ragged paged attention
  tests): uniform [0, 1) q and caches with unscaled logits (sm_scale 1: logits ~D / 4,
  rows close to one-hot), an fp8 cache of raw e4m3 values (scale 1.0: the peers' fp8
  cache without scales) or with per-head scales, NaN in every unused cache slot and in
  the padding query rows past cu_q_lens[-1] (which must come out exactly 0): within
  q's dtype's tolerance, at the default tiling or at one page per kv step."""
  p = _problem(data="uniform", dtype=dtype, kv_dtype=kv_dtype, scale=scale, sm_scale=1.0,
               kv_lens=[1, 40, 130, 17, 0], q_lens=[1, 40, 30, 1, 0], head_dim=128,
               group=4, seed=61)
  p["block_kv"] = pages_per_step and pages_per_step * p["page_size"]
  x = _inputs(p)
  x["q"][int(x["cu_q_lens"][-1]):] = np.nan
  _check(p, x, _run(p, x))


@pytest.mark.parametrize("group, num_kv_heads", [(1, 4), (2, 2), (4, 2), (8, 1), (16, 1)])
def test_gqa_equals_each_head_with_repeated_kv(group, num_kv_heads):
  """G query heads per KV head give what G copies of each KV head (MHA) give."""
  p = _problem(group=group, num_kv_heads=num_kv_heads, sinks="normal", soft_cap=5.0)
  x = _inputs(p)
  out = _run(p, x)
  _check(p, x, out)
  mha = dict(p, group=1, num_kv_heads=num_kv_heads * group)
  xr = dict(x, k_pages=np.repeat(x["k_pages"], group, axis=1),
            v_pages=np.repeat(x["v_pages"], group, axis=1))
  ref.assert_close(out, _run(mha, xr), ref.PAGED_TOLERANCE["float32"], "gqa vs mha")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_window_of_one_sees_only_itself(dtype):
  """Weight exactly 1 on the query's own position: out is that token's V, bit for bit."""
  p = _problem(dtype=dtype, sliding_window=1, sinks=None)
  x = _inputs(p)
  out = np.asarray(_run(p, x))
  _check(p, x, out)
  group, page_size = p["group"], p["page_size"]
  cu = x["cu_q_lens"]
  for s, (kv_len, q_len) in enumerate(zip(p["kv_lens"], p["q_lens"])):
    for i in range(q_len):
      pos = kv_len - q_len + i
      page = x["page_indices"][s, pos // page_size]
      v = np.repeat(x["v_pages"][page, :, pos % page_size], group, axis=0)
      np.testing.assert_array_equal(out[cu[s] + i], v)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_every_cache_code_widens_exactly(kv_dtype):
  """All 256 codes of a 1-byte cache as V rows, each query seeing only its own token (window
  1, v_scale 1): out is each code's value bit for bit, NaN codes NaN. The kernel hands the
  1-byte blocks to the MXU unconverted (Mosaic widens them); this is what it must get."""
  p = _problem(kv_lens=[2], q_lens=[2], page_size=16, pad_tokens=0, extra_table=0,
               share=False, repeat=False, dtype="bfloat16", kv_dtype=kv_dtype,
               num_kv_heads=1, group=1, head_dim=128, sliding_window=1)
  x = _inputs(p)
  codes = np.arange(256, dtype=np.uint8).view(NP[kv_dtype]).reshape(2, 128)
  page = x["page_indices"][0, 0]
  x["v_pages"][page, 0, :2] = codes
  x["v_scale"] = 1.0
  out = np.asarray(_run(p, x)).astype(np.float32)
  want = codes.astype(np.float32)
  assert np.isnan(want).sum() == (2 if kv_dtype == "float8_e4m3fn" else 0)
  np.testing.assert_array_equal(out[:, 0], want)


@pytest.mark.parametrize("kv_len, window, block_kv", [
    (37, 1, None), (37, 5, None), (33, 1, None), (37, 5, 16), (37, 16, None), (48, 3, None)])
def test_nan_past_the_length_never_leaks(kv_len, window, block_kv):
  """One decode token whose visible keys all lie in its last, partly filled page (the
  slots after kv_len hold NaN), with other pages' places in the same kv block (a page
  table row of 6 pages: the default block_kv is 64 keys, 4 pages)."""
  p = _problem(kv_lens=[kv_len], q_lens=[1], pad_tokens=1, share=False, repeat=False,
               sliding_window=window, block_kv=block_kv, extra_table=3)
  x = _inputs(p)
  last = x["v_pages"][x["page_indices"][0, (kv_len - 1) // 16]]
  filled = kv_len - 16 * ((kv_len - 1) // 16)
  assert np.isnan(last[:, filled:]).all() and not np.isnan(last[:, :filled]).any()
  _check(p, x, _run(p, x))


@pytest.mark.parametrize("manual_fetch", [True, False])
def test_page_fetch_by_hand_and_by_blockspec(manual_fetch):
  """Both page fetches (module docstring, "Page fetch") at page 16: decode and prefill
  sequences whose lengths are not page multiples (NaN past them, junk page ids past the
  used pages), 2 pages per kv step so items span several steps and the next item's
  first block is prefetched, with a window cutting into a block."""
  p = _problem(kv_lens=[37, 1, 70, 20, 0], q_lens=[1, 1, 6, 7, 0], block_kv=32,
               sliding_window=40, manual_fetch=manual_fetch)
  x = _inputs(p)
  _check(p, x, _run(p, x))


def test_decode_batch_and_prefill_agree():
  """Decoding the last token of each sequence equals the last row of its full prefill,
  in one batch (same pages, same cache)."""
  p = _problem(kv_lens=[37, 64, 20], q_lens=[37, 64, 20], pad_tokens=0, sinks="normal",
               sliding_window=30)
  x = _inputs(p)
  full = np.asarray(_run(p, x))
  _check(p, x, full)
  last = x["cu_q_lens"][1:] - 1
  decode = dict(x, q=x["q"][last], cu_q_lens=np.arange(4, dtype=np.int32))
  out = _run(dict(p, q_lens=[1, 1, 1]), decode)
  ref.assert_close(out, full[last], ref.PAGED_TOLERANCE["float32"], "decode vs prefill")


def test_eager_call_checks_indices_and_matches_jit():
  """Outside jit the index inputs are concrete: check_indices runs (junk past the used
  pages passes it) and the result is the jitted one, bit for bit."""
  p = _problem(sinks="normal", sliding_window=21)
  x = _inputs(p)
  names = ("q", "k_pages", "v_pages", "kv_lens", "page_indices", "cu_q_lens")
  out = pa.ragged_paged_attention(*(jnp.asarray(x[n]) for n in names),
                                  sinks=jnp.asarray(x["sinks"]), interpret=True,
                                  **_options(p))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(_run(p, x)))
  _check(p, x, out)


def test_all_sequences_empty():
  """Only padding: every output token is exactly 0."""
  p = _problem(kv_lens=[0, 5, 0], q_lens=[0, 0, 0], pad_tokens=8)
  x = _inputs(p)
  out = np.asarray(_run(p, x))
  assert out.shape == x["q"].shape and not out.any()


@pytest.mark.parametrize("pages_per_block", [1, 3, 4])
def test_slot_pages_fetch_each_needed_page_once(pages_per_block):
  """The page ids the index maps are given (_slot_pages), judged by the fetch rule the
  kernel relies on: at the step of block b, slot i holds page b * n + i of the item's
  sequence whenever that page is in [first_page, last_page] (the body masks keys by that
  position); no slot ever holds a page outside the item's range (so junk page-table
  entries are never read); and, counting a DMA whenever a slot's page id changes from
  one step to the next (as Pallas does), each needed page crosses HBM once, plus the
  first step's slots outside the range (repeats of the first or last page)."""
  rng = np.random.default_rng(pages_per_block)
  n, pages_per_seq, num_seqs = pages_per_block, 10, 3
  # Unique ids, so every id names one (sequence, page); junk past each row's used pages.
  page_indices = rng.permutation(num_seqs * pages_per_seq).reshape(num_seqs, pages_per_seq)
  rows = []
  for seq in range(num_seqs):
    for first_page in range(pages_per_seq):
      for last_page in range(first_page, pages_per_seq):
        rows.append((seq, first_page, last_page))
  seq, first_page, last_page = (np.array(c, np.int32) for c in zip(*rows))
  items = dict(seq=seq, first_page=first_page, last_page=last_page,
               first_block=first_page // n, last_block=last_page // n)
  slot_pages = np.asarray(pa._slot_pages(jnp.asarray(page_indices, jnp.int32),
                                         {k: jnp.asarray(v) for k, v in items.items()}, n,
                                         num_pages=page_indices.size,
                                         steps=-(-pages_per_seq // n)))
  steps = -(-pages_per_seq // n)
  assert slot_pages.shape == (len(rows), steps * n)
  where = {int(page_indices[s, j]): (s, j) for s in range(num_seqs)
           for j in range(pages_per_seq)}
  for w, (s, lo, hi) in enumerate(rows):
    held = slot_pages[w].reshape(steps, n)
    logical = np.vectorize(lambda i: where[int(i)][1])(held)
    assert all(where[int(i)][0] == s for i in held.ravel()), (w, held)
    assert ((logical >= lo) & (logical <= hi)).all(), (w, lo, hi, logical)
    for t in range(hi // n - lo // n + 1):
      block = lo // n + t
      for i in range(n):
        if lo <= block * n + i <= hi:
          assert logical[t, i] == block * n + i, (w, t, i, logical)
    fetched = [logical[0, i] for i in range(n)]
    fetched += [logical[t, i] for t in range(1, steps) for i in range(n)
                if held[t, i] != held[t - 1, i]]
    assert sorted(set(fetched)) == list(range(lo, hi + 1)), (w, fetched)
    in_first_block = min(hi, (lo // n) * n + n - 1) - lo + 1
    assert len(fetched) == (hi - lo + 1) + n - in_first_block, (w, fetched)


def test_xla_baseline_matches_reference():
  """The plain-XLA baseline has the same semantics (float and quantized caches)."""
  for kv_dtype in ("same", "int8"):
    p = _problem(kv_dtype=kv_dtype, sinks="normal", sliding_window=21, soft_cap=5.0,
                 sm_scale=0.2)
    x = _inputs(p)
    j = lambda a: None if a is None else jnp.asarray(a)
    out = pa.paged_attention_xla(
        *(j(x[n]) for n in ("q", "k_pages", "v_pages", "kv_lens", "page_indices",
                            "cu_q_lens")),
        sinks=j(x["sinks"]), k_scale=j(x["k_scale"]), v_scale=j(x["v_scale"]), **_options(p))
    _check(p, x, out)


# ----------------------------------------------------------------------------- write_kv_cache


def _bits(a):
  """The raw bits of an array (NaN-safe exact comparison)."""
  a = np.asarray(a)
  return a.view(f"u{a.dtype.itemsize}")


@pytest.mark.parametrize("kv_dtype, new_dtype, scale", [
    ("float32", "float32", None), ("bfloat16", "bfloat16", None),
    ("int8", "float32", "per_head"), ("int8", "bfloat16", "python"),
    ("float8_e4m3fn", "bfloat16", "0d"), ("float8_e4m3fn", "float32", "per_head"),
])
@pytest.mark.parametrize("jit", [False, True])
def test_write_kv_cache_matches_reference(kv_dtype, new_dtype, scale, jit):
  """Written slots hold the (quantized) new K/V; negative slots are skipped; every other
  slot, NaN included, is unchanged bit for bit."""
  rng = np.random.default_rng(len(kv_dtype) + len(new_dtype))
  num_kv_heads, num_pages, page_size, head_dim, num_tokens = 2, 6, 16, 64, 12
  used = rng.random((num_pages, page_size)) < 0.5
  k_pages, v_pages = (_cache(rng, kv_dtype, num_kv_heads, num_pages, page_size, head_dim,
                             used) for _ in range(2))
  slots = rng.choice(num_pages * page_size, num_tokens, replace=False).astype(np.int32)
  slots[[2, 7]] = -1
  slots[5] = -100
  # Values across the quantized ranges: some clip at +-127 / +-448.
  amp = 1.0 if scale is None else 3.0
  new_k, new_v = ((amp * rng.standard_normal((num_tokens, num_kv_heads, head_dim)))
                  .astype(NP[new_dtype]) for _ in range(2))
  k_scale, v_scale = (_scale(rng, scale, num_kv_heads, kv_dtype) if scale else None
                      for _ in range(2))
  if isinstance(k_scale, np.ndarray) and k_scale.ndim == 0:
    k_scale, v_scale = jnp.asarray(k_scale), jnp.asarray(v_scale)
  if kv_dtype == "int8":   # scales as large as this clip often
    new_k[0, 0, :4] = [300.0, -300.0, 0.0, 1e-3]
  write = pa.write_kv_cache
  if jit:
    write = jax.jit(write, static_argnames=() if not isinstance(k_scale, float) else
                    ("k_scale", "v_scale"))
  out_k, out_v = write(jnp.asarray(k_pages), jnp.asarray(v_pages), jnp.asarray(new_k),
                       jnp.asarray(new_v), jnp.asarray(slots), k_scale=k_scale,
                       v_scale=v_scale)
  want_k, want_v = ref.write_kv_cache(k_pages, v_pages, new_k, new_v, slots,
                                      k_scale=None if k_scale is None else np.asarray(k_scale),
                                      v_scale=None if v_scale is None else np.asarray(v_scale))
  for name, got, want in (("k", out_k, want_k), ("v", out_v, want_v)):
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.dtype)
    bad = np.argwhere(_bits(got) != _bits(want))
    assert not len(bad), (f"{name}: {len(bad)} elements differ, first at {bad[:5].tolist()}: "
                          f"{np.asarray(got)[tuple(bad[0])]} vs {want[tuple(bad[0])]}")


def test_write_then_attend():
  """One serving step: write a mixed batch's new K/V into the cache, then attend over it."""
  p = _problem(kv_lens=[37, 20, 64], q_lens=[1, 7, 64], pad_tokens=3, sinks="normal",
               share=False, repeat=False)
  x = _inputs(p)
  rng = np.random.default_rng(1)
  cu, table, ps = x["cu_q_lens"], x["page_indices"], p["page_size"]
  slots = np.full(x["q"].shape[0], -1, np.int32)       # padding tokens write nothing
  for s, (kv_len, q_len) in enumerate(zip(p["kv_lens"], p["q_lens"])):
    for i in range(q_len):
      pos = kv_len - q_len + i
      slots[cu[s] + i] = table[s, pos // ps] * ps + pos % ps
  new_k, new_v = (rng.standard_normal((len(slots), p["num_kv_heads"], p["head_dim"]))
                  .astype(np.float32) for _ in range(2))
  k_pages, v_pages = pa.write_kv_cache(jnp.asarray(x["k_pages"]), jnp.asarray(x["v_pages"]),
                                       jnp.asarray(new_k), jnp.asarray(new_v),
                                       jnp.asarray(slots))
  x = dict(x, k_pages=np.asarray(k_pages), v_pages=np.asarray(v_pages))
  want_k, _ = ref.write_kv_cache(x["k_pages"], x["v_pages"], new_k, new_v, slots)
  np.testing.assert_array_equal(_bits(x["k_pages"]), _bits(want_k))
  _check(p, x, _run(p, x))


# ----------------------------------------------------------------------------- bad inputs


def _bad(q_shape=(8, 4, 64), kv_shape=(4, 2, 16, 64), v_shape=None, dtype=np.float32,
         k_dtype=None, v_dtype=None, kv_lens=(5,), page_indices=((0, 1),),
         cu_q_lens=(0, 3), **options):
  q = np.zeros(q_shape, dtype)
  k = np.zeros(kv_shape, k_dtype or dtype)
  v = np.zeros(v_shape or kv_shape, v_dtype or k_dtype or dtype)
  idx = lambda a: jnp.asarray(np.array(a, np.int32))
  return lambda: pa.ragged_paged_attention(q, k, v, idx(kv_lens), idx(page_indices),
                                           idx(cu_q_lens), interpret=True, **options)


BF16, F32, I8, F8 = ml_dtypes.bfloat16, np.float32, np.int8, ml_dtypes.float8_e4m3fn
BAD_INPUTS = {
    # dtypes: TypeError
    "q_float16": (_bad(dtype=np.float16), r"\bq\b"),
    "q_float64": (_bad(dtype=np.float64), r"\bq\b"),
    "bf16_q_f32_cache": (_bad(dtype=BF16, k_dtype=F32), "dtype"),
    "f32_q_bf16_cache": (_bad(dtype=F32, k_dtype=BF16), "dtype"),
    "k_v_dtypes_differ": (_bad(k_dtype=I8, v_dtype=F8, k_scale=1.0,
                               v_scale=1.0), "dtype"),
    "int16_cache": (_bad(k_dtype=np.int16, k_scale=1.0, v_scale=1.0), "dtype"),
    "float16_cache": (_bad(k_dtype=np.float16), "dtype"),
    # everything else: ValueError
    "heads_not_a_multiple": (_bad(q_shape=(8, 3, 64)), "head"),
    "k_v_shapes_differ": (_bad(v_shape=(5, 2, 16, 64)), r"v_pages|k_pages"),
    "head_dim_differs": (_bad(kv_shape=(4, 2, 16, 32)), "head_dim|D"),
    "q_rank_4": (_bad(q_shape=(1, 8, 4, 64)), r"\bq\b"),
    "k_pages_rank_3": (_bad(kv_shape=(4, 16, 64)), "k_pages"),
    "page_size_8": (_bad(kv_shape=(4, 2, 8, 64)), "page_size"),
    "page_size_24": (_bad(kv_shape=(4, 2, 24, 64)), "page_size"),
    "page_size_512": (_bad(kv_shape=(4, 2, 512, 64)), "page_size"),
    "window_0": (_bad(sliding_window=0), "sliding_window"),
    "window_negative": (_bad(sliding_window=-3), "sliding_window"),
    "soft_cap_0": (_bad(soft_cap=0.0), "soft_cap"),
    "soft_cap_negative": (_bad(soft_cap=-1.0), "soft_cap"),
    "sinks_per_kv_head": (_bad(sinks=jnp.zeros((2,))), "sinks"),
    "sinks_2d": (_bad(sinks=jnp.zeros((1, 4))), "sinks"),
    "scale_with_float_cache": (_bad(k_scale=1.0, v_scale=1.0), "scale"),
    "int8_cache_without_scales": (_bad(k_dtype=I8), "scale"),
    "fp8_cache_without_v_scale": (_bad(k_dtype=F8, k_scale=1.0), "scale"),
    "scale_wrong_length": (_bad(k_dtype=I8, k_scale=jnp.ones(3), v_scale=1.0),
                           "scale"),
    "kv_lens_vs_page_indices": (_bad(kv_lens=(5, 6)), r"kv_lens|page_indices"),
    "cu_q_lens_length": (_bad(cu_q_lens=(0, 3, 4)), "cu_q_lens"),
    "page_indices_1d": (_bad(page_indices=(0, 1)), "page_indices"),
    # concrete index values go through check_indices
    "used_page_out_of_range": (_bad(kv_lens=(20,), page_indices=((0, 4),)), r"sequence 0"),
    "q_len_over_kv_len": (_bad(kv_lens=(2,)), r"sequence 0"),
    "cu_q_lens_past_tokens": (_bad(cu_q_lens=(0, 9)), "cu_q_lens"),
}
DTYPE_CASES = {"q_float16", "q_float64", "bf16_q_f32_cache", "f32_q_bf16_cache",
               "k_v_dtypes_differ", "int16_cache", "float16_cache"}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_gives_clear_error(case):
  call, message = BAD_INPUTS[case]
  with pytest.raises(TypeError if case in DTYPE_CASES else ValueError, match=message):
    call()


def _check_indices(kv_lens, page_indices, cu_q_lens, num_tokens=10, num_pages=4,
                   page_size=16):
  return pa.check_indices(np.array(kv_lens, np.int32), np.array(page_indices, np.int32),
                          np.array(cu_q_lens, np.int32), num_tokens=num_tokens,
                          num_pages=num_pages, page_size=page_size)


# (kv_lens, page_indices, cu_q_lens, the sequence the message names or None)
GOOD_TABLE = ((3, 2), (0, -1), (1, 3))
BAD_INDICES = {
    "cu_q_lens_not_from_0": ((20, 5, 3), GOOD_TABLE, (1, 2, 3, 4), None),
    "cu_q_lens_decreasing": ((20, 5, 3), GOOD_TABLE, (0, 4, 2, 5), None),
    "cu_q_lens_past_tokens": ((20, 5, 3), GOOD_TABLE, (0, 4, 6, 11), None),
    "q_len_over_kv_len": ((20, 5, 3), GOOD_TABLE, (0, 4, 10, 10), 1),
    "kv_len_beyond_pages": ((20, 5, 33), GOOD_TABLE, (0, 4, 6, 7), 2),
    "used_page_negative": ((20, 17, 3), GOOD_TABLE, (0, 4, 6, 7), 1),
    "used_page_past_cache": ((20, 5, 30), ((3, 2), (0, -1), (1, 4)), (0, 4, 6, 7), 2),
}


@pytest.mark.parametrize("case", BAD_INDICES)
def test_check_indices_rejects(case):
  kv_lens, table, cu, seq = BAD_INDICES[case]
  match = "cu_q_lens" if seq is None else rf"sequence {seq}\b"
  with pytest.raises(ValueError, match=match):
    _check_indices(kv_lens, table, cu)


def test_check_indices_accepts_junk_past_used_pages():
  """Unused entries (-1, past the cache) and empty sequences are fine."""
  _check_indices((20, 5, 0, 3), ((3, 2), (0, -1), (-1, 99), (1, 2**30)), (0, 4, 6, 6, 7))
  _check_indices((20, 16, 3), ((3, 2), (0, -1), (1, 3)), (0, 0, 0, 0), num_tokens=0)


def test_write_kv_cache_dtype_and_slot_errors():
  k = jnp.zeros((4, 2, 16, 64), jnp.bfloat16)
  new = jnp.zeros((3, 2, 64), jnp.float32)
  with pytest.raises(TypeError, match="dtype"):
    pa.write_kv_cache(k, k, new, new, jnp.array([0, 1, 2], jnp.int32))
  with pytest.raises(TypeError, match="dtype"):
    pa.write_kv_cache(k, k.astype(jnp.float32), new, new, jnp.array([0, 1, 2], jnp.int32))
  # Slots past the cache: refused on the check path (concrete slots), dropped by the op.
  pa.check_slots(np.array([0, -1, 63], np.int32), num_pages=4, page_size=16)
  with pytest.raises(ValueError, match=r"slot_mapping\[1\]"):
    pa.check_slots(np.array([0, 64, 2], np.int32), num_pages=4, page_size=16)
  new = jnp.ones((3, 2, 64), jnp.bfloat16)
  out_k, _ = pa.write_kv_cache(k, k, new, new, jnp.array([0, 64, 2], jnp.int32))
  want_k, _ = ref.write_kv_cache(np.asarray(k), np.asarray(k), np.asarray(new),
                                 np.asarray(new), np.array([0, -1, 2]))
  np.testing.assert_array_equal(_bits(out_k), _bits(want_k))
