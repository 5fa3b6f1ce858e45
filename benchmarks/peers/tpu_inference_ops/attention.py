"""tpu-inference's attention kernels:

  * `flash_attention` (`FlashSpec`, causal attention cases): no GQA (k / v repeated to every
    head, as for jax's flash anchor), no scalar prefetch: rated at 2 and 4 heads,
    extrapolated.
  * ragged paged attention v3 (`RpaV3Spec`, paged decode cases and the decode-only serving
    batches): grid (1,), loops over the sequences and kv blocks bounded by SMEM values
    (distribution, kv_lens, cu_q_lens), so they read the batch's values as constants
    (static-length variant, like jax's RaggedPagedAnchor, peers/jax_ops/paged.py). The other
    serving batches say why not (`tpu_inference_ops.not_rated_why`).
"""

from __future__ import annotations

import dataclasses
import json
from unittest import mock

from benchmarks.cases import ITEMSIZE
from benchmarks.cases.headline import Attention
from benchmarks.estimator import visible
from benchmarks.peers.tpu_inference_ops.common import (VERSION, STACK, TpuInferenceSpec,
                                                        kernel_module)


FLASH_HEADS = (2, 4)


@dataclasses.dataclass(frozen=True)
class FlashSpec(TpuInferenceSpec):
  case: Attention
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-flash:{self.case.name}"

  @property
  def implementation(self) -> str:
    return (f"tpu-inference flash_attention (tpu-inference {VERSION}, {STACK}, its block "
            f"sizes, k/v repeated to {self.case.q_heads} heads)")

  truncations = tuple([h] for h in FLASH_HEADS)

  @property
  def method(self) -> str:
    return (f"static estimate at {FLASH_HEADS[0]} and {FLASH_HEADS[1]} heads (the whole "
            f"sequence), extrapolated linearly to {self.case.q_heads} heads")

  @property
  def note(self) -> str:
    return ("flash_attention has no GQA ('Head count mismatch'): rated on k/v with every "
            "head (a caller repeats them; the repeat's bytes, read Hkv heads + write Hq, are "
            "in hbm_bytes, its cycles are not); [B, H, S, D] layout (transposes not counted). "
            "Block sizes: no tuned entry for these shapes, so its heuristic (128 blocks) and "
            "its single-step override (block_k = the whole kv length when its VMEM estimate "
            "fits 0.9 of the chip's VMEM); vmem_limit_bytes left at its default (None)")

  def _shape(self, heads: int) -> tuple[int, int, int, int]:
    c = self.case
    return (c.batch, heads, c.seq, c.head_dim)

  def choose(self, chip: str) -> dict:
    """What flash_attention picks for the whole case (its own code path, stopped before the
    kernel)."""
    import jax
    import jax.numpy as jnp
    F = kernel_module("flash_attention.kernel")
    c = self.case
    x = jax.ShapeDtypeStruct(self._shape(c.q_heads), jnp.bfloat16)
    picked = {}

    def capture(q, k, v, ab, segment_ids, save_residuals, causal, sm_scale, block_sizes,
                vmem_limit_bytes, debug):
      picked.update(dataclasses.asdict(block_sizes), vmem_limit_bytes=vmem_limit_bytes)
    with mock.patch.object(F, "_flash_attention", capture):
      F.flash_attention(x, x, x, causal=True, sm_scale=c.head_dim ** -0.5)
    return picked

  def build(self, trunc, chip: str = "v6e"):
    (heads,) = trunc
    import jax
    import jax.numpy as jnp
    F = kernel_module("flash_attention.kernel")
    chosen = self.config_for(chip)
    blocks = F.BlockSizes(**{k: chosen[k] for k in ("block_q", "block_k_major", "block_k",
                                                    "block_b")})
    c = self.case

    def fn(q, k, v):
      return F.flash_attention(q, k, v, causal=True, sm_scale=c.head_dim ** -0.5,
                               block_sizes=blocks, vmem_limit_bytes=chosen["vmem_limit_bytes"])
    return fn, [jax.ShapeDtypeStruct(self._shape(heads), jnp.bfloat16)] * 3

  def extrapolate(self, cycles: dict) -> float:
    (h1, h2) = FLASH_HEADS
    c1, c2 = cycles[json.dumps([h1])], cycles[json.dumps([h2])]
    return c1 + (c2 - c1) / (h2 - h1) * (self.case.q_heads - h1)

  def hbm_bytes(self) -> int:
    """Replay of one (batch, head)'s grid (q row i, kv column j; the kv index is j on or
    below the diagonal, else 0, its below_or_on_diag), times batch x heads (each restarts),
    plus the k / v repeat."""
    c = self.case
    bq, bk = self.get("block_q"), self.get("block_k_major")
    nq, nk = -(-c.seq // bq), c.seq // bk
    below = lambda i, j: (i + 1) * bq - 1 > j * bk
    kv = lambda i, j: j if below(i, j) else 0
    steps = ((i, j) for i in range(nq) for j in range(nk))
    per_head = visible.replay(steps, [
        ("q", lambda i, j: i, bq * c.head_dim * 2), ("k", kv, bk * c.head_dim * 2),
        ("v", kv, bk * c.head_dim * 2), ("o", lambda i, j: i, bq * c.head_dim * 2)])
    repeat = 2 * c.batch * (c.kv_heads + c.q_heads) * c.seq * c.head_dim * 2
    return c.batch * c.q_heads * per_head + repeat

  def hand(self, chip) -> dict:
    c = self.case
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=max(c.flops() / chip.bf16_flops_per_s * 1e6, hbm_us),
                hand_count="causal flops at bf16 peak vs replayed bytes at HBM bandwidth")


