"""A small paged KV cache for serving loops: page pool, per-sequence page lists, and the
per-step metadata (slot mapping, page table, lengths) the two ops take.

    cache = PagedKVCache(num_layers=2, num_kv_heads=2, head_dim=16, num_pages=64)
    cache.add_sequence("a"); cache.add_sequence("b")
    batch = cache.schedule([("a", 21), ("b", 1)], num_tokens=32)   # a: prefill, b: decode
    # per layer:  out = cache.write_and_attend(layer, q, k, v, batch)
    cache.free_sequence("a")

Plain Python bookkeeping on the host (as serving engines do), no kernel involved. The
cache tensors are one pair per layer, k[layer] and v[layer], each
[num_pages, num_kv_heads, page_size, head_dim]; a page id indexes dim 0 of every layer's
pair (a sequence owns the same page ids in every layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class PagedBatch:
  """The paging metadata of one packed step (int32 tensors on the cache's device).

  Attributes:
    seq_ids: the scheduled sequences, in packing order (row s of the tensors below).
    kv_lens: [S] each sequence's KV length after this step's tokens.
    page_indices: [S, pages_per_seq] each sequence's page ids (unused entries 0).
    cu_q_lens: [S + 1] sequence s owns tokens cu_q_lens[s]:cu_q_lens[s + 1].
    slot_mapping: [T] the cache slot of each token (page * page_size + offset), -1 for
      padding tokens past cu_q_lens[-1].
    positions: [T] int64 position of each token in its sequence (0 for padding): the
      model's position_ids.
    num_scheduled: the number of real tokens, cu_q_lens[-1].
  """

  seq_ids: tuple
  kv_lens: torch.Tensor
  page_indices: torch.Tensor
  cu_q_lens: torch.Tensor
  slot_mapping: torch.Tensor
  positions: torch.Tensor
  num_scheduled: int

  def last_token_indices(self) -> list[int]:
    """Index in the packed tokens of each sequence's last new token (where its next-token
    logits are), in packing order; empty sequences (padding rows) are left out."""
    cu = self.cu_q_lens.tolist()
    return [cu[s + 1] - 1 for s in range(len(self.seq_ids)) if cu[s + 1] > cu[s]]


class PagedKVCache:
  """Per-layer K/V page tensors, a page allocator and per-sequence page tables.

  Args:
    num_layers, num_kv_heads, head_dim: the model's attention shape.
    num_pages: pages in the pool (per layer); page_size: tokens per page (a multiple of
      16 in [16, 256]).
    dtype: float32 / bfloat16 (the model's dtype), or torch.int8 / torch.float8_e4m3fn
      with k_scale and v_scale (a float or a float32 [num_kv_heads] tensor, the same for
      every layer).
    device: where the pages live ("cpu" or a TorchTPU "tpu" device).
    shuffle_seed: None hands out pages in order 0, 1, 2, ...; an int shuffles the free
      list once (as a long-running server's pool ends up), so a sequence's pages are
      neither contiguous nor ordered.
  """

  def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, num_pages: int,
               page_size: int = 16, *, dtype: torch.dtype = torch.float32,
               device: torch.device | str = "cpu", k_scale=None, v_scale=None,
               shuffle_seed: int | None = None):
    self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
    self.num_pages, self.page_size = num_pages, page_size
    self.device = torch.device(device)
    shape = (num_pages, num_kv_heads, page_size, head_dim)
    self.k = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
    self.v = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(num_layers)]
    self.k_scale, self.v_scale = k_scale, v_scale
    order = list(range(num_pages))
    if shuffle_seed is not None:
      gen = torch.Generator().manual_seed(shuffle_seed)
      order = [order[i] for i in torch.randperm(num_pages, generator=gen).tolist()]
    self._free = order
    self.pages: dict[Hashable, list[int]] = {}
    self.lengths: dict[Hashable, int] = {}

  # ------------------------------------------------------------------ sequences and pages

  @property
  def num_free_pages(self) -> int:
    return len(self._free)

  def add_sequence(self, seq_id: Hashable) -> None:
    if seq_id in self.pages:
      raise ValueError(f"PagedKVCache: sequence {seq_id!r} already exists")
    self.pages[seq_id] = []
    self.lengths[seq_id] = 0

  def free_sequence(self, seq_id: Hashable) -> None:
    """Returns the sequence's pages to the pool (their contents are left as they are)."""
    self._free.extend(self.pages.pop(seq_id))
    del self.lengths[seq_id]

  def _reserve(self, seq_id: Hashable, length: int) -> None:
    pages = self.pages[seq_id]
    needed = -(-length // self.page_size) - len(pages)
    if needed > len(self._free):
      raise RuntimeError(f"PagedKVCache: out of pages: sequence {seq_id!r} needs {needed} more, "
                         f"{len(self._free)} free")
    for _ in range(max(needed, 0)):
      pages.append(self._free.pop(0))

  def slot(self, seq_id: Hashable, position: int) -> int:
    """The cache slot (page * page_size + offset) of a sequence's token at `position`."""
    page = self.pages[seq_id][position // self.page_size]
    return page * self.page_size + position % self.page_size

  # ------------------------------------------------------------------------- one step

  def schedule(self, chunks: Sequence[tuple[Hashable, int]], *, num_tokens: int | None = None,
               num_seqs: int | None = None, pages_per_seq: int | None = None) -> PagedBatch:
    """Plans one packed step: sequence seq_id gets its next n tokens (a prefill chunk, or 1
    to decode), in the order given. Allocates the pages they need, advances the
    sequences' lengths, and returns the step's metadata.

    num_tokens / num_seqs / pages_per_seq pad T, S and the page-table width to fixed
    buckets (padding tokens get slot -1; padding sequences q_len 0 and kv_len 0), so
    that every step of a loop has the same shapes and reuses one compiled kernel.
    """
    seq_ids, kv_lens, cu, slots, positions, rows = [], [], [0], [], [], []
    for seq_id, n in chunks:
      if n < 1:
        raise ValueError(f"PagedKVCache.schedule: sequence {seq_id!r} scheduled {n} tokens")
      start = self.lengths[seq_id]
      self._reserve(seq_id, start + n)
      self.lengths[seq_id] = start + n
      seq_ids.append(seq_id)
      kv_lens.append(start + n)
      cu.append(cu[-1] + n)
      slots.extend(self.slot(seq_id, p) for p in range(start, start + n))
      positions.extend(range(start, start + n))
      rows.append(list(self.pages[seq_id]))
    total = cu[-1]
    num_tokens = total if num_tokens is None else num_tokens
    num_seqs = len(seq_ids) if num_seqs is None else num_seqs
    width = max(len(r) for r in rows) if pages_per_seq is None else pages_per_seq
    if total > num_tokens or len(seq_ids) > num_seqs or max(len(r) for r in rows) > width:
      raise ValueError(f"PagedKVCache.schedule: {total} tokens, {len(seq_ids)} sequences and "
                       f"{max(len(r) for r in rows)} pages per sequence do not fit the "
                       f"buckets ({num_tokens}, {num_seqs}, {width})")
    pad = num_seqs - len(seq_ids)
    kv_lens += [0] * pad
    cu += [total] * pad
    rows = [r + [0] * (width - len(r)) for r in rows] + [[0] * width] * pad
    slots += [-1] * (num_tokens - total)
    positions += [0] * (num_tokens - total)

    def int32(values):
      return torch.tensor(values, dtype=torch.int32, device=self.device)

    return PagedBatch(seq_ids=tuple(seq_ids), kv_lens=int32(kv_lens),
                      page_indices=int32(rows), cu_q_lens=int32(cu),
                      slot_mapping=int32(slots),
                      positions=torch.tensor(positions, dtype=torch.long, device=self.device),
                      num_scheduled=total)

  def write_and_attend(self, layer: int, q: torch.Tensor, new_k: torch.Tensor,
                       new_v: torch.Tensor, batch: PagedBatch, **attention_kwargs
                       ) -> torch.Tensor:
    """write_kv_cache_ of this step's K/V into layer `layer`, then ragged_paged_attention
    of q [T, Hq, D] over it; attention_kwargs (sm_scale, soft_cap, sliding_window,
    sinks, ...) go to the attention. Returns out [T, Hq, D]."""
    from . import ragged_paged_attention, write_kv_cache_

    scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
    write_kv_cache_(self.k[layer], self.v[layer], new_k, new_v, batch.slot_mapping, **scales)
    return ragged_paged_attention(q, self.k[layer], self.v[layer], batch.kv_lens,
                                  batch.page_indices, batch.cu_q_lens, **scales,
                                  **attention_kwargs)
