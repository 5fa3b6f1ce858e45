"""The paged-attention-tpu torch ops (CPU path: DLPack + Pallas interpret mode), loaded
through get_kernel from the build of scripts/build.py.

Reference: `paged_reference` below, plain torch in float64, written from the contract
(not from the kernel): gather each sequence's first kv_lens[s] tokens page by page,
dequantize (int8 / e4m3 values times the per-KV-head scale, exact in float64), causal
(and window) mask with the queries as the last q_len positions, soft-cap, softmax with
the sink in the denominator, @ V. Tolerances: tests/reference.py's ATTENTION_TOLERANCE
for q's dtype (|got - ref| <= atol * max|ref| + rtol * |ref|); quantized caches are
judged against the dequantized values, so q's dtype sets the bound there too.

Every cache slot no sequence reads holds NaN (float caches), so a kernel that reads past
kv_lens, an unused page-table entry or another sequence's page gives NaN, not a small
error.
"""

import math

import pytest
import torch
from torch.library import opcheck

import reference as ref

PAGE = 16
HQ, HKV, D = 4, 2, 16
TOKENS = 32                      # T bucket: every attention case pads q to this
PAGES = 24                       # pool size
PAGES_PER_SEQ = 4

# (q_len, kv_len) per sequence: a prefill chunk after a cached prefix, a decode step, a
# whole prompt, an empty padding row; none a multiple of the page size.
LAYOUT = [(13, 29), (1, 40), (7, 7), (0, 0)]


def _quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
  """x [..., Hkv, D] -> cache values, the contract's rounding (per-KV-head scale)."""
  y = x.float() / scale[:, None]
  if dtype == torch.int8:
    return y.round().clamp(-127, 127).to(torch.int8)
  return y.clamp(-448, 448).to(torch.float8_e4m3fn)


def _dequantize(pages: torch.Tensor, scale) -> torch.Tensor:
  values = pages.to(torch.float64)
  if scale is None:
    return values
  scale = torch.as_tensor(scale, dtype=torch.float64).reshape(-1)
  return values * scale.expand(pages.shape[1])[None, :, None, None]


