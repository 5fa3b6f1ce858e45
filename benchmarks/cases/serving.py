"""Paged attention at serving shapes (issue 28; docs/serving.md): the case kind `PagedBatch`
(one serving step of decodes and chunked-prefill chunks) and its rows."""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE


@dataclasses.dataclass(frozen=True)
class PagedBatch:
  """One serving step of ragged paged attention (issue 28): `decode` sequences of `context`
  cached tokens with one new query token each, plus `prefill` chunks of `chunk` new tokens,
  each chunk the last `chunk` tokens of a sequence of `prefill_context` tokens (chunked
  prefill: its earlier tokens are cached). Caches in pages of `page_size` tokens, in
  `kv_dtype` (bfloat16, or int8 / float8_e4m3fn with per-KV-head scales); `sliding_window`
  keys visible per query (None: all). The new tokens' K/V are already in the cache (the
  write is a separate op). Llama-3-8B-like heads by default (32 / 8 x 128).

  Everything an RPA-style anchor needs is here: the per-sequence q and kv lengths
  (`sequences`), the page size and the dtypes. Memory bound at every serving shape rated
  here (the prefill chunks add flops, not bytes: tests check the roofline is the bytes'
  side on v5e and v6e)."""

  decode: int = 64
  context: int = 2048
  prefill: int = 0
  chunk: int = 512
  prefill_context: int = 2048
  page_size: int = 64
  kv_dtype: str = "bfloat16"
  sliding_window: int | None = None
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  q_dtype: str = "bfloat16"
  kernel = "paged-attention-tpu"
  bound = "memory"

  def __post_init__(self):
    if self.decode < 0 or self.prefill < 0 or self.decode + self.prefill == 0:
      raise ValueError(f"need decode >= 0, prefill >= 0 and some sequences, got "
                       f"{self.decode} / {self.prefill}")
    if self.prefill and not 0 < self.chunk <= self.prefill_context:
      raise ValueError(f"need 0 < chunk <= prefill_context, got {self.chunk} / "
                       f"{self.prefill_context}")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

  @property
  def name(self) -> str:
    parts = [f"paged_attention serving H={self.q_heads}/{self.kv_heads} D={self.head_dim}"]
    if self.decode:
      parts.append(f"decode {self.decode}x{self.context}")
    if self.prefill:
      parts.append(f"prefill {self.prefill}x{self.chunk}@{self.prefill_context}")
    parts.append(f"page={self.page_size}")
    if self.sliding_window is not None:
      parts.append(f"window={self.sliding_window}")
    parts.append("bf16" if self.kv_dtype == "bfloat16" else f"cache {self.kv_dtype}")
    return " ".join(parts)

  def sequences(self) -> list[tuple[int, int]]:
    """(q_len, kv_len) of every sequence, decodes first: what cu_q_lens / kv_lens hold."""
    return [(1, self.context)] * self.decode + [(self.chunk, self.prefill_context)] * self.prefill

  @property
  def num_tokens(self) -> int:
    return self.decode + self.prefill * self.chunk

  def _visible(self, q_len: int, kv_len: int) -> tuple[int, int]:
    """(sum over the sequence's queries of their visible keys, distinct keys any of them
    sees): query i sits at position kv_len - q_len + i and sees keys in
    (position - window, position]."""
    w = self.sliding_window
    pairs = 0
    first = kv_len - q_len
    for p in range(first, kv_len):
      pairs += p + 1 if w is None else min(p + 1, w)
    keys = kv_len - (0 if w is None else max(0, first - w + 1))
    return pairs, keys

  def flops(self) -> int:
    pairs = sum(self._visible(q, kv)[0] for q, kv in self.sequences())
    return 4 * self.q_heads * self.head_dim * pairs

  def min_bytes(self) -> int:
    """K and V of every key some query sees (a window's earlier keys are never read), q
    read and out written once."""
    keys = sum(self._visible(q, kv)[1] for q, kv in self.sequences())
    kv = 2 * keys * self.kv_heads * self.head_dim * ITEMSIZE[self.kv_dtype]
    q_out = 2 * self.num_tokens * self.q_heads * self.head_dim * ITEMSIZE[self.q_dtype]
    return kv + q_out


SERVING_PAGED: tuple = (           # paged attention at serving page sizes and batches (issue 28)
    # Decode 64 x 2k at the page sizes serving engines use (page 64 is HEADLINE's row).
    PagedBatch(page_size=16), PagedBatch(page_size=32), PagedBatch(page_size=256),
    # A vLLM-like mixed step: 60 decodes + 4 chunked-prefill chunks of 512.
    PagedBatch(decode=60, prefill=4),
    # Quantized caches (1 byte per element).
    PagedBatch(kv_dtype="int8"), PagedBatch(kv_dtype="float8_e4m3fn"),
    # A sliding window on a long context (gpt-oss / Mistral-like): only 4k of 32k is read.
    PagedBatch(context=32768, sliding_window=4096),
)
CASES = SERVING_PAGED