@dataclasses.dataclass(frozen=True)
class RpaV3Spec(TpuInferenceSpec):
  """A decode batch as RPA v3 sees it (a PagedDecode case, or a PagedBatch with no prefill
  chunks): `batch` sequences of one query token and `context` cached tokens (distribution =
  (batch, batch, batch): all decode; its mixed kernel runs over an empty range). Its kernel
  has grid (1,) and loops over the sequences (pl.loop between SMEM values of `distribution`)
  and each sequence's kv blocks (up to cdiv(kv_lens[s], bkv_sz)), which the estimator reads
  as 0; here those reads are constants of the batch ("const": distribution -> batch, kv_lens
  -> context); cu_q_lens[i] and page-table reads yield max(value, i) (the batch's values: one
  token a sequence, pages in order). Its SMEM state carried between iterations (semaphore /
  buffer ids) is left alone (read as 0 by the estimator).

  fp8 cache: its per-tensor k_scale / v_scale (1.0; it has no per-head scale). The plain
  compile succeeds; libtpu's static estimator aborts on the kernel (docs/performance.md,
  tpu-inference: what was tried), so its rows are error rows."""

  case: object
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-rpa-v3:{self.case.name}"

  @property
  def batch(self) -> int:
    return getattr(self.case, "batch", None) or self.case.decode

  @property
  def kv_dtype(self) -> str:
    return self.case.kv_dtype

  @property
  def implementation(self) -> str:
    return (f"tpu-inference ragged_paged_attention v3 (tpu-inference {VERSION}, {STACK}, its "
            f"decode block sizes, static-length variant)")

  @property
  def truncations(self):
    """The case itself up to two kv blocks a sequence, else contexts of one and two blocks
    (the estimator's memory grows with the loop iterations it walks)."""
    bkv = self.get("d_block_sizes")[1]
    if self.kv_blocks() <= 2:
      return ([self.case.context],)
    return ([bkv], [2 * bkv])

  @property
  def method(self) -> str:
    how = "static estimate at the full batch (static-length variant: SMEM loop bounds as constants)"
    if self.chosen and len(self.truncations) == 2:
      how += (f", rated at contexts {self.truncations[0][0]} and {self.truncations[1][0]} (one "
              f"and two kv blocks) and extrapolated linearly in kv blocks to {self.case.context}")
    return how

  @property
  def note(self) -> str:
    scale = (f" {self.kv_dtype} cache with its per-tensor k_scale / v_scale (1.0)."
             if self.kv_dtype != "bfloat16" else "")
    return ("Static-length variant (see RpaV3Spec). update_kv_cache=False: it attends to the "
            "cached tokens without writing this step's K/V (its fused cache write, as served, "
            "adds 2*B*Hkv*D*2 bytes). K/V in its fused [pages, page, 2*Hkv/packing, packing, "
            "D] layout. Block sizes: ragged_paged_attention's decode default "
            "(get_default_block_sizes; its 4,463-line tuned table is only read by the hd64 "
            "variant in 0.32.0, and vLLM passes none unless RPA_V3_DECODE_BLOCK_SIZES is set); "
            "vmem_limit_bytes its default (the chip's VMEM capacity)." + scale)

  def choose(self, chip: str) -> dict:
    import jax.numpy as jnp
    K = kernel_module("ragged_paged_attention.v3.kernel")
    c = self.case
    sizes = K.get_default_block_sizes(jnp.bfloat16, jnp.dtype(self.kv_dtype), c.q_heads,
                                      c.kv_heads, c.head_dim, c.page_size, self.batch,
                                      self.batch, c.context // c.page_size,
                                      case=K.RpaCase.DECODE)
    return dict(d_block_sizes=[sizes[k] for k in ("bq_sz", "bkv_sz", "bq_csz", "bkv_csz")],
                page_size=c.page_size)

  def validate_shapes(self) -> None:
    c = self.case
    if c.context % c.page_size:
      raise ValueError("the static kv lengths assume whole pages")
    if getattr(c, "prefill", 0) or getattr(c, "sliding_window", None) is not None:
      raise ValueError("decode batches without a window only")

  def kv_blocks(self, context: int | None = None) -> int:
    c = self.case
    context = c.context if context is None else context
    return -(-context // self.get("d_block_sizes")[1])

  def build(self, trunc, chip: str = "v6e"):
    (context,) = trunc
    import jax
    import jax.numpy as jnp
    import numpy as np
    self.validate_shapes()
    K = kernel_module("ragged_paged_attention.v3.kernel")
    chosen = self.config_for(chip)
    c, batch = self.case, self.batch
    pages_per_seq = context // c.page_size
    # Loop bounds (kv_lens, distribution) as constants; cu_q_lens as max(value, i): a constant
    # would make the never-taken prefetch of sequence `batch` a static out-of-bounds slice.
    forms = (("const", lambda s: np.int32(context)), lambda i: i, lambda i: i,
             ("const", lambda i: np.int32(batch)), None, None, None)
    kv_dtype = jnp.dtype(self.kv_dtype)
    kv_cache_shape = K.get_kv_cache_shape(batch * pages_per_seq, c.page_size, c.kv_heads,
                                          c.head_dim, kv_dtype)
    scales = {} if self.kv_dtype == "bfloat16" else dict(k_scale=1.0, v_scale=1.0)

    def fn(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution):
      with visible.visible_prefetch(K, forms):
        return K.ragged_paged_attention(
            q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
            sm_scale=c.head_dim ** -0.5, update_kv_cache=False,
            d_block_sizes=tuple(chosen["d_block_sizes"]), **scales)
    S = jax.ShapeDtypeStruct
    return fn, [S((batch, c.q_heads, c.head_dim), jnp.bfloat16),
                S((batch, c.kv_heads, c.head_dim), kv_dtype),
                S((batch, c.kv_heads, c.head_dim), kv_dtype),
                S(kv_cache_shape, kv_dtype), S((batch,), jnp.int32),
                S((batch * pages_per_seq,), jnp.int32), S((batch + 1,), jnp.int32),
                S((3,), jnp.int32)]

  def extrapolate(self, cycles: dict) -> float:
    points = [(self.kv_blocks(t[0]), cycles[json.dumps(t)]) for t in self.truncations]
    if len(points) == 1:
      return points[0][1]
    (b0, c0), (b1, c1) = points
    return c1 + (c1 - c0) / (b1 - b0) * (self.kv_blocks() - b1)

  def hbm_bytes(self) -> int:
    """Each sequence's K/V pages once (whole kv blocks); q read and o written once."""
    c = self.case
    kv = 2 * self.batch * c.kv_heads * self.kv_blocks() * self.get("d_block_sizes")[1] \
        * c.head_dim * ITEMSIZE[self.kv_dtype]
    return kv + 2 * self.batch * c.q_heads * c.head_dim * 2

  def hand(self, chip) -> dict:
    return dict(hand_us=self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6,
                hand_count="k/v pages once at HBM bandwidth")