def paged_reference(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, *, sm_scale=None,
                    soft_cap=None, sliding_window=None, sinks=None, k_scale=None,
                    v_scale=None) -> torch.Tensor:
  """out [T, Hq, D] float64, from the definition (see the module docstring)."""
  num_tokens, num_q_heads, head_dim = q.shape
  _, num_kv_heads, page_size, _ = k_cache.shape
  group = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  k_all, v_all = _dequantize(k_cache, k_scale), _dequantize(v_cache, v_scale)
  out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
  for s in range(kv_lens.shape[0]):
    start, end, kv_len = int(cu_q_lens[s]), int(cu_q_lens[s + 1]), int(kv_lens[s])
    q_len = end - start
    if q_len == 0:
      continue
    # Token j of the sequence: page page_indices[s, j // page_size], offset j % page_size.
    j = torch.arange(kv_len)
    pages = page_indices[s].long()[j // page_size]
    k = k_all[pages, :, j % page_size].transpose(0, 1).repeat_interleave(group, 0)  # [Hq, L, D]
    v = v_all[pages, :, j % page_size].transpose(0, 1).repeat_interleave(group, 0)
    pos = kv_len - q_len + torch.arange(q_len)
    visible = j[None, :] <= pos[:, None]
    if sliding_window is not None:
      visible &= pos[:, None] - j[None, :] < sliding_window
    logits = scale * torch.einsum("qhd,hkd->hqk", q[start:end].double(), k)
    if soft_cap is not None:
      logits = soft_cap * torch.tanh(logits / soft_cap)
    logits = logits.masked_fill(~visible, -math.inf)
    if sinks is not None:
      sink = sinks.double()[:, None, None].expand(num_q_heads, q_len, 1)
      probs = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
      probs = torch.softmax(logits, -1)
    out[start:end] = torch.einsum("hqk,hkd->qhd", probs, v)
  return out


def _metadata(layout, seed, *, shared_prefix=True):
  """(kv_lens, page_indices, cu_q_lens) int32 and the set of used (page, offset) slots.

  Pages are drawn in a shuffled order; with shared_prefix the decode sequence (row 1)
  starts with the prefill chunk's (row 0) first page (prefix caching)."""
  gen = torch.Generator().manual_seed(seed)
  order = torch.randperm(PAGES, generator=gen).tolist()
  rows, used = [], set()
  for s, (_, kv_len) in enumerate(layout):
    count = -(-kv_len // PAGE)
    row = [order.pop() for _ in range(count)]
    if shared_prefix and s == 1 and rows[0]:
      order.append(row[0])
      row[0] = rows[0][0]
    for j in range(kv_len):
      used.add((row[j // PAGE], j % PAGE))
    # Unused entries: garbage a kernel must never follow (out of range on purpose).
    rows.append(row + [PAGES + 7] * (PAGES_PER_SEQ - count))
  cu = [0]
  for q_len, _ in layout:
    cu.append(cu[-1] + q_len)
  int32 = lambda x: torch.tensor(x, dtype=torch.int32)
  return int32([kv for _, kv in layout]), int32(rows), int32(cu), used


def _case(dtype=torch.float32, cache_dtype=None, seed=0, layout=LAYOUT, garbage=math.nan):
  """q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, k_scale, v_scale; float
  caches hold `garbage` in every slot no sequence reads."""
  cache_dtype = dtype if cache_dtype is None else cache_dtype
  gen = torch.Generator().manual_seed(seed)
  kv_lens, page_indices, cu_q_lens, used = _metadata(layout, seed)
  q = torch.randn(TOKENS, HQ, D, generator=gen).to(dtype)
  k_scale = v_scale = None
  caches = []
  for _ in range(2):
    x = torch.randn(PAGES, HKV, PAGE, D, generator=gen)
    if cache_dtype in (torch.int8, torch.float8_e4m3fn):
      scale = torch.rand(HKV, generator=gen) * 0.02 + 0.01
      cache = _quantize(x.permute(0, 2, 1, 3), scale, cache_dtype).permute(0, 2, 1, 3)
      cache = cache.contiguous()
      if k_scale is None:
        k_scale = scale
      else:
        v_scale = scale
    else:
      mask = torch.ones(PAGES, PAGE, dtype=torch.bool)
      for page, offset in used:
        mask[page, offset] = False
      cache = x.masked_fill(mask[:, None, :, None], garbage).to(cache_dtype)
    caches.append(cache)
  return q, *caches, kv_lens, page_indices, cu_q_lens, k_scale, v_scale


# Kernel bug (reported to the kernel's owner): with a sliding window, an item whose window
# starts inside a block fetches, for the block's pages before the window, the window's
# first page instead (index map clipped to first_page), and zeroes V only past kv_len, so
# that page's NaN slots past kv_len reach p @ V as 0 * NaN. Finite garbage is exact.
CASES = {
    "mixed_f32": dict(),
    "window_cap_sinks_scale_f32": dict(sliding_window=5, soft_cap=2.0, sinks=True, sm_scale=0.3),
    "window_cap_sinks_scale_f32_finite_garbage": dict(
        sliding_window=5, soft_cap=2.0, sinks=True, sm_scale=0.3, garbage=1e4),
    "mixed_bf16": dict(dtype=torch.bfloat16, sliding_window=20),
    "int8_cache_f32": dict(cache_dtype=torch.int8),
    "fp8_cache_bf16_scalar_scale": dict(dtype=torch.bfloat16, cache_dtype=torch.float8_e4m3fn,
                                        scalar_scale=True, sinks=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_matches_float64_reference(paged, name):
  case = dict(CASES[name])
  dtype = case.pop("dtype", torch.float32)
  q, k, v, kv_lens, page_indices, cu_q_lens, k_scale, v_scale = _case(
      dtype, case.pop("cache_dtype", None), garbage=case.pop("garbage", math.nan))
  if case.pop("scalar_scale", False):   # a Python float: the same scale for every KV head
    k_scale, v_scale = float(k_scale[0]), float(v_scale[0])
    k_ref, v_ref = k_scale, v_scale
  else:
    k_ref, v_ref = k_scale, v_scale
  if case.pop("sinks", False):
    case["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0])
  out = paged.ragged_paged_attention(q, k, v, kv_lens, page_indices, cu_q_lens,
                                     k_scale=k_scale, v_scale=v_scale, **case)
  assert out.shape == q.shape and out.dtype == q.dtype
  want = paged_reference(q, k, v, kv_lens, page_indices, cu_q_lens, k_scale=k_ref,
                         v_scale=v_ref, **case)
  tolerance = ref.ATTENTION_TOLERANCE[str(dtype).removeprefix("torch.")]
  ref.assert_close(out.float(), want.numpy(), tolerance, what=name)
  end = int(cu_q_lens[-1])
  assert torch.equal(out[end:], torch.zeros_like(out[end:]))     # padding tokens: 0


def _scatter_reference(cache, new, slot_mapping, scale=None):
  expected = cache.clone()
  values = new if scale is None else _quantize(new, scale, cache.dtype)
  for t, slot in enumerate(slot_mapping.tolist()):
    if slot >= 0:
      expected[slot // PAGE, :, slot % PAGE] = values[t]
  return expected


def _bits(t: torch.Tensor) -> torch.Tensor:
  """Bit patterns, so that NaN slots and fp8 values compare exactly."""
  return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[t.element_size()])


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8,
                                         torch.float8_e4m3fn])
def test_write_kv_cache_in_place(paged, cache_dtype):
  """The caller's caches are updated in place (same tensors, same storage) with exactly
  the contract's values; skipped (-1) slots and every other slot keep their contents."""
  gen = torch.Generator().manual_seed(7)
  quantized = cache_dtype in (torch.int8, torch.float8_e4m3fn)
  new_dtype = torch.float32 if quantized else cache_dtype
  k_cache, v_cache = (torch.randn(PAGES, HKV, PAGE, D, generator=gen).to(cache_dtype)
                      for _ in range(2))
  new_k, new_v = (torch.randn(8, HKV, D, generator=gen).to(new_dtype) * 3 for _ in range(2))
  slots = torch.tensor([5 * PAGE + 3, -1, 0, PAGES * PAGE - 1, 17, -1, 2 * PAGE, 100],
                       dtype=torch.int32)
  k_scale = torch.tensor([0.05, 0.02]) if quantized else None
  v_scale = 0.03 if quantized else None
  want_k = _scatter_reference(k_cache, new_k, slots, k_scale)
  want_v = _scatter_reference(v_cache, new_v, slots,
                              None if v_scale is None else torch.full((HKV,), v_scale))
  k_ptr, v_ptr, k_id = k_cache.data_ptr(), v_cache.data_ptr(), id(k_cache)
  assert paged.write_kv_cache_(k_cache, v_cache, new_k, new_v, slots, k_scale=k_scale,
                               v_scale=v_scale) is None
  assert id(k_cache) == k_id and k_cache.data_ptr() == k_ptr and v_cache.data_ptr() == v_ptr
  assert torch.equal(_bits(k_cache), _bits(want_k))
  assert torch.equal(_bits(v_cache), _bits(want_v))


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8,
                                         torch.float8_e4m3fn])
def test_write_kv_pages_one_cache_in_place(paged, cache_dtype):
  """write_kv_pages_: ONE cache holding K and V pages (here as Transformers' continuous
  batching lays them out: K of block b on page 2b, V on page 2b + 1), the step's K and V
  rows packed into one call. The cache is updated in place with exactly the contract's
  values (plain torch indexing below); skipped (-1) and untouched slots keep theirs."""
  gen = torch.Generator().manual_seed(11)
  # bfloat16 rows into the int8 cache; float32 into fp8: XLA divides by the scale as a
  # multiply by its reciprocal (up to 1 ulp off the quotient), so an exact rounding tie,
  # frequent for bfloat16 values at fp8's 3-bit mantissa, may land one fp8 step from
  # torch's rounding (a property of the quantizer both writes share, not of this op).
  new_dtype = {torch.int8: torch.bfloat16, torch.float8_e4m3fn: torch.float32}.get(
      cache_dtype, cache_dtype)
  cache = torch.randn(PAGES, HKV, PAGE, D, generator=gen).to(cache_dtype)
  new_k, new_v = (torch.randn(6, HKV, D, generator=gen).to(new_dtype) * 3 for _ in range(2))
  k_slots = torch.tensor([2 * PAGE + 3, -1, 0, 2 * (PAGES // 2 - 1) * PAGE + PAGE - 1,
                          6 * PAGE + 9, -1], dtype=torch.int32)
  slots = torch.cat([k_slots, torch.where(k_slots >= 0, k_slots + PAGE, k_slots)])
  rows = torch.cat([new_k, new_v])
  scale = {torch.int8: torch.tensor([0.05, 0.02]), torch.float8_e4m3fn: 0.03}.get(cache_dtype)
  want = cache.clone()
  values = rows if scale is None else _quantize(rows, torch.as_tensor(scale).expand(HKV),
                                                cache_dtype)
  for t, slot in enumerate(slots.tolist()):
    if slot >= 0:
      want[slot // PAGE, :, slot % PAGE] = values[t]
  ptr, storage = cache.data_ptr(), cache.untyped_storage().data_ptr()
  assert paged.write_kv_pages_(cache, rows, slots, scale=scale) is None
  assert cache.data_ptr() == ptr and cache.untyped_storage().data_ptr() == storage
  assert torch.equal(_bits(cache), _bits(want))


def test_write_then_attend_sees_the_new_tokens(paged):
  """A mixed step through the PagedKVCache helper: this step's K/V written, then read by
  the attention (new tokens attend to themselves and the cached prefix)."""
  gen = torch.Generator().manual_seed(8)
  cache = paged.PagedKVCache(1, HKV, D, PAGES, PAGE, shuffle_seed=3)
  for name in ("a", "b"):
    cache.add_sequence(name)
  history = {"a": [], "b": []}
  steps = [[("a", 21), ("b", 9)], [("a", 1), ("b", 11)]]      # prefill, then mixed
  for chunks in steps:
    batch = cache.schedule(chunks, num_tokens=TOKENS, num_seqs=3, pages_per_seq=PAGES_PER_SEQ)
    q = torch.randn(TOKENS, HQ, D, generator=gen)
    k, v = torch.randn(TOKENS, HKV, D, generator=gen), torch.randn(TOKENS, HKV, D, generator=gen)
    out = cache.write_and_attend(0, q, k, v, batch)
    cu = batch.cu_q_lens.tolist()
    for s, (name, n) in enumerate(chunks):
      history[name].append((k[cu[s]:cu[s + 1]], v[cu[s]:cu[s + 1]]))
      # The reference reads a contiguous, unpaged copy of the sequence's K/V.
      ks = torch.cat([h[0] for h in history[name]]).transpose(0, 1)[:, None]   # [Hkv, 1, L, D]
      vs = torch.cat([h[1] for h in history[name]]).transpose(0, 1)[:, None]
      length = ks.shape[2]
      pad = -length % PAGE
      # -> pages [P, Hkv, PAGE, D]
      ks = torch.nn.functional.pad(ks, (0, 0, 0, pad)).reshape(HKV, -1, PAGE, D).transpose(0, 1)
      vs = torch.nn.functional.pad(vs, (0, 0, 0, pad)).reshape(HKV, -1, PAGE, D).transpose(0, 1)
      pages = torch.arange(ks.shape[0], dtype=torch.int32)[None]
      want = paged_reference(q[cu[s]:cu[s + 1]], ks, vs, torch.tensor([length]), pages,
                             torch.tensor([0, n]))
      ref.assert_close(out[cu[s]:cu[s + 1]], want.numpy(), ref.ATTENTION_TOLERANCE["float32"],
                       what=f"{name} at step {chunks}")
  assert cache.lengths == {"a": 22, "b": 20}


def test_paged_kv_cache_bookkeeping(paged):
  cache = paged.PagedKVCache(2, HKV, D, 6, PAGE, shuffle_seed=0)
  assert len(cache.k) == len(cache.v) == 2 and cache.k[1].shape == (6, HKV, PAGE, D)
  cache.add_sequence("a")
  cache.add_sequence("b")
  batch = cache.schedule([("a", 17), ("b", 1)], num_tokens=24, num_seqs=3, pages_per_seq=3)
  pages_a, pages_b = cache.pages["a"], cache.pages["b"]
  assert len(pages_a) == 2 and len(pages_b) == 1 and cache.num_free_pages == 3
  assert sorted(pages_a + pages_b + cache._free) == list(range(6))
  assert batch.kv_lens.tolist() == [17, 1, 0]
  assert batch.cu_q_lens.tolist() == [0, 17, 18, 18]
  assert batch.page_indices.tolist() == [pages_a + [0], pages_b + [0, 0], [0, 0, 0]]
  want_slots = [pages_a[p // PAGE] * PAGE + p % PAGE for p in range(17)] + [pages_b[0] * PAGE]
  assert batch.slot_mapping.tolist() == want_slots + [-1] * 6
  assert batch.positions.tolist() == list(range(17)) + [0] + [0] * 6
  assert batch.last_token_indices() == [16, 17]
  assert all(t.dtype == torch.int32 for t in (batch.kv_lens, batch.page_indices,
                                              batch.cu_q_lens, batch.slot_mapping))
  batch = cache.schedule([("b", 1), ("a", 1)])
  assert batch.kv_lens.tolist() == [2, 18] and batch.positions.tolist() == [1, 17]
  cache.free_sequence("a")
  assert cache.num_free_pages == 5 and "a" not in cache.pages
  with pytest.raises(RuntimeError, match="out of pages"):
    cache.add_sequence("c")
    cache.schedule([("c", 6 * PAGE)])
  with pytest.raises(ValueError, match="do not fit the buckets"):
    cache.schedule([("b", 3)], num_tokens=2)


def test_opcheck(paged_ops):
  q, k, v, kv_lens, page_indices, cu_q_lens, _, _ = _case()
  k, v = k.nan_to_num(), v.nan_to_num()      # opcheck compares outputs with allclose
  opcheck(paged_ops.ragged_paged_attention_op,
          (q, k, v, kv_lens, page_indices, cu_q_lens, None, None, None, 0.25, 0.0, 0, 0, 0, 0,
           0, ""))
  opcheck(paged_ops.ragged_paged_attention_op,
          (q, k, v, kv_lens, page_indices, cu_q_lens, torch.zeros(HQ), None, None, 0.3, 2.0, 5,
           0, 0, 0, 0, ""))
  gen = torch.Generator().manual_seed(9)
  new_k, new_v = torch.randn(TOKENS, HKV, D, generator=gen), torch.randn(TOKENS, HKV, D,
                                                                         generator=gen)
  slots = torch.arange(TOKENS, dtype=torch.int32) * 3
  slots[-5:] = -1
  opcheck(paged_ops.write_kv_cache_op, (k.clone(), v.clone(), new_k, new_v, slots, None, None))
  k8, v8 = (torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8) for _ in range(2))
  scale = torch.tensor([0.05, 0.02])
  opcheck(paged_ops.write_kv_cache_op, (k8, v8, new_k, new_v, slots, scale, scale))


def test_opcheck_write_kv_pages(paged_ops):
  gen = torch.Generator().manual_seed(12)
  rows = torch.randn(TOKENS, HKV, D, generator=gen)
  slots = torch.arange(TOKENS, dtype=torch.int32) * 5
  slots[-5:] = -1
  cache = torch.randn(PAGES, HKV, PAGE, D, generator=gen)
  opcheck(paged_ops.write_kv_pages_op, (cache, rows, slots, None))
  cache8 = torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8)
  opcheck(paged_ops.write_kv_pages_op, (cache8, rows, slots, torch.tensor([0.05, 0.02])))


def test_torch_compile_write_then_attend(paged):
  """A compiled function that writes this step's K/V and then attends gives eager's result
  exactly, and leaves the caches exactly as eager does (the write is declared as a
  mutation, so the compiled graph neither drops it nor reads the cache before it)."""
  def step(k_cache, v_cache, q, new_k, new_v, slots, kv_lens, page_indices, cu_q_lens):
    paged.write_kv_cache_(k_cache, v_cache, new_k, new_v, slots)
    out = paged.ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens,
                                       sliding_window=12)
    return out * 2

  gen = torch.Generator().manual_seed(10)
  cache = paged.PagedKVCache(1, HKV, D, PAGES, PAGE, shuffle_seed=1)
  cache.add_sequence("a")
  cache.add_sequence("b")
  batch = cache.schedule([("a", 19), ("b", 6)], num_tokens=TOKENS, num_seqs=2,
                         pages_per_seq=PAGES_PER_SEQ)
  q = torch.randn(TOKENS, HQ, D, generator=gen)
  new_k, new_v = torch.randn(TOKENS, HKV, D, generator=gen), torch.randn(TOKENS, HKV, D,
                                                                         generator=gen)
  args = (q, new_k, new_v, batch.slot_mapping, batch.kv_lens, batch.page_indices,
          batch.cu_q_lens)
  eager_k, eager_v = cache.k[0].clone(), cache.v[0].clone()
  compiled_k, compiled_v = cache.k[0].clone(), cache.v[0].clone()
  eager = step(eager_k, eager_v, *args)
  compiled = torch.compile(step, fullgraph=True)(compiled_k, compiled_v, *args)
  torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
  assert torch.equal(compiled_k, eager_k) and torch.equal(compiled_v, eager_v)
  assert not torch.equal(eager_k, cache.k[0])          # the write happened
  assert torch.isfinite(eager).all()


def test_forward_only(paged):
  """Under autograd the forward runs; a backward through it raises a clear error."""
  q, k, v, kv_lens, page_indices, cu_q_lens, _, _ = _case()
  q.requires_grad_()
  out = paged.ragged_paged_attention(q, k, v, kv_lens, page_indices, cu_q_lens)
  assert out.requires_grad
  with pytest.raises(NotImplementedError, match="forward-only"):
    out.sum().backward()


def _ok(**changes):
  """Keyword arguments of a valid ragged_paged_attention call, with `changes`."""
  q, k, v, kv_lens, page_indices, cu_q_lens, _, _ = _case()
  args = dict(q=q, k_cache=k, v_cache=v, kv_lens=kv_lens, page_indices=page_indices,
              cu_q_lens=cu_q_lens)
  args.update(changes)
  return args


def _i32(*values):
  return torch.tensor(values, dtype=torch.int32)


_OK = _ok()
_ROWS = _OK["page_indices"]


def _rows_with(s, j, value):
  rows = _ROWS.clone()
  rows[s, j] = value
  return rows


_BAD_ATTENTION = [
    # Index values (CPU path: the kernel module's check_indices, on concrete values).
    ("used page id >= num_pages", dict(page_indices=_rows_with(0, 1, PAGES)), ValueError,
     rf"sequence 0: page_indices\[0, 1\]={PAGES} is outside the cache's {PAGES} pages"),
    ("negative used page id", dict(page_indices=_rows_with(1, 2, -1)), ValueError,
     r"sequence 1: page_indices\[1, 2\]=-1 is outside"),
    ("kv_len beyond the pages given", dict(kv_lens=_i32(29, 40, 7, 0),
                                            page_indices=_ROWS[:, :2].contiguous()),
     ValueError, r"sequence 1: need q_len \(1\) <= kv_len \(40\) <= pages_per_seq \* page_size "
                 r"\(32\)"),
    ("cu_q_lens decreasing", dict(cu_q_lens=_i32(0, 13, 12, 21, 21)), ValueError,
     "cu_q_lens must not decrease"),
    ("cu_q_lens[0] != 0", dict(cu_q_lens=_i32(1, 14, 15, 22, 22)), ValueError,
     r"cu_q_lens\[0\] must be 0"),
    ("cu_q_lens past T", dict(cu_q_lens=_i32(0, 13, 14, 33, 33)), ValueError,
     rf"cu_q_lens\[-1\]=33 exceeds the {TOKENS} tokens of q"),
    ("more queries than KV", dict(kv_lens=_i32(29, 40, 6, 0)), ValueError,
     r"sequence 2: need q_len \(7\) <= kv_len \(6\)"),
    # Dtypes (TypeError) and shapes (ValueError), checked in torch before the kernel.
    ("bf16 q, f32 cache", dict(q=_OK["q"].bfloat16()), TypeError,
     "a float cache must have q's dtype"),
    ("float64 q", dict(q=_OK["q"].double()), TypeError, "q has dtype float64"),
    ("v dtype", dict(v_cache=_OK["v_cache"].bfloat16()), TypeError,
     "v_cache must have the dtype of k_cache"),
    ("float16 cache", dict(q=_OK["q"].half(), k_cache=_OK["k_cache"].half(),
                           v_cache=_OK["v_cache"].half()), TypeError, "q has dtype float16"),
    ("int64 kv_lens", dict(kv_lens=_OK["kv_lens"].long()), TypeError,
     "kv_lens must be int32, got int64"),
    ("int64 page_indices", dict(page_indices=_ROWS.long()), TypeError,
     "page_indices must be int32"),
    ("cu_q_lens shape", dict(cu_q_lens=_i32(0, 13, 14, 21)), ValueError,
     r"cu_q_lens must have shape \(5,\)"),
    ("page_indices rows", dict(page_indices=_ROWS[:3].contiguous()), ValueError,
     r"page_indices must have shape \(4, pages_per_seq"),
    ("2-d q", dict(q=_OK["q"][0]), ValueError, "q must be 3-D"),
    ("head_dim", dict(q=torch.zeros(TOKENS, HQ, 8)), ValueError, "head_dim 8 differs"),
    ("heads do not divide", dict(q=torch.zeros(TOKENS, 3, D)), ValueError,
     "3 heads must be a multiple"),
    ("v shape", dict(v_cache=_OK["v_cache"][:, :-1].contiguous()), ValueError,
     "v_cache must have shape"),
    ("page size 8", dict(k_cache=torch.zeros(HKV, 48, 8, D), v_cache=torch.zeros(HKV, 48, 8, D)),
     ValueError, "page_size .* must be a multiple of 16"),
    ("window 0", dict(sliding_window=0), ValueError, "sliding_window must be None or >= 1"),
    ("soft_cap 0", dict(soft_cap=0.0), ValueError, "soft_cap must be None or > 0"),
    ("sm_scale nan", dict(sm_scale=math.nan), ValueError, "sm_scale must be finite"),
    ("sinks shape", dict(sinks=torch.zeros(HKV)), ValueError, r"sinks must have shape \(4,\)"),
    ("scale with a float cache", dict(k_scale=0.1, v_scale=0.1), ValueError,
     "only for int8 / float8_e4m3fn caches"),
    ("int8 cache without scales", dict(k_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                                       v_cache=torch.zeros(PAGES, HKV, PAGE, D,
                                                           dtype=torch.int8)),
     ValueError, "needs k_scale"),
    ("int8 scale shape", dict(k_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                              v_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                              k_scale=torch.ones(3), v_scale=1.0),
     ValueError, r"k_scale must have shape \(2,\)"),
    ("mixed devices", dict(kv_lens=_OK["kv_lens"].to("meta")), RuntimeError, "same device"),
]


@pytest.mark.parametrize("what, changes, error, message", _BAD_ATTENTION,
                         ids=[b[0] for b in _BAD_ATTENTION])
def test_attention_bad_input_gives_clear_error(paged, what, changes, error, message):
  args = _ok(**changes)
  q, k, v = args.pop("q"), args.pop("k_cache"), args.pop("v_cache")
  lens, rows, cu = args.pop("kv_lens"), args.pop("page_indices"), args.pop("cu_q_lens")
  with pytest.raises(error, match=message):
    paged.ragged_paged_attention(q, k, v, lens, rows, cu, **args)


def _write_ok(**changes):
  args = dict(k_cache=torch.zeros(PAGES, HKV, PAGE, D), v_cache=torch.zeros(PAGES, HKV, PAGE, D),
              new_k=torch.ones(4, HKV, D), new_v=torch.ones(4, HKV, D),
              slot_mapping=_i32(0, 1, -1, PAGES * PAGE - 1))
  args.update(changes)
  return args


_BAD_WRITE = [
    ("slot beyond the cache", dict(slot_mapping=_i32(0, 1, PAGES * PAGE, 3)), ValueError,
     rf"slot_mapping\[2\]={PAGES * PAGE} is past the cache's {PAGES * PAGE} slots"),
    ("new_k dtype", dict(new_k=torch.ones(4, HKV, D, dtype=torch.bfloat16)), TypeError,
     "new_k has dtype bfloat16, the cache float32"),
    ("int64 slots", dict(slot_mapping=torch.zeros(4, dtype=torch.long)), TypeError,
     "slot_mapping must be int32"),
    ("slot count", dict(slot_mapping=_i32(0, 1, 2)), ValueError,
     r"slot_mapping must have shape \(4,\)"),
    ("new_k heads", dict(new_k=torch.ones(4, 1, D), new_v=torch.ones(4, 1, D)), ValueError,
     r"new_k must have shape \(4, 2, 16\)"),
    ("non-contiguous cache", dict(k_cache=torch.zeros(PAGES, PAGE, HKV, D).transpose(1, 2),
                                  v_cache=torch.zeros(PAGES, PAGE, HKV, D).transpose(1, 2)),
     ValueError, "k_cache must be contiguous"),
    ("fp8 cache without scales", dict(
        k_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.float8_e4m3fn),
        v_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.float8_e4m3fn)),
     ValueError, "needs k_scale"),
    ("scale <= 0", dict(k_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                        v_cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                        k_scale=0.0, v_scale=1.0), ValueError, "k_scale must be > 0"),
]


def _write_pages_ok(**changes):
  args = dict(cache=torch.zeros(PAGES, HKV, PAGE, D), new_rows=torch.ones(4, HKV, D),
              slot_mapping=_i32(0, PAGE, -1, PAGES * PAGE - 1))
  args.update(changes)
  return args


_BAD_WRITE_PAGES = [
    ("slot beyond the cache", dict(slot_mapping=_i32(0, 1, PAGES * PAGE, 3)), ValueError,
     rf"write_kv_pages_: slot_mapping\[2\]={PAGES * PAGE} is past the cache's "
     rf"{PAGES * PAGE} slots"),
    ("new_rows dtype", dict(new_rows=torch.ones(4, HKV, D, dtype=torch.bfloat16)), TypeError,
     "new_rows has dtype bfloat16, the cache float32"),
    ("int64 slots", dict(slot_mapping=torch.zeros(4, dtype=torch.long)), TypeError,
     "slot_mapping must be int32"),
    ("slot count", dict(slot_mapping=_i32(0, 1, 2)), ValueError,
     r"slot_mapping must have shape \(4,\)"),
    ("new_rows heads", dict(new_rows=torch.ones(4, 1, D)), ValueError,
     r"new_rows must have shape \(4, 2, 16\)"),
    ("new_rows head_dim", dict(new_rows=torch.ones(4, HKV, 8)), ValueError,
     r"new_rows must have shape \(4, 2, 16\)"),
    ("new_rows 2-D", dict(new_rows=torch.ones(4, HKV * D)), ValueError, "new_rows"),
    ("3-D cache", dict(cache=torch.zeros(PAGES, PAGE, D)), ValueError, "cache"),
    ("float16 cache", dict(cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.float16),
                           new_rows=torch.ones(4, HKV, D, dtype=torch.float16)), TypeError,
     "cache has dtype float16"),
    ("page size 8", dict(cache=torch.zeros(2 * PAGES, HKV, 8, D)), ValueError,
     "multiple of 16"),
    ("non-contiguous cache", dict(cache=torch.zeros(PAGES, PAGE, HKV, D).transpose(1, 2)),
     ValueError, "cache must be contiguous"),
    ("int8 cache without scale", dict(cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8)),
     ValueError, "needs scale"),
    ("scale on a float cache", dict(scale=0.5), ValueError, "scale is only for int8"),
    ("scale <= 0", dict(cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.float8_e4m3fn),
                        scale=-1.0), ValueError, "scale must be > 0"),
    ("scale per head shape", dict(cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                                  scale=torch.ones(3)), ValueError,
     r"scale must have shape \(2,\)"),
    ("float64 scale", dict(cache=torch.zeros(PAGES, HKV, PAGE, D, dtype=torch.int8),
                           scale=torch.ones(2, dtype=torch.float64)), TypeError, "scale"),
]


