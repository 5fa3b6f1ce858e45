"""Flash attention for TPU in Pallas, forward and backward: GQA, causal, sliding window,
soft-cap, segment ids, sinks, chunked-prefill offsets.

Math. For batch b, query head h (KV head h // G, G = Hq / Hkv), query row i at
position p_i = q_offset + i and key j at position j:

    s[i, j] = sm_scale * q[i] . k[j]                (f32; sm_scale = 1/sqrt(D) by default)
    s[i, j] = soft_cap * tanh(s[i, j] / soft_cap)   if soft_cap
    visible(i, j) = (not causal or j <= p_i)
                    and (sliding_window is None or p_i - j < sliding_window)
                    and (segment_ids is None or q_seg[i] == kv_seg[j])
    lse[i] = log(exp(sinks[h]) + sum_{visible j} exp(s[i, j]))   (no sink term without sinks)
    out[i] = sum_{visible j} exp(s[i, j] - lse[i]) v[j]

A row with no visible key gives out = 0 and lse = -inf (lse = sinks[h] with sinks),
and passes no gradient: never NaN. The sliding window follows Transformers' masks:
a window of w shows the query's own position and the w - 1 before it.

Backward (first order; lse is differentiable too, with cotangent g_lse):

    di[i]  = sum_d dout[i, d] * out[i, d] - g_lse[i]
    p      = exp(s - lse)              (recomputed per block from the saved lse)
    dv[j]  = sum_{h in group, i} p[i, j] dout[i]
    ds     = p * (dout . v[j] - di[i]) * sech^2(s_raw / soft_cap)   (last factor with soft_cap;
             sech^2 as u (1 + |tanh x|)^2, u = exp(-2|x|), never 1 - tanh^2, which cancels)
    dq[i]  = sm_scale * sum_j ds[i, j] k[j]
    dk[j]  = sm_scale * sum_{h in group, i} ds[i, j] q[i]
    dsinks[h] = -sum_{b, i} exp(sinks[h] - lse[i]) * di[i]

Layout. q is viewed as [B, Hkv, G, Sq, D] (a free reshape), so one block holds the
same rows of all G query heads of a KV head: every K/V block is loaded once per group,
and the kernels loop over the G heads inside. Three kernels:

  forward  grid (B, Hkv, q blocks, kv steps): online softmax over the kv steps, with
           f32 running max / sum / accumulator in VMEM; writes out and lse.
  dq       grid (B, Hkv, q blocks, kv steps): dq accumulated over the kv steps.
  dkv      grid (B, Hkv, kv blocks, q steps): dk, dv accumulated over the q steps and
           over the G heads of the group (no XLA reduction over heads).

Layouts. The forward keeps query rows on sublanes (s = q k^T, (rows, keys) tiles). dkv
works transposed, keys on sublanes and query rows on lanes (s^T = k q^T), so that lse
and di are used as the lane rows they are stored as. dq does too from block_q = 1024
(`_dq_transposed`): it accumulates dq^T = k^T ds^T, which gives the MXU ds^T as its
weights instead of the 128-wide k, and transposes once per q block; libtpu's estimate
rates that 17.5% cheaper on v6e at 1024 x 1024 (S=4096, D=128) but 10% dearer at
512 x 512. (The forward transposed the same way rated 3% faster at 1024 x 1024 and 10%
slower at 512 x 512 on v6e, and stays as it is.)

Block skipping. Causal masking and the sliding window bound, for each q block, the kv
blocks it can see: [lo, hi), computed from q_offset (scalar-prefetched, so it may be a
traced value) inside the index maps. Step t of the kv axis visits block lo + t; steps
past hi - 1 name the block the next q block starts with, so Pallas fetches it once,
behind this q block's last computed step, and the kernel skips their compute. With a
window the kv axis has only as many steps as a q block's band can touch
(ceil((block_q + w - 1) / block_k) + 1) when the window is causal, so the grid itself
shrinks with the window. The dkv kernel does the same with the roles swapped.

Folded causal forward. Skipped steps still cost pipeline overhead (about 600 cycles
each in libtpu's estimate), and a causal grid skips almost half its steps. For causal
self-attention with a static zero offset, no window, no partial block, block_q a multiple of
block_k and an even number of q blocks, the forward's grid row i runs q block i and
then q block nq - 1 - i: r (i + 1) + r (nq - i) = r (nq + 1) kv steps per row
(r = block_q / block_k), exactly one step per visited tile (`_fold_causal`,
`_folded`). The output block changes mid-row; Pallas writes each back when its index
changes. dq uses the same rows; dkv pairs kv blocks j and nk - 1 - j, which the q
blocks see nq - floor(j / r) and nq - floor((nk - 1 - j) / r) times: nq + 1 together
(`_folded_dkv`). In libtpu's estimate (v6e, S=4096, 2 heads, 1024 x 1024 blocks) the
forward, dkv and dq kernels take 21%, 26% and 24% fewer cycles than on the
rectangular grids.
Blocks that the causal / window mask or a partial last block (Tails, below) crosses run
a masked copy of the body; the interior blocks run it without iotas, compares or selects. Segment ids mask
inside every block and do not skip any.

Diagonal tiles. On folded grids with square blocks (no segment ids), the only masked
tiles are the causal diagonal ones, where the q and kv blocks start at the same
position. Such a tile runs in strips of 512 (`_diagonal_strips`): in the forward and
dq, query rows [512 r, 512 (r + 1)) against keys [0, 512 (r + 1)) only; in dkv, keys
[512 r, 512 (r + 1)) against query rows [512 r, block). The squares above the diagonal
are never computed (1/4 of the tile's work at 1024 x 1024). In libtpu's estimate
(S=4096, D=128, 1024 x 1024 blocks) that takes 9.8% (v6e) and 12% (v5e) off the
forward, and 13% off dq + dkv on v6e (v5e's estimator aborts on the backward either way).

Tails. q, k and v go into the kernels as they are: the grids have cdiv(S, block) blocks
per axis and the last ones are partial. Pallas reads a partial block's tail from past
the array's end (whatever VMEM holds there: possibly NaN or inf; interpret mode fills it
with NaN) and drops its writes there, so no out, lse, dq, dk or dv row past S reaches
HBM. The kernels keep the tails out of the real results (`_in_bounds`, `_visible`):
tail keys get -inf logits and their k / v rows are zeroed by a select before a matmul
(forward: v; dq: k and v), since a zero weight does not hide a NaN (0 * NaN = NaN); in
dkv the tail query rows' q, dout, lse and di are zeroed, so they add exactly 0 to dk and
dv. Query rows are independent in the forward and dq, whose tail rows are computed and
dropped. Only these blocks run the masked body. Before, Sq and Skv were padded in XLA to
whole blocks and the output sliced back: 57-70% on top of the kernel in libtpu's estimate
(probe: S=2040, 512 x 512 blocks); dropping them took SD3.5's 4429 tokens from 7,502 to
4,544 µs on v5e (docs/diffusers.md). What is still
padded: the [B, S] segment ids and lse / di ([B, Hkv, G, S] f32), small rows of lanes,
to whole blocks (a block of lanes that is not a multiple of 128, e.g. one block of 336
rows over 333, must tile its array).
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
from . import tuning_tables
from . import vmem

FLOAT_DTYPES = common.FLOAT_DTYPES
# The pallas_call names, as they appear in compiled HLO.
FORWARD_KERNEL = "flash_attention_fwd"
DQ_KERNEL = "flash_attention_dq"
DKV_KERNEL = "flash_attention_dkv"

_MASK_VALUE = common.MASK_VALUE
_BLOCK_CANDIDATES = (1024, 512, 256, 128)
# Strip of a causal diagonal tile (_diagonal_strips). In libtpu's forward estimate
# (S=4096, D=128, 1024 x 1024 blocks) strips of 512 take 9.8% (v6e) / 12% (v5e) off the
# forward; strips of 256 4.4% / 12%, of 128 a loss on v6e (smaller matmuls).
_DIAGONAL_ROWS = 512
_MAX_SINGLE_BLOCK = 512   # sequences up to this length are one block (padded to sublanes)
_LANES = common.LANES
_NT = common.NT
_NN = common.NN
_TN = common.TN


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How one attention call is cut up, and the VMEM its largest kernel plans for."""

  block_q: int
  block_k: int
  vmem_limit_bytes: int
  vmem_plan_bytes: int


