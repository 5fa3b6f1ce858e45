"""jax's paged-attention kernels as a peer: `paged_attention` (k / v pages [Hkv, pages, page,
D], its default inline_seq_dim=True) and `ragged_paged_attention` (fused K/V pages), on the
paged decode headline cases and the serving batches.

What the estimator is shown (it reads every SMEM / scalar-prefetch value as 0):
  * paged_attention: its loop count is lax.div(length + bk - 1, bk) of an SMEM length,
    which the estimator mis-evaluates for any run-time value, so the length is made static
    (the kernel reads the case's context length as a constant: a static-length variant);
    page-table reads yield max(value, identity table).
  * ragged_paged_attention: its loops run over SMEM values (num_seqs, cu_q_lens,
    kv_lens), so they become static loops with the batch's trip counts (a static-length
    variant, see `RaggedPagedAnchor`).
"""

from __future__ import annotations

import dataclasses
import json
import types
from unittest import mock

from benchmarks.cases import ITEMSIZE
from benchmarks.cases.headline import PagedDecode
from benchmarks.cases.serving import PagedBatch
from benchmarks.estimator import visible
from benchmarks.peers.megablox import jax_pallas_op, jax_version


PAGED_TRUNCATED_BATCH = (2, 4)


@dataclasses.dataclass(frozen=True)
class PagedAnchor:
  context: int
  pages_per_compute_block: int = 8

  @property
  def case(self):
    return PagedDecode(self.context)

  @property
  def key(self) -> str:
    return f"paged:{self.context}:{self.pages_per_compute_block}"

  @property
  def implementation(self) -> str:
    return (f"jax paged_attention (jax {jax_version()}, pages_per_compute_block "
            f"{self.pages_per_compute_block}, inline_seq_dim)")

  truncations = tuple([b] for b in PAGED_TRUNCATED_BATCH)

  @property
  def method(self) -> str:
    return (f"static estimate at batch {PAGED_TRUNCATED_BATCH[0]} and "
            f"{PAGED_TRUNCATED_BATCH[1]} (static-length variant), extrapolated linearly to 64")

  @property
  def note(self) -> str:
    return ("Static-length variant: the kernel reads the context length as a constant (its "
            "loop count lax.div(length + bk - 1, bk) of an SMEM value is mis-evaluated by the "
            "estimator); page-table reads max(value, identity). Its double-buffer index and "
            "init flag live in SMEM scratch carried across grid steps (the estimator loses "
            "them: each step sees 0). q, k computed in f32 (its own choice). "
            "k/v pages in its [Hkv, pages, page, D] layout.")

  def config(self) -> dict:
    return dict(pages_per_compute_block=self.pages_per_compute_block,
                page_size=self.case.page_size, megacore_mode=None, inline_seq_dim=True,
                block_tokens=self.pages_per_compute_block * self.case.page_size)

  def validate(self) -> None:
    pass

  def build(self, trunc, chip: str = "v6e"):
    (batch,) = trunc
    import jax
    import jax.numpy as jnp
    import numpy as np
    P = jax_pallas_op("paged_attention.paged_attention_kernel")
    c = self.case
    pages_per_seq = c.context // c.page_size
    total_pages = batch * pages_per_seq
    length = np.int32(c.context)
    forms = (("const", lambda b: length), lambda idx: idx, None, None)

    def fn(q, k_pages, v_pages, page_indices):
      with visible.visible_prefetch(P, forms):
        return P.paged_attention(q, k_pages, v_pages, jnp.full((batch,), c.context, jnp.int32),
                                 page_indices,
                                 pages_per_compute_block=self.pages_per_compute_block)
    S = jax.ShapeDtypeStruct
    return fn, [S((batch, c.q_heads, c.head_dim), jnp.bfloat16),
                S((c.kv_heads, total_pages, c.page_size, c.head_dim), jnp.bfloat16),
                S((c.kv_heads, total_pages, c.page_size, c.head_dim), jnp.bfloat16),
                S((batch, pages_per_seq), jnp.int32)]

  def extrapolate(self, cycles: dict) -> float:
    (b1, b2) = PAGED_TRUNCATED_BATCH
    k1, k2 = cycles[json.dumps([b1])], cycles[json.dumps([b2])]
    return k1 + (k2 - k1) / (b2 - b1) * (self.case.batch - b1)

  def hbm_bytes(self, batch: int | None = None) -> int:
    """Every (sequence, kv head) loads ceil(L / bk) blocks of k and v pages (the next block is
    prefetched once, never twice); q read and o written once; m, l (f32 [B, Hq, 1]) written."""
    c = self.case
    batch = c.batch if batch is None else batch
    bk = self.pages_per_compute_block * c.page_size
    blocks = -(-c.context // bk)
    kv = 2 * batch * c.kv_heads * blocks * bk * c.head_dim * 2
    return kv + 2 * batch * c.q_heads * c.head_dim * 2 + 2 * batch * c.q_heads * 4

  def hand(self, chip) -> dict:
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=hbm_us, hand_count="k/v pages once at HBM bandwidth (decode is "
                "memory bound: 4*B*Hq*L*D flops are tiny)")