# (function, valid arguments, the cache checked for no write, bad case) per case.
_BAD_WRITES = ([("write_kv_cache_", _write_ok, "k_cache", *b) for b in _BAD_WRITE]
               + [("write_kv_pages_", _write_pages_ok, "cache", *b) for b in _BAD_WRITE_PAGES])


@pytest.mark.parametrize("function, valid, cache, what, changes, error, message", _BAD_WRITES,
                         ids=[f"{b[0]} {b[3]}" for b in _BAD_WRITES])
def test_write_bad_input_gives_clear_error(paged, function, valid, cache, what, changes, error,
                                           message):
  args = valid(**changes)
  before = args[cache].clone()
  with pytest.raises(error, match=message):
    getattr(paged, function)(**args)
  assert torch.equal(_bits(args[cache]), _bits(before))     # nothing written


def test_every_entry_point_satisfies_jax_op_contract(paged, paged_ops):
  """TorchTPU's jax_op needs every parameter annotated: tensors as jax.Array, statics as
  plain types, and chip / interpret (filled in by the shim)."""
  import importlib
  import inspect
  import typing

  import jax

  functions = importlib.import_module(f"{paged.__name__}._jax_functions")
  dispatch = importlib.import_module(f"{paged.__name__}._shim.dispatch")
  kernels = [k for k in vars(paged_ops).values() if isinstance(k, dispatch.JaxKernel)]
  assert {k.function for k in kernels} >= {"ragged_paged_attention_forward", "write_kv_cache",
                                           "write_kv_pages"}
  for kernel in kernels:
    signature = inspect.signature(getattr(functions, kernel.function), eval_str=True)
    params = signature.parameters
    assert {"chip", "interpret"} <= set(params), kernel.function
    assert all(p.annotation in (jax.Array, int, float, str, bool) for p in params.values())
    returned = typing.get_args(signature.return_annotation) or (signature.return_annotation,)
    assert all(a is jax.Array for a in returned), kernel.function