def _seq_block_candidates(length: int, sublanes: int, fixed: int | None) -> list[int]:
  """Block sizes along a sequence axis, largest first. One block (the length rounded up
  to whole sublanes) for short sequences; otherwise multiples of 128 (lse, segment ids
  and the kv mask put the sequence on lanes) that pad the last block by at most 1/8."""
  single = vmem.round_up(max(length, 1), sublanes)
  if fixed is not None:
    if fixed >= single:
      return [single]
    if fixed % 128:
      raise ValueError(f"a block of {fixed} over a sequence of {length} must be a multiple "
                       f"of 128 (or cover the whole sequence)")
    return [fixed]
  if single <= _MAX_SINGLE_BLOCK:
    return [single]
  cands = [b for b in _BLOCK_CANDIDATES
           if b <= single and vmem.round_up(length, b) - length <= length // 8]
  return cands or [128]


def _plan_bytes(block_q, block_k, head_dim, group, itemsize):
  """VMEM of the hungriest kernel (dkv): double-buffered q, dout (G rows each), k, v,
  dk, dv blocks, lse / di rows, the f32 accumulators and the f32 (block_k, block_q)
  temporaries of one head (s, p, dp, ds); segment-id rows when present (8 sublanes each)."""
  d = vmem.lane_padded(head_dim)
  q_rows = group * block_q
  total = 2 * 2 * q_rows * d * itemsize             # q, dout
  total += 2 * 2 * block_k * d * itemsize           # k, v
  total += 2 * 2 * block_k * d * itemsize           # dk, dv out blocks
  total += 2 * 2 * vmem.round_up(group, 8) * vmem.lane_padded(block_q) * 4   # lse, di
  total += 2 * block_k * d * 4                      # dk, dv accumulators
  total += 4 * block_k * vmem.lane_padded(block_q) * 4
  total += 2 * 8 * (vmem.lane_padded(block_q) + vmem.lane_padded(block_k)) * 4   # segment ids
  # The forward and dq kernels also hold f32 accumulators for all G heads' rows (dq's
  # transposed one, (G, D, block_q), pads block_q to lanes), and m, l.
  acc = max(q_rows * d, group * vmem.round_up(head_dim, 8) * vmem.lane_padded(block_q))
  fwd = 2 * 2 * q_rows * d * itemsize + 2 * 2 * block_k * d * itemsize
  fwd += acc * 4 + 2 * q_rows * 128 * 4 + 3 * block_q * vmem.lane_padded(block_k) * 4
  return max(total, fwd)


@dataclasses.dataclass(frozen=True, order=True)
class TuningKey:
  """A bucket of the tuning table (tuned/flash_attention.<chip>.json)."""

  chip: str
  dtype: str
  head_dim: int       # D rounded up to 64, 128 or 256
  group: int          # G rounded up to a power of two, 1 to 16
  seq: int            # Sq = Skv rounded up to a power of two, 1024 to 65536


TUNED_VALUE_FIELDS = ("block_q", "block_k", "vmem_limit_bytes")
# {(chip, dtype, head_dim, group, seq): (block_q, block_k, vmem_limit_bytes)}
TUNED_BLOCKS = tuning_tables.load("flash_attention", TuningKey, TUNED_VALUE_FIELDS)


_HEAD_DIM_BUCKETS = (64, 128, 256)
_GROUP_BUCKETS = (1, 2, 4, 8, 16)
_SEQ_BUCKETS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)


def tuning_key(chip: str, dtype, q_len: int, kv_len: int, head_dim: int, group: int, *,
               causal: bool, sliding_window: int | None = None) -> TuningKey | None:
  """The table key of a call, or None where the table does not apply (the heuristic
  decides): it is tuned on causal self-attention without a window (prefill), at
  sequences longer than one block."""
  if not causal or sliding_window is not None or q_len != kv_len:
    return None
  bucket = lambda x, buckets: next((b for b in buckets if x <= b), None)
  d, g = bucket(head_dim, _HEAD_DIM_BUCKETS), bucket(group, _GROUP_BUCKETS)
  seq = bucket(q_len, _SEQ_BUCKETS) if q_len > _MAX_SINGLE_BLOCK else None
  if d is None or g is None or seq is None:
    return None
  return TuningKey(chips.get_chip(chip).name, np.dtype(dtype).name, d, g, seq)


def tuned_blocks(key: TuningKey | None) -> tuple[int, int, int] | None:
  """The table's (block_q, block_k, vmem_limit_bytes) for a key, or None."""
  if key is None:
    return None
  return TUNED_BLOCKS.get(dataclasses.astuple(key))


def _tuned_tiling(entry: tuple[int, int, int] | None, q_cands, k_cands, plan, chip_: chips.Chip,
                  vmem_limit_bytes: int | None) -> Tiling | None:
  """The tuning table's entry as a Tiling, if its blocks are valid at this length and its
  plan fits the caller's limit, or else the entry's own limit; None otherwise."""
  if entry is None or entry[0] not in q_cands or entry[1] not in k_cands:
    return None
  bq, bk, tuned_limit = entry
  limit = vmem.resolve_vmem_limit(
      chip_, tuned_limit if vmem_limit_bytes is None else vmem_limit_bytes)
  if plan(bq, bk) > int(limit * vmem.BUDGET_FRACTION):
    return None
  return Tiling(bq, bk, limit, plan(bq, bk))


def attention_tiling(q_len: int, kv_len: int, head_dim: int, *, group: int, dtype,
                     chip: str = chips.DEFAULT_CHIP, block_q: int | None = None,
                     block_k: int | None = None, vmem_limit_bytes: int | None = None,
                     causal: bool = False, sliding_window: int | None = None) -> Tiling:
  """block_q / block_k for all three kernels from the chip's VMEM budget.

  Causal self-attention with no window takes the tuning table's entry when it has one
  for the shape's bucket and it is a valid block pair here (tuned/flash_attention.<chip>.json,
  from libtpu's static estimates): its blocks under its scoped-VMEM limit (which may be
  above the chip's default), or under the caller's limit if one is given and the plan
  fits it. Otherwise, among the pairs whose plan fits: the largest smaller side
  (balanced blocks: fewer grid steps and longer matmuls in both kernels' directions),
  then, for causal self-attention, a pair the forward can fold (_fold_causal: no
  skipped grid steps), then the larger block_k, then block_q."""
  chip_ = chips.get_chip(chip)
  itemsize = np.dtype(dtype).itemsize
  sub = vmem.sublane_multiple(dtype)
  q_cands = _seq_block_candidates(q_len, sub, block_q)
  k_cands = _seq_block_candidates(kv_len, sub, block_k)
  limit = vmem.resolve_vmem_limit(chip_, vmem_limit_bytes)
  budget = int(limit * vmem.BUDGET_FRACTION)
  plan = functools.partial(_plan_bytes, head_dim=head_dim, group=group, itemsize=itemsize)
  fits = [(bq, bk) for bk in k_cands for bq in q_cands if plan(bq, bk) <= budget]
  if block_q is None and block_k is None:
    tuned = _tuned_tiling(
        tuned_blocks(tuning_key(chip, dtype, q_len, kv_len, head_dim, group,
                                causal=causal, sliding_window=sliding_window)),
        q_cands, k_cands, plan, chip_, vmem_limit_bytes)
    if tuned is not None:
      return tuned
  if fits:
    def folds(c):   # causal self-attention (offset 0 assumed) on the folded grid
      return causal and _fold_causal(True, sliding_window, 0, q_len, kv_len, *c)
    bq, bk = max(fits, key=lambda c: (min(c), folds(c), c[1], c[0]))
    return Tiling(bq, bk, limit, plan(bq, bk))
  bq, bk = q_cands[-1], k_cands[-1]
  needed = plan(bq, bk)
  if vmem_limit_bytes is None and needed / vmem.BUDGET_FRACTION <= chip_.max_vmem_limit_bytes:
    limit = vmem.round_up(int(needed / vmem.BUDGET_FRACTION), vmem.MiB)
    return Tiling(bq, bk, limit, needed)
  if block_q is not None or block_k is not None or vmem_limit_bytes is not None:
    return Tiling(bq, bk, limit, needed)
  raise ValueError(f"attention with head_dim={head_dim}, {group} query heads per KV head "
                   f"needs {needed} bytes of VMEM at its smallest blocks, more than "
                   f"{chip_.name} allows")


