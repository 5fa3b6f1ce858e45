"""Ragged paged attention for TPU in Pallas: one call serves decode, prefill and mixed
batches over a paged KV cache (GQA, sliding window, soft-cap, sinks, int8 / fp8 caches).

Inputs. The new tokens of S sequences are packed along one axis: q [T, Hq, D], sequence
s owning rows cu_q_lens[s] : cu_q_lens[s + 1]. Its keys and values are in a paged cache,
one array per K and V, page-major:

    k_pages, v_pages   [num_pages, Hkv, page_size, D]

token j of sequence s at k_pages[page_indices[s, j // page_size], h, j % page_size]. One
page of all KV heads is one contiguous run (Hkv x page_size x D), so a page costs one DMA
for the whole head group, whatever Hkv (jax's `paged_attention` layout, [Hkv, num_pages,
page_size, D], needs one DMA per page and KV head: eight times as many descriptors for 8
KV heads, each 4 KiB at page size 16). Each KV head's page serves all G = Hq / Hkv query
heads of its group. With tensor parallelism the Hkv axis is the one to shard.

Math. With q_len[s] = cu_q_lens[s+1] - cu_q_lens[s], the queries of sequence s are the
last q_len[s] tokens of its kv_lens[s] keys (the caller writes them into the cache first,
see `write_kv_cache`): query i sits at position p = kv_lens[s] - q_len[s] + i. Then

    visible(p, j) = j <= p and (sliding_window is None or p - j < sliding_window)
    s_j  = sm_scale * k_scale[h] * (q . k_j)         (f32; k_scale = 1 for float caches)
    s_j  = soft_cap * tanh(s_j / soft_cap)           if soft_cap
    lse  = log(exp(sinks[h]) + sum_{visible j} exp(s_j))   (no sink term without sinks)
    out  = v_scale[h] * sum_{visible j} exp(s_j - lse) v_j

A decode step is q_len 1; a prefill chunk is q_len > 1 with kv_lens - q_len cached tokens
before it. Rows of q past cu_q_lens[S] are padding and come out as zeros.

Work items. The packed tokens are cut, in XLA, into *work items* of block_q consecutive
tokens of one sequence (a sequence of n tokens gives ceil(n / block_q) items; at most
min(T, ceil(T / block_q) + S) items in all, a static bound). q is gathered into
[W, Hkv * R, D]: per KV head, R rows (G * block_q rounded up to whole sublane tiles,
zero-padded), ordered token-major (row r of a head's R is token r // G, query head r % G
of its group). So one item's block holds every query head: a decode step of a 32/8-head
model is eight (16, D) slices (4 rows used) against each page, a prefill item eight
(G * block_q, D) slices. Output blocks are gathered back to [T, Hq, D]. Token-major, an
item with few tokens uses only the first rows of each head's R: when block_q > 1 and an
item's tokens fit the first `small_rows` rows (G sublane-padded: a decode sequence in a
batch mixed with prefill chunks), the body runs on those rows only, not on all R.

Grid (items, kv steps): kv step t of an item reads pages_per_block pages, each one page
of all KV heads (the cache viewed, for free, as [num_pages, Hkv * page_size, D]). Every
slot's page id is worked out in XLA beforehand (`_slot_pages`, below) and
scalar-prefetched as slot_pages [items, steps * pages_per_block]: the page of slot i at
step t is one SMEM read, `slot_pages[item, t * pages_per_block + i]`. The body loops
over the KV heads; online softmax over the steps, with f32 running max / sum
(lane-replicated) and accumulator in VMEM. Every block is 2-D (libtpu's static
estimator rates kernels with 3-D blocks at 0 cycles).

Page fetch (manual_fetch, the default at every page size). The caches stay in HBM
(memory_space ANY); the kernel copies each step's pages itself, one async copy per page
and per K / V, into a VMEM double buffer [2, pages_per_block, Hkv * page_size, D], one
DMA semaphore per buffer and K / V. Grid step g computes from buffer g % 2 while the next
grid step's pages (the item's next block, or the next item's first block on its last
step) stream into the other, so the grid runs in order ("arbitrary" on both axes: on
two-core chips the items are not split across cores). Only the pages of an item's
[first_page, last_page] are copied: a block wholly inside that range issues its copies
straight, the item's first and last blocks test each page; a step past the item's last
block copies nothing. Buffer slots left uncopied hold stale or garbage VMEM, always at
keys outside [first key, last key], which the body masks by select (below). With
manual_fetch=False each page slot is instead its own BlockSpec whose index map reads
slot_pages, and Pallas double-buffers them like any block: index maps run for every slot
at every step, twice, and the per-block bookkeeping came to about 150-190 estimated
cycles per page on v6e, whatever block_kv: 739 µs against 312 µs fetched by hand at page
16 for a 64 x 2k decode step (libtpu's static estimates, benchmarks/rating/paged_attention.py).

Skipping. Each item needs only the keys from its first query's window start (0 without
a window) to its last query's position. Steps past that range repeat the last block's
page ids (with BlockSpecs Pallas then issues no DMA; by hand nothing is copied) and the
body is skipped; pages before the window are never read. In the last block, a page slot
past the item's last page keeps the page it held one step earlier (again no DMA; on the
item's first block it takes the last page). So the page table's unused entries, which
may hold anything, are never read, and only the item's pages cross HBM (with BlockSpecs,
plus at most repeats within a first block). Every page id is clamped into the cache.
Keys in slots that hold a repeated (or, fetched by hand, an uncopied) page are masked by
position.

SMEM. The per-item tables and slot_pages are scalar-prefetched: steps * pages_per_block
(pages_per_seq rounded up to whole blocks) + 7 words per item. At long contexts and big
batches that overflows SMEM (1 MiB), so the items are split into chunks of at most
`items_per_call` items, and one kernel runs once per chunk (`lax.map`), with
items_per_call set from the chip's SMEM budget.

Quantized caches (int8, float8_e4m3fn) go into the two matmuls as they are, and Mosaic
widens them exactly on the way to the MXU (every code is a bf16 value); their per-KV-head
scales are applied to the f32 logits and output: the cache is read at 1 byte per element.
Float caches must have q's dtype: no silent down-casts.

Cache slots past a sequence's length may hold anything (even NaN): keys outside the
item's [first key, last key] are masked, and their values zeroed before the p @ v product
(a slot holding a repeated page, or the tail of the last page, is such a key).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

from . import attention_common as common
from . import chips
from . import masking
from . import tuning_tables
from . import vmem

FLOAT_DTYPES = common.FLOAT_DTYPES
QUANTIZED_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
# The pallas_call name, as it appears in compiled HLO.
KERNEL_NAME = "ragged_paged_attention"
PAGE_SIZES = tuple(range(16, 257, 16))   # multiples of 16 from 16 to 256

_MASK_VALUE = common.MASK_VALUE
_LANES = common.LANES
_NT = common.NT
_NN = common.NN
_INT8_MAX = 127.0
_FP8_E4M3_MAX = 448.0
# Per-item int32 tables scalar-prefetched next to slot_pages (see _work_items).
_ITEM_FIELDS = ("rows", "q_pos", "kv_len", "first_block", "last_block", "first_page",
                "last_page")
# More BlockSpecs per step lengthen compiles for no gain once a step moves enough bytes.
_MAX_PAGES_PER_BLOCK = 64
_BLOCK_KV_CANDIDATES = (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)
# Rows of a work item's q block (G * block_q) the default block_q stays within, and the
# scoped-VMEM limit items of more than one token plan their block_kv against (instead of
# the chip's default limit; raised only as far as the plan needs). Every item re-reads its
# sequence's pages, so prefill chunks and mixed steps want big items and big kv blocks.
# Static estimates of a mixed step (60 decodes + 4 x 512 prefill, 32/8 heads x 128, page
# 64; benchmarks/rating/paged_attention.py), block_q / block_kv -> µs:
#   v6e: 64 / 512 (the old default) 686; 64 / 1024 581; 128 / 512 706; 128 / 1024 603
#   v5e: 32 / 256 (the old default) 1,402; 32 / 1024 1,282; 64 / 1024 1,031 (HBM-bound);
#        128 / 1024 1,000
_MAX_ITEM_ROWS = 256
_MANY_ROWS_VMEM_LIMIT = 48 * vmem.MiB
# KV heads per step up to this are unrolled (straight-line code); more run as a loop.
_UNROLL_HEADS = 8
# Page sizes up to this fetch their pages by hand (module docstring, "Page fetch").
MANUAL_FETCH_MAX_PAGE_SIZE = 256


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class Tiling:
  block_q: int            # tokens of one sequence per work item (a power of two)
  rows: int               # q rows per KV head in a block: G * block_q, sublane-padded
  block_kv: int           # keys per kv step = pages_per_block * page_size
  pages_per_block: int
  items_per_call: int     # work items per pallas_call (bounds the SMEM tables)
  vmem_limit_bytes: int
  vmem_plan_bytes: int    # what the tiling plans to keep in VMEM
  smem_plan_words: int    # scalar-prefetched words per call
  manual_fetch: bool = False   # pages copied by hand from HBM (see "Page fetch")


def _plan_bytes(rows, block_kv, num_kv_heads, head_dim, q_itemsize, kv_itemsize):
  d = vmem.lane_padded(head_dim)
  total = 2 * 2 * num_kv_heads * block_kv * d * kv_itemsize   # K, V pages, double-buffered
  total += 2 * block_kv * d * q_itemsize                 # one head's block in q's dtype
  total += 2 * 2 * num_kv_heads * rows * d * q_itemsize  # q and out blocks, double-buffered
  total += num_kv_heads * rows * (d + 3 * _LANES) * 4    # accumulator, m, l, sinks
  total += 4 * rows * vmem.lane_padded(block_kv) * 4     # logits, probabilities, masks
  total += block_kv * d * 4                              # the value mask
  return total


def _default_block_q(num_tokens: int, num_seqs: int, group: int) -> int:
  """Tokens per work item: about the mean new tokens per sequence (1 for pure decode),
  as a power of two, with G * block_q rows at most _MAX_ITEM_ROWS."""
  mean = max(1, -(-num_tokens // max(num_seqs, 1)))
  block_q = 1 << (mean - 1).bit_length()
  max_rows = max(_MAX_ITEM_ROWS, group)
  while block_q > 1 and group * block_q > max_rows:
    block_q //= 2
  return block_q


# ----------------------------------------------------------------------------- tuning table


@dataclasses.dataclass(frozen=True, order=True)
class TuningKey:
  """The bucket of a decode call shape in the tuning table (tuned/paged_attention.<chip>.json)."""

  chip: str
  kv_dtype: str       # the cache dtype's name
  page_size: int      # exact: 16, 32, 64, 128 or 256
  head_dim: int       # D rounded up to 64, 128 or 256
  num_kv_heads: int   # Hkv rounded up to a power of two, 1 to 16


TUNED_VALUE_FIELDS = ("block_kv",)
# {(chip, kv_dtype, page_size, head_dim, num_kv_heads): block_kv}
TUNED_BLOCK_KV = tuning_tables.load("paged_attention", TuningKey, TUNED_VALUE_FIELDS)


TUNED_PAGE_SIZES = (16, 32, 64, 128, 256)
_HEAD_DIM_BUCKETS = (64, 128, 256)
_KV_HEAD_BUCKETS = (1, 2, 4, 8, 16)


def tuning_key(chip: str, kv_dtype, page_size: int, head_dim: int,
               num_kv_heads: int) -> TuningKey | None:
  """The table key of a decode shape, or None outside the tuned buckets (the heuristic
  then decides): page sizes that are not powers of two, D > 256, Hkv > 16."""
  if page_size not in TUNED_PAGE_SIZES:
    return None
  d = next((b for b in _HEAD_DIM_BUCKETS if head_dim <= b), None)
  h = next((b for b in _KV_HEAD_BUCKETS if num_kv_heads <= b), None)
  if d is None or h is None:
    return None
  return TuningKey(chips.get_chip(chip).name, np.dtype(kv_dtype).name, page_size, d, h)


def tuned_block_kv(chip: str, kv_dtype, page_size: int, head_dim: int,
                   num_kv_heads: int) -> int | None:
  """The table's block_kv for a decode shape, or None."""
  key = tuning_key(chip, kv_dtype, page_size, head_dim, num_kv_heads)
  return None if key is None else TUNED_BLOCK_KV.get(dataclasses.astuple(key))