def _write_probe(monkeypatch, paged, paged_ops, attr):
  """The TorchTPU stand-in (no TPU here) with a jax_op whose op, while aliased["on"], writes
  1.0, 2.0, ... into the donated caches in place (what an aliased kernel does) and returns
  them, else returns fresh tensors of 3.0, 4.0, ...; paged_ops.<attr> becomes a probe
  JaxKernel of the same function. Returns (calls, dispatch, aliased)."""
  import sys

  from torch_tpu_stand_in import install_fake_torch_tpu

  calls, dispatch = install_fake_torch_tpu(monkeypatch, paged)
  aliased = {"on": True}

  def jax_op(qualname, fn, donate_argnums=None):
    calls["jax_op"].append((qualname, fn, donate_argnums))

    def op(*tensors, **kwargs):
      calls["op"].append((qualname, tensors, kwargs))
      caches = [tensors[i] for i in donate_argnums]
      outs = [c.fill_(1.0 + i) if aliased["on"] else torch.full_like(c, 3.0 + i)
              for i, c in enumerate(caches)]
      return tuple(outs) if len(outs) > 1 else outs[0]
    return op

  monkeypatch.setattr(sys.modules["torch.tpu.pallas"], "jax_op", jax_op)
  kernel = getattr(paged_ops, attr)
  monkeypatch.setattr(paged_ops, attr, dispatch.JaxKernel(
      kernel.qualname + "_probe", kernel.module, kernel.function, cpu_chip="v6e",
      donate_argnums=kernel.donate_argnums))
  return calls, dispatch, aliased