# ----------------------------------------------------------------------------- statics


@dataclasses.dataclass(frozen=True)
class _Static:
  """Everything static about one call (hashable)."""

  causal: bool
  sm_scale: float
  sliding_window: int | None
  soft_cap: float | None
  has_segments: bool
  has_sinks: bool
  q_len: int           # real query rows; rows at or past it are the last q block's tail
  kv_len: int          # real keys; keys at or past it are the last kv block's tail
  block_q: int
  block_k: int
  vmem_limit_bytes: int
  interpret: bool
  fold: bool = False   # the forward pairs causal q blocks i and nq - 1 - i (_fold_causal)


def _div(x, block: int):
  """x // block for a traced x >= 0. A shift when block is a power of two: libtpu's static
  estimator mis-rates run-time divisions (see ../shared notes), the hardware does not care."""
  if block & (block - 1) == 0:
    return lax.shift_right_logical(x, jnp.int32(block.bit_length() - 1))
  return lax.div(x, jnp.int32(block))


def _kv_range(q_block, q_offset, st: _Static, num_kv_blocks):
  """[lo, hi): the kv blocks that q block `q_block` can see (traced int32 scalars)."""
  first = q_offset + q_block * st.block_q        # position of the block's first row
  last = first + st.block_q - 1
  lo = jnp.int32(0)
  hi = jnp.int32(num_kv_blocks)
  if st.causal:
    hi = jnp.minimum(hi, _div(last, st.block_k) + 1)
  if st.sliding_window is not None:
    lo = _div(jnp.maximum(first - st.sliding_window + 1, 0), st.block_k)
  return lo, hi


def _q_range(kv_block, q_offset, st: _Static, num_q_blocks):
  """[lo, hi): the q blocks that can see kv block `kv_block`."""
  first = kv_block * st.block_k
  last = first + st.block_k - 1
  lo = jnp.int32(0)
  hi = jnp.int32(num_q_blocks)
  if st.causal:     # rows whose position q_offset + r >= first
    lo = _div(jnp.maximum(first - q_offset, 0), st.block_q)
  if st.sliding_window is not None:   # rows whose position q_offset + r < last + window
    rows = jnp.maximum(last + st.sliding_window - q_offset, 0)
    hi = jnp.minimum(hi, _div(rows + st.block_q - 1, st.block_q))
  return lo, hi


def _num_steps(block_along, block_across, num_blocks, st: _Static):
  """Grid steps along the reduced axis: all blocks, or the band of a causal sliding
  window (without causal, a left window still shows every later key)."""
  if st.sliding_window is None or not st.causal:
    return num_blocks
  band = pl.cdiv(block_along + st.sliding_window - 1, block_across) + 1
  return min(num_blocks, band)


def _visit(lo, hi, step):
  """The block visited at `step` of [lo, hi) (clamped to the last one, so that no DMA
  is issued once the range is exhausted), and whether the step computes."""
  last = jnp.maximum(hi - 1, 0)
  return jnp.minimum(lo + step, last), lo + step < hi


def _fetch(lo, hi, step, next_lo):
  """The block an index map names at `step` of [lo, hi): the visited one, then, on the
  steps past the range, `next_lo`, the block the next grid row starts with. Its fetch
  is then issued during this row's last computed step and hidden behind it; waiting at
  the last visited block instead would leave the next row's first fetch to the short
  skipped steps (about 1% of a causal forward's estimated cycles at 512 x 512 blocks,
  v5e). Folded grids (_fold_causal) skip no step and do not need this."""
  return jnp.where(lo + step < hi, lo + step, next_lo)


