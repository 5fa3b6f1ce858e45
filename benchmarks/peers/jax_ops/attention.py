"""jax's attention kernels as a peer: `flash_attention` and splash attention
(`make_splash_mha`), on the causal headline cases and the non-causal Diffusers shapes.

  * `flash_attention` (q / k / v [B, H, S, D]; it has no GQA, so a caller repeats k / v to
    32 heads first: the repeat's HBM traffic is in hbm_bytes, its cycles are not. The kernel
    is rated on k / v that already have every head, as ours is rated on its MHA program:
    with the repeat in the same program XLA fuses it into the kernel's operands and the
    estimate of the kernel alone drops by a fifth, while the program's total rises);
  * splash attention (`make_splash_mha`, GQA by k / v with 8 heads, causal mask). Its mask
    info (data_next, block_mask) is scalar prefetch: reads yield max(value, closed form of
    the causal mask) (checked against `process_mask`).

Big grids are rated truncated and extrapolated (see `AttentionAnchor`'s `method`); the
padded block grid of a case is attention_geometry.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from unittest import mock

from benchmarks.cases.diffusion import JointAttention
from benchmarks.estimator import visible
from benchmarks.peers.attention_geometry import AttentionCase, causal_rows
from benchmarks.peers.megablox import jax_pallas_op, jax_version


@dataclasses.dataclass(frozen=True)
class AttentionAnchor(AttentionCase):
  seq: int
  kind: str                 # "flash" or "splash"
  block: int = 128          # block_q = block_k(v) (both anchors' defaults: 128)
  joint: JointAttention | None = None   # a non-causal case instead of Attention(seq)

  @property
  def key(self) -> str:
    return f"attn:{self.kind}:{self.seq}:{self.block}{self.key_suffix}"

  @property
  def implementation(self) -> str:
    b, c = self.block, self.case
    if self.kind == "flash":
      repeat = (f", k/v repeated to {c.q_heads} heads" if c.kv_heads != c.q_heads else "")
      return (f"jax flash_attention (jax {jax_version()}, blocks q/k_major/k "
              f"{b}/{b}/{b}{repeat})")
    mha = "MHA-GQA" if c.kv_heads != c.q_heads else "MHA"
    return f"jax splash attention {mha} (jax {jax_version()}, block_q/kv {b}/{b})"

  # Truncations: [heads, blocks]: the causal self-attention of `blocks` blocks (q and kv
  # both blocks * block long, the full square grid). One head rates differently from
  # several (flash v6e at S=4096: 1 head 500,252 cycles, 2 heads 863,510, 4 heads 1,726,486 =
  # exactly twice 2 heads; v5e: 588,210 / 759,966 / 1,519,390), so heads are extrapolated
  # from 2 and 4. Small grids (<= 1024 steps a head): the case itself at 2 and 4 heads.
  # Large (S=32768): 2 heads at SHORT_BLOCKS blocks (S = 8, 16, 32 blocks), fitted as
  # a + b * n + c * n^2 in the block count n (one row per q block, n steps a row, of which
  # n (n + 1) / 2 compute), evaluated at the case's n, times 16 for 32 heads. An earlier fit
  # of the first 2, 4 and 8 q-block rows against the full kv length rated splash at half
  # its cycles: the first rows' few computed tiles rate cheaper than later rows' (jax 0.12
  # splash, blocks 512, S=16384, 2 heads, v6e: 1,207,602 fitted vs 1,626,135 direct).
  SHORT_BLOCKS = (8, 16, 32)

  @property
  def small(self) -> bool:
    return self.nq * self.nq <= 1024

  @property
  def truncations(self):
    if self.small:
      return ([2, self.nq], [4, self.nq])
    return tuple([2, n] for n in self.SHORT_BLOCKS)

  @property
  def method(self) -> str:
    heads = self.heads_text()
    if self.small:
      return ("static estimate at 2 and 4 heads (all q blocks), extrapolated linearly to "
              f"{heads}")
    lengths = "/".join(str(n * self.block) for n in self.SHORT_BLOCKS)
    grid = "causal" if self.causal else "non-causal (full)"
    return (f"static estimate of 2 heads at S={lengths} (the whole {grid} grid of 8, 16 and "
            f"32 blocks), fitted as a + b*n + c*n^2 in the block count n, evaluated at "
            f"n={self.nq}, times {self.total_heads // 2} for {heads} (checked for jax 0.12 "
            "splash, blocks 512, v6e: 6,408,721 fitted vs 6,406,161 cycles rated directly at "
            "S=32768, 2 heads)")

  @property
  def note(self) -> str:
    if not self.causal:   # the Diffusers shapes: MHA, full mask
      if self.kind == "flash":
        return ("[B, H, S, D] layout (the transposes from [B, S, H, D] are not counted); "
                "causal=False: every grid step computes." + self.ragged_note)
      return ("splash MHA kernel with a full mask (FullMask); mask info (data_next, "
              "block_mask) made visible as max(value, closed form: j, 2); the kernel "
              "computes p @ v in f32 (its own choice); [H, S, D] layout (transposes not "
              "counted)." + self.ragged_note)
    if self.kind == "flash":
      return ("flash_attention has no GQA: rated on k/v with all 32 heads (a caller repeats "
              "them first; the repeat's bytes, read 8 heads + write 32, are in hbm_bytes, its "
              "cycles are not); "
              "[B, H, S, D] layout (the transposes from the headline's [B, S, H, D] are not "
              "counted); blocks above the diagonal are grid steps with the compute skipped.")
    return ("splash MHA kernel with 8 kv heads (GQA through its h // 4 index map); mask info "
            "(data_next, block_mask) made visible as max(value, causal closed form); the "
            "kernel computes p @ v in f32 (its own choice); [H, S, D] layout (transposes not "
            "counted); blocks above the diagonal are grid steps with the compute skipped.")

  def config(self) -> dict:
    b, c = self.block, self.case
    if self.kind == "flash":   # k / v repeated to every query head
      return dict(block_q=b, block_k_major=b, block_k=b, block_b=1, layout="BHSD",
                  kv_heads_in_kernel=c.q_heads)
    return dict(block_q=b, block_kv=b, block_kv_compute=b, layout="HSD",
                kv_heads_in_kernel=c.kv_heads, downcast_smem_data=True)

  # Splash's mask info for a causal mask (rows = the first `rows` q blocks, full kv), or
  # for a full mask (non-causal: every block full, data_next = j):
  def block_mask(self, i, j):
    import jax.numpy as jnp
    if not self.causal:
      return 2 if isinstance(i, int) else jnp.full(jnp.shape(i), 2, jnp.int32)
    return jnp.where(j < i, 2, jnp.where(j == i, 1, 0)) if not isinstance(i, int) else \
        (2 if j < i else 1 if j == i else 0)

  def data_next(self, i, j):
    import jax.numpy as jnp
    if not self.causal:
      return j
    return jnp.where(j <= i, j, 0) if not isinstance(i, int) else (j if j <= i else 0)

  def splash_mask(self, sq: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as M
    return (M.CausalMask if self.causal else M.FullMask)((sq, sq))

  def _splash_mask_info(self, blocks: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as M, splash_attention_mask_info as MI)
    mask = M.MultiHeadMask([self.splash_mask(blocks * self.block)])
    info, _ = MI.process_mask(mask, (self.block, self.block), shrink_grid=False)
    return info

  def validate(self) -> None:
    if self.kind != "splash":
      return
    for blocks in sorted({t[1] for t in self.truncations}):   # every grid the child builds
      self._check_mask_info(blocks)

  def _check_mask_info(self, blocks: int) -> None:
    import numpy as np
    info = self._splash_mask_info(blocks)
    i, j = np.meshgrid(np.arange(blocks), np.arange(blocks), indexing="ij")
    want_mask = np.vectorize(self.block_mask)(i, j)
    want_next = np.vectorize(self.data_next)(i, j)
    np.testing.assert_array_equal(np.asarray(info.block_mask)[0], want_mask)
    np.testing.assert_array_equal(np.asarray(info.data_next)[0], want_next)
    assert info.mask_next is None and info.partial_mask_blocks is None

  def build(self, trunc, chip: str = "v6e"):
    heads, blocks = trunc
    import jax
    import jax.numpy as jnp
    c, b = self.case, self.block
    sq = blocks * b
    S = jax.ShapeDtypeStruct
    scale = 1.0 / math.sqrt(c.head_dim)
    if self.kind == "flash":
      F = jax_pallas_op("flash_attention")

      def fn(q, k, v):   # k / v already repeated to every head (see the module docstring)
        return F.flash_attention(q, k, v, causal=self.causal, sm_scale=scale,
                                 block_sizes=F.BlockSizes(block_q=b, block_k_major=b,
                                                          block_k=b, block_b=1))
      return fn, [S((1, heads, sq, c.head_dim), jnp.bfloat16)] * 3
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as K, splash_attention_mask as M,
        splash_attention_mask_info as MI)
    kv_heads = max(1, heads * c.kv_heads // c.q_heads)
    mask = M.MultiHeadMask([self.splash_mask(sq)] * heads)
    # The square causal grid keeps its skipped steps (above the diagonal), as the case's does.
    process = functools.partial(MI.process_mask, shrink_grid=False)
    with mock.patch.object(K.mask_info_lib, "process_mask", process):
      kernel = K.make_splash_mha(mask, head_shards=1, q_seq_shards=1,
                                 downcast_smem_data=os.environ.get("SPLASH_DOWNCAST", "1") == "1",
                                 block_sizes=K.BlockSizes(block_q=b, block_kv=b,
                                                          block_kv_compute=b))
    forms = (lambda h, i, j: self.data_next(i, j), lambda h, i, j: self.block_mask(i, j), None)

    def fn(q, k, v):
      with visible.visible_prefetch(K, forms):
        return kernel(q, k, v)   # (1/sqrt(D) folded into q by the caller: not rated)
    return fn, [S((heads, sq, c.head_dim), jnp.bfloat16),
                S((kv_heads, sq, c.head_dim), jnp.bfloat16),
                S((kv_heads, sq, c.head_dim), jnp.bfloat16)]

  def extrapolate(self, cycles: dict) -> float:
    H = self.total_heads
    if self.small:
      c2, c4 = cycles[json.dumps([2, self.nq])], cycles[json.dumps([4, self.nq])]
      return c2 + (c4 - c2) / 2 * (H - 2)
    return H / 2 * self.fit_blocks(cycles)

  def fit_blocks(self, cycles: dict) -> float:
    """Solve a + b*n + c*n^2 through the three short lengths (one head count); evaluate at
    the case's block count."""
    import numpy as np
    ns = [json.loads(t)[1] for t in cycles]
    A = np.array([[1.0, n, n * n] for n in ns])
    y = np.array([cycles[json.dumps([2, n])] for n in ns], dtype=float)
    coef = np.linalg.solve(A, y)
    return float(coef @ [1.0, self.nq, self.nq ** 2])

  def hbm_bytes_head(self, nq_rows: int | None = None) -> int:
    """Bytes one head's grid moves (replay of (q row, kv col) through the index maps)."""
    b, d = self.block, self.case.head_dim
    nq = self.nq if nq_rows is None else nq_rows
    blk = b * d * 2
    steps = ((i, j) for i in range(nq) for j in range(self.nq))
    if self.kind == "flash":   # kv index: j on or below the diagonal, else 0 (causal)
      kv = lambda i, j: j if j <= i or not self.causal else 0
    else:                      # splash: data_next
      kv = lambda i, j: self.data_next(i, j)
    return visible.replay(steps, [("q", lambda i, j: i, blk), ("k", kv, blk), ("v", kv, blk),
                          ("o", lambda i, j: i, blk)])

  def hbm_bytes(self) -> int:
    """All heads: every head starts with new q / o / kv blocks (the head is part of each
    block index, and j restarts at 0), so heads x one head's replay."""
    c = self.case
    total = self.total_heads * self.hbm_bytes_head()
    if self.kind == "flash" and c.kv_heads != c.q_heads:   # the k / v repeat: read 8 heads,
      total += 2 * (c.kv_heads + c.q_heads) * self.seq * c.head_dim * 2   # write 32, k and v
    return total + self.pad_copy_bytes()

  def hand(self, chip) -> dict:
    c = self.case
    run, steps = (causal_rows(self.nq, self.nq) if self.causal else
                  (self.nq * self.nq,) * 2)
    heads = self.total_heads
    mxu = heads * run * 4 * self.block * self.block * c.head_dim
    if self.kind == "splash":   # p @ v in f32: count it at 1/3 of bf16 MXU rate (3 passes)
      mxu_equiv = heads * run * 2 * self.block ** 2 * c.head_dim * (1 + 3)
    else:
      mxu_equiv = mxu
    hand_us = max(mxu_equiv / chip.bf16_flops_per_s,
                  self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6
    blocks = "diagonal-or-below" if self.causal else "(all)"
    return dict(hand_mxu_flops=mxu, hand_us=hand_us,
                hand_count=f"{heads} heads x {run} {blocks} {self.block}^2 blocks x "
                           f"4*{self.block}^2*{c.head_dim} flops at bf16 peak"
                           + (" (p@v in f32 counted as 3 bf16 passes)"
                              if self.kind == "splash" else "")
                           + f"; {steps} grid steps per head")
