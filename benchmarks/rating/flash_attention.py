"""Static estimate of flash-attention-tpu's forward at an attention case: causal
(cases/headline.py's Attention, GQA) or non-causal (cases/diffusion.py's JointAttention,
Diffusers' shapes, MHA).

Why a proxy. The kernel views q as [B, Hkv, G, S, D] and holds the G query heads of a
KV head in one (G, block_q, D) block, so each K/V block is loaded once per group.
libtpu's estimator rates any kernel with such a 3-D block at 0 cycles (a probe kernel
confirmed it: 2-D blocks are rated, a (8, 16, 128) block gives 0; the GQA program here
gives 0 too). So the kernel is rated on its MHA program (G = 1: 2-D blocks) at the
tiling the GQA case picks. Per query head the two do the same work: the same q rows,
the same (block_q x block_k) logit tiles, the same online softmax. The MHA program
loads K/V once per query head rather than once per group, so its cycles (which
include DMA-wait stalls) bound the GQA kernel's from above. HBM bytes are counted for
the GQA kernel itself (below), never for the proxy.

Heads are the outermost grid axes and identical, so the cycles are rated at 1 and 2
heads and extrapolated linearly to B * Hq (not from 1: a lone head can rate differently
from each further one, up to 1.55x on v5e for jax's kernel). Long sequences make the estimator slow
(it unrolls every grid step: one head at S=32768 took 171 s and 7 GB), so a case
longer than `MAX_RATED_SEQ` is rated at two shorter causal lengths with the same
tiling and fitted as  cycles per head = a * (q blocks) + b * (interior tiles),  where
an interior tile is a visited (q block, kv block) pair the causal mask does not cross
(it runs the unmasked body) and the per-q-block term carries the masked diagonal tiles
and the block's prologue / epilogue. Checked on v6e at block 1024 x 512: fitted from
S=4096 and 8192, one head, it gives 2,364,572 cycles at S=32768; the direct estimate
is 2,353,286 (0.5 % apart). Again at 1024 x 1024 with the diagonal tiles run in strips
(the headline row's fit): 1,775,760 fitted per head, 1,768,260 direct (0.4 % apart).

HBM bytes, replaying the grid: every q block is read once and its output (and f32 lse)
written once per group; q block i visits kv blocks [0, hi_i), hi_i = ceil((i + 1) *
block_q / block_k), and a K / V block is fetched whenever the kv index changes between
consecutive steps (`kv_schedule`, `kv_block_fetches`: the folded causal grid, or a row per
q block whose skipped steps wait at block 0).

Non-causal cases (`case.causal` False) use the same code: every q block visits every kv
block (hi_i = number of kv blocks), the kernel's own tiling for non-causal attention, and
the long-sequence fit in q blocks and interior tiles, where an interior tile is now any
tile the key-tail mask does not cross. A sequence that is not a multiple of the blocks
goes into the kernels unpadded (`flash_attention`): the last q and kv blocks are partial,
their tails computed as whole blocks and masked in the kernel (the last kv block runs the
masked body); no XLA copy surrounds the kernel. The bytes count whole blocks (an upper
bound for the partial last ones); the roofline counts the real S only, so the computed
tails show in the efficiency. Long ragged cases are rated at shorter lengths with the
same tail (same partial, masked last blocks).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from tpu_kernels import aot, flash_attention as F

from benchmarks.cases.diffusion import JointAttention
from benchmarks.cases.headline import Attention

RATES = (Attention, JointAttention)   # the case kinds rated here (rating/ours.py)
S = jax.ShapeDtypeStruct
MAX_RATED_SEQ = 8192
# one head alone can rate differently from the next (peers/jax_ops/attention.py)
RATED_HEADS = (2, 4)


def tiling(case, chip: str) -> F.Tiling:
  return F.attention_tiling(case.seq, case.seq, case.head_dim,
                            group=case.q_heads // case.kv_heads,
                            dtype=jnp.dtype(case.dtype), chip=chip, causal=case.causal)


def visited_tiles(seq: int, block_q: int, block_k: int, causal: bool = True) -> list[int]:
  """hi_i per q block: the kv blocks a q block visits (causal: no offset, no window;
  non-causal: all of them)."""
  num_q = -(-seq // block_q)
  num_k = -(-seq // block_k)
  if not causal:
    return [num_k] * num_q
  return [min(num_k, -(-min((i + 1) * block_q, seq) // block_k)) for i in range(num_q)]


def kv_schedule(seq: int, block_q: int, block_k: int, causal: bool = True) -> list[int]:
  """The kv block index of every forward grid step of one (batch row, KV head), causal
  self-attention, as the kernel's index maps name it. Folded grid (the kernel's
  `_fold_causal`): row i runs q block i's kv blocks, then q block nq - 1 - i's.
  Otherwise a row per q block over every kv step: blocks 0 .. hi_i - 1, then, on the
  skipped steps, block 0 (where the next q block starts; `_fetch`)."""
  num_q, num_k = -(-seq // block_q), -(-seq // block_k)
  hi = visited_tiles(seq, block_q, block_k, causal)
  if F._fold_causal(causal, None, 0, seq, seq, block_q, block_k):
    return [j for i in range(num_q // 2) for q in (i, num_q - 1 - i) for j in range(hi[q])]
  return [step if step < hi[i] else 0 for i in range(num_q) for step in range(num_k)]


def kv_block_fetches(seq: int, block_q: int, block_k: int, causal: bool = True) -> int:
  """K (or V) block fetches of one (batch row, KV head): how often the kv block index
  changes between consecutive grid steps (an unchanged index issues no DMA)."""
  schedule = kv_schedule(seq, block_q, block_k, causal)
  return sum(j != last for j, last in zip(schedule, [None] + schedule[:-1]))


def hbm_bytes(case, t: F.Tiling) -> int:
  item = jnp.dtype(case.dtype).itemsize
  q_len_p = -(-case.seq // t.block_q) * t.block_q
  q_out = 2 * case.batch * case.q_heads * q_len_p * case.head_dim * item
  lse = case.batch * case.q_heads * q_len_p * 4
  kv_blocks = kv_block_fetches(case.seq, t.block_q, t.block_k, case.causal)
  kv = 2 * case.batch * case.kv_heads * kv_blocks * t.block_k * case.head_dim * item
  return q_out + lse + kv


def mha_program(seq: int, heads: int, case, t: F.Tiling, chip: str):
  """(fn, specs): the forward (causal as the case) of B=1, `heads` MHA heads at the case's
  tiling."""
  dtype = jnp.dtype(case.dtype)
  spec = S((1, heads, seq, case.head_dim), dtype)
  fn = functools.partial(F.flash_attention, causal=case.causal, chip=chip, block_q=t.block_q,
                         block_k=t.block_k, vmem_limit_bytes=t.vmem_limit_bytes)
  return fn, [spec, spec, spec]


def _cycles(seq: int, heads: int, case, t, chip: str) -> int:
  fn, specs = mha_program(seq, heads, case, t, chip)
  report = aot.compile_for_chip(fn, specs, chip)
  if not report.ok:
    raise RuntimeError(f"MHA proxy S={seq} H={heads} on {chip}: {report.error}")
  if not report.estimated_cycles:
    raise RuntimeError(f"MHA proxy S={seq} H={heads} on {chip}: the estimator gave no cycles")
  return report.estimated_cycles


def interior_tiles(seq: int, block_q: int, block_k: int, causal: bool = True) -> int:
  """Visited (q block, kv block) pairs no mask crosses: causal, wholly below the diagonal
  (a block multiple S assumed); non-causal, every pair but those of the partial last kv
  block (its tail keys are masked)."""
  if not causal:
    num_q, num_k = -(-seq // block_q), -(-seq // block_k)
    return num_q * (num_k - (seq % block_k != 0))
  return sum(min(-(-seq // block_k), (i * block_q + 1) // block_k)
             for i in range(-(-seq // block_q)))


def estimate(case, chip: str) -> dict:
  """Partial row: estimated_cycles (the whole forward, all heads), hbm_bytes, how."""
  t = tiling(case, chip)
  total_heads = case.batch * case.q_heads
  # Long cases: two shorter lengths with the case's tail (the same partial, masked last
  # blocks; 0 for block multiples). Non-causal ones at half the lengths: their grid
  # has every step of each q row (4x the causal folded grid's steps at 1024 x 1024; at
  # S=8184, 512 x 512, 4 heads on v5e the rating took over 900 s on this shared machine),
  # and every q row does the same work, so the per-q-block / per-tile fit is not stretched.
  tail = -case.seq % max(t.block_q, t.block_k)
  longest = MAX_RATED_SEQ if case.causal else MAX_RATED_SEQ // 2
  seqs = ((case.seq,) if case.seq <= MAX_RATED_SEQ else
          (longest // 2 - tail, longest - tail))
  fixed, per_head = {}, {}
  for seq in seqs:
    c1, c2 = (_cycles(seq, h, case, t, chip) for h in RATED_HEADS)
    per_head[seq] = (c2 - c1) / (RATED_HEADS[1] - RATED_HEADS[0])
    fixed[seq] = c1 - per_head[seq] * RATED_HEADS[0]
  gqa = case.q_heads != case.kv_heads
  how = ("static estimate of the MHA program (G=1) at the GQA tiling" if gqa else
         "static estimate of the program (non-causal, B=1)")
  how += f", rated at {RATED_HEADS} heads"
  if case.seq % t.block_q or case.seq % t.block_k:
    how += (f"; S={case.seq} not a block multiple: partial last blocks in the kernel "
            f"({case.seq % t.block_q or t.block_q} of {t.block_q} q rows, "
            f"{case.seq % t.block_k or t.block_k} of {t.block_k} keys; the tails computed, "
            "the last kv block masked), no pad or slice in XLA")
  if len(seqs) == 1:
    head_cycles = per_head[case.seq]
    method = f"{how}, extrapolated to {total_heads}"
  else:   # solve per_head(s) = a * q_blocks(s) + b * interior(s) from the two lengths
    (s1, s2), bq, bk = seqs, t.block_q, t.block_k
    n1, n2, n = (-(-s // bq) for s in (s1, s2, case.seq))
    i1, i2, i = (interior_tiles(s, bq, bk, case.causal) for s in (s1, s2, case.seq))
    det = n1 * i2 - n2 * i1
    per_block = (per_head[s1] * i2 - per_head[s2] * i1) / det
    per_tile = (n1 * per_head[s2] - n2 * per_head[s1]) / det
    head_cycles = per_block * n + per_tile * i
    method = (f"{how} at S={s1}, {s2}; fitted per q block ({per_block:,.0f}) and per "
              f"interior tile ({per_tile:,.0f}), extrapolated to S={case.seq}, "
              f"{total_heads} heads")
  row = dict(compiled=True, error=None,   # _cycles raised otherwise
             estimated_cycles=round(fixed[seqs[-1]] + head_cycles * total_heads),
             cycles_per_head=round(head_cycles),
             hbm_bytes=hbm_bytes(case, t), method=method,
             tiling=dict(block_q=t.block_q, block_k=t.block_k,
                         vmem_limit_bytes=t.vmem_limit_bytes))
  if gqa:
    row["note"] = ("GQA rated through its MHA program (the estimator gives 3-D blocks 0 "
                   "cycles); K/V bytes counted once per group")
  else:
    row["note"] = "the [B, S, H, D] <-> [B, H, S, D] transposes of a Diffusers caller"
  return row


rate = estimate   # our kernel's partial row for an attention case (rating/ours.py)