def _fold_causal(causal: bool, sliding_window, q_offset, q_len: int, kv_len: int,
                 block_q: int, block_k: int) -> bool:
  """Whether the three kernels can run on folded causal grids: causal self-attention
  with no window or offset (q_offset a Python 0), no partial block, block_q a multiple of
  block_k and an even number of q blocks.

  q block i visits r (i + 1) kv blocks (r = block_q / block_k), so q blocks i and
  nq - 1 - i visit r (nq + 1) together: grid row i runs the first, then the second, and
  the grid (nq / 2 rows of r (nq + 1) steps) has exactly one step per visited tile
  (`_folded`; dkv pairs kv blocks the same way, `_folded_dkv`). The rectangular grid
  has nq rows of nq r steps, of which almost half are skipped, and libtpu's estimate
  charges a step that computes nothing about 600 cycles (v5e, 512 x 512 blocks): folding
  takes 19-26% off each kernel's estimate at S=4096 (v5e forward at 512 x 512; v6e
  forward, dq and dkv at 1024 x 1024)."""
  if not causal or sliding_window is not None or not isinstance(q_offset, (int, np.integer)):
    return False
  if int(q_offset) != 0 or q_len != kv_len or q_len % block_q or block_q % block_k:
    return False
  return (q_len // block_q) % 2 == 0


def _folded(row, step, nq: int, st: _Static):
  """(q block, kv block, first step of the q block, last step) at `step` of folded row
  `row` (see _fold_causal). Plain scalar arithmetic on grid indices: no SMEM."""
  r = st.block_q // st.block_k
  first_len = (row + 1) * r           # steps of q block `row`; then q block nq - 1 - row
  in_first = step < first_len
  q_block = jnp.where(in_first, row, nq - 1 - row)
  kv_block = jnp.where(in_first, step, step - first_len)
  starts = (step == 0) | (step == first_len)
  ends = (step == first_len - 1) | (step == (nq + 1) * r - 1)
  return q_block, kv_block, starts, ends


def _folded_dkv(row, step, nq: int, nk: int, st: _Static):
  """The dkv kernel's folded grid (same conditions as the forward's): row i runs kv block
  i over the q blocks that see it, [floor(i / r), nq), then kv block nk - 1 - i over
  its own; the two counts sum to nq + 1. -> (kv block, q block, first step of the kv
  block, last step)."""
  r = st.block_q // st.block_k
  first_len = nq - _div(row, r)      # _div, not //: jnp's // lowers through lax.sign,
  in_first = step < first_len        # which Mosaic cannot lower ahead of time on a CPU host
  kv_block = jnp.where(in_first, row, nk - 1 - row)
  q_block = jnp.where(in_first, _div(row, r) + step, _div(nk - 1 - row, r) + step - first_len)
  starts = (step == 0) | (step == first_len)
  ends = (step == first_len - 1) | (step == nq)
  return kv_block, q_block, starts, ends


def _needs_mask(q_first, k_first, st: _Static, padded_keys: bool, q_end=None):
  """Whether a (q block, kv block) pair holds any invisible pair: a traced bool, True
  (segment ids: any block may), or None (nothing is ever masked). Interior blocks skip
  the mask's iotas, compares and selects. q_end (the dkv kernel, when the last q block is
  partial): the position one past the last real query row; the block holding it is
  masked too (`_in_bounds`)."""
  if st.has_segments:
    return True
  q_last, k_last = q_first + st.block_q - 1, k_first + st.block_k - 1
  needs = None

  def either(a, b):
    return b if a is None else a | b

  if st.causal:
    needs = either(needs, k_last > q_first)
  if st.sliding_window is not None:
    needs = either(needs, q_last - k_first >= st.sliding_window)
  if padded_keys:
    needs = either(needs, k_last >= st.kv_len)
  if q_end is not None:
    needs = either(needs, q_last >= q_end)
  return needs


def _run_block(run, needs_mask, compute):
  """compute(masked) on the steps that `run`, masked only where `needs_mask`."""
  if needs_mask is None or needs_mask is True:
    pl.when(run)(lambda: compute(needs_mask is True))
    return
  pl.when(run & needs_mask)(lambda: compute(True))
  pl.when(run & jnp.logical_not(needs_mask))(lambda: compute(False))


def _visible(q_pos, k_pos, q_seg, kv_seg, st: _Static, padded_keys: bool):
  """The visibility mask of one block (None when everything is visible)."""
  mask = None

  def both(a, b):
    return b if a is None else a & b

  if st.causal:
    mask = both(mask, k_pos <= q_pos)
  if st.sliding_window is not None:
    mask = both(mask, q_pos - k_pos < st.sliding_window)
  if padded_keys:
    mask = both(mask, k_pos < st.kv_len)
  if st.has_segments:
    mask = both(mask, q_seg == kv_seg)
  return mask


def _raw_logits(st: _Static) -> bool:
  """Whether the forward runs its online softmax on unscaled logits, taking
  exp(sm_scale * (s - m)) as one exp2 of (s - m) * (sm_scale * log2 e): no multiply of each
  logit by sm_scale (3.4% / 3.8% of the forward's cycles in libtpu's estimate on v5e / v6e,
  S=4096, 1024 x 1024 blocks; exp is an exp2 after a multiply by log2 e anyway). Needs a
  positive scale (the max of the raw logits is then the max of the scaled ones) and no
  soft-cap (its tanh takes the scaled logit)."""
  return st.soft_cap is None and st.sm_scale > 0


def _triangular_diagonal(st: _Static, padded_keys: bool) -> bool:
  """Whether the kernels' masked tiles are exactly the causal diagonal tiles
  (q_first == k_first, static): folded grids (no window, no offset), square blocks, no
  segment ids or partial kv block. Those tiles then skip their upper triangle
  (_diagonal_strips)."""
  return st.fold and st.block_q == st.block_k and not st.has_segments and not padded_keys


def _diagonal_strips(block: int):
  """The causal diagonal tile of a `block` x `block` tile pair (q and kv blocks starting
  at the same position) cut into n strips of c rows (_DIAGONAL_ROWS when it divides the
  block, else one strip): yields static slices (rows, keys), strip r's query rows
  [r c, (r + 1) c) and the keys [0, (r + 1) c) they can see (the visible pairs are
  `_causal_mask(rows, keys)`; only the last c keys hold invisible ones). Computing strips
  skips the n (n - 1) / 2 strip squares above the diagonal: (n + 1) / 2n of the tile's
  work. The dkv kernel runs key strips: keys [r c, (r + 1) c), seen by rows [r c, block)."""
  c = _DIAGONAL_ROWS if block % _DIAGONAL_ROWS == 0 else block
  for r in range(block // c):
    yield slice(r * c, (r + 1) * c), slice(0, (r + 1) * c)


def _positions(q_first, k_first, num_rows: int, num_keys: int, keys_on_sublanes: bool):
  """(query position, key position) of every element of a tile of num_rows query rows x
  num_keys keys starting at q_first / k_first: (rows, keys) arrays, or (keys, rows) with
  keys on sublanes."""
  if keys_on_sublanes:
    shape, q_axis = (num_keys, num_rows), 1
  else:
    shape, q_axis = (num_rows, num_keys), 0
  return (q_first + lax.broadcasted_iota(jnp.int32, shape, q_axis),
          k_first + lax.broadcasted_iota(jnp.int32, shape, 1 - q_axis))


def _in_bounds(x, first, length: int, axis: int = 0):
  """x, a block read from VMEM whose entry i along `axis` is entry first + i of an
  array of `length`, with the entries at or past `length` set to 0. Those are the tail
  of a partial last block: Pallas reads them from past the array's end, and they hold
  whatever VMEM held, possibly NaN or inf. A select, not a multiply by the mask, since
  0 * NaN = NaN. The tail keys' logits are masked as well (`_visible`); this keeps their
  values (and, in the backward, their keys, and the tail query rows' q, dout, lse and di)
  out of the matmuls, where a zero weight does not hide a NaN."""
  index = first + lax.broadcasted_iota(jnp.int32, x.shape, axis)
  return jnp.where(index < length, x, jnp.zeros_like(x))


def _block_mask(q_first, k_first, seg_refs, st: _Static, padded_keys: bool,
                keys_on_sublanes: bool):
  """The visibility mask of a whole (q block, kv block) tile; seg_refs are the segment-id
  blocks (q (1, block_q), kv (1, block_k)) when st.has_segments."""
  q_pos, k_pos = _positions(q_first, k_first, st.block_q, st.block_k, keys_on_sublanes)
  q_seg = kv_seg = None
  if st.has_segments:
    q_seg_ref, kv_seg_ref = seg_refs
    if keys_on_sublanes:
      q_seg, kv_seg = q_seg_ref[...], kv_seg_ref[0][:, None]
    else:
      q_seg, kv_seg = q_seg_ref[0][:, None], kv_seg_ref[...]
  return _visible(q_pos, k_pos, q_seg, kv_seg, st, padded_keys)


def _causal_mask(rows: slice, keys: slice, st: _Static, keys_on_sublanes: bool = False):
  """The mask of a causal diagonal tile's strip (`_diagonal_strips`): query rows x keys,
  positions relative to the tile's start (on such tiles it is key <= query)."""
  q_pos, k_pos = _positions(rows.start, keys.start, rows.stop - rows.start,
                            keys.stop - keys.start, keys_on_sublanes)
  return _visible(q_pos, k_pos, None, None, st, padded_keys=False)


def _logits(s, st: _Static):
  """Scaled (and soft-capped) f32 logits, for the forward."""
  s = s * st.sm_scale
  if st.soft_cap is None:
    return s
  return st.soft_cap * jnp.tanh(s * (1.0 / st.soft_cap))


def _logits_and_cap_slope(s, st: _Static):
  """The backward's logits (as `_logits`) and the soft cap's slope d(capped) / d(scaled),
  sech^2(x) with x = scaled logit / soft_cap (None without a cap).

  With t = tanh|x| = (1 - u) / (1 + u), u = exp(-2|x|): 1 - t = u (1 + t), so
  sech^2(x) = (1 - t)(1 + t) = u (1 + t)^2. The slope as 1 - tanh^2 cancels: tanh rounds
  to 1 within an ulp once |x| passes ~4, and 1 - tanh^2 keeps only the digits tanh's
  rounding left (a dq 2e-3 off at cap 5 with unscaled logits of 16-32: issue 61);
  u (1 + t)^2 has its full relative precision at every x, and needs no division: the
  first form, 4u / (1 + u)^2 (with tanh from u too), made the dq kernel 31% dearer on v5e
  in libtpu's estimate (S=4096, D=128, 1024 x 1024 blocks; this one: 1.1% over
  1 - tanh^2). On v6e the extra exp weighs more: dq +51% / +35%, dkv +26% / +17%
  (docs/performance/flash-attention.md). The logit keeps jnp.tanh, as the forward does."""
  s = s * st.sm_scale
  if st.soft_cap is None:
    return s, None
  x = s * (1.0 / st.soft_cap)
  t = jnp.tanh(x)
  w = 1.0 + jnp.abs(t)
  return st.soft_cap * t, jnp.exp(-2.0 * jnp.abs(x)) * w * w


# ----------------------------------------------------------------------------- forward


def _forward_kernel(q_offset_ref, sinks_ref, q_ref, k_ref, v_ref, *refs, st: _Static,
                    group, num_q_blocks, num_kv_blocks, padded_keys):
  seg_refs, refs = (refs[:2], refs[2:]) if st.has_segments else (None, refs)
  o_ref, lse_ref, m_ref, l_ref, acc_ref = refs
  head, row, step = pl.program_id(1), pl.program_id(2), pl.program_id(3)
  bq, bk, head_dim = st.block_q, st.block_k, acc_ref.shape[-1]
  q_offset = q_offset_ref[0]
  q_block, kv_block, run, starts, ends = _q_major_step(row, step, q_offset, num_q_blocks,
                                                       num_kv_blocks, st)
  # m_ref (the running max) and s are in raw logits when _raw_logits, else scaled ones;
  # `unit` turns them into scaled logits, exp_scaled(x) = exp(unit * x).
  raw = _raw_logits(st)
  triangular = _triangular_diagonal(st, padded_keys)
  unit = st.sm_scale if raw else 1.0
  exp_scaled = common.scaled_exp(unit)

  @pl.when(starts)
  def _init():
    for g in range(group):
      if st.has_sinks:
        m_ref[g] = jnp.full((bq, _LANES), sinks_ref[head * group + g] / unit, jnp.float32)
        l_ref[g] = jnp.ones((bq, _LANES), jnp.float32)
      else:
        m_ref[g] = jnp.full((bq, _LANES), _MASK_VALUE, jnp.float32)
        l_ref[g] = jnp.zeros((bq, _LANES), jnp.float32)
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def _update(g, rows, s, mask, v):
    """One online-softmax step of head g's query rows `rows` (a static slice) with the
    dot products s (rows, keys), their visibility `mask` (or None) and the keys' values v."""
    if not raw:
      s = _logits(s, st)
    if mask is not None:
      # -inf, not _MASK_VALUE: the running max starts at the finite _MASK_VALUE, so
      # m_new is always finite and a masked logit's p = exp(-inf - m_new) is exactly 0,
      # also in a row that has seen no key yet (with a finite fill it would be
      # exp(0) = 1). So p needs no second masking, and the mask dies before the exp:
      # kept alive across it, a 512 x 512 mask spilled and made a diagonal tile cost
      # about 2.9x an interior one in libtpu's estimate.
      s = jnp.where(mask, s, -jnp.inf)
    m_prev = m_ref[g, rows]                             # (rows, 128), lanes equal
    m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
    p = exp_scaled(s - common.lanes(m_new, s.shape[1]))
    alpha = exp_scaled(m_prev - m_new)
    l_ref[g, rows] = alpha * l_ref[g, rows] + jnp.sum(p, axis=1, keepdims=True)
    acc_ref[g, rows] = common.lanes(alpha, head_dim) * acc_ref[g, rows] + lax.dot_general(
        p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
    m_ref[g, rows] = m_new

  def _compute(masked):
    if masked and triangular:
      for rows, keys in _diagonal_strips(bq):   # query-row strips, the keys they see
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = _causal_mask(rows, keys, st)
        for g in range(group):
          s = lax.dot_general(q_ref[g, rows, :], k, _NT, preferred_element_type=jnp.float32)
          _update(g, rows, s, mask, v)
      return
    k = k_ref[...]
    v = v_ref[...]
    mask = None
    if masked:
      mask = _block_mask(q_first, kv_block * bk, seg_refs, st, padded_keys,
                         keys_on_sublanes=False)
      if padded_keys:   # the tail keys' logits are masked (a select); their v rows are not
        v = _in_bounds(v, kv_block * bk, st.kv_len)
    for g in range(group):
      s = lax.dot_general(q_ref[g], k, _NT, preferred_element_type=jnp.float32)
      _update(g, slice(None), s, mask, v)

  q_first = q_offset + q_block * bq
  _run_block(run, _needs_mask(q_first, kv_block * bk, st, padded_keys), _compute)

  @pl.when(ends)
  def _finish():
    for g in range(group):
      l = l_ref[g]
      seen = l > 0.0
      inv = jnp.where(seen, 1.0 / jnp.where(seen, l, 1.0), 0.0)
      o_ref[g] = (acc_ref[g] * common.lanes(inv, head_dim)).astype(o_ref.dtype)
      lse = jnp.where(seen, m_ref[g] * unit + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
      lse_ref[g] = lse[:, 0]


def _q_major_step(row, step, q_offset, nq: int, nk: int, st: _Static):
  """Inside the forward and dq kernels: (q block, kv block, whether the step computes,
  first step of the q block, last step) at grid (row, step) of `_q_major_grid`."""
  if st.fold:
    q_block, kv_block, starts, ends = _folded(row, step, nq, st)
    return q_block, kv_block, jnp.bool_(True), starts, ends
  lo, hi = _kv_range(row, q_offset, st, nk)
  kv_block, run = _visit(lo, hi, step)
  return row, kv_block, run, step == 0, step == pl.num_programs(3) - 1


def _q_major_grid(nq: int, nk: int, st: _Static):
  """(rows, steps, q_of, kv_of) of the forward's and dq's grid (B, Hkv, rows, steps):
  folded, nq / 2 rows of paired q blocks with one step per visited tile; else a row per
  q block whose steps past its kv range are skipped. q_of / kv_of map (row, step, *the
  scalar-prefetch refs) to the q and kv block, for the index maps."""
  if st.fold:
    def q_of(i, t, *_):
      return _folded(i, t, nq, st)[0]

    def kv_of(i, t, *_):
      return _folded(i, t, nq, st)[1]

    return nq // 2, (nq + 1) * (st.block_q // st.block_k), q_of, kv_of

  def q_of(i, t, *_):
    return i

  def kv_of(i, t, q_offset_ref, sinks_ref):
    lo, hi = _kv_range(i, q_offset_ref[0], st, nk)
    next_lo, _ = _kv_range(jnp.where(i + 1 < nq, i + 1, 0), q_offset_ref[0], st, nk)
    return _fetch(lo, hi, t, next_lo)

  return nq, _num_steps(st.block_q, st.block_k, nk, st), q_of, kv_of


def _num_blocks(st: _Static) -> tuple[int, int]:
  """(q blocks, kv blocks): whole blocks, the last one partial where the length is not a
  block multiple."""
  return pl.cdiv(st.q_len, st.block_q), pl.cdiv(st.kv_len, st.block_k)


def _forward(q5, k, v, sinks, q_seg, kv_seg, q_offset, st: _Static):
  """q5 [B, Hkv, G, Sq, D], k / v [B, Hkv, Skv, D], segment ids [B, 1, S_p] (padded to
  whole blocks) -> out [B, Hkv, G, Sq, D], lse [B, Hkv, G, Sq_p] f32 (Sq_p = whole q
  blocks: lse and di are rows of lanes, whose blocks must tile them when block_q is not a
  multiple of 128; the tail's lse is garbage, dropped by the caller)."""
  batch, num_kv_heads, group, _, head_dim = q5.shape
  bq, bk = st.block_q, st.block_k
  nq, nk = _num_blocks(st)
  rows, steps, q_of, kv_of = _q_major_grid(nq, nk, st)

  q_spec = pl.BlockSpec((None, None, group, bq, head_dim),
                        lambda b, h, i, t, *refs: (b, h, 0, q_of(i, t, *refs), 0))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim),
                         lambda b, h, i, t, *refs: (b, h, kv_of(i, t, *refs), 0))
  in_specs = [q_spec, kv_spec, kv_spec]
  operands = [q5, k, v]
  if st.has_segments:
    in_specs += [pl.BlockSpec((None, 1, bq), lambda b, h, i, t, *refs: (b, 0, q_of(i, t, *refs))),
                 pl.BlockSpec((None, 1, bk), lambda b, h, i, t, *refs: (b, 0, kv_of(i, t, *refs)))]
    operands += [q_seg, kv_seg]
  kernel = functools.partial(_forward_kernel, st=st, group=group, num_q_blocks=nq,
                             num_kv_blocks=nk, padded_keys=nk * bk != st.kv_len)
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads, rows, steps),
          in_specs=in_specs,
          out_specs=[q_spec,
                     pl.BlockSpec((None, None, group, bq),
                                  lambda b, h, i, t, *refs: (b, h, 0, q_of(i, t, *refs)))],
          scratch_shapes=[pltpu.VMEM((group, bq, _LANES), jnp.float32),
                          pltpu.VMEM((group, bq, _LANES), jnp.float32),
                          pltpu.VMEM((group, bq, head_dim), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(q5.shape, q5.dtype),
                 jax.ShapeDtypeStruct((batch, num_kv_heads, group, nq * bq), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=st.vmem_limit_bytes),
      interpret=st.interpret,
      name=FORWARD_KERNEL,
  )(q_offset, sinks, *operands)
  return out, lse


# ----------------------------------------------------------------------------- backward


def _dq_transposed(st: _Static) -> bool:
  """Whether the dq kernel works transposed (keys on sublanes, query rows on lanes) and
  accumulates dq^T = k^T ds^T, with ds^T (block_k x block_q) as the MXU's weights instead
  of the 128-wide k. In libtpu's estimate of the dq kernel that pays from block_q = 1024
  and costs below it (S=4096, D=128, causal): v6e 1024 x 1024 -17.5% (38,080 -> 31,402
  cycles; S=8192 -20%, D=64 / 256 -11% / -16%), 1024 x 512 -14%, 512 x 512 +10%; v5e
  1024 x 1024 -6% (D=64 -13%), 512 x 512 +11% (S=1024)."""
  return st.block_q >= 1024


def _dq_kernel(q_offset_ref, sinks_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs,
               st: _Static, group, num_q_blocks, num_kv_blocks, padded_keys):
  """q-major, or transposed (`_dq_transposed`): then the accumulator holds dq^T (D,
  block_q) and is transposed once per q block."""
  del sinks_ref
  seg_refs, refs = (refs[:2], refs[2:]) if st.has_segments else (None, refs)
  dq_ref, acc_ref = refs
  row, step = pl.program_id(2), pl.program_id(3)
  bq, bk = st.block_q, st.block_k
  q_offset = q_offset_ref[0]
  q_block, kv_block, run, starts, ends = _q_major_step(row, step, q_offset, num_q_blocks,
                                                       num_kv_blocks, st)
  triangular = _triangular_diagonal(st, padded_keys)
  transposed = _dq_transposed(st)

  @pl.when(starts)
  def _init():
    acc_ref[...] = jnp.zeros_like(acc_ref)

  def _accumulate(g, rows, k, v, mask):
    """dq of head g's query rows `rows` (a static slice) from the keys k, values v and
    their visibility `mask` (or None): (rows, keys) tiles, or (keys, rows) transposed."""
    q, do = q_ref[g, rows, :], do_ref[g, rows, :]
    if transposed:   # lse and di used as the lane rows they are stored as
      s = lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32)
      dp = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
      lse, di = lse_ref[pl.ds(g, 1), rows], di_ref[pl.ds(g, 1), rows]
    else:
      s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
      dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
      lse, di = lse_ref[g][rows][:, None], di_ref[g][rows][:, None]
    s, slope = _logits_and_cap_slope(s, st)
    p = jnp.exp(s - lse)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    ds = p * (dp - di)
    if slope is not None:
      ds = ds * slope
    ds = ds.astype(k.dtype)
    if transposed:
      acc_ref[g, :, rows] += lax.dot_general(k, ds, _TN, preferred_element_type=jnp.float32)
    else:
      acc_ref[g, rows] += lax.dot_general(ds, k, _NN, preferred_element_type=jnp.float32)

  def _compute(masked):
    if masked and triangular:
      for rows, keys in _diagonal_strips(bq):   # query-row strips, the keys they see
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = _causal_mask(rows, keys, st, keys_on_sublanes=transposed)
        for g in range(group):
          _accumulate(g, rows, k, v, mask)
      return
    k = k_ref[...]
    v = v_ref[...]
    mask = None
    if masked:
      mask = _block_mask(q_first, kv_block * bk, seg_refs, st, padded_keys,
                         keys_on_sublanes=transposed)
      if padded_keys:   # v feeds dp, k the dq matmul: ds = 0 there, but 0 * NaN = NaN
        k = _in_bounds(k, kv_block * bk, st.kv_len)
        v = _in_bounds(v, kv_block * bk, st.kv_len)
    for g in range(group):
      _accumulate(g, slice(None), k, v, mask)

  q_first = q_offset + q_block * bq
  _run_block(run, _needs_mask(q_first, kv_block * bk, st, padded_keys), _compute)

  @pl.when(ends)
  def _finish():
    if not transposed:
      dq_ref[...] = (acc_ref[...] * st.sm_scale).astype(dq_ref.dtype)
      return
    for g in range(group):
      dq_ref[g] = (acc_ref[g] * st.sm_scale).astype(dq_ref.dtype).T


def _dkv_kernel(q_offset_ref, sinks_ref, q_ref, k_ref, v_ref, do_ref, lse_ref, di_ref, *refs,
                st: _Static, group, num_q_blocks, num_kv_blocks, padded_keys, padded_rows):
  """Transposed (keys on sublanes, query rows on lanes; module docstring, Layouts).
  padded_rows: the last q block is partial; its tail rows' q, dout, lse and di are
  zeroed, so that they add exactly 0 to dk and dv (p dout = 0, ds = p (0 - 0) = 0)."""
  del sinks_ref
  seg_refs, refs = (refs[:2], refs[2:]) if st.has_segments else (None, refs)
  dk_ref, dv_ref, dk_acc_ref, dv_acc_ref = refs
  row, step = pl.program_id(2), pl.program_id(3)
  bq, bk = st.block_q, st.block_k
  q_offset = q_offset_ref[0]
  if st.fold:
    kv_block, q_block, starts, ends = _folded_dkv(row, step, num_q_blocks, num_kv_blocks, st)
    run = jnp.bool_(True)
  else:
    kv_block = row
    lo, hi = _q_range(kv_block, q_offset, st, num_q_blocks)
    q_block, run = _visit(lo, hi, step)
    starts, ends = step == 0, step == pl.num_programs(3) - 1

  triangular = _triangular_diagonal(st, padded_keys)

  @pl.when(starts)
  def _init():
    dk_acc_ref[...] = jnp.zeros_like(dk_acc_ref)
    dv_acc_ref[...] = jnp.zeros_like(dv_acc_ref)

  def _accumulate(g, keys, rows, k, v, mask, tail=False):
    """dk, dv of the keys `keys` (a static slice; k, v their blocks) from head g's query
    rows `rows` (a static slice), visible where `mask` (or None). tail: the q block may
    hold rows past the real ones (whole blocks only)."""
    q = q_ref[g, rows, :]
    do = do_ref[g, rows, :]
    lse = lse_ref[pl.ds(g, 1), rows]
    di = di_ref[pl.ds(g, 1), rows]
    if tail:
      q, do = (_in_bounds(x, q_block * bq, st.q_len) for x in (q, do))
      lse, di = (_in_bounds(x, q_block * bq, st.q_len, axis=1) for x in (lse, di))
    s, slope = _logits_and_cap_slope(
        lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32), st)
    p = jnp.exp(s - lse)
    if mask is not None:
      p = jnp.where(mask, p, 0.0)
    dv_acc_ref[keys, :] += lax.dot_general(p.astype(do.dtype), do, _NN,
                                           preferred_element_type=jnp.float32)
    dp = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
    ds = p * (dp - di)
    if slope is not None:
      ds = ds * slope
    dk_acc_ref[keys, :] += lax.dot_general(ds.astype(q.dtype), q, _NN,
                                           preferred_element_type=jnp.float32)

  def _compute(masked):
    if masked and triangular:
      for keys, _ in _diagonal_strips(bk):   # key strips (the row strips' slices) and
        rows = slice(keys.start, bk)           # the query rows that see them
        k, v = k_ref[keys, :], v_ref[keys, :]
        mask = _causal_mask(rows, keys, st, keys_on_sublanes=True)
        for g in range(group):
          _accumulate(g, keys, rows, k, v, mask)
      return
    k = k_ref[...]
    v = v_ref[...]
    mask = None
    if masked:
      mask = _block_mask(q_first, kv_block * bk, seg_refs, st, padded_keys,
                         keys_on_sublanes=True)
    for g in range(group):
      _accumulate(g, slice(None), slice(None), k, v, mask, tail=masked and padded_rows)

  q_first = q_offset + q_block * bq
  q_end = q_offset + st.q_len if padded_rows else None
  _run_block(run, _needs_mask(q_first, kv_block * bk, st, padded_keys, q_end), _compute)

  @pl.when(ends)
  def _finish():
    dk_ref[...] = (dk_acc_ref[...] * st.sm_scale).astype(dk_ref.dtype)
    dv_ref[...] = dv_acc_ref[...].astype(dv_ref.dtype)