def test_tpu_branch_aliases_or_copies(paged, paged_ops, monkeypatch):
  """On "tpu" tensors (TorchTPU stand-in: no TPU here) the write op passes the caches
  themselves to jax_op; when the outputs come back in the caches' buffers (the donation
  honoured) nothing is copied, otherwise the outputs are copied into the caches."""
  calls, dispatch, aliased = _write_probe(monkeypatch, paged, paged_ops, "_write")
  try:
    args = _write_ok()
    k_cache, v_cache = args["k_cache"], args["v_cache"]
    paged.write_kv_cache_(**args)
    assert (k_cache == 1.0).all() and (v_cache == 2.0).all()
    aliased["on"] = False
    paged.write_kv_cache_(**args)
    assert (k_cache == 3.0).all() and (v_cache == 4.0).all()
  finally:
    dispatch.tpu_chip_name.cache_clear()
  (name, tensors, kwargs), _ = calls["op"]
  assert name.endswith("::write_kv_cache_probe_tpu_jax")
  (_, _, donated), = calls["jax_op"]
  assert donated == (0, 1)          # the caches, donated to the TPU program
  assert tensors[0] is k_cache and tensors[1] is v_cache     # the caches themselves
  assert [(tuple(t.shape), t.dtype) for t in tensors[5:]] == [((0,), torch.float32)] * 2
  assert kwargs == dict(chip="v6e", interpret=False)


def test_tpu_branch_one_cache_aliases_or_copies(paged, paged_ops, monkeypatch):
  """write_kv_pages_ on "tpu" tensors (TorchTPU stand-in): its jax_op is built with only
  the cache donated, is passed the cache itself, and the result is copied into the cache
  only when it does not come back in the cache's buffer."""
  calls, dispatch, aliased = _write_probe(monkeypatch, paged, paged_ops, "_write_pages")
  try:
    args = _write_pages_ok()
    cache = args["cache"]
    paged.write_kv_pages_(**args)
    assert (cache == 1.0).all()
    aliased["on"] = False
    paged.write_kv_pages_(**args)
    assert (cache == 3.0).all()
  finally:
    dispatch.tpu_chip_name.cache_clear()
  (name, tensors, kwargs), _ = calls["op"]
  assert name.endswith("::write_kv_pages_probe_tpu_jax")
  (_, _, donated), = calls["jax_op"]
  assert donated == (0,)            # the one cache, donated to the TPU program
  assert tensors[0] is cache        # the cache itself
  assert [(tuple(t.shape), t.dtype) for t in tensors[3:]] == [((0,), torch.float32)]
  assert kwargs == dict(chip="v6e", interpret=False)