@dataclasses.dataclass(frozen=True)
class RaggedPagedAnchor:
  """jax's ragged_paged_attention on the uniform decode batch, static-length variant.

  The kernel walks the batch with two lax.while_loops whose conditions read SMEM
  (num_seqs, cu_q_lens, kv_lens), which the estimator reads as 0: it would rate one
  empty pass. Here both loops become fori_loops with the trip counts this batch has on
  hardware (outer: the num_queries_per_block sequences of a full q block, one token
  each; inner: ceil(context / (num_kv_pages_per_block * page_size)) kv blocks), and the
  SMEM reads yield the batch's values (kv_lens: the context, cu_q_lens[i]: i, num_seqs:
  the batch; page-table reads max(value, identity)). Rated at the full batch (with static
  loops the grid is only (head blocks, q blocks)); past RPA_MAX_RATED_CONTEXT at two
  shorter contexts, extrapolated linearly in kv blocks (the estimator's memory grows with
  the loop iterations it walks: 32k context passed 21 GB)."""

  context: int
  num_kv_pages_per_block: int = 32
  num_queries_per_block: int = 32

  def vmem_limit_bytes(self, chip: str) -> int | None:
    """The kernel's default (None) where it compiles (v6e); on v5e, whose default scoped
    limit (16 MiB) cannot hold its double-buffered 16 MiB of K/V pages, 64 MiB."""
    return 64 * 2**20 if chip == "v5e" else None

  @property
  def case(self):
    return PagedDecode(self.context)

  @property
  def key(self) -> str:
    return f"rpa:{self.context}:{self.num_kv_pages_per_block}:{self.num_queries_per_block}"

  @property
  def implementation(self) -> str:
    return (f"jax ragged_paged_attention (jax {jax_version()}, kv pages / queries per "
            f"block {self.num_kv_pages_per_block} / {self.num_queries_per_block}, static-length "
            f"variant)")

  @property
  def truncations(self):
    c = self.case
    if c.context <= RPA_MAX_RATED_CONTEXT:
      return ([c.batch, c.context],)
    return tuple([c.batch, ctx] for ctx in (RPA_MAX_RATED_CONTEXT // 2, RPA_MAX_RATED_CONTEXT))

  @property
  def method(self) -> str:
    how = "static estimate at the full batch (static-length variant: loops with static trip counts)"
    if self.case.context > RPA_MAX_RATED_CONTEXT:
      how += (f", rated at contexts {RPA_MAX_RATED_CONTEXT // 2} and {RPA_MAX_RATED_CONTEXT} and "
              f"extrapolated linearly in kv blocks to {self.case.context}")
    return how

  @property
  def note(self) -> str:
    return ("Static-length variant: its two while loops over SMEM values become fori loops "
            "with this batch's trip counts, SMEM reads yield the batch's values. K/V fused in "
            "its [pages, page, 2*Hkv, D] layout. Block sizes: jax's tuned table (v5e and "
            "v6e) gives 32 queries and 32 kv pages at 2k context, used at both contexts; at "
            "32k it gives 128 pages, which cannot fit: 64 pages already need 158 MiB of VMEM "
            "with all 32/8 heads on one chip (compile at 4k context). 16 pages rate 1.4x "
            "slower at 2k on v6e.")

  def config(self) -> dict:
    return dict(num_kv_pages_per_block=self.num_kv_pages_per_block,
                num_queries_per_block=self.num_queries_per_block,
                page_size=self.case.page_size,
                vmem_limit_bytes="kernel default on v6e, 64 MiB on v5e")

  def validate(self) -> None:
    c = self.case
    if c.batch % self.num_queries_per_block or c.context % c.page_size:
      raise ValueError("the static trip counts assume full q blocks and whole pages")

  def loop_counts(self, context: int | None = None) -> tuple[int, int]:
    """(outer, inner) trip counts of the kernel's while loops on this batch (at `context`
    tokens, default the case's)."""
    c = self.case
    context = c.context if context is None else context
    return (self.num_queries_per_block,
            -(-context // (self.num_kv_pages_per_block * c.page_size)))

  def build(self, trunc, chip: str = "v6e"):
    batch, context = trunc
    return rpa_program(self.case, batch, 1, context, self.num_kv_pages_per_block,
                        self.num_queries_per_block, self.vmem_limit_bytes(chip))

  def lowering(self, chip: str):
    """Around tracing and compiling (see `target_chip`)."""
    return visible.target_chip(chip)

  def extrapolate(self, cycles: dict) -> float:
    points = [(self.loop_counts(t[1])[1], cycles[json.dumps(t)]) for t in self.truncations]
    if len(points) == 1:
      return points[0][1]
    (b0, c0), (b1, c1) = points
    return c1 + (c1 - c0) / (b1 - b0) * (self.loop_counts()[1] - b1)

  def hbm_bytes(self) -> int:
    """Each sequence's K/V pages once (its blocks are whole: the context is a multiple of
    the block); q read and o written once."""
    c = self.case
    blocks = self.loop_counts()[1]
    kv = 2 * c.batch * c.kv_heads * blocks * self.num_kv_pages_per_block * c.page_size \
        * c.head_dim * 2
    return kv + 2 * c.batch * c.q_heads * c.head_dim * 2

  def hand(self, chip) -> dict:
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=hbm_us, hand_count="k/v pages once at HBM bandwidth")


RPA_MAX_RATED_CONTEXT = 4096


def rpa_program(c, num_seqs: int, q_len: int, context: int, pages_per_block: int,
                 queries_per_block: int, vmem_limit_bytes: int | None):
  """(fn, specs): jax's ragged_paged_attention, static-length variant (see
  `RaggedPagedAnchor`), on `num_seqs` sequences of `q_len` new tokens and `context` keys
  each, with `c`'s heads, page size, cache dtype (quantized: scales 1.0) and sliding window.
  Its outer while loop runs once per sequence a q block touches (queries_per_block // q_len
  sequences, at least 1), its inner one over every kv block of the sequence (it skips
  neither causally invisible blocks nor keys before a window)."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  K = jax_pallas_op("ragged_paged_attention.kernel")
  pages_per_seq = context // c.page_size
  counts = (max(1, queries_per_block // q_len),
            -(-context // (pages_per_block * c.page_size)))
  depth = [0]

  def static_while_loop(cond, body, init):
    del cond   # true for exactly counts[depth] iterations on this batch
    n = counts[depth[0]]
    depth[0] += 1
    try:
      return lax.fori_loop(0, n, lambda i, state: body(state), init)
    finally:
      depth[0] -= 1
  lax_view = types.SimpleNamespace(**{n: getattr(lax, n) for n in dir(lax)
                                      if not n.startswith("__")})
  lax_view.while_loop = static_while_loop
  forms = (("const", lambda s: np.int32(context)), lambda s, p: s * pages_per_seq + p,
           ("const", (lambda i: i) if q_len == 1 else (lambda i: i * q_len)), None, ("const", lambda i: np.int32(num_seqs)))
  kv_dtype = jnp.dtype(getattr(c, "kv_dtype", "bfloat16"))
  scale = None if kv_dtype == jnp.bfloat16 else 1.0
  window = getattr(c, "sliding_window", None)
  extra = {} if window is None else dict(sliding_window=window)

  def fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs_):
    with visible.visible_prefetch(K, forms), mock.patch.object(K, "lax", lax_view):
      return K.ragged_paged_attention(
          q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs_,
          sm_scale=c.head_dim ** -0.5, num_kv_pages_per_block=pages_per_block,
          num_queries_per_block=queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
          k_scale=scale, v_scale=scale, **extra)
  S = jax.ShapeDtypeStruct
  return fn, [S((num_seqs * q_len, c.q_heads, c.head_dim), jnp.bfloat16),
              S((num_seqs * pages_per_seq, c.page_size, 2 * c.kv_heads, c.head_dim), kv_dtype),
              S((num_seqs,), jnp.int32), S((num_seqs, pages_per_seq), jnp.int32),
              S((num_seqs + 1,), jnp.int32), S((1,), jnp.int32)]


@dataclasses.dataclass(frozen=True)
class RaggedPagedServingAnchor:
  """jax's ragged_paged_attention on a serving step (`PagedBatch`): the same
  static-length variant as `RaggedPagedAnchor` (`rpa_program`), rated per part of the
  batch and summed: the decode sequences (rated at a whole number of q blocks, scaled to
  the real count) and the prefill chunks (each q block of a chunk is one sequence's
  queries). Block sizes: `kv_tokens_per_block` keys (2048, the existing rows' 32 pages of
  64) in whole pages and 32 queries; jax's tuned table has no key for these shapes (its
  32/8-head keys stop at 1280 tokens of context, and its default of 128 pages does not fit
  VMEM at page 64)."""

  serving: PagedBatch
  num_queries_per_block: int = 32
  kv_tokens_per_block: int = 2048

  @property
  def case(self):
    return self.serving

  @property
  def key(self) -> str:
    return (f"rpa-serving:{self.serving.name}:{self.num_queries_per_block}:"
            f"{self.kv_tokens_per_block}")

  @property
  def pages_per_block(self) -> int:
    c = self.serving
    longest = max(kv for _, kv in c.sequences())
    return max(1, min(self.kv_tokens_per_block // c.page_size, longest // c.page_size))

  @property
  def implementation(self) -> str:
    return (f"jax ragged_paged_attention (jax {jax_version()}, kv pages / queries per "
            f"block {self.pages_per_block} / {self.num_queries_per_block}, static-length "
            f"variant)")

  def parts(self) -> list[tuple[str, int, int, int, int]]:
    """[(part, sequences, rated sequences, q_len, context)] of the batch."""
    c, qb = self.serving, self.num_queries_per_block
    out = []
    if c.decode:
      out.append(("decode", c.decode, -(-c.decode // qb) * qb, 1, c.context))
    if c.prefill:
      out.append(("prefill", c.prefill, c.prefill, c.chunk, c.prefill_context))
    return out

  def _contexts(self, context: int) -> tuple[int, ...]:
    if context <= RPA_MAX_RATED_CONTEXT:
      return (context,)
    return (RPA_MAX_RATED_CONTEXT // 2, RPA_MAX_RATED_CONTEXT)

  @property
  def truncations(self):
    return tuple([part, rated, q_len, ctx] for part, _, rated, q_len, context in self.parts()
                 for ctx in self._contexts(context))

  @property
  def method(self) -> str:
    how = ("static estimate per part (static-length variant: loops with static trip counts), "
           "summed: " + ", ".join(f"{part} at {rated} sequences" + (
               f" scaled to {n}" if rated != n else "") for part, n, rated, _, _ in
               self.parts()))
    if any(len(self._contexts(p[4])) > 1 for p in self.parts()):
      how += (f"; contexts past {RPA_MAX_RATED_CONTEXT} rated at {RPA_MAX_RATED_CONTEXT // 2} "
              f"and {RPA_MAX_RATED_CONTEXT} and extrapolated linearly in kv blocks")
    return how

  @property
  def note(self) -> str:
    return ("Static-length variant as for the headline rows. Each part is its own kernel "
            "here (one launch's fixed cycles counted once per part). It reads every kv block "
            "of a sequence for every q block (no causal or window skipping), as on hardware; "
            "quantized caches with scales 1.0 (its k_scale / v_scale are floats).")

  def config(self) -> dict:
    return dict(num_kv_pages_per_block=self.pages_per_block,
                num_queries_per_block=self.num_queries_per_block,
                page_size=self.serving.page_size,
                vmem_limit_bytes="kernel default on v6e, 64 MiB on v5e")

  def vmem_limit_bytes(self, chip: str) -> int | None:
    return 64 * 2**20 if chip == "v5e" else None

  def validate(self) -> None:
    c, qb = self.serving, self.num_queries_per_block
    if c.prefill and c.chunk % qb:
      raise ValueError("the static trip counts assume chunks of whole q blocks")
    for _, _, _, _, context in self.parts():
      if context % c.page_size:
        raise ValueError("the static trip counts assume whole pages")

  def build(self, trunc, chip: str = "v6e"):
    _, seqs, q_len, context = trunc
    return rpa_program(self.serving, seqs, q_len, context, self.pages_per_block,
                        self.num_queries_per_block, self.vmem_limit_bytes(chip))

  def lowering(self, chip: str):
    return visible.target_chip(chip)

  def kv_blocks(self, context: int) -> int:
    return -(-context // (self.pages_per_block * self.serving.page_size))

  def extrapolate(self, cycles: dict) -> float:
    total = 0.0
    for part, n, rated, q_len, context in self.parts():
      points = [(self.kv_blocks(ctx), cycles[json.dumps([part, rated, q_len, ctx])])
                for ctx in self._contexts(context)]
      value = points[0][1]
      if len(points) == 2:
        (b0, c0), (b1, c1) = points
        value = c1 + (c1 - c0) / (b1 - b0) * (self.kv_blocks(context) - b1)
      total += value * n / rated
    return total

  def hbm_bytes(self) -> int:
    """Per sequence, every q block it spans fetches the pages of its kv_len (the last block
    only the pages it needs); q read and out written once."""
    c, qb = self.serving, self.num_queries_per_block
    token_bytes = 2 * c.kv_heads * c.head_dim * ITEMSIZE[c.kv_dtype]
    kv = 0
    for _, n, _, q_len, context in self.parts():
      pages = -(-context // c.page_size)
      kv += n * -(-q_len // qb) * pages * c.page_size * token_bytes
    return kv + 2 * c.num_tokens * c.q_heads * c.head_dim * ITEMSIZE[c.q_dtype]

  def hand(self, chip) -> dict:
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=hbm_us, hand_count="k/v pages it fetches at HBM bandwidth")