def _backward(q5, k, v, sinks, q_seg, kv_seg, q_offset, lse, do5, di, st: _Static):
  """Gradients of q5, k, v (shapes as in `_forward`; lse and di [B, Hkv, G, Sq_p] f32)."""
  batch, num_kv_heads, group, _, head_dim = q5.shape
  bq, bk = st.block_q, st.block_k
  nq, nk = _num_blocks(st)
  padded_keys = nk * bk != st.kv_len
  params = pltpu.CompilerParams(
      dimension_semantics=("parallel", "parallel", "parallel", "arbitrary"),
      vmem_limit_bytes=st.vmem_limit_bytes)

  # dq: the forward's grid, folded or not.
  rows, steps, q_of, kv_of = _q_major_grid(nq, nk, st)

  q_spec = pl.BlockSpec((None, None, group, bq, head_dim),
                        lambda b, h, i, t, *r: (b, h, 0, q_of(i, t, *r), 0))
  row_spec = pl.BlockSpec((None, None, group, bq),
                          lambda b, h, i, t, *r: (b, h, 0, q_of(i, t, *r)))
  kv_spec = pl.BlockSpec((None, None, bk, head_dim),
                         lambda b, h, i, t, *r: (b, h, kv_of(i, t, *r), 0))
  in_specs = [q_spec, kv_spec, kv_spec, q_spec, row_spec, row_spec]
  operands = [q5, k, v, do5, lse, di]
  if st.has_segments:
    in_specs += [pl.BlockSpec((None, 1, bq), lambda b, h, i, t, *r: (b, 0, q_of(i, t, *r))),
                 pl.BlockSpec((None, 1, bk), lambda b, h, i, t, *r: (b, 0, kv_of(i, t, *r)))]
    operands += [q_seg, kv_seg]
  dq = pl.pallas_call(
      functools.partial(_dq_kernel, st=st, group=group, num_q_blocks=nq, num_kv_blocks=nk,
                        padded_keys=padded_keys),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads, rows, steps),
          in_specs=in_specs,
          out_specs=q_spec,
          scratch_shapes=[pltpu.VMEM((group, head_dim, bq) if _dq_transposed(st) else
                                     (group, bq, head_dim), jnp.float32)]),
      out_shape=jax.ShapeDtypeStruct(q5.shape, q5.dtype),
      compiler_params=params, interpret=st.interpret, name=DQ_KERNEL,
  )(q_offset, sinks, *operands)

  # dk, dv: kv blocks outer, the q blocks that see them inner (folded: kv blocks j and
  # nk - 1 - j share a row).
  if st.fold:
    rows_t, steps_t = nk // 2, nq + 1

    def kv_of_t(j, t, *_):
      return _folded_dkv(j, t, nq, nk, st)[0]

    def q_of_t(j, t, *_):
      return _folded_dkv(j, t, nq, nk, st)[1]
  else:
    rows_t, steps_t = nk, _num_steps(bk, bq, nq, st)

    def kv_of_t(j, t, *_):
      return j

    def q_of_t(j, t, q_offset_ref, sinks_ref):
      lo, hi = _q_range(j, q_offset_ref[0], st, nq)
      return _visit(lo, hi, t)[0]

  q_spec_t = pl.BlockSpec((None, None, group, bq, head_dim),
                          lambda b, h, j, t, *r: (b, h, 0, q_of_t(j, t, *r), 0))
  row_spec_t = pl.BlockSpec((None, None, group, bq),
                            lambda b, h, j, t, *r: (b, h, 0, q_of_t(j, t, *r)))
  kv_spec_t = pl.BlockSpec((None, None, bk, head_dim),
                           lambda b, h, j, t, *r: (b, h, kv_of_t(j, t, *r), 0))
  in_specs = [q_spec_t, kv_spec_t, kv_spec_t, q_spec_t, row_spec_t, row_spec_t]
  if st.has_segments:
    in_specs += [pl.BlockSpec((None, 1, bq), lambda b, h, j, t, *r: (b, 0, q_of_t(j, t, *r))),
                 pl.BlockSpec((None, 1, bk), lambda b, h, j, t, *r: (b, 0, kv_of_t(j, t, *r)))]
  dk, dv = pl.pallas_call(
      functools.partial(_dkv_kernel, st=st, group=group, num_q_blocks=nq, num_kv_blocks=nk,
                        padded_keys=padded_keys, padded_rows=nq * bq != st.q_len),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(batch, num_kv_heads, rows_t, steps_t),
          in_specs=in_specs,
          out_specs=[kv_spec_t, kv_spec_t],
          scratch_shapes=[pltpu.VMEM((bk, head_dim), jnp.float32),
                          pltpu.VMEM((bk, head_dim), jnp.float32)]),
      out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
      compiler_params=params, interpret=st.interpret, name=DKV_KERNEL,
  )(q_offset, sinks, *operands)
  return dq, dk, dv