def paged_tiling(num_tokens: int, num_seqs: int, pages_per_seq: int, page_size: int,
                 head_dim: int, *, num_kv_heads: int, group: int, q_dtype, kv_dtype,
                 chip: str = chips.DEFAULT_CHIP, block_q: int | None = None,
                 block_kv: int | None = None, items_per_call: int | None = None,
                 vmem_limit_bytes: int | None = None,
                 manual_fetch: bool | None = None) -> Tiling:
  """Tiles for one call shape from the chip's VMEM and SMEM budgets.

  block_q: about the mean new tokens per sequence (1 for decode), see _default_block_q.
  block_kv: for decode (block_q 1), the tuning table's entry when it has one and it fits
  (tuned/paged_attention.<chip>.json, from libtpu's static estimates); otherwise the largest
  candidate (a multiple of page_size, at most 64 pages, no longer than a sequence's
  pages) whose plan fits the VMEM budget: half the scoped-VMEM limit, which for block_q > 1
  is at least _MANY_ROWS_VMEM_LIMIT (the limit is then raised as far as the plan needs).
  items_per_call: all items when their tables fit the SMEM budget, else as many as fit
  (an explicit items_per_call may only lower that). manual_fetch: pages copied by hand
  (module docstring, "Page fetch"); default: for page sizes up to
  MANUAL_FETCH_MAX_PAGE_SIZE.
  """
  chip_ = chips.get_chip(chip)
  if manual_fetch is None:
    manual_fetch = page_size <= MANUAL_FETCH_MAX_PAGE_SIZE
  if block_q is None:
    block_q = _default_block_q(num_tokens, num_seqs, group)
  elif not isinstance(block_q, (int, np.integer)) or block_q < 1 or block_q & (block_q - 1):
    raise ValueError(f"block_q must be a power of two >= 1, got {block_q!r}")
  rows = vmem.round_up(group * block_q, vmem.sublane_multiple(q_dtype))
  q_itemsize, kv_itemsize = np.dtype(q_dtype).itemsize, np.dtype(kv_dtype).itemsize
  limit = vmem.resolve_vmem_limit(chip_, vmem_limit_bytes)
  limit_budget = int(limit * vmem.BUDGET_FRACTION)   # what `limit` holds
  budget = limit_budget                               # what block_kv is planned against
  if block_q > 1 and vmem_limit_bytes is None:   # see _MANY_ROWS_VMEM_LIMIT
    many_rows_limit = min(_MANY_ROWS_VMEM_LIMIT, chip_.max_vmem_limit_bytes)
    budget = max(budget, int(many_rows_limit * vmem.BUDGET_FRACTION))
  plan = functools.partial(_plan_bytes, rows, num_kv_heads=num_kv_heads, head_dim=head_dim,
                           q_itemsize=q_itemsize, kv_itemsize=kv_itemsize)
  if block_kv is not None:
    if (not isinstance(block_kv, (int, np.integer)) or block_kv < page_size
        or block_kv % page_size):
      raise ValueError(f"block_kv must be a positive multiple of page_size={page_size}, "
                       f"got {block_kv!r}")
  else:
    longest = pages_per_seq * page_size
    cands = [c for c in _BLOCK_KV_CANDIDATES
             if c % page_size == 0 and c // page_size <= _MAX_PAGES_PER_BLOCK]
    cands = [c for c in cands if c <= max(longest, page_size)] or [page_size]
    fitting = [c for c in cands if plan(c) <= budget]
    block_kv = fitting[0] if fitting else cands[-1]
    tuned = tuned_block_kv(chip_.name, kv_dtype, page_size, head_dim, num_kv_heads)
    if block_q == 1 and tuned is not None and tuned <= max(longest, page_size) \
        and plan(tuned) <= budget:
      block_kv = tuned
  needed = plan(block_kv)
  if needed > limit_budget and vmem_limit_bytes is None:
    limit = vmem.round_up(int(needed / vmem.BUDGET_FRACTION), vmem.MiB)
    if limit > chip_.max_vmem_limit_bytes:
      raise ValueError(f"paged attention with {num_kv_heads} KV heads, {rows} query rows per "
                       f"item, head_dim={head_dim} and {block_kv} keys per step needs "
                       f"{needed} bytes of VMEM, more than {chip_.name} allows; pass a "
                       f"smaller block_q or block_kv")
  words = vmem.smem_budget_words(chip_)
  pages_per_block = block_kv // page_size
  per_item = _kv_steps(pages_per_seq, pages_per_block) * pages_per_block + len(_ITEM_FIELDS)
  items = num_work_items(num_tokens, num_seqs, block_q)
  items_per_call_fit = min(items, words // per_item)
  if items_per_call_fit < 1:
    raise ValueError(f"the page ids of a sequence of {pages_per_seq} pages ({per_item} words "
                     f"with its item fields) does not fit {chip_.name}'s SMEM budget "
                     f"({words} words); use larger pages")
  if items_per_call is not None:
    if not isinstance(items_per_call, (int, np.integer)) or items_per_call < 1:
      raise ValueError(f"items_per_call must be an int >= 1, got {items_per_call!r}")
    items_per_call = min(int(items_per_call), items_per_call_fit)
  else:
    items_per_call = items_per_call_fit
  return Tiling(block_q, rows, block_kv, pages_per_block, items_per_call, limit, needed,
                items_per_call * per_item, bool(manual_fetch))


def small_rows(t: Tiling, group: int, q_dtype) -> int:
  """Rows of the kernel's short body (the first rows of each head's R, enough for one
  token's G query heads, sublane-padded), or 0 when it would not be shorter (block_q 1)."""
  rows = vmem.round_up(group, vmem.sublane_multiple(q_dtype))
  return rows if t.block_q > 1 and rows < t.rows else 0


def _kv_steps(pages_per_seq: int, pages_per_block: int) -> int:
  """Kv steps of the grid: enough blocks of pages_per_block pages for the longest row."""
  return -(-pages_per_seq // pages_per_block)


def _grid_steps(pages_per_seq: int, pages_per_block: int, page_size: int, block_q: int,
                sliding_window: int | None) -> int:
  """Kv steps of the grid: enough blocks for the longest row, or, with a window, for the
  keys one item can see (window - 1 + block_q keys touch at most ceil(that / block_kv) + 1
  blocks): a 4k window on a 32k context runs 5 steps of 1024 keys per item, not 32 (the
  skipped steps were over half the static estimate)."""
  steps = _kv_steps(pages_per_seq, pages_per_block)
  if sliding_window is not None:
    block_kv = pages_per_block * page_size
    steps = min(steps, -(-(sliding_window - 1 + block_q) // block_kv) + 1)
  return steps


def num_work_items(num_tokens: int, num_seqs: int, block_q: int) -> int:
  """Static bound on the work items of any batch of this shape (each holds >= 1 token)."""
  return max(1, min(num_tokens, -(-num_tokens // block_q) + num_seqs))


# ----------------------------------------------------------------------------- work items


def _work_items(kv_lens, cu_q_lens, num_tokens, num_items, block_q, block_kv, page_size,
                sliding_window):
  """Per-item int32 tables [num_items] (_ITEM_FIELDS, plus seq, first_page and last_page
  for _slot_pages), plus for every token its item and row (token_item, token_row) and
  whether it belongs to a sequence (token_valid)."""
  q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
  num_seqs = q_lens.shape[0]
  blocks = (q_lens + block_q - 1) // block_q
  item_end = jnp.cumsum(blocks)
  item_begin = item_end - blocks
  w = jnp.arange(num_items, dtype=jnp.int32)
  total = item_end[-1]
  valid = w < total
  seq = jnp.minimum(jnp.searchsorted(item_end, w, side="right"), num_seqs - 1)
  seq = seq.astype(jnp.int32)
  first_row = (w - item_begin[seq]) * block_q
  rows = jnp.where(valid, jnp.clip(q_lens[seq] - first_row, 0, block_q), 0)
  kv_len = kv_lens[seq]
  q_pos = kv_len - q_lens[seq] + first_row                  # position of the item's row 0
  last_key = jnp.maximum(q_pos + rows - 1, 0)
  first_key = jnp.zeros_like(q_pos)
  if sliding_window is not None:
    first_key = jnp.clip(q_pos - sliding_window + 1, 0, last_key)

  def zero_if_invalid(x):
    return jnp.where(valid, x, 0).astype(jnp.int32)

  items = dict(
      seq=seq, rows=rows.astype(jnp.int32), q_pos=zero_if_invalid(q_pos),
      kv_len=zero_if_invalid(kv_len),
      first_block=zero_if_invalid(first_key // block_kv),
      last_block=zero_if_invalid(last_key // block_kv),
      first_page=zero_if_invalid(first_key // page_size),
      last_page=zero_if_invalid(last_key // page_size))
  tokens = jnp.arange(num_tokens, dtype=jnp.int32)
  token_valid = tokens < cu_q_lens[-1]
  token_seq = jnp.minimum(jnp.searchsorted(cu_q_lens[1:], tokens, side="right"), num_seqs - 1)
  local = tokens - cu_q_lens[token_seq]
  token_item = jnp.where(token_valid, item_begin[token_seq] + local // block_q, 0)
  token_row = jnp.where(token_valid, local % block_q, 0)
  token_first = jnp.where(valid, cu_q_lens[seq] + first_row, 0)   # item's first token
  return items, token_first, token_item, token_row, token_valid


def _slot_pages(page_indices, items, pages_per_block: int, num_pages: int, steps: int):
  """The page id each page slot fetches at each kv step of each item (module docstring,
  "Skipping"): int32 [num_items, steps * pages_per_block], entry t * pages_per_block + i
  for slot i at step t (steps: _grid_steps). Empty items (all fields 0) fetch their
  sequence's first page."""
  num_seqs, pages_per_seq = page_indices.shape
  n = pages_per_block
  first_b, last_b, first_p, last_p = (items[f][:, None, None] for f in
                                      ("first_block", "last_block", "first_page", "last_page"))
  block = jnp.minimum(first_b + jnp.arange(steps)[None, :, None], last_b)
  page = block * n + jnp.arange(n)[None, None, :]
  # Past the item's last page: the page this slot fetched one step earlier (the same id,
  # so no DMA), or the last page on the item's first step.
  page = jnp.where((page > last_p) & (block > first_b), page - n, page)
  page = jnp.clip(page, first_p, last_p).reshape(page.shape[0], -1)
  seq = jnp.clip(items["seq"], 0, num_seqs - 1)[:, None]
  # Clamped: a page id outside the cache must never become an out-of-bounds DMA. (Used
  # entries are validated on the checked path; unused ones may hold anything.)
  ids = page_indices[seq, jnp.clip(page, 0, pages_per_seq - 1)]
  return jnp.clip(ids, 0, num_pages - 1).astype(jnp.int32)


# ----------------------------------------------------------------------------- kernel


@dataclasses.dataclass(frozen=True)
class _Static:
  sm_scale: float
  soft_cap: float | None
  sliding_window: int | None
  has_sinks: bool
  quantized: bool
  block_q: int
  block_kv: int
  page_size: int
  pages_per_block: int
  pages_per_seq: int
  num_kv_heads: int
  rows: int               # R: rows per KV head in a q block (G * block_q, sublane-padded)
  group: int              # G: query heads per KV head
  vmem_limit_bytes: int
  interpret: bool
  # Static estimates only (benchmarks/rating/paged_attention.py): libtpu's estimator reads every
  # SMEM value as 0, so with floors set each per-item value is read as max(value, floor)
  # (_ITEM_FIELDS order). A uniform batch's floors equal its values: nothing changes on
  # hardware, and the estimator sees the real trip counts.
  item_floors: tuple[int, ...] | None = None
  # Rows of the short body for items whose tokens fit them (0: none; see the docstring).
  small_rows: int = 0
  # Pages copied by hand from HBM into a double-buffered VMEM scratch (module docstring,
  # "Page fetch"), instead of one BlockSpec per page slot.
  manual_fetch: bool = False
  # Zero a bf16 value block's hidden keys in f32 (`masking.selects_in_f32(chip)`).
  mask_in_f32: bool = False


def _item(st: _Static, ref, item, field: str):
  value = ref[item]
  if st.item_floors is None:
    return value
  return jnp.maximum(value, st.item_floors[_ITEM_FIELDS.index(field)])


def _kernel(*refs, st: _Static):
  (rows_ref, q_pos_ref, kv_len_ref, first_block_ref, last_block_ref, first_page_ref,
   last_page_ref, slot_pages_ref, scales_ref, q_ref, *refs) = refs
  if st.has_sinks:
    sinks_ref, *refs = refs
  n = st.pages_per_block
  item, step = pl.program_id(0), pl.program_id(1)
  if st.manual_fetch:
    k_hbm, v_hbm, o_ref, m_ref, l_ref, acc_ref, k_buf, v_buf, sems = refs
    num_items, steps = pl.num_programs(0), pl.num_programs(1)
    tables = (rows_ref, first_block_ref, last_block_ref, first_page_ref, last_page_ref,
              slot_pages_ref)

    def fetch(w, t, slot, start: bool):
      _fetch_block(st, tables, (k_hbm, v_hbm), (k_buf, v_buf), sems, w, t, steps, slot,
                   start)

    g = item * steps + step            # grid steps run in order: buffer = parity
    slot = g & 1

    @pl.when(g == 0)
    def _first():
      fetch(item, step, slot, True)

    # The next grid step's pages (this item's next block or the next item's first) go
    # into the other buffer while this step computes.
    last_step = step == steps - 1
    next_item = jnp.where(last_step, item + 1, item)
    next_step = jnp.where(last_step, 0, step + 1)

    @pl.when(next_item < num_items)
    def _prefetch():
      fetch(next_item, next_step, 1 - slot, True)

    fetch(item, step, slot, False)     # wait for this step's pages
    k_refs = [k_buf.at[slot, i] for i in range(n)]
    v_refs = [v_buf.at[slot, i] for i in range(n)]
  else:
    k_refs, v_refs, (o_ref, m_ref, l_ref, acc_ref) = refs[:n], refs[n:2 * n], refs[2 * n:]
  head_dim = acc_ref.shape[1]
  num_rows, num_kv_heads, ps = st.rows, st.num_kv_heads, st.page_size
  bkv = st.block_kv
  del slot_pages_ref, first_page_ref, last_page_ref

  # m_ref (the running max) and the logits are raw q . k when `raw`, else scaled ones;
  # exp_scaled(x) = exp(unit * x) turns a difference of them into a softmax weight.
  raw = _raw_logits(st)
  unit = st.sm_scale if raw else 1.0
  exp_scaled = common.scaled_exp(unit)

  @pl.when(step == 0)
  def _init():
    if st.has_sinks:   # the sink joins the softmax as one more logit with no value
      m_ref[...] = sinks_ref[...] / unit
      l_ref[...] = jnp.ones_like(l_ref)
    else:
      m_ref[...] = jnp.full_like(m_ref, _MASK_VALUE)
      l_ref[...] = jnp.zeros_like(l_ref)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  block = _item(st, first_block_ref, item, "first_block") + step
  num_rows_used = _item(st, rows_ref, item, "rows")
  run = (num_rows_used > 0) & (block <= _item(st, last_block_ref, item, "last_block"))

  def _compute(masked: bool, num_rows: int):
    dtype = q_ref.dtype
    if masked:
      kv_len = _item(st, kv_len_ref, item, "kv_len")
      # The masks are the same for every KV head: built once per step.
      # Only keys in [first_key, last_key] are visible to any row of the item. Slots
      # outside hold a repeated page or cache slots past the sequence's length, which
      # may be garbage (NaN): p = 0 there, but 0 * NaN is NaN, so their values are zeroed.
      key_rows = key0 + lax.broadcasted_iota(jnp.int32, (bkv, head_dim), 0)
      needed = key_rows <= last_key
      if st.sliding_window is not None:
        needed = needed & (key_rows > q_pos0 - st.sliding_window)
      row = lax.broadcasted_iota(jnp.int32, (num_rows, bkv), 0)
      token = _token_of_row(row, st.group) if st.block_q > 1 else jnp.zeros_like(row)
      q_pos = q_pos0 + token
      key = key0 + lax.broadcasted_iota(jnp.int32, (num_rows, bkv), 1)
      visible = key <= jnp.minimum(q_pos, kv_len - 1)
      if st.sliding_window is not None:
        visible = visible & (q_pos - key < st.sliding_window)

    def scores(h):
      heads = _rows(h, st.rows, num_rows)   # this KV head's (first num_rows) q rows
      page_rows = _slice(h, ps)         # its part of each page block
      # An int8 / fp8 block goes into the dot unconverted, as in ragged_dot. Converting it
      # with astype first rated fp8 2.5x the cycles (v6e, 64 x 2k decode, page 64, block_kv
      # 2048: 628,614 -> 247,138, HBM-bound since) and aborted v5e's estimator (an LLO_CHECK
      # in a vunpack) for int8 and fp8; int8 rates the same either way on v6e.
      k = jnp.concatenate([r[page_rows, :] for r in k_refs], axis=0)  # (bkv, D)
      s = lax.dot_general(q_ref[heads, :], k, _NT, preferred_element_type=jnp.float32)
      if not raw:
        s = s * (st.sm_scale * scales_ref[0, h] if st.quantized else st.sm_scale)
      if st.soft_cap is not None:
        s = st.soft_cap * jnp.tanh(s * (1.0 / st.soft_cap))
      if masked:
        # -inf, not _MASK_VALUE: the running max starts finite (_MASK_VALUE or a sink), so
        # m_new is finite and a hidden key's p = exp(-inf - m_new) is exactly 0, also in a
        # row that has seen no key yet. So p needs no select of its own, and the mask dies
        # before the exp (as in flash_attention).
        s = jnp.where(visible, s, -jnp.inf)
      return s

    def update(h, s):
      heads = _rows(h, st.rows, num_rows)
      page_rows = _slice(h, ps)
      v = jnp.concatenate([r[page_rows, :] for r in v_refs], axis=0)
      if masked:   # codes select as they are; bf16 in f32 where the chip needs it
        v = masking.zero_unless(needed, v, in_f32=st.mask_in_f32)
      m_prev = m_ref[heads, :]                                  # (rows, 128), lanes equal
      m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
      p = exp_scaled(s - common.lanes(m_new, bkv))
      alpha = exp_scaled(m_prev - m_new)
      l_ref[heads, :] = alpha * l_ref[heads, :] + jnp.sum(p, axis=1, keepdims=True)
      acc_ref[heads, :] = common.lanes(alpha, head_dim) * acc_ref[heads, :] + lax.dot_general(
          p.astype(dtype), v, _NN, preferred_element_type=jnp.float32)
      m_ref[heads, :] = m_new

    def head_step(h, carry):
      update(h, scores(h))
      return carry

    if num_kv_heads <= _UNROLL_HEADS:
      # All heads' logits first, then their updates: independent matmuls back to back,
      # so one head's MXU latency overlaps the next's.
      all_scores = [scores(h) for h in range(num_kv_heads)]
      for h in range(num_kv_heads):
        update(h, all_scores[h])
    else:
      lax.fori_loop(0, num_kv_heads, head_step, 0)

  # A block every row sees whole (every key at or before the item's first query
  # position, and inside the window of its last) runs the body without masks: no iotas,
  # compares or selects. Decode items at long contexts are almost all such blocks.
  q_pos0 = _item(st, q_pos_ref, item, "q_pos")
  key0 = block * bkv
  last_key = q_pos0 + num_rows_used - 1
  whole = key0 + bkv - 1 <= q_pos0
  if st.sliding_window is not None:
    whole = whole & (key0 > last_key - st.sliding_window)
  if st.small_rows:
    short = num_rows_used * st.group <= st.small_rows
    pl.when(run & whole & short)(lambda: _compute(False, st.small_rows))
    pl.when(run & jnp.logical_not(whole) & short)(lambda: _compute(True, st.small_rows))
    run = run & jnp.logical_not(short)
  pl.when(run & whole)(lambda: _compute(False, num_rows))
  pl.when(run & jnp.logical_not(whole))(lambda: _compute(True, num_rows))

  @pl.when(step == pl.num_programs(1) - 1)
  def _finish():
    for h in range(num_kv_heads):
      heads = pl.ds(h * num_rows, num_rows)
      l = l_ref[heads, :]
      seen = l > 0.0     # false only for an empty item, whose rows are never gathered
      inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
      if st.quantized:
        inv = inv * scales_ref[1, h]
      o_ref[heads, :] = (acc_ref[heads, :] * common.lanes(inv, head_dim)).astype(o_ref.dtype)


def _fetch_block(st: _Static, tables, hbm, bufs, sems, w, t, steps, slot, start: bool):
  """Starts (start=True) or waits for the copies of item w's kv step t into buffer
  `slot`: each page of the block inside [first_page, last_page] of a non-empty item, K
  and V, from slot_pages (page ids already clamped into the cache). Waits take the same
  branches as the starts, so every started copy is waited once. A block entirely inside
  that range (all but an item's first and last, usually) issues its copies without
  per-page branches."""
  rows_ref, first_block_ref, last_block_ref, first_page_ref, last_page_ref, pages_ref = tables
  n = st.pages_per_block
  w_ = jnp.minimum(w, rows_ref.shape[0] - 1)      # never an SMEM read past the tables
  block = _item(st, first_block_ref, w_, "first_block") + t
  first_page = _item(st, first_page_ref, w_, "first_page")
  last_page = _item(st, last_page_ref, w_, "last_page")
  run = ((_item(st, rows_ref, w_, "rows") > 0)
         & (block <= _item(st, last_block_ref, w_, "last_block")))
  page0 = block * n
  base = (w_ * steps + t) * n

  def copy(i):
    page_id = pages_ref[base + i]
    for j, (src, buf) in enumerate(zip(hbm, bufs)):
      c = pltpu.make_async_copy(src.at[page_id], buf.at[slot, i], sems.at[slot, j])
      if start:
        c.start()
      else:
        c.wait()

  inside = (page0 >= first_page) & (page0 + n - 1 <= last_page)

  @pl.when(run & inside)
  def _all():
    for i in range(n):
      copy(i)

  if n > 1:
    @pl.when(run & jnp.logical_not(inside))
    def _some():
      for i in range(n):
        pl.when((page0 + i >= first_page) & (page0 + i <= last_page))(
            functools.partial(copy, i))


def _raw_logits(st: _Static) -> bool:
  """Whether the online softmax runs on unscaled logits q . k, taking
  exp(sm_scale (s - m)) as one exp2 of (s - m) (sm_scale log2 e): no multiply of each logit
  by sm_scale. Needs a positive scale known when tracing (the max of the raw logits is then
  the max of the scaled ones), no soft-cap (its tanh takes the scaled logit), and a float
  cache (a quantized one's k_scale is a traced value, per KV head)."""
  return st.soft_cap is None and st.sm_scale > 0 and not st.quantized


def _token_of_row(row, group: int):
  """The token of each q row in a token-major block (row // group; exact in f32 for the
  row counts a block has)."""
  if group & (group - 1) == 0:
    return row >> (group.bit_length() - 1)
  return ((row.astype(jnp.float32) + 0.5) * (1.0 / group)).astype(jnp.int32)


def _rows(h, stride: int, size: int):
  """Rows [h * stride, h * stride + size) for a static or traced h."""
  if isinstance(h, int):
    return pl.ds(h * stride, size)
  return pl.ds(pl.multiple_of(h * stride, stride), size)


def _slice(h, size: int):
  """Rows [h * size, (h + 1) * size) for a static or traced h (size: whole sublane tiles)."""
  if isinstance(h, int):
    return pl.ds(h * size, size)
  return pl.ds(pl.multiple_of(h * size, size), size)


def _call(items, slot_pages, scales, q_items, sink_rows, k_pages, v_pages, st: _Static):
  """One pallas_call over `q_items` [Wc, Hkv * R, D] -> out [Wc, Hkv * R, D]; slot_pages
  [Wc, steps * pages_per_block] from _slot_pages."""
  num_items, all_rows, head_dim = q_items.shape
  n, ps = st.pages_per_block, st.page_size
  steps = _grid_steps(st.pages_per_seq, n, ps, st.block_q, st.sliding_window)
  # A page of every KV head as one 2-D block: [num_pages, Hkv * page_size, D] (free view).
  k_view = k_pages.reshape(k_pages.shape[0], st.num_kv_heads * ps, head_dim)
  v_view = v_pages.reshape(k_view.shape)

  def page_map(i):
    def index_map(w, t, *prefetched):
      slot_pages = prefetched[len(_ITEM_FIELDS)]
      return slot_pages[(w * steps + t) * n + i], 0, 0
    return index_map

  row_spec = pl.BlockSpec((None, all_rows, head_dim), lambda w, t, *_: (w, 0, 0))
  page_specs = [pl.BlockSpec((None, st.num_kv_heads * ps, head_dim), page_map(i))
                for i in range(n)]
  in_specs = [row_spec]
  operands = [q_items]
  if st.has_sinks:
    in_specs.append(pl.BlockSpec((all_rows, _LANES), lambda w, t, *_: (0, 0)))
    operands.append(sink_rows)
  scratch = [pltpu.VMEM((all_rows, _LANES), jnp.float32),
             pltpu.VMEM((all_rows, _LANES), jnp.float32),
             pltpu.VMEM((all_rows, head_dim), jnp.float32)]
  if st.manual_fetch:
    # The caches stay in HBM; each step's pages are copied into a double buffer.
    in_specs += [pl.BlockSpec(memory_space=pl.ANY)] * 2
    operands += [k_view, v_view]
    buf = pltpu.VMEM((2, n, st.num_kv_heads * ps, head_dim), k_view.dtype)
    scratch += [buf, buf, pltpu.SemaphoreType.DMA((2, 2))]
    # The next item's first block is prefetched during this item's last step, so grid
    # steps must run in order on one core.
    semantics = ("arbitrary", "arbitrary")
  else:
    in_specs += page_specs + page_specs
    operands += [k_view] * n + [v_view] * n
    semantics = ("parallel", "arbitrary")
  return pl.pallas_call(
      functools.partial(_kernel, st=st),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=len(_ITEM_FIELDS) + 2,
          grid=(num_items, steps),
          in_specs=in_specs,
          out_specs=row_spec,
          scratch_shapes=scratch),
      out_shape=jax.ShapeDtypeStruct(q_items.shape, q_items.dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=semantics,
          vmem_limit_bytes=st.vmem_limit_bytes),
      interpret=st.interpret,
      name=KERNEL_NAME,
  )(*[items[f] for f in _ITEM_FIELDS], slot_pages.reshape(-1), scales, *operands)


# ----------------------------------------------------------------------------- API


def _is_concrete(*arrays) -> bool:
  return not any(isinstance(a, jax.core.Tracer) for a in arrays)


def _scales(scale, num_kv_heads, name):
  """A scale given as a python float, a 0-d or an [Hkv] array -> f32 [Hkv]."""
  s = jnp.asarray(scale, jnp.float32) if not hasattr(scale, "dtype") else scale
  if not jnp.issubdtype(s.dtype, jnp.floating):
    raise TypeError(f"{name} must be floating point, got {s.dtype}")
  if s.shape not in ((), (1,), (num_kv_heads,)):
    raise ValueError(f"{name} must be a scalar or have shape ({num_kv_heads},) (one per KV "
                     f"head), got {s.shape}")
  return jnp.broadcast_to(s.astype(jnp.float32).reshape(-1), (num_kv_heads,))


def _check_pages(pages, head_dim, what, name="k_pages"):
  """One paged cache [num_pages, Hkv, page_size, D] read or written with `what`'s
  head_dim. Returns whether it is quantized (int8 / float8_e4m3fn)."""
  if pages.ndim != 4:
    raise ValueError(f"{name} must be 4-D [num_pages, num_kv_heads, page_size, head_dim], "
                     f"got shape {pages.shape}")
  num_pages, num_kv_heads, page_size, cache_head_dim = pages.shape
  if cache_head_dim != head_dim:
    raise ValueError(f"the cache's head_dim {cache_head_dim} differs from {what}'s {head_dim}")
  if page_size not in PAGE_SIZES:
    raise ValueError(f"page_size must be a multiple of 16 from 16 to 256, got {page_size}")
  if num_kv_heads == 0 or num_pages == 0:
    raise ValueError(f"the cache must have KV heads and pages, got shape {pages.shape}")
  return pages.dtype in QUANTIZED_DTYPES


def _check_scales_given(quantized, cache_dtype, scales: dict):
  """Scales (name -> value or None) are given for a quantized cache, absent otherwise."""
  if quantized and any(s is None for s in scales.values()):
    raise ValueError(f"a {cache_dtype} cache needs {' and '.join(scales)}")
  if not quantized and any(s is not None for s in scales.values()):
    verb = "apply" if len(scales) > 1 else "applies"
    raise ValueError(f"{' / '.join(scales)} {verb} only to int8 / float8_e4m3fn caches, not "
                     f"{cache_dtype}")


def _check_cache(k_pages, v_pages, head_dim, k_scale, v_scale, what):
  quantized = _check_pages(k_pages, head_dim, what)
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k_pages and v_pages must have the same shape, got {k_pages.shape} and "
                     f"{v_pages.shape}")
  if k_pages.dtype != v_pages.dtype:
    raise TypeError(f"k_pages and v_pages must have the same dtype, got {k_pages.dtype} and "
                    f"{v_pages.dtype}")
  _check_scales_given(quantized, k_pages.dtype, {"k_scale": k_scale, "v_scale": v_scale})
  return quantized


def check_indices(kv_lens, page_indices, cu_q_lens, *, num_tokens: int, num_pages: int,
                  page_size: int) -> None:
  """Checks the index inputs on concrete values (NumPy); ValueError naming the sequence.

  cu_q_lens starts at 0, never decreases and ends at most at num_tokens; every sequence
  has 0 <= q_len <= kv_len <= pages_per_seq * page_size; every page id a sequence uses
  (its first ceil(kv_len / page_size)) is in [0, num_pages).
  """
  kv_lens, page_indices, cu = (np.asarray(a) for a in (kv_lens, page_indices, cu_q_lens))
  num_seqs = kv_lens.shape[0]
  if cu.shape != (num_seqs + 1,):
    raise ValueError(f"cu_q_lens must have shape ({num_seqs + 1},) for {num_seqs} sequences, "
                     f"got {cu.shape}")
  if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs:
    raise ValueError(f"page_indices must have shape ({num_seqs}, pages_per_seq), got "
                     f"{page_indices.shape}")
  if cu[0] != 0:
    raise ValueError(f"cu_q_lens[0] must be 0, got {cu[0]}")
  q_lens = np.diff(cu)
  if (q_lens < 0).any():
    s = int(np.argmax(q_lens < 0))
    raise ValueError(f"cu_q_lens must not decrease: cu_q_lens[{s + 1}]={cu[s + 1]} < "
                     f"cu_q_lens[{s}]={cu[s]}")
  if cu[-1] > num_tokens:
    raise ValueError(f"cu_q_lens[-1]={cu[-1]} exceeds the {num_tokens} tokens of q")
  capacity = page_indices.shape[1] * page_size
  for s in range(num_seqs):
    if not q_lens[s] <= kv_lens[s] <= capacity:
      raise ValueError(
          f"sequence {s}: need q_len ({q_lens[s]}) <= kv_len ({kv_lens[s]}) <= pages_per_seq "
          f"* page_size ({capacity})")
    used = page_indices[s, :-(-int(kv_lens[s]) // page_size)]
    bad = (used < 0) | (used >= num_pages)
    if bad.any():
      j = int(np.argmax(bad))
      raise ValueError(f"sequence {s}: page_indices[{s}, {j}]={used[j]} is outside the cache's "
                       f"{num_pages} pages")


def _check(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sliding_window, soft_cap,
           sinks, k_scale, v_scale):
  if q.ndim != 3:
    raise ValueError(f"q must be 3-D [tokens, heads, head_dim], got shape {q.shape}")
  if q.dtype not in FLOAT_DTYPES:
    raise TypeError(f"q must be float32 or bfloat16, got {q.dtype}")
  num_tokens, num_q_heads, head_dim = q.shape
  if num_tokens == 0 or head_dim == 0:
    raise ValueError(f"q must have tokens and a head_dim, got shape {q.shape}")
  if k_pages.dtype not in QUANTIZED_DTYPES and k_pages.dtype != q.dtype:
    raise TypeError(f"the cache must have q's dtype {q.dtype} or be int8 / float8_e4m3fn with "
                    f"scales, got {k_pages.dtype}; no silent casts")
  quantized = _check_cache(k_pages, v_pages, head_dim, k_scale, v_scale, "q")
  num_kv_heads = k_pages.shape[1]
  if num_q_heads % num_kv_heads:
    raise ValueError(f"the number of query heads ({num_q_heads}) must be a multiple of the "
                     f"number of KV heads ({num_kv_heads})")
  for name, a in (("kv_lens", kv_lens), ("page_indices", page_indices),
                  ("cu_q_lens", cu_q_lens)):
    if not jnp.issubdtype(a.dtype, jnp.integer):
      raise TypeError(f"{name} must be integers, got {a.dtype}")
  num_seqs = kv_lens.shape[0] if kv_lens.ndim == 1 else -1
  if num_seqs < 1:
    raise ValueError(f"kv_lens must be 1-D [num_seqs] with num_seqs >= 1, got {kv_lens.shape}")
  if page_indices.ndim != 2 or page_indices.shape[0] != num_seqs or page_indices.shape[1] < 1:
    raise ValueError(f"page_indices must have shape ({num_seqs}, pages_per_seq >= 1), got "
                     f"{page_indices.shape}")
  if cu_q_lens.shape != (num_seqs + 1,):
    raise ValueError(f"cu_q_lens must have shape ({num_seqs + 1},), got {cu_q_lens.shape}")
  common.check_softmax_options(sliding_window, soft_cap, sinks, num_q_heads)
  return quantized


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *,
                           sm_scale: float | None = None, soft_cap: float | None = None,
                           sliding_window: int | None = None, sinks=None, k_scale=None,
                           v_scale=None, chip: str | None = None, block_q: int | None = None,
                           block_kv: int | None = None, items_per_call: int | None = None,
                           vmem_limit_bytes: int | None = None,
                           manual_fetch: bool | None = None, interpret: bool = False):
  """Attention of packed new tokens over a paged KV cache (math in the module docstring).

  Args:
    q: [T, Hq, D] float32 or bfloat16: the new tokens of all sequences, packed.
    k_pages, v_pages: [num_pages, Hkv, page_size, D]: q's dtype, or int8 / float8_e4m3fn
      with k_scale / v_scale. page_size a multiple of 16 from 16 to 256; Hq % Hkv == 0.
    kv_lens: [S] int32: each sequence's KV length, including its new tokens.
    page_indices: [S, pages_per_seq] int32: each sequence's page ids; entries past its
      ceil(kv_len / page_size) used pages are never read.
    cu_q_lens: [S + 1] int32: sequence s owns q[cu_q_lens[s]:cu_q_lens[s + 1]].
      Sequences with q_len 0 are padding; q rows past cu_q_lens[S] come out as zeros.
    sm_scale: logit scale, default 1 / sqrt(D).
    soft_cap: float > 0: logits become soft_cap * tanh(logits / soft_cap).
    sliding_window: int >= 1: key j visible from position p only if p - j < window.
    sinks: [Hq] float32 or bfloat16: one learned logit per query head (gpt-oss).
    k_scale, v_scale: for quantized caches: a float or an [Hkv] array (per KV head).
    chip: tiles and VMEM / SMEM budgets for "v5e", "v6e", "v5p" or "v7" (default v6e).
    block_q, block_kv, items_per_call, vmem_limit_bytes, manual_fetch: override the
      tiling (`paged_tiling`).
    interpret: run in Pallas interpret mode (CPU).

  Index inputs are checked (`check_indices`) when they are concrete; under jit they
  cannot be, and bad page ids are clamped into the cache rather than read out of bounds.

  Returns:
    out [T, Hq, D] in q's dtype.
  """
  quantized = _check(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sliding_window,
                     soft_cap, sinks, k_scale, v_scale)
  num_tokens, num_q_heads, head_dim = q.shape
  num_pages, num_kv_heads, page_size, _ = k_pages.shape
  num_seqs, pages_per_seq = page_indices.shape
  group = num_q_heads // num_kv_heads
  if _is_concrete(kv_lens, page_indices, cu_q_lens):
    check_indices(kv_lens, page_indices, cu_q_lens, num_tokens=num_tokens,
                  num_pages=num_pages, page_size=page_size)
  chip = chips.DEFAULT_CHIP if chip is None else chip
  t = paged_tiling(num_tokens, num_seqs, pages_per_seq, page_size, head_dim,
                   num_kv_heads=num_kv_heads, group=group,
                   q_dtype=q.dtype, kv_dtype=k_pages.dtype, chip=chip, block_q=block_q,
                   block_kv=block_kv, items_per_call=items_per_call,
                   vmem_limit_bytes=vmem_limit_bytes, manual_fetch=manual_fetch)
  st = _Static(
      sm_scale=float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale),
      soft_cap=None if soft_cap is None else float(soft_cap),
      sliding_window=None if sliding_window is None else int(sliding_window),
      has_sinks=sinks is not None, quantized=quantized, block_q=t.block_q,
      block_kv=t.block_kv, page_size=page_size, pages_per_block=t.pages_per_block,
      pages_per_seq=pages_per_seq, num_kv_heads=num_kv_heads, rows=t.rows, group=group,
      vmem_limit_bytes=t.vmem_limit_bytes, interpret=bool(interpret),
      small_rows=small_rows(t, group, q.dtype), manual_fetch=t.manual_fetch,
      mask_in_f32=masking.selects_in_f32(chip))

  bq, rows = t.block_q, group * t.block_q
  num_items = num_work_items(num_tokens, num_seqs, bq)
  num_calls = -(-num_items // t.items_per_call)
  num_items_p = num_calls * t.items_per_call
  kv_lens = kv_lens.astype(jnp.int32)
  cu_q_lens = cu_q_lens.astype(jnp.int32)
  items, token_first, token_item, token_row, token_valid = _work_items(
      kv_lens, cu_q_lens, num_tokens, num_items_p, bq, t.block_kv, page_size, sliding_window)
  slot_pages = _slot_pages(page_indices, items, t.pages_per_block, num_pages,
                           _grid_steps(pages_per_seq, t.pages_per_block, page_size, t.block_q,
                                       sliding_window))
  items = {f: items[f] for f in _ITEM_FIELDS}

  # q -> [W, Hkv * R, D]: per KV head bq * G token-major rows, zero-padded to R; rows past
  # an item's tokens read a zero row.
  offsets = jnp.arange(bq, dtype=jnp.int32)
  src = jnp.where(offsets[None, :] < items["rows"][:, None],
                  token_first[:, None] + offsets[None, :], num_tokens)
  q_rows = jnp.concatenate([q, jnp.zeros((1,) + q.shape[1:], q.dtype)])[src]   # [W, bq, Hq, D]
  q_items = q_rows.reshape(num_items_p, bq, num_kv_heads, group, head_dim)
  q_items = q_items.transpose(0, 2, 1, 3, 4).reshape(num_items_p, num_kv_heads, rows, head_dim)
  q_items = jnp.pad(q_items, ((0, 0), (0, 0), (0, t.rows - rows), (0, 0)))
  q_items = q_items.reshape(num_items_p, num_kv_heads * t.rows, head_dim)

  scales = jnp.zeros((2, 1), jnp.float32)
  if quantized:
    scales = jnp.stack([_scales(k_scale, num_kv_heads, "k_scale"),
                        _scales(v_scale, num_kv_heads, "v_scale")])
  sink_rows = None
  if sinks is not None:
    per_row = jnp.tile(sinks.astype(jnp.float32).reshape(num_kv_heads, group), (1, bq))
    per_row = jnp.pad(per_row, ((0, 0), (0, t.rows - rows)))
    sink_rows = jnp.broadcast_to(per_row.reshape(-1, 1), (num_kv_heads * t.rows, _LANES))

  def call(chunk):
    chunk_items, chunk_slot_pages, chunk_q = chunk
    return _call(chunk_items, chunk_slot_pages, scales, chunk_q, sink_rows, k_pages, v_pages,
                 st)

  if num_calls == 1:
    out_items = call((items, slot_pages, q_items))
  else:   # one kernel, run once per chunk of items
    def split(a):
      return a.reshape((num_calls, t.items_per_call) + a.shape[1:])
    out_items = lax.map(call, ({f: split(a) for f, a in items.items()}, split(slot_pages),
                               split(q_items)))
    out_items = out_items.reshape((num_items_p,) + out_items.shape[2:])
  # Back to tokens: [W, Hkv, bq, G, D] -> [W, bq, Hkv, G, D], one row per token.
  out_items = out_items.reshape(num_items_p, num_kv_heads, t.rows, head_dim)[:, :, :rows]
  out_items = out_items.reshape(num_items_p, num_kv_heads, bq, group, head_dim)
  out = out_items.transpose(0, 2, 1, 3, 4)[token_item, token_row]       # [T, Hkv, G, D]
  out = jnp.where(token_valid[:, None, None, None], out, jnp.zeros_like(out))
  return out.reshape(num_tokens, num_q_heads, head_dim)


# ----------------------------------------------------------------------------- cache writes


def _quantize(x, dtype, scale):
  """x [T, Hkv, D] -> the cache's dtype (scale: f32 [Hkv] or None for float caches)."""
  if scale is None:
    return x
  y = x.astype(jnp.float32) / scale[None, :, None]
  if dtype == jnp.int8:
    return jnp.clip(jnp.round(y), -_INT8_MAX, _INT8_MAX).astype(jnp.int8)
  return jnp.clip(y, -_FP8_E4M3_MAX, _FP8_E4M3_MAX).astype(jnp.float8_e4m3fn)


def _write_rows(pages, new, slot_mapping, scale, name):
  """The scatter behind both cache writes: `pages` (checked by _check_pages) with row t of
  `new` ([T, Hkv, D], its head_dim checked; quantized with `scale` for an int8 / fp8
  cache) at slot slot_mapping[t]."""
  num_pages, num_kv_heads, page_size, _ = pages.shape
  quantized = pages.dtype in QUANTIZED_DTYPES
  if new.shape[1] != num_kv_heads:
    raise ValueError(f"{name} has {new.shape[1]} KV heads, the cache {num_kv_heads}")
  if slot_mapping.shape != (new.shape[0],) or not jnp.issubdtype(slot_mapping.dtype,
                                                                jnp.integer):
    raise ValueError(f"slot_mapping must be integers of shape ({new.shape[0]},), got "
                     f"{slot_mapping.shape} {slot_mapping.dtype}")
  if quantized and new.dtype not in FLOAT_DTYPES:
    raise TypeError(f"{name} must be float32 or bfloat16 for a quantized cache, got {new.dtype}")
  if not quantized and new.dtype != pages.dtype:
    raise TypeError(f"{name} must have the cache's dtype {pages.dtype}, got {new.dtype}; "
                    f"no silent casts")
  slots = slot_mapping.astype(jnp.int32)
  page = jnp.where(slots < 0, num_pages, slots // page_size)   # out of range: dropped below
  offset = slots % page_size
  if scale is not None:
    scale = _scales(scale, num_kv_heads, "scale")
  values = _quantize(new, pages.dtype, scale)                    # [T, Hkv, D]
  return pages.at[page, :, offset].set(values, mode="drop")


def write_kv_cache(k_pages, v_pages, new_k, new_v, slot_mapping, *, k_scale=None,
                   v_scale=None):
  """Writes new keys / values into their cache slots: (k_pages, v_pages) updated.

  Args:
    k_pages, v_pages: [num_pages, Hkv, page_size, D]: the caches.
    new_k, new_v: [T, Hkv, D]: the cache's dtype for float caches (no silent casts);
      float32 / bfloat16 for int8 / float8_e4m3fn caches, quantized here with the scales:
      int8 = clip(round(x / scale), -127, 127), fp8 = e4m3(clip(x / scale, -448, 448)).
    slot_mapping: [T] int32: token t goes to slot page_id * page_size + offset; a
      negative slot skips the token (padding). Slots past the cache are dropped (and
      refused by the torch op's checks).
    k_scale, v_scale: a float or an [Hkv] array, for quantized caches only.

  Functional in JAX. Under `jax.jit(..., donate_argnums=(0, 1))` XLA aliases the
  caches' buffers to the results, so on a TPU the write happens in place. k_pages and
  v_pages must then be two buffers (XLA refuses to donate one twice): for K and V pages
  in one array, use `write_kv_pages`.
  """
  if new_k.ndim != 3 or new_k.shape != new_v.shape:
    raise ValueError(f"new_k and new_v must both be [tokens, num_kv_heads, head_dim], got "
                     f"{new_k.shape} and {new_v.shape}")
  _check_cache(k_pages, v_pages, new_k.shape[2], k_scale, v_scale, "new_k")
  return (_write_rows(k_pages, new_k, slot_mapping, k_scale, "new_k"),
          _write_rows(v_pages, new_v, slot_mapping, v_scale, "new_v"))


def write_kv_pages(pages, new_rows, slot_mapping, *, scale=None):
  """Writes rows into their slots of ONE paged cache: `pages` updated.

  The one-array form of `write_kv_cache`, for a pool whose K and V pages live in the same
  array (Transformers' continuous-batching engine keeps every layer's K and V pages in
  one buffer; a fused K/V pool is another): K rows and V rows go in one call, their
  slots pointing at K pages and V pages of the pool. Same contract per row:

  Args:
    pages: [num_pages, Hkv, page_size, D]: the cache.
    new_rows: [T, Hkv, D]: the cache's dtype for a float cache (no silent casts);
      float32 / bfloat16 for an int8 / float8_e4m3fn cache, quantized here with `scale`.
    slot_mapping: [T] int32: row t goes to slot page_id * page_size + offset; a negative
      slot skips the row. Slots past the cache are dropped (and refused by the torch op's
      checks).
    scale: a float or an [Hkv] array, for quantized caches only (one scale for every row
      of the call: a pool whose K and V pages have different scales takes two calls).

  Functional in JAX. Under `jax.jit(..., donate_argnums=(0,))` XLA aliases the cache's
  buffer to the result, so on a TPU the write happens in place.
  """
  if new_rows.ndim != 3:
    raise ValueError(f"new_rows must be [tokens, num_kv_heads, head_dim], got {new_rows.shape}")
  quantized = _check_pages(pages, new_rows.shape[2], "new_rows", name="pages")
  _check_scales_given(quantized, pages.dtype, {"scale": scale})
  return _write_rows(pages, new_rows, slot_mapping, scale, "new_rows")


def check_slots(slot_mapping, *, num_pages: int, page_size: int) -> None:
  """Concrete slot_mapping check: every slot is negative (skipped) or in the cache."""
  slots = np.asarray(slot_mapping)
  bad = slots >= num_pages * page_size
  if bad.any():
    t = int(np.argmax(bad))
    raise ValueError(f"slot_mapping[{t}]={slots[t]} is past the cache's "
                     f"{num_pages * page_size} slots")


# ----------------------------------------------------------------------------- XLA baseline


def paged_attention_xla(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *,
                        sm_scale=None, soft_cap=None, sliding_window=None, sinks=None,
                        k_scale=None, v_scale=None):
  """The same attention in plain XLA (f32 math; gathers every sequence's pages, so
  O(S * pages_per_seq * page_size) memory): the baseline the benchmarks compare against."""
  num_tokens, num_q_heads, head_dim = q.shape
  num_pages, num_kv_heads, page_size, _ = k_pages.shape
  num_seqs, pages_per_seq = page_indices.shape
  group = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  table = jnp.clip(page_indices, 0, num_pages - 1)

  def dequant(pages, s):
    x = pages.astype(jnp.float32)
    if s is not None:
      x = x * _scales(s, num_kv_heads, "scale")[None, :, None, None]
    x = x[table].transpose(2, 0, 1, 3, 4)                       # [Hkv, S, P, page, D]
    return x.reshape(num_kv_heads, num_seqs, pages_per_seq * page_size, head_dim)

  k, v = dequant(k_pages, k_scale), dequant(v_pages, v_scale)     # [Hkv, S, L, D]
  cu = cu_q_lens.astype(jnp.int32)
  tokens = jnp.arange(num_tokens)
  valid = tokens < cu[-1]
  seq = jnp.minimum(jnp.searchsorted(cu[1:], tokens, side="right"), num_seqs - 1)
  q_pos = kv_lens[seq] - (cu[seq + 1] - cu[seq]) + (tokens - cu[seq])
  k_tok, v_tok = k[:, seq], v[:, seq]                              # [Hkv, T, L, D]
  qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
  s = jnp.einsum("thgd,htld->thgl", qf, k_tok, precision=lax.Precision.HIGHEST) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  key = jnp.arange(pages_per_seq * page_size)[None, :]
  visible = (key <= q_pos[:, None]) & (key < kv_lens[seq][:, None])
  if sliding_window is not None:
    visible &= q_pos[:, None] - key < sliding_window
  visible = visible[:, None, None, :]
  s = jnp.where(visible, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32).reshape(num_kv_heads, group))
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom = denom + jnp.exp(sinks.astype(jnp.float32).reshape(num_kv_heads, group) - m)
  v_tok = jnp.where(jnp.isfinite(v_tok), v_tok, 0.0)
  out = jnp.einsum("thgl,htld->thgd", p, v_tok, precision=lax.Precision.HIGHEST)
  out = out / jnp.where(denom > 0, denom, 1.0)[..., None]
  out = jnp.where(valid[:, None, None, None], out, 0.0)
  return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