# ----------------------------------------------------------------------------- custom VJP


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _attention(q5, k, v, sinks, q_seg, kv_seg, q_offset, st):
  return _forward(q5, k, v, sinks, q_seg, kv_seg, q_offset, st)


def _attention_fwd(q5, k, v, sinks, q_seg, kv_seg, q_offset, st):
  out, lse = _forward(q5, k, v, sinks, q_seg, kv_seg, q_offset, st)
  return (out, lse), (q5, k, v, sinks, q_seg, kv_seg, q_offset, out, lse)


def _attention_bwd(st, saved, cotangents):
  q5, k, v, sinks, q_seg, kv_seg, q_offset, out, lse = saved
  d_out, d_lse = cotangents
  # lse and d_lse have whole q blocks of rows (_forward); di too, its tail zero.
  di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  di = _pad(di, 3, lse.shape[3]) - d_lse
  dq, dk, dv = _backward(q5, k, v, sinks, q_seg, kv_seg, q_offset, lse,
                         d_out.astype(q5.dtype), di, st)
  d_sinks = None
  if st.has_sinks:
    group = q5.shape[2]
    per_head = sinks.reshape(1, -1, group, 1)
    lse, di = lse[..., :st.q_len], di[..., :st.q_len]   # the tail's lse is garbage
    p_sink = jnp.exp(per_head - lse)   # the sink's probability: lse >= sink, so in (0, 1]
    d_sinks = -jnp.sum(p_sink * di, axis=(0, 3)).reshape(-1).astype(sinks.dtype)
  return dq, dk, dv, d_sinks, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------- JAX API


def _check(q, k, v, sliding_window, soft_cap, segment_ids, sinks, q_offset):
  for name, a in (("q", q), ("k", k), ("v", v)):
    if a.ndim != 4:
      raise ValueError(f"{name} must be 4-D [batch, heads, seq, head_dim], got shape {a.shape}")
  if q.dtype not in FLOAT_DTYPES:
    raise TypeError(f"q must be float32 or bfloat16, got {q.dtype}")
  for name, a in (("k", k), ("v", v)):
    if a.dtype != q.dtype:
      raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}; no silent casts")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
  batch, num_q_heads, q_len, head_dim = q.shape
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"k / v {k.shape} must match q {q.shape} in batch and head_dim")
  if k.shape[1] == 0 or num_q_heads % k.shape[1]:
    raise ValueError(f"the number of query heads ({num_q_heads}) must be a multiple of the "
                     f"number of KV heads ({k.shape[1]})")
  if head_dim == 0:
    raise ValueError("head_dim must be positive")
  common.check_softmax_options(sliding_window, soft_cap, sinks, num_q_heads)
  if segment_ids is not None:
    if isinstance(segment_ids, (tuple, list)):
      if len(segment_ids) != 2:
        raise ValueError("segment_ids must be one [B, S] array or a pair (q_segment_ids, "
                         "kv_segment_ids)")
      q_seg, kv_seg = segment_ids
    else:
      if q_len != k.shape[2]:
        raise ValueError(f"a single segment_ids array needs Sq == Skv (got {q_len} and "
                         f"{k.shape[2]}); pass (q_segment_ids, kv_segment_ids)")
      q_seg = kv_seg = segment_ids
    for name, a, length in (("q segment_ids", q_seg, q_len), ("kv segment_ids", kv_seg,
                                                              k.shape[2])):
      if a.shape != (batch, length):
        raise ValueError(f"{name} must have shape ({batch}, {length}), got {a.shape}")
      if not jnp.issubdtype(a.dtype, jnp.integer):
        raise TypeError(f"{name} must be integers, got {a.dtype}")
  if isinstance(q_offset, (int, np.integer)) and q_offset < 0:
    raise ValueError(f"q_offset must be >= 0, got {q_offset}")


def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    segment_ids=None, sinks=None, q_offset=0, return_lse: bool = False,
                    chip: str | None = None, block_q: int | None = None,
                    block_k: int | None = None, vmem_limit_bytes: int | None = None,
                    interpret: bool = False):
  """Attention in the SDPA layout (see the module docstring for the exact math).

  Args:
    q: [B, Hq, Sq, D] float32 or bfloat16.
    k, v: [B, Hkv, Skv, D], q's dtype; Hq a multiple of Hkv (GQA / MQA).
    causal: key j visible from query i only if j <= q_offset + i.
    sm_scale: logit scale, default 1 / sqrt(D).
    sliding_window: int >= 1; key j visible only if (q_offset + i) - j < sliding_window.
    soft_cap: float > 0; logits become soft_cap * tanh(logits / soft_cap).
    segment_ids: None; int32 [B, S] when Sq == Skv (queries and keys share it); or a
      pair (q_segment_ids [B, Sq], kv_segment_ids [B, Skv]). Key j visible from query
      i only within the same segment.
    sinks: [Hq] (f32 or q's dtype): one learned logit per query head, added to the
      softmax denominator (gpt-oss).
    q_offset: int or int32 scalar (may be traced), >= 0: the position of query row 0
      in the key sequence (chunked prefill).
    return_lse: also return lse [B, Hq, Sq] float32.
    chip: tiles and VMEM limit for "v5e", "v6e", "v5p" or "v7" (default v6e).
    block_q, block_k, vmem_limit_bytes: override the tiling (`attention_tiling`).
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    out [B, Hq, Sq, D] in q's dtype, or (out, lse) when return_lse. Differentiable with
    respect to q, k, v and sinks (and through lse).
  """
  _check(q, k, v, sliding_window, soft_cap, segment_ids, sinks, q_offset)
  batch, num_q_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  chip = chips.DEFAULT_CHIP if chip is None else chip
  if q_len == 0 or kv_len == 0:
    out = jnp.zeros(q.shape, q.dtype)
    lse = jnp.full(q.shape[:3], -jnp.inf, jnp.float32)
    if sinks is not None:
      lse = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], lse.shape)
    return (out, lse) if return_lse else out
  t = attention_tiling(q_len, kv_len, head_dim, group=group, dtype=q.dtype, chip=chip,
                       block_q=block_q, block_k=block_k, vmem_limit_bytes=vmem_limit_bytes,
                       causal=causal, sliding_window=sliding_window)
  st = _Static(
      causal=bool(causal),
      sm_scale=float(1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale),
      sliding_window=None if sliding_window is None else int(sliding_window),
      soft_cap=None if soft_cap is None else float(soft_cap),
      has_segments=segment_ids is not None, has_sinks=sinks is not None, q_len=q_len,
      kv_len=kv_len,
      block_q=t.block_q, block_k=t.block_k, vmem_limit_bytes=t.vmem_limit_bytes,
      interpret=bool(interpret),
      fold=_fold_causal(causal, sliding_window, q_offset, q_len, kv_len, t.block_q, t.block_k))
  # q, k and v go in as they are (the last blocks partial, their tails masked in the
  # kernels); only the small segment-id rows are padded to whole blocks (the blocks of a
  # row of lanes must tile it when they are not a multiple of 128).
  q5 = q.reshape(batch, num_kv_heads, group, q_len, head_dim)
  q_seg = kv_seg = None
  if segment_ids is not None:
    q_seg, kv_seg = _split_segment_ids(segment_ids)
    q_seg = _pad(q_seg.astype(jnp.int32), 1, vmem.round_up(q_len, t.block_q))[:, None, :]
    kv_seg = _pad(kv_seg.astype(jnp.int32), 1, vmem.round_up(kv_len, t.block_k))[:, None, :]
  # Scalar-prefetched (SMEM holds 32-bit words): sinks in f32, a dummy when absent.
  sinks_f32 = jnp.zeros((1,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
  q_offset_arg = jnp.asarray(q_offset, jnp.int32).reshape(1)
  out5, lse4 = _attention(q5, k, v, sinks_f32, q_seg, kv_seg, q_offset_arg, st)
  out = out5.reshape(q.shape)
  if not return_lse:
    return out
  return out, lse4[:, :, :, :q_len].reshape(batch, num_q_heads, q_len)


def _pad(a, axis: int, to: int):
  """a padded with zeros along `axis` to length `to` (a itself if it has that length)."""
  if a.shape[axis] == to:
    return a
  widths = [(0, 0)] * a.ndim
  widths[axis] = (0, to - a.shape[axis])
  return jnp.pad(a, widths)


def _split_segment_ids(segment_ids):
  if isinstance(segment_ids, (tuple, list)):
    return tuple(segment_ids)
  return segment_ids, segment_ids


# ----------------------------------------------------------------------------- XLA baseline


def attention_xla(q, k, v, *, causal=False, sm_scale=None, sliding_window=None, soft_cap=None,
                  segment_ids=None, sinks=None, q_offset=0):
  """The same attention in plain XLA (f32 math, O(Sq * Skv) memory): the baseline the
  benchmarks compare against. Returns (out, lse)."""
  batch, num_q_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
  vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
  s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), kf,
                 precision=lax.Precision.HIGHEST) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  q_pos = q_offset + jnp.arange(q_len)[:, None]
  k_pos = jnp.arange(kv_len)[None, :]
  visible = jnp.ones((q_len, kv_len), bool)
  if causal:
    visible &= k_pos <= q_pos
  if sliding_window is not None:
    visible &= q_pos - k_pos < sliding_window
  visible = visible[None, None]
  if segment_ids is not None:
    q_seg, kv_seg = _split_segment_ids(segment_ids)
    visible = visible & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  s = jnp.where(visible, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32)[None, :, None])
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom = denom + jnp.exp(sinks.astype(jnp.float32)[None, :, None] - m_safe)
  out = jnp.einsum("bhqk,bhkd->bhqd", p, vf, precision=lax.Precision.HIGHEST)
  safe = jnp.where(denom > 0, denom, 1.0)
  out = jnp.where(denom[..., None] > 0, out / safe[..., None], 0.0)
  lse = jnp.where(denom > 0, m_safe + jnp.log(safe), -jnp.inf)
  return out.astype(q.dtype), lse
