"""The gated delta rule (Gated DeltaNet) for TPU in Pallas: a chunked kernel for prefill and
training with its backward, and a recurrent kernel for decode; packed sequences by
cu_seqlens on both.

Math (Transformers' `torch_recurrent_gated_delta_rule`). q, k: [B, T, Hk, K]; v: [B, T, Hv,
V], Hv a multiple of Hk (value head h reads key head h // G, G = Hv / Hk); g: the float32
log-decay [B, T, Hv] (<= 0); beta: [B, T, Hv]. Optionally q and k are l2-normalised
(x / sqrt(|x|^2 + 1e-6)); then q *= scale (K^-0.5 by default). Per value head, with the
state S [K, V] (float32, zeros or the initial state), token by token:

    S <- exp(g_t) S;   delta_t = beta_t (v_t - S^T k_t);   S <- S + k_t delta_t^T;
    o_t = S^T q_t.

Outputs o [B, T, Hv, V] in q's dtype and, optionally, the final S [B, Hv, K, V] float32.
Everything is computed in float32: blocks are widened on load, and every matmul runs at
`lax.Precision.HIGHEST` (Mosaic's default contracts float32 operands in one bf16 pass:
libtpu's static estimate of a chain of 64 x 64 float32 matmuls is the same as bf16's).

Chunk form (C = 64 tokens; the WY / UT representation of fla and tpu-inference). Inside
a chunk, with G_i = sum_{j<=i} g_j (chunk-local cumulative log-decay), Gam_i = exp(G_i),
gam = exp(G_{C-1}), E_ij = exp(G_i - G_j) for j <= i (0 above the diagonal, never an exp
of a positive number), and the state S at the chunk's start:

    A    = strict_lower(beta_i E_ij k_i . k_j)          (C x C)
    Tinv = (I + A)^-1                                  (unit lower triangular)
    W    = Tinv diag(beta Gam) K,   U0 = Tinv diag(beta) V
    U    = U0 - W S                                    (the deltas of the chunk's tokens)
    O    = diag(Gam) Q S + lower(E_ij q_i . k_j) U
    S'   = gam S + (diag(exp(G_{C-1} - G)) K)^T U

The inverse is built by doubling on whole (C, C) matrices (no lane slices): with X_1 = I
and E_b the part of A inside each 2b-block below its b-diagonal blocks,
X_2b = X_b - X_b E_b X_b (exact, as X_b E_b is nilpotent of index 2: this is blocked
forward substitution, the blocks doubling 1, 2, 4, ..., 32), ten 64^3 matmuls per chunk
and value head.

Layout. q, k and v are reshaped to [B, T, H * D]: a block is (C, heads x D) lanes of one
batch row, no transpose in XLA. (Under XLA's TPU tiling that reshape, and o's back, is a
relayout copy unless the producer fuses it: about 7% of the program's estimate at T = 512
on v5e.) K and V are padded to whole lanes (128) only when they are not (test shapes;
model shapes are 128). The chunked kernels take `heads_per_step` value heads per grid
step (a multiple of G: all value heads of their key heads, so q . k^T and k . k^T are
computed once per key head and dq / dk are summed over the group inside the kernel), and
run them phase by phase (`_each`), so that the heads' independent chains sit side by
side and interleave (the inverse alone is a chain of ten dependent matmuls: libtpu's
estimate on v6e is 2,400 cycles for one head, 740 per head for four in lockstep; the
whole forward went from 7.9k to 1.5k cycles per head and chunk). g and beta go in as one
(8, 128) float32 tile per value head and chunk, built in XLA ([B, NC, Hv * 8, 128]):
row 0 holds G (lanes 0..C-1), row 1 beta; the kernel gets their column forms by one
(8, 128) transpose. Every block is 2-D (libtpu's static estimator rates kernels with
3-D blocks at 0 cycles). The state is viewed as [N * Hv * K, V]: a step's block is the
(heads_per_step * K, V) rows of its heads.

Kernels (grid (B, Hv / heads_per_step, chunks); batch and heads "parallel", chunks
"arbitrary", the running state in a float32 VMEM scratch):

  forward  o per chunk; the final state (written every step into a block whose index
           only changes between sequences, so Pallas writes it back once per sequence).
  states   the forward without o, writing the state at each chunk's start to
           hs [B, NC, Hv, K, V] float32 (the backward's recomputation; nothing but the
           inputs is saved by the forward).
  backward runs the chunks in reverse with dS (the gradient of the state at the chunk's
           end) in VMEM scratch; per chunk it recomputes the forward quantities from hs
           and writes dq, dk, dv, d(G, beta) and, at each sequence's first chunk, the
           gradient of its initial state. Formulas (dO the output cotangent, dS' the
           carried state gradient; P = lower(E_ij q_i . k_j)):

    dU  = P^T dO + Kd dS'                       Kd = diag(exp(G_{C-1} - G)) K
    dS  = (diag(Gam) Q)^T dO + gam dS' - W^T dU  (carried to the previous chunk)
    dP  = lower(dO U^T);   dQ = diag(Gam) dO S^T + (dP * E) K
    dK  = (dP * E)^T Q + diag(exp(G_{C-1} - G)) U dS'^T
    dW  = -dU S^T;   Y = Tinv^T [dW | dU] = [Y_W | Y_U]
    dV  = diag(beta) Y_U;   dK += diag(beta Gam) Y_W
    dA  = -strict_lower(Y [W | U0]^T);   Cm = diag(beta) (dA * E);   dK += (Cm + Cm^T) K
    dbeta = rowsum(dA * E * KK) + rowsum(V * Y_U) + Gam rowsum(K * Y_W)
    dG  = rowsum(X) - colsum(X) (X = dA * A + dP * P, the log-decay pairs)
          + Gam rowsum(Q * dO S^T) + beta Gam rowsum(K * Y_W) - y,
          dG_{C-1} += gam sum(S * dS') + sum(y),   y = exp(G_{C-1} - G) rowsum(K * U dS'^T)

           Then the l2-norm and scale backward of q and k (inside the kernel). What stays
           in XLA: G's chunk-local cumsum and its transpose (dg = reverse cumsum of dG), the
           gate tiles, K / V padding, and the packing below, all by JAX autodiff of jnp.

Tails. T need not be a multiple of C: the grid has cdiv(T, C) chunks and the last block is
partial; the kernels zero q, k, v (and dO) rows past T before any use (Pallas reads
whatever VMEM holds there; interpret mode: NaN), and the gate tiles are zero there
(beta = 0, g = 0: such a row leaves the state unchanged). Rows past T are never written to
HBM. T < C is padded to C in XLA.

Packed sequences (cu_seqlens [N + 1], B = 1). XLA re-packs the tokens so that every
sequence starts a chunk: sequence s takes max(1, ceil(len_s / C)) chunks (an empty
sequence one chunk of padding, so that its final state is written: it equals its
initial state), at most NC = N + T // C chunks in all (static); padding rows are zeros
with beta = 0 and g = 0. Two int32 tables [NC] are scalar-prefetched: each chunk's
sequence (its state slot; chunks past the last sequence's go to the last sequence and
change nothing) and its flags (first / last chunk of a sequence), read by the kernel and by
the state blocks' index maps. Cost: one gather of q, k, v, g, beta into the packed rows
and one of o back (and in the backward the inverse gathers: the packing is a partial
permutation, `_move_rows`, so its transpose is a gather, not a scatter-add), and up to
N * (C - 1) rows of padding computed.

Decode (`fused_recurrent_gated_delta_rule`). L tokens per sequence (L small: 1 in
decode), a batch of N per-sequence states. Grid (N, Hv / heads_per_step), both
"parallel"; the state block (heads_per_step * K, V) is read once and written once per
call, aliased input -> output (`input_output_aliases`), so a caller that donates the
state updates it in place. q, k, v and o are viewed as [N, heads * L, D] (rows (head,
token): at L = 1 a free view of the caller's [N, 1, H, D]); g and beta go in as their
[N, L, Hv] rows, each head's value picked by a lane select (no XLA op on them: scalar
tables prefetched from XLA's output lived in VMEM, where libtpu's v5e estimator aborts).
The update runs on the vector unit (per token and head: S^T k and S^T q in one pass over
S, then S <- exp(g) S + k delta^T, o = exp(g) S^T q + (q . k) delta; the MXU would reload
S as weights for every token), q and k made into columns by one in-kernel transpose of
the block. Its VJP is the chunked backward (the same function on the same inputs).
Packed decode (cu_seqlens) re-packs to [N, max_seqlen] (static) with beta = 0, g = 0
padding.

VMEM. Blocks are double-buffered: per chunk step about 2 x (q, k, v, o, dO, dq, dk, dv
blocks of C rows) + 2-4 state blocks (heads_per_step K x V float32) + the scratch, plus
float32 temporaries, about 40 (C, 128) and a few (K, V) per value head (`_chunk_plan`).
`gdn_tiling` takes up to 4 value heads per step (a whole number of groups) and asks for
a scoped-VMEM limit of which the plan fills at most half (`vmem.py`): the chip's default
where that holds (v6e), else a raised one (v5e: 20 MiB for Qwen3.5's shapes; Mosaic
itself fitted 4 heads into 16 MiB and refused 8).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
import numpy as np

from . import chips
from . import vmem

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)
CHUNK = 64
L2NORM_EPS = 1e-6
# The pallas_call names, as they appear in compiled HLO.
FORWARD_KERNEL = "gated_delta_rule_fwd"
STATES_KERNEL = "gated_delta_rule_states"
BACKWARD_KERNEL = "gated_delta_rule_bwd"
DECODE_KERNEL = "gated_delta_rule_decode"

_LANES = 128
_GATE_ROWS = 8          # sublane rows of one value head's gate tile
_HI = lax.Precision.HIGHEST
_NN = (((1,), (0,)), ((), ()))
_NT = (((1,), (1,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))
# Value heads per chunk step the default tiling aims for: independent chains to interleave.
_TARGET_HEADS_PER_STEP = 4
# Unrolled (head, token) bodies per decode step at most (code size).
_MAX_DECODE_BODIES = 64
# Tokens per sequence the recurrent kernel takes (its bodies are unrolled per head and
# token); longer calls run the chunked kernel (one chunk of 64 serves up to 64 tokens).
MAX_RECURRENT_TOKENS = 16


# ----------------------------------------------------------------------------- tiling


@dataclasses.dataclass(frozen=True)
class Tiling:
  """How one call is cut up, and the VMEM its hungriest kernel plans for."""

  heads_per_step: int
  vmem_limit_bytes: int
  vmem_plan_bytes: int


def _chunk_plan(heads: int, group: int, k_dim: int, v_dim: int, itemsize: int) -> int:
  """VMEM of the backward kernel (the hungriest) for `heads` value heads per step: q, k,
  dq, dk blocks (heads / group key heads), v, dO, dv, o blocks, gate tiles in and out,
  hs, dS'-in and dh0-out state blocks, all double-buffered; the dS scratch; float32
  temporaries per value head (about 40 (C, 128) tiles and 4 (K, V))."""
  kh = heads // group
  c = CHUNK
  total = 2 * 4 * c * kh * k_dim * max(itemsize, 4)      # q, k in; dq, dk out
  total += 2 * 4 * c * heads * v_dim * max(itemsize, 4)   # v, dO, dv, o
  total += 2 * 2 * heads * _GATE_ROWS * _LANES * 4       # gate tiles, d gate tiles
  total += 2 * 3 * heads * k_dim * v_dim * 4             # hs, dhT, dh0 blocks
  total += heads * k_dim * v_dim * 4                     # dS scratch
  total += heads * (40 * c * _LANES + 4 * k_dim * v_dim) * 4
  return total


def _decode_plan(heads: int, key_heads: int, tokens: int, k_dim: int, v_dim: int,
                 itemsize: int) -> int:
  """VMEM of the decode kernel for `heads` value heads (`key_heads` key heads) per step:
  state in and out blocks, q, k, v, o blocks (all double-buffered), the float32 copies and
  transposes of q, k, v, and a few (K, V) float32 temporaries."""
  qk_rows = vmem.round_up(key_heads * tokens, 8)
  v_rows = vmem.round_up(heads * tokens, 8)
  total = 2 * 2 * heads * k_dim * v_dim * 4
  total += 2 * 2 * qk_rows * k_dim * itemsize + 2 * 2 * v_rows * v_dim * itemsize
  total += 2 * (qk_rows * k_dim + k_dim * vmem.lane_padded(qk_rows)) * 4 + 2 * v_rows * v_dim * 4
  total += 4 * k_dim * v_dim * 4
  return total


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _fit(cands, plan, chip_: chips.Chip, vmem_limit_bytes, what: str):
  """(heads, limit, plan bytes) for candidates in order of preference. With no limit
  given: the first candidate, under the chip's default limit if its plan fits half of it,
  else under a limit raised as far as the plan needs (more heads per step beat the default
  limit: on v5e, 4 heads under 19 MiB rate 9% fewer forward cycles than 2 under 16 MiB),
  then the next candidate if the chip cannot give that. With a limit given: the first
  candidate whose plan fits half of it."""
  limit = vmem.resolve_vmem_limit(chip_, vmem_limit_bytes)
  for h in cands:
    if plan(h) <= limit * vmem.BUDGET_FRACTION:
      return h, limit, plan(h)
    need = vmem.round_up(int(plan(h) / vmem.BUDGET_FRACTION), vmem.MiB)
    if vmem_limit_bytes is None and need <= chip_.max_vmem_limit_bytes:
      return h, need, plan(h)
  raise ValueError(f"{what} with {cands[-1]} value heads per step needs {plan(cands[-1])} "
                   f"bytes of VMEM, more than half of the {limit}-byte limit on {chip_.name}")


def gdn_tiling(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, *, dtype,
               chip: str = chips.DEFAULT_CHIP, heads_per_step: int | None = None,
               vmem_limit_bytes: int | None = None) -> Tiling:
  """Tiles of the chunked kernels (forward, states, backward share them).

  heads_per_step: value heads per grid step, a multiple of G = Hv / Hk dividing Hv;
  default: the largest such count up to max(G, 4), under the chip's default scoped-VMEM
  limit if its VMEM plan (`_chunk_plan`, the backward's) fits half of it, else under a
  raised limit (`_fit`). k_dim, v_dim: the padded (lane) sizes.
  """
  chip_ = chips.get_chip(chip)
  group = num_v_heads // num_k_heads
  itemsize = np.dtype(dtype).itemsize
  cands = [h for h in _divisors(num_v_heads) if h % group == 0]
  if heads_per_step is not None:
    if heads_per_step not in cands:
      raise ValueError(f"heads_per_step must be a multiple of Hv / Hk = {group} dividing "
                       f"Hv = {num_v_heads}, got {heads_per_step!r}")
    cands = [heads_per_step]
  else:
    target = max(group, _TARGET_HEADS_PER_STEP)
    cands = sorted((h for h in cands if h <= target), reverse=True) or [group]
  plan = functools.partial(_chunk_plan, group=group, k_dim=k_dim, v_dim=v_dim,
                           itemsize=itemsize)
  h, limit, need = _fit(cands, plan, chip_, vmem_limit_bytes, "the chunked gated delta rule")
  return Tiling(h, limit, need)


def decode_tiling(num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, tokens: int, *,
                  dtype, chip: str = chips.DEFAULT_CHIP, heads_per_step: int | None = None,
                  vmem_limit_bytes: int | None = None) -> Tiling:
  """Tiles of the decode kernel: value heads per step, a multiple of G dividing Hv whose
  q / k and v / o blocks ((key) heads x tokens rows) are whole 8-row tiles (or all heads;
  Mosaic takes 8-row bf16 blocks too), with heads x tokens <= 64 unrolled bodies when
  possible: the largest, the limit raised if its plan needs it (`_fit`)."""
  chip_ = chips.get_chip(chip)
  group = num_v_heads // num_k_heads
  itemsize = np.dtype(dtype).itemsize
  sub = 8

  def legal(h):
    return (h % group == 0 and (h == num_v_heads or (h * tokens % sub == 0
                                                     and h // group * tokens % sub == 0)))

  cands = [h for h in _divisors(num_v_heads) if legal(h)]
  if heads_per_step is not None:
    if heads_per_step not in cands:
      raise ValueError(f"heads_per_step must be a multiple of Hv / Hk = {group} dividing "
                       f"Hv = {num_v_heads} (and, below Hv, a whole number of {sub}-row "
                       f"tiles of q and v rows per step), got {heads_per_step!r}")
    cands = [heads_per_step]
  else:
    cands = sorted(cands, reverse=True)
    cands = [h for h in cands if h * tokens <= _MAX_DECODE_BODIES] or cands[-1:]

  def plan(h):
    return _decode_plan(h, h // group, tokens, k_dim, v_dim, itemsize)

  h, limit, need = _fit(cands, plan, chip_, vmem_limit_bytes, "the recurrent gated delta rule")
  return Tiling(h, limit, need)


# ----------------------------------------------------------------------------- chunk math


def _mm(a, b):
  return lax.dot_general(a, b, _NN, precision=_HI, preferred_element_type=jnp.float32)


def _mm_nt(a, b):
  return lax.dot_general(a, b, _NT, precision=_HI, preferred_element_type=jnp.float32)


def _mm_tn(a, b):
  return lax.dot_general(a, b, _TN, precision=_HI, preferred_element_type=jnp.float32)


def _iota(shape, axis):
  return lax.broadcasted_iota(jnp.int32, shape, axis)


def _rowsum(x):
  return jnp.sum(x, axis=1, keepdims=True)


def _total(x):
  return jnp.sum(jnp.sum(x, axis=0, keepdims=True), axis=1, keepdims=True)


def _each(f, *lists):
  """[f(*xs) for xs in zip(*lists)]: one phase of the step's value heads. The kernels run
  their heads phase by phase, so that the heads' independent matmul chains sit next to
  each other and interleave (libtpu's estimate of the inverse below: 2,400 cycles for one
  head alone, 740 per head for four in lockstep)."""
  return [f(*xs) for xs in zip(*lists)]


def _unit_lower_inverse(mats):
  """[(I + a)^-1 for a in mats], each a strictly lower-triangular (C, C) float32 matrix, C
  a power of two, by doubling the blocks of forward substitution (module docstring); the
  levels run in lockstep over the matrices."""
  c = mats[0].shape[0]
  row, col = _iota((c, c), 0), _iota((c, c), 1)
  eye = jnp.where(row == col, 1.0, 0.0)
  pairs = ((row & 1) != 0) & (col == row - 1)
  xs = [eye - jnp.where(pairs, a, 0.0) for a in mats]
  b = 2
  while b < c:
    inside = ((row & b) != 0) & ((col & b) == 0) & ((row ^ col) < 2 * b)
    ys = _each(lambda x, a: _mm(x, jnp.where(inside, a, 0.0)), xs, mats)
    xs = _each(lambda x, y: x - _mm(y, x), xs, ys)
    b *= 2
  return xs


def _l2norm(x):
  """(x / sqrt(|x|^2 + eps) rowwise, 1 / sqrt(|x|^2 + eps) as a column)."""
  inv = lax.rsqrt(_rowsum(x * x) + L2NORM_EPS)
  return x * inv, inv


def _l2norm_bwd(dxn, xn, inv):
  return inv * (dxn - xn * _rowsum(xn * dxn))


@dataclasses.dataclass
class _Chunk:
  """One value head's chunk quantities (module docstring's names)."""

  g_col: jax.Array      # G (C, 1)
  g_last: jax.Array     # G_{C-1} (1, 1)
  b_col: jax.Array      # beta (C, 1)
  e: jax.Array          # E, 0 above the diagonal (C, C)
  a: jax.Array          # A (C, C)
  tinv: jax.Array       # (I + A)^-1
  gam: jax.Array        # exp(G) (C, 1)
  to_end: jax.Array     # exp(G_{C-1} - G) (C, 1)
  wu0: jax.Array        # [W | U0] (C, K + V)
  u: jax.Array          # U (C, V)


def _chunks(tiles, ks, vs, kks, ss, k_dim: int) -> list[_Chunk]:
  """The forward quantities of the step's value heads (lists, one entry per head). tiles:
  their (8, 128) gate tiles; ks (C, K) normalised keys (each head's key head); vs (C, V);
  kks = k k^T; ss (K, V) the states at the chunk's start."""
  c = ks[0].shape[0]
  row, col = _iota((c, c), 0), _iota((c, c), 1)

  def gates(tile):
    tt = tile.T                                # (128, 8): column 0 G, column 1 beta
    g_col, b_col = tt[:c, 0:1], tt[:c, 1:2]
    return g_col, tile[0:1, :c], b_col, g_col[c - 1:c, :]

  gs = [gates(t) for t in tiles]
  es = [jnp.exp(jnp.where(row >= col, g_col - g_row, -jnp.inf)) for g_col, g_row, _, _ in gs]
  as_ = _each(lambda g, kk, e: jnp.where(row > col, g[2] * kk * e, 0.0), gs, kks, es)
  tinvs = _unit_lower_inverse(as_)
  gams = [jnp.exp(g[0]) for g in gs]
  to_ends = [jnp.exp(g[3] - g[0]) for g in gs]
  wu0s = _each(lambda t, g, gam, k, v: _mm(t, jnp.concatenate([(g[2] * gam) * k, g[2] * v],
                                                                axis=1)),
               tinvs, gs, gams, ks, vs)
  us = _each(lambda wu0, s: wu0[:, k_dim:] - _mm(wu0[:, :k_dim], s), wu0s, ss)
  return _each(lambda g, e, a, t, gam, te, wu0, u: _Chunk(g[0], g[3], g[2], e, a, t, gam, te,
                                                          wu0, u),
               gs, es, as_, tinvs, gams, to_ends, wu0s, us)


def _lower(c):
  return _iota((c, c), 0) >= _iota((c, c), 1)


def _forward_heads(qs, ks, vs, kks, qks, tiles, ss, k_dim: int, want_out: bool):
  """(o (C, V) per head or None, the states at the chunk's end) for the step's heads."""
  chs = _chunks(tiles, ks, vs, kks, ss, k_dim)
  lower = _lower(ks[0].shape[0])
  outs = None
  if want_out:
    ps = _each(lambda qk, ch: jnp.where(lower, qk * ch.e, 0.0), qks, chs)
    outs = _each(lambda q, s, p, ch: _mm(ch.gam * q, s) + _mm(p, ch.u), qs, ss, ps, chs)
  s_news = _each(lambda s, k, ch: jnp.exp(ch.g_last) * s + _mm_tn(ch.to_end * k, ch.u),
                 ss, ks, chs)
  return outs, s_news


def _backward_heads(qs, ks, vs, kks, qks, tiles, ss, ds_nexts, dos, k_dim: int):
  """Gradients of the step's heads' chunks, per head: (dq, dk (w.r.t. the scaled
  normalised q and the normalised k), dv, dG column, dbeta column, dS for the chunk's
  start). Formulas: module docstring."""
  chs = _chunks(tiles, ks, vs, kks, ss, k_dim)
  c = ks[0].shape[0]
  row, col = _iota((c, c), 0), _iota((c, c), 1)
  lower, strict = row >= col, row > col
  ps = _each(lambda qk, ch: jnp.where(lower, qk * ch.e, 0.0), qks, chs)
  kds = _each(lambda k, ch: ch.to_end * k, ks, chs)
  gqs = _each(lambda q, ch: ch.gam * q, qs, chs)
  gammas = [jnp.exp(ch.g_last) for ch in chs]
  dus = _each(lambda p, do, kd, dsn: _mm_tn(p, do) + _mm(kd, dsn), ps, dos, kds, ds_nexts)
  dss = _each(lambda gq, do, gm, dsn, ch, du: _mm_tn(gq, do) + gm * dsn
              - _mm_tn(ch.wu0[:, :k_dim], du), gqs, dos, gammas, ds_nexts, chs, dus)
  doss = _each(_mm_nt, dos, ss)                           # dO S^T (C, K)
  dps = _each(lambda do, ch: jnp.where(lower, _mm_nt(do, ch.u), 0.0), dos, chs)
  dpes = _each(lambda dp, ch: dp * ch.e, dps, chs)
  dqs = _each(lambda ch, dos_, dpe, k: ch.gam * dos_ + _mm(dpe, k), chs, doss, dpes, ks)
  dkds = _each(lambda ch, dsn: _mm_nt(ch.u, dsn), chs, ds_nexts)   # U dS'^T (C, K)
  dks = _each(lambda dpe, q, ch, dkd: _mm_tn(dpe, q) + ch.to_end * dkd, dpes, qs, chs, dkds)
  ys = _each(lambda ch, du, s: _mm_tn(ch.tinv, jnp.concatenate([-_mm_nt(du, s), du], axis=1)),
             chs, dus, ss)                                # [Y_W | Y_U]
  dvs = _each(lambda ch, y: ch.b_col * y[:, k_dim:], chs, ys)
  kyws = _each(lambda k, y: _rowsum(k * y[:, :k_dim]), ks, ys)
  das = _each(lambda ch, y: jnp.where(strict, -_mm_nt(y, ch.wu0), 0.0), chs, ys)
  daes = _each(lambda da, ch: da * ch.e, das, chs)
  cms = _each(lambda ch, dae: ch.b_col * dae, chs, daes)
  dks = _each(lambda dk, ch, y, cm, k: dk + (ch.b_col * ch.gam) * y[:, :k_dim]
              + _mm(cm + cm.T, k), dks, chs, ys, cms, ks)
  dbetas = _each(lambda dae, kk, v, y, ch, kyw: _rowsum(dae * kk) + _rowsum(v * y[:, k_dim:])
                 + ch.gam * kyw, daes, kks, vs, ys, chs, kyws)
  last_row = _iota((c, 1), 0) == c - 1

  def dg(ch, da, dp, p, gq, dos_, kyw, k, dkd, s, dsn, gamma):
    x = da * ch.a + dp * p
    yend = ch.to_end * _rowsum(k * dkd)
    d = _rowsum(x - x.T) + _rowsum(gq * dos_) + ch.b_col * ch.gam * kyw - yend
    return d + jnp.where(last_row, gamma * _total(s * dsn) + _total(yend), 0.0)

  dgs = _each(dg, chs, das, dps, ps, gqs, doss, kyws, ks, dkds, ss, ds_nexts, gammas)
  return dqs, dks, dvs, dgs, dbetas, dss


def _rows_tile(dg, dbeta):
  """Two (C, 1) columns -> an (8, 128) tile with them as rows 0 and 1 (lanes 0..C-1)."""
  c = dg.shape[0]
  lane = _iota((c, _LANES), 1)
  m = jnp.where(lane == 0, dg, jnp.where(lane == 1, dbeta, 0.0))
  m = jnp.concatenate([m, jnp.zeros((_LANES - c, _LANES), jnp.float32)], axis=0)
  return m.T[:_GATE_ROWS, :]


# ----------------------------------------------------------------------------- kernels


@dataclasses.dataclass(frozen=True)
class _Static:
  batch: int              # rows of the chunk grid (B, or 1 when packed)
  seq_len: int            # rows of q / k / v per batch row (T, padded to >= C; packed: NC*C)
  num_chunks: int
  num_k_heads: int
  num_v_heads: int
  k_dim: int              # K padded to lanes
  v_dim: int
  heads: int              # value heads per step
  scale: float
  l2norm: bool
  varlen: bool
  has_initial: bool
  emit_final: bool
  vmem_limit_bytes: int
  interpret: bool

  @property
  def group(self):
    return self.num_v_heads // self.num_k_heads

  @property
  def key_heads(self):   # key heads per step
    return self.heads // self.group

  @property
  def head_blocks(self):
    return self.num_v_heads // self.heads

  @property
  def tail(self):        # valid rows of the last chunk when partial, else 0
    return 0 if self.varlen else self.seq_len % CHUNK


_FIRST, _LAST = 1, 2


def _flags(st: _Static, flag_ref, c):
  """(first, last): whether chunk c starts / ends its sequence."""
  if st.varlen:
    f = flag_ref[c]
    return (f & _FIRST) != 0, (f & _LAST) != 0
  return c == 0, c == st.num_chunks - 1


def _load_rows(ref, lanes: slice, c, st: _Static):
  """A (C, D) block slice in float32, rows past the sequence zeroed (partial last chunk)."""
  x = ref[:, lanes].astype(jnp.float32)
  if st.tail:
    valid = jnp.where(c == st.num_chunks - 1, st.tail, CHUNK)
    x = jnp.where(_iota((CHUNK, 1), 0) < valid, x, 0.0)
  return x


def _prepare_qk(q_ref, k_ref, kk_i: int, c, st: _Static):
  """Key head kk_i of the step: (q scaled (and normalised), k (normalised), the norms)."""
  lanes = slice(kk_i * st.k_dim, (kk_i + 1) * st.k_dim)
  q = _load_rows(q_ref, lanes, c, st)
  k = _load_rows(k_ref, lanes, c, st)
  q_inv = k_inv = None
  if st.l2norm:
    q, q_inv = _l2norm(q)
    k, k_inv = _l2norm(k)
  return q * st.scale, k, q, q_inv, k_inv


def _state_rows(r: int, st: _Static):
  return slice(r * st.k_dim, (r + 1) * st.k_dim)


def _load_step(q_ref, k_ref, v_ref, tile_ref, c, st: _Static):
  """The step's inputs per value head r (key head r // G): q (scaled, normalised), k
  (normalised), the key heads' (q normalised unscaled, 1 / |q|, 1 / |k|), v, gate tile,
  and k k^T, q k^T per key head (computed once for its G value heads)."""
  keys = [_prepare_qk(q_ref, k_ref, i, c, st) for i in range(st.key_heads)]
  kks = [_mm_nt(x[1], x[1]) for x in keys]
  qks = [_mm_nt(x[0], x[1]) for x in keys]
  heads = range(st.heads)
  per_head = lambda xs: [xs[r // st.group] for r in heads]
  vs = [_load_rows(v_ref, _v_lanes(r, st), c, st) for r in heads]
  tiles = [tile_ref[r * _GATE_ROWS:(r + 1) * _GATE_ROWS, :] for r in heads]
  qs, ks = per_head([x[0] for x in keys]), per_head([x[1] for x in keys])
  return keys, qs, ks, vs, tiles, per_head(kks), per_head(qks)


def _v_lanes(r: int, st: _Static):
  return slice(r * st.v_dim, (r + 1) * st.v_dim)


def _forward_kernel(seq_ref, flag_ref, q_ref, k_ref, v_ref, tile_ref, *refs, st: _Static,
                    emit_out: bool, emit_states: bool):
  del seq_ref
  refs = list(refs)
  h0_ref = refs.pop(0) if st.has_initial else None
  o_ref = refs.pop(0) if emit_out else None
  ht_ref = refs.pop(0) if st.emit_final else None
  hs_ref = refs.pop(0) if emit_states else None
  (s_scr,) = refs
  c = pl.program_id(2)
  first, _ = _flags(st, flag_ref, c)

  @pl.when(first)
  def _init():
    if h0_ref is not None:
      s_scr[...] = h0_ref[...]
    else:
      s_scr[...] = jnp.zeros_like(s_scr)

  _, qs, ks, vs, tiles, kks, qks = _load_step(q_ref, k_ref, v_ref, tile_ref, c, st)
  ss = [s_scr[_state_rows(r, st), :] for r in range(st.heads)]
  if emit_states:
    for r, s in enumerate(ss):
      hs_ref[_state_rows(r, st), :] = s
  outs, s_news = _forward_heads(qs, ks, vs, kks, qks, tiles, ss, st.k_dim, emit_out)
  for r in range(st.heads):
    if emit_out:
      o_ref[:, _v_lanes(r, st)] = outs[r].astype(o_ref.dtype)
    s_scr[_state_rows(r, st), :] = s_news[r]
    if ht_ref is not None:
      ht_ref[_state_rows(r, st), :] = s_news[r]


def _backward_kernel(seq_ref, flag_ref, q_ref, k_ref, v_ref, tile_ref, hs_ref, do_ref, *refs,
                     st: _Static, has_dht: bool):
  del seq_ref
  refs = list(refs)
  dht_ref = refs.pop(0) if has_dht else None
  dq_ref, dk_ref, dv_ref, dtile_ref = refs[:4]
  refs = refs[4:]
  dh0_ref = refs.pop(0) if st.has_initial else None
  (ds_scr,) = refs
  c = st.num_chunks - 1 - pl.program_id(2)     # chunks in reverse
  _, last = _flags(st, flag_ref, c)

  @pl.when(last)
  def _init():
    if dht_ref is not None:
      ds_scr[...] = dht_ref[...]
    else:
      ds_scr[...] = jnp.zeros_like(ds_scr)

  keys, qs, ks, vs, tiles, kks, qks = _load_step(q_ref, k_ref, v_ref, tile_ref, c, st)
  heads = range(st.heads)
  ss = [hs_ref[_state_rows(r, st), :] for r in heads]
  ds_nexts = [ds_scr[_state_rows(r, st), :] for r in heads]
  dos = [_load_rows(do_ref, _v_lanes(r, st), c, st) for r in heads]
  dqs, dks, dvs, dgs, dbetas, dss = _backward_heads(qs, ks, vs, kks, qks, tiles, ss, ds_nexts,
                                                    dos, st.k_dim)
  for r in heads:
    ds_scr[_state_rows(r, st), :] = dss[r]
    if dh0_ref is not None:
      dh0_ref[_state_rows(r, st), :] = dss[r]
    dv_ref[:, _v_lanes(r, st)] = dvs[r].astype(dv_ref.dtype)
    dtile_ref[r * _GATE_ROWS:(r + 1) * _GATE_ROWS, :] = _rows_tile(dgs[r], dbetas[r])
  for i, (_, k, q_n, q_inv, k_inv) in enumerate(keys):
    group = range(i * st.group, (i + 1) * st.group)
    dq = sum(dqs[r] for r in group) * st.scale
    dk = sum(dks[r] for r in group)
    if st.l2norm:
      dq = _l2norm_bwd(dq, q_n, q_inv)
      dk = _l2norm_bwd(dk, k, k_inv)
    lanes_k = slice(i * st.k_dim, (i + 1) * st.k_dim)
    dq_ref[:, lanes_k] = dq.astype(dq_ref.dtype)
    dk_ref[:, lanes_k] = dk.astype(dk_ref.dtype)


# ----------------------------------------------------------------------------- pallas calls


def _specs(st: _Static, reverse: bool):
  """BlockSpecs of the chunked kernels: (qk, v, tile, state, hs)."""
  nc, nb = st.num_chunks, st.head_blocks

  def chunk(c):
    return nc - 1 - c if reverse else c

  qk = pl.BlockSpec((None, CHUNK, st.key_heads * st.k_dim),
                    lambda b, j, c, *_: (b, chunk(c), j))
  v = pl.BlockSpec((None, CHUNK, st.heads * st.v_dim), lambda b, j, c, *_: (b, chunk(c), j))
  tile = pl.BlockSpec((None, None, st.heads * _GATE_ROWS, _LANES),
                      lambda b, j, c, *_: (b, chunk(c), j, 0))

  def state_map(b, j, c, seq_ref, flag_ref):
    del flag_ref
    slot = seq_ref[chunk(c)] if st.varlen else b
    return slot * nb + j, 0

  state = pl.BlockSpec((st.heads * st.k_dim, st.v_dim), state_map)
  hs = pl.BlockSpec((st.heads * st.k_dim, st.v_dim),
                    lambda b, j, c, *_: ((b * nc + chunk(c)) * nb + j, 0))
  return qk, v, tile, state, hs


def _params(st: _Static):
  return pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary"),
                              vmem_limit_bytes=st.vmem_limit_bytes)


def _forward_call(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, st: _Static, *, emit_out: bool,
                  emit_states: bool, num_slots: int):
  qk_spec, v_spec, tile_spec, state_spec, hs_spec = _specs(st, reverse=False)
  in_specs = [qk_spec, qk_spec, v_spec, tile_spec]
  operands = [qx, kx, vx, tiles]
  if st.has_initial:
    in_specs.append(state_spec)
    operands.append(h0x)
  out_specs, out_shape = [], []
  state_rows = num_slots * st.num_v_heads * st.k_dim
  if emit_out:
    out_specs.append(v_spec)
    out_shape.append(jax.ShapeDtypeStruct(vx.shape, vx.dtype))
  if st.emit_final:
    out_specs.append(state_spec)
    out_shape.append(jax.ShapeDtypeStruct((state_rows, st.v_dim), jnp.float32))
  if emit_states:
    out_specs.append(hs_spec)
    out_shape.append(jax.ShapeDtypeStruct(
        (st.batch * st.num_chunks * st.num_v_heads * st.k_dim, st.v_dim), jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_forward_kernel, st=st, emit_out=emit_out, emit_states=emit_states),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(st.batch, st.head_blocks, st.num_chunks),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((st.heads * st.k_dim, st.v_dim), jnp.float32)]),
      out_shape=out_shape,
      compiler_params=_params(st),
      interpret=st.interpret,
      name=STATES_KERNEL if emit_states else FORWARD_KERNEL,
  )(seq_tab, flag_tab, *operands)
  return list(outs)


def _backward_call(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, hs, dox, dhtx, st: _Static,
                   num_slots: int):
  qk_spec, v_spec, tile_spec, state_spec, hs_spec = _specs(st, reverse=True)
  in_specs = [qk_spec, qk_spec, v_spec, tile_spec, hs_spec, v_spec]
  operands = [qx, kx, vx, tiles, hs, dox]
  if dhtx is not None:
    in_specs.append(state_spec)
    operands.append(dhtx)
  out_specs = [qk_spec, qk_spec, v_spec, tile_spec]
  out_shape = [jax.ShapeDtypeStruct(qx.shape, qx.dtype), jax.ShapeDtypeStruct(kx.shape, kx.dtype),
               jax.ShapeDtypeStruct(vx.shape, vx.dtype),
               jax.ShapeDtypeStruct(tiles.shape, jnp.float32)]
  if st.has_initial:
    out_specs.append(state_spec)
    out_shape.append(jax.ShapeDtypeStruct(h0x.shape, jnp.float32))
  outs = pl.pallas_call(
      functools.partial(_backward_kernel, st=st, has_dht=dhtx is not None),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=2,
          grid=(st.batch, st.head_blocks, st.num_chunks),
          in_specs=in_specs,
          out_specs=out_specs,
          scratch_shapes=[pltpu.VMEM((st.heads * st.k_dim, st.v_dim), jnp.float32)]),
      out_shape=out_shape,
      compiler_params=_params(st),
      interpret=st.interpret,
      name=BACKWARD_KERNEL,
  )(seq_tab, flag_tab, *operands)
  del num_slots
  return list(outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8))
def _chunked(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, st: _Static, num_slots: int):
  outs = _forward_call(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, st, emit_out=True,
                       emit_states=False, num_slots=num_slots)
  return outs[0], (outs[1] if st.emit_final else None)


def _chunked_fwd(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, st, num_slots):
  out = _chunked(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, st, num_slots)
  return out, (qx, kx, vx, tiles, h0x, seq_tab, flag_tab)


def _chunked_bwd(st: _Static, num_slots: int, saved, cotangents):
  qx, kx, vx, tiles, h0x, seq_tab, flag_tab = saved
  dox, dhtx = cotangents
  # The backward's states: the forward once more, writing each chunk's starting state.
  states_st = dataclasses.replace(st, emit_final=False)
  (hs,) = _forward_call(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, states_st, emit_out=False,
                        emit_states=True, num_slots=num_slots)
  outs = _backward_call(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, hs, dox.astype(vx.dtype),
                        None if dhtx is None else dhtx.astype(jnp.float32), st, num_slots)
  dqx, dkx, dvx, dtiles = outs[:4]
  dh0x = outs[4] if st.has_initial else None
  return dqx, dkx, dvx, dtiles, dh0x, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)


# ----------------------------------------------------------------------------- XLA glue


def _pad_last(x, to: int):
  if x.shape[-1] == to:
    return x
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, to - x.shape[-1])])


def _gate_tiles(g, beta, num_chunks: int):
  """g, beta [Bx, NC * C, Hv] -> tiles [Bx, NC, Hv * 8, 128] float32: per value head and
  chunk, row 0 the chunk-local cumsum of g, row 1 beta (lanes 0..C-1)."""
  bx, _, hv = g.shape
  gc = jnp.cumsum(g.astype(jnp.float32).reshape(bx, num_chunks, CHUNK, hv), axis=2)
  b = beta.astype(jnp.float32).reshape(bx, num_chunks, CHUNK, hv)
  rows = jnp.stack([gc, b], axis=3).transpose(0, 1, 4, 3, 2)     # [Bx, NC, Hv, 2, C]
  rows = jnp.pad(rows, ((0, 0), (0, 0), (0, 0), (0, _GATE_ROWS - 2), (0, _LANES - CHUNK)))
  return rows.reshape(bx, num_chunks, hv * _GATE_ROWS, _LANES)


def _pack_plan(cu_seqlens, num_tokens: int, num_seqs: int):
  """Where packed tokens go so that every sequence starts a chunk (module docstring).

  Returns (num_chunks, src [NC * C] token per packed row (num_tokens: padding),
  dest [T] packed row per token (NC * C: not in a sequence), chunk_seq [NC],
  chunk_flags [NC])."""
  num_chunks = num_seqs + num_tokens // CHUNK
  rows = num_chunks * CHUNK
  cu = cu_seqlens.astype(jnp.int32)
  lens = cu[1:] - cu[:-1]
  chunks = jnp.maximum(1, (lens + CHUNK - 1) // CHUNK)
  chunk_end = jnp.cumsum(chunks)
  chunk_start = chunk_end - chunks
  tok = jnp.arange(num_tokens, dtype=jnp.int32)
  seq = jnp.clip(jnp.searchsorted(cu[1:], tok, side="right"), 0, num_seqs - 1)
  inside = (tok >= cu[0]) & (tok < cu[-1])
  dest = jnp.where(inside, chunk_start[seq] * CHUNK + tok - cu[seq], rows).astype(jnp.int32)
  n = jnp.arange(num_chunks, dtype=jnp.int32)
  chunk_seq = jnp.clip(jnp.searchsorted(chunk_end, n, side="right"), 0, num_seqs - 1)
  chunk_seq = chunk_seq.astype(jnp.int32)
  row = jnp.arange(rows, dtype=jnp.int32)
  row_seq = chunk_seq[row // CHUNK]
  pos = row - chunk_start[row_seq] * CHUNK            # position in its sequence
  src = jnp.where(pos < lens[row_seq], cu[row_seq] + pos, num_tokens).astype(jnp.int32)
  first = n == chunk_start[chunk_seq]
  last = jnp.concatenate([first[1:], jnp.ones((1,), bool)])
  flags = first.astype(jnp.int32) * _FIRST + last.astype(jnp.int32) * _LAST
  return num_chunks, src, dest, chunk_seq, flags


def _gather_rows(x, idx):
  """x [T, ...] rows at idx; idx == T gives a zero row."""
  return jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)])[idx]


@jax.custom_vjp
def _move_rows(x, to, back):
  """Rows of x [R, ...] moved by a partial permutation: out[i] = x[to[i]] (a zero row where
  to[i] == R), each row of x going to at most one place, back[j] (len(to) for nowhere).
  Its transpose is the gather by `back` (not a scatter-add)."""
  return _gather_rows(x, to)


def _move_rows_fwd(x, to, back):
  return _gather_rows(x, to), (to, back)


def _move_rows_bwd(saved, d_out):
  to, back = saved
  return _gather_rows(d_out, back), None, None


_move_rows.defvjp(_move_rows_fwd, _move_rows_bwd)


# ----------------------------------------------------------------------------- checks


def _is_concrete(*arrays) -> bool:
  return all(not isinstance(a, jax.core.Tracer) for a in arrays)


def _check(q, k, v, g, beta, initial_state, cu_seqlens, scale):
  for name, a in (("q", q), ("k", k), ("v", v)):
    if getattr(a, "ndim", None) != 4:
      raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim], got shape "
                       f"{getattr(a, 'shape', None)}")
  if q.dtype not in FLOAT_DTYPES:
    raise TypeError(f"q must be float32 or bfloat16, got {q.dtype}")
  for name, a in (("k", k), ("v", v)):
    if a.dtype != q.dtype:
      raise TypeError(f"{name} must have q's dtype {q.dtype}, got {a.dtype}; no silent casts")
  if k.shape != q.shape:
    raise ValueError(f"q and k must have the same shape, got q {q.shape} and k {k.shape}")
  batch, seq, num_k_heads, k_dim = q.shape
  if v.shape[:2] != (batch, seq):
    raise ValueError(f"v {v.shape} must match q {q.shape} in batch and sequence length")
  num_v_heads, v_dim = v.shape[2:]
  if num_k_heads == 0 or k_dim == 0 or v_dim == 0:
    raise ValueError(f"heads and head dims must be positive, got q {q.shape} and v {v.shape}")
  if num_v_heads % num_k_heads:
    raise ValueError(f"the number of value heads ({num_v_heads}) must be a multiple of the "
                     f"number of key heads ({num_k_heads})")
  if getattr(g, "shape", None) != (batch, seq, num_v_heads):
    raise ValueError(f"g must have shape {(batch, seq, num_v_heads)}, got "
                     f"{getattr(g, 'shape', None)}")
  if g.dtype != jnp.float32:
    raise TypeError(f"g (the log-decay) must be float32, got {g.dtype}")
  if getattr(beta, "shape", None) != (batch, seq, num_v_heads):
    raise ValueError(f"beta must have shape {(batch, seq, num_v_heads)}, got "
                     f"{getattr(beta, 'shape', None)}")
  if beta.dtype not in (jnp.float32, q.dtype):
    raise TypeError(f"beta must be float32 or q's dtype {q.dtype}, got {beta.dtype}")
  num_states = batch
  if cu_seqlens is not None:
    if getattr(cu_seqlens, "ndim", None) != 1 or cu_seqlens.shape[0] < 2:
      raise ValueError(f"cu_seqlens must be 1-D [num_seqs + 1] with at least 2 entries, got "
                       f"shape {getattr(cu_seqlens, 'shape', None)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
      raise TypeError(f"cu_seqlens must be integers, got {cu_seqlens.dtype}")
    if batch != 1:
      raise ValueError(f"packed sequences (cu_seqlens) need batch 1, got batch {batch}")
    num_states = cu_seqlens.shape[0] - 1
    if _is_concrete(cu_seqlens):
      cu = np.asarray(cu_seqlens)
      if cu[0] != 0 or cu[-1] != seq or np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must rise from 0 to the sequence length {seq}, got "
                         f"{cu.tolist()}")
  if initial_state is not None:
    want = (num_states, num_v_heads, k_dim, v_dim)
    if getattr(initial_state, "shape", None) != want:
      raise ValueError(f"initial_state must have shape {want} ([batch or num_seqs, value "
                       f"heads, K, V]), got {getattr(initial_state, 'shape', None)}")
    if initial_state.dtype != jnp.float32:
      raise TypeError(f"initial_state must be float32, got {initial_state.dtype}")
  if scale is not None and not (isinstance(scale, (int, float, np.floating)) and scale > 0):
    raise ValueError(f"scale must be None or a positive float, got {scale!r}")
  return num_states


# ----------------------------------------------------------------------------- JAX API


def chunk_gated_delta_rule(q, k, v, g, beta, *, initial_state=None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                           scale: float | None = None, chip: str | None = None,
                           heads_per_step: int | None = None,
                           vmem_limit_bytes: int | None = None, interpret: bool = False):
  """The gated delta rule by chunks of 64 tokens (module docstring): prefill and training.

  Args:
    q, k: [B, T, Hk, K] float32 or bfloat16.
    v: [B, T, Hv, V], q's dtype; Hv a multiple of Hk (value head h reads key head h // G).
    g: [B, T, Hv] float32: the log-decay (<= 0 and finite: a positive g can overflow the
      chunk's exp(G_i - G_j), as in Transformers' chunked code).
    beta: [B, T, Hv] float32 or q's dtype.
    initial_state: None (zeros) or [B, Hv, K, V] float32 ([N, Hv, K, V] with cu_seqlens).
    output_final_state: also return the final state(s), float32.
    use_qk_l2norm_in_kernel: l2-normalise q and k (eps 1e-6) first.
    cu_seqlens: None, or [N + 1] integers (B must be 1): sequence s is tokens
      cu_seqlens[s]:cu_seqlens[s + 1], with its own initial and final state.
    scale: q's scale, default K^-0.5.
    chip: tiles and VMEM limit for "v5e", "v6e", "v5p" or "v7" (default v6e).
    heads_per_step, vmem_limit_bytes: override the tiling (`gdn_tiling`).
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    (o [B, T, Hv, V] in q's dtype, final state [B or N, Hv, K, V] float32 or None).
    Differentiable with respect to q, k, v, g, beta and initial_state.
  """
  num_states = _check(q, k, v, g, beta, initial_state, cu_seqlens, scale)
  batch, seq, num_k_heads, k_dim = q.shape
  num_v_heads, v_dim = v.shape[2:]
  chip = chips.DEFAULT_CHIP if chip is None else chip
  scale = float(k_dim ** -0.5 if scale is None else scale)
  kp, vp = vmem.round_up(k_dim, _LANES), vmem.round_up(v_dim, _LANES)
  if seq == 0:
    o = jnp.zeros(v.shape, v.dtype)
    if not output_final_state:
      return o, None
    state = (jnp.zeros((num_states, num_v_heads, k_dim, v_dim), jnp.float32)
             if initial_state is None else initial_state)
    return o, state
  t = gdn_tiling(num_k_heads, num_v_heads, kp, vp, dtype=q.dtype, chip=chip,
                 heads_per_step=heads_per_step, vmem_limit_bytes=vmem_limit_bytes)

  def lanes(x, heads, dim, to):   # [B, T, H, D] -> [B, T, H * Dp]
    x = _pad_last(x, to)
    return x.reshape(x.shape[0], x.shape[1], heads * to)

  qx, kx = lanes(q, num_k_heads, k_dim, kp), lanes(k, num_k_heads, k_dim, kp)
  vx = lanes(v, num_v_heads, v_dim, vp)
  if cu_seqlens is None:
    bx, tx = batch, max(seq, CHUNK)
    if tx != seq:   # T < C: one chunk, padded
      pad = ((0, 0), (0, tx - seq), (0, 0))
      qx, kx, vx = (jnp.pad(a, pad) for a in (qx, kx, vx))
    num_chunks = -(-tx // CHUNK)
    gate_pad = ((0, 0), (0, num_chunks * CHUNK - seq), (0, 0))
    gx, bx_ = jnp.pad(g, gate_pad), jnp.pad(beta, gate_pad)
    seq_tab = flag_tab = jnp.zeros((1,), jnp.int32)
  else:
    num_chunks, src, dest, seq_tab, flag_tab = _pack_plan(cu_seqlens, seq, num_states)
    bx, tx = 1, num_chunks * CHUNK
    qx, kx, vx, gx, bx_ = (_move_rows(a[0], src, dest)[None] for a in (qx, kx, vx, g, beta))
  tiles = _gate_tiles(gx, bx_, num_chunks)
  h0x = None
  if initial_state is not None:
    h0 = _pad_last(initial_state, vp)
    h0 = jnp.pad(h0, ((0, 0), (0, 0), (0, kp - k_dim), (0, 0)))
    h0x = h0.reshape(num_states * num_v_heads * kp, vp)
  st = _Static(batch=bx, seq_len=tx, num_chunks=num_chunks, num_k_heads=num_k_heads,
               num_v_heads=num_v_heads, k_dim=kp, v_dim=vp, heads=t.heads_per_step,
               scale=scale, l2norm=bool(use_qk_l2norm_in_kernel),
               varlen=cu_seqlens is not None, has_initial=initial_state is not None,
               emit_final=bool(output_final_state), vmem_limit_bytes=t.vmem_limit_bytes,
               interpret=bool(interpret))
  ox, htx = _chunked(qx, kx, vx, tiles, h0x, seq_tab, flag_tab, st, num_states)
  if cu_seqlens is None:
    o = ox[:, :seq]
  else:
    o = _move_rows(ox[0], dest, src)[None]
  o = o.reshape(batch, seq, num_v_heads, vp)[..., :v_dim]
  final = None
  if output_final_state:
    final = htx.reshape(num_states, num_v_heads, kp, vp)[:, :, :k_dim, :v_dim]
  return o, final


# ----------------------------------------------------------------------------- decode


@dataclasses.dataclass(frozen=True)
class _DecodeStatic:
  num_seqs: int
  tokens: int             # L, tokens per sequence
  num_k_heads: int
  num_v_heads: int
  k_dim: int
  v_dim: int
  heads: int              # value heads per step
  scale: float
  l2norm: bool
  vmem_limit_bytes: int
  interpret: bool

  @property
  def group(self):
    return self.num_v_heads // self.num_k_heads

  @property
  def key_heads(self):    # key heads per step
    return self.heads // self.group

  @property
  def head_blocks(self):
    return self.num_v_heads // self.heads


def _decode_kernel(g_ref, beta_ref, q_ref, k_ref, v_ref, s_ref, o_ref, s_out_ref, *,
                   st: _DecodeStatic):
  j = pl.program_id(1)
  kd, tokens = st.k_dim, st.tokens
  g_all = g_ref[...].astype(jnp.float32)                # (L, Hv)
  beta_all = beta_ref[...].astype(jnp.float32)
  lane = _iota((1, st.num_v_heads), 1)

  def pick(rows, t, h):   # rows[t, h] as a (1, 1) value (h traced: lanes, not a slice)
    return jnp.sum(jnp.where(lane == h, rows[t:t + 1, :], 0.0), axis=1, keepdims=True)

  def columns(ref):
    """The block's rows (key head, token) as float32 columns (K, rows), normalised."""
    x = ref[...].astype(jnp.float32)
    if st.l2norm:
      x, _ = _l2norm(x)
    pad = vmem.round_up(x.shape[0], 8) - x.shape[0]
    if pad:
      x = jnp.concatenate([x, jnp.zeros((pad, kd), jnp.float32)], axis=0)
    return x.T

  q_cols, k_cols = columns(q_ref) * st.scale, columns(k_ref)
  v_all = v_ref[...].astype(jnp.float32)                # (heads * L, V), rows (head, token)
  outs = []
  for r in range(st.heads):
    s = s_ref[r * kd:(r + 1) * kd, :]
    for t in range(tokens):
      col = (r // st.group) * tokens + t
      q_col, k_col = q_cols[:, col:col + 1], k_cols[:, col:col + 1]
      h = j * st.heads + r
      decay, beta = jnp.exp(pick(g_all, t, h)), pick(beta_all, t, h)
      ks = jnp.sum(k_col * s, axis=0, keepdims=True)              # (1, V)
      qs = jnp.sum(q_col * s, axis=0, keepdims=True)
      qk = jnp.sum(q_col * k_col, axis=0, keepdims=True)          # (1, 1)
      delta = beta * (v_all[r * tokens + t:r * tokens + t + 1, :] - decay * ks)
      outs.append(decay * qs + qk * delta)
      s = decay * s + k_col * delta
    s_out_ref[r * kd:(r + 1) * kd, :] = s
  o_ref[...] = jnp.concatenate(outs, axis=0).astype(o_ref.dtype)


def _decode_call(qd, kd, vd, g, beta, state, st: _DecodeStatic):
  """qd, kd [N, Hk * L, Kp], vd [N, Hv * L, Vp] (rows (head, token)); g (f32), beta
  [N, L, Hv]; state [N * Hv * Kp, Vp] f32 (aliased to the new state)."""
  nb, tokens = st.head_blocks, st.tokens
  qk_spec = pl.BlockSpec((None, st.key_heads * tokens, st.k_dim), lambda n, j: (n, j, 0))
  v_spec = pl.BlockSpec((None, st.heads * tokens, st.v_dim), lambda n, j: (n, j, 0))
  gate_spec = pl.BlockSpec((None, tokens, st.num_v_heads), lambda n, j: (n, 0, 0))
  s_spec = pl.BlockSpec((st.heads * st.k_dim, st.v_dim), lambda n, j: (n * nb + j, 0))
  return pl.pallas_call(
      functools.partial(_decode_kernel, st=st),
      grid=(st.num_seqs, nb),
      in_specs=[gate_spec, gate_spec, qk_spec, qk_spec, v_spec, s_spec],
      out_specs=[v_spec, s_spec],
      out_shape=[jax.ShapeDtypeStruct(vd.shape, vd.dtype),
                 jax.ShapeDtypeStruct(state.shape, jnp.float32)],
      input_output_aliases={5: 1},
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel"),
                                           vmem_limit_bytes=st.vmem_limit_bytes),
      interpret=st.interpret,
      name=DECODE_KERNEL,
  )(g, beta, qd, kd, vd, state)


def _decode_forward(q, k, v, g, beta, h0, st: _DecodeStatic, k_dim: int, v_dim: int):
  """The decode kernel on [N, L, ...] inputs (unpadded dims), h0 [N, Hv, K, V] f32."""
  n, tokens = q.shape[:2]
  hk, hv = q.shape[2], v.shape[2]
  kp, vp = st.k_dim, st.v_dim

  def rows(x, heads, to):   # [N, L, H, D] -> [N, H * L, Dp], rows (head, token): a free
    x = _pad_last(x, to).transpose(0, 2, 1, 3)   # view at L = 1 and D = Dp
    return x.reshape(n, heads * tokens, to)

  state = jnp.pad(_pad_last(h0, vp), ((0, 0), (0, 0), (0, kp - k_dim), (0, 0)))
  state = state.reshape(n * hv * kp, vp)
  o, s = _decode_call(rows(q, hk, kp), rows(k, hk, kp), rows(v, hv, vp), g, beta, state, st)
  o = o.reshape(n, hv, tokens, vp).transpose(0, 2, 1, 3)[..., :v_dim]   # free at L = 1
  s = s.reshape(n, hv, kp, vp)[:, :, :k_dim, :v_dim]
  return o, s


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _recurrent(q, k, v, g, beta, h0, st: _DecodeStatic, chunk_options):
  return _decode_forward(q, k, v, g, beta, h0, st, q.shape[3], v.shape[3])


def _recurrent_fwd(q, k, v, g, beta, h0, st, chunk_options):
  out = _recurrent(q, k, v, g, beta, h0, st, chunk_options)
  return out, (q, k, v, g, beta, h0)


def _recurrent_bwd(st, chunk_options, saved, cotangents):
  """The decode step's VJP: the chunked kernels' backward on the same inputs."""
  def chunked(q, k, v, g, beta, h0):
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                  **dict(chunk_options))

  _, vjp = jax.vjp(chunked, *saved)
  return vjp(cotangents)


_recurrent.defvjp(_recurrent_fwd, _recurrent_bwd)


def fused_recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False, cu_seqlens=None,
                                     max_seqlen: int | None = None, scale: float | None = None,
                                     chip: str | None = None,
                                     heads_per_step: int | None = None,
                                     vmem_limit_bytes: int | None = None,
                                     interpret: bool = False):
  """The gated delta rule token by token, for decode: the same math and arguments as
  `chunk_gated_delta_rule`, run by the recurrent kernel (module docstring, "Decode").

  Args beyond chunk_gated_delta_rule's:
    max_seqlen: with cu_seqlens, a static bound on any sequence's length (L); read from
      cu_seqlens when it is concrete, required under jit.
    heads_per_step, vmem_limit_bytes: override the decode tiling (`decode_tiling`).

  The state is read once and written once per call. To update it in place on a TPU, jit
  the call with the initial state donated (its buffer is aliased to the final state's).
  Calls with more than MAX_RECURRENT_TOKENS tokens per sequence run the chunked kernel.
  Differentiable (through the chunked backward).

  Returns:
    (o [B, T, Hv, V] in q's dtype, final state float32 or None).
  """
  num_states = _check(q, k, v, g, beta, initial_state, cu_seqlens, scale)
  batch, seq, num_k_heads, k_dim = q.shape
  num_v_heads, v_dim = v.shape[2:]
  chip = chips.DEFAULT_CHIP if chip is None else chip
  scale = float(k_dim ** -0.5 if scale is None else scale)
  chunk_options = (("use_qk_l2norm_in_kernel", bool(use_qk_l2norm_in_kernel)),
                   ("scale", scale), ("chip", chip), ("interpret", bool(interpret)))
  if cu_seqlens is not None:
    if max_seqlen is None:
      if not _is_concrete(cu_seqlens):
        raise ValueError("fused_recurrent_gated_delta_rule with a traced cu_seqlens needs a "
                         "static max_seqlen")
      cu = np.asarray(cu_seqlens)
      max_seqlen = int(np.max(np.diff(cu), initial=0))
    if not isinstance(max_seqlen, (int, np.integer)) or max_seqlen < 0:
      raise ValueError(f"max_seqlen must be an int >= 0, got {max_seqlen!r}")
    tokens = max(1, int(max_seqlen))
  else:
    tokens = seq
  if seq == 0 or tokens > MAX_RECURRENT_TOKENS:
    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  cu_seqlens=cu_seqlens, **dict(chunk_options))
  kp, vp = vmem.round_up(k_dim, _LANES), vmem.round_up(v_dim, _LANES)
  t = decode_tiling(num_k_heads, num_v_heads, kp, vp, tokens, dtype=q.dtype, chip=chip,
                    heads_per_step=heads_per_step, vmem_limit_bytes=vmem_limit_bytes)
  st = _DecodeStatic(num_seqs=num_states, tokens=tokens, num_k_heads=num_k_heads,
                     num_v_heads=num_v_heads, k_dim=kp, v_dim=vp, heads=t.heads_per_step,
                     scale=scale, l2norm=bool(use_qk_l2norm_in_kernel), vmem_limit_bytes=t.vmem_limit_bytes,
                     interpret=bool(interpret))
  h0 = (jnp.zeros((num_states, num_v_heads, k_dim, v_dim), jnp.float32)
        if initial_state is None else initial_state)
  if cu_seqlens is None:
    o, state = _recurrent(q, k, v, g, beta, h0, st, chunk_options)
  else:
    # Re-pack [1, T] -> [N, L]: token i of sequence s at (s, i); padding is zeros (beta 0,
    # g 0: no change to the state).
    cu = cu_seqlens.astype(jnp.int32)
    pos = cu[:-1, None] + jnp.arange(tokens, dtype=jnp.int32)[None, :]
    src = jnp.where(pos < cu[1:, None], pos, seq).reshape(-1)          # [N * L]
    tok = jnp.arange(seq, dtype=jnp.int32)
    seq_of = jnp.clip(jnp.searchsorted(cu[1:], tok, side="right"), 0, num_states - 1)
    inside = (tok >= cu[0]) & (tok < cu[-1])
    flat = jnp.where(inside, seq_of * tokens + tok - cu[seq_of], num_states * tokens)
    dense = [_move_rows(a[0], src, flat).reshape((num_states, tokens) + a.shape[2:])
             for a in (q, k, v, g, beta)]
    o_d, state = _recurrent(*dense, h0, st, chunk_options)
    o = _move_rows(o_d.reshape(num_states * tokens, num_v_heads, v_dim), flat, src)[None]
  return o, (state if output_final_state else None)


# ----------------------------------------------------------------------------- XLA baseline


def chunk_gated_delta_rule_xla(q, k, v, g, beta, *, initial_state=None,
                               use_qk_l2norm_in_kernel: bool = False,
                               scale: float | None = None):
  """The same chunked algorithm in plain jnp (f32, HIGHEST matmuls, a lax.scan over
  chunks; no packed sequences): the XLA baseline the benchmarks compare against. Returns
  (o in q's dtype, final state [B, Hv, K, V] float32)."""
  batch, seq, num_k_heads, k_dim = q.shape
  num_v_heads, v_dim = v.shape[2:]
  group = num_v_heads // num_k_heads
  scale = k_dim ** -0.5 if scale is None else scale
  nc = -(-seq // CHUNK)
  pad = nc * CHUNK - seq

  def heads_first(x, rep):   # [B, T, H, D] -> [B, Hv, NC, C, D] f32
    x = jnp.repeat(x.astype(jnp.float32), rep, axis=2)
    x = jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    return x.transpose(0, 2, 1, 3).reshape(batch, num_v_heads, nc, CHUNK, x.shape[-1])

  qf, kf = q.astype(jnp.float32), k.astype(jnp.float32)
  if use_qk_l2norm_in_kernel:
    qf = qf * lax.rsqrt(jnp.sum(qf * qf, -1, keepdims=True) + L2NORM_EPS)
    kf = kf * lax.rsqrt(jnp.sum(kf * kf, -1, keepdims=True) + L2NORM_EPS)
  qh, kh, vh = heads_first(qf * scale, group), heads_first(kf, group), heads_first(v, 1)
  gates = _gate_tiles(jnp.pad(g, ((0, 0), (0, pad), (0, 0))),
                      jnp.pad(beta, ((0, 0), (0, pad), (0, 0))), nc)
  gates = gates.reshape(batch, nc, num_v_heads, _GATE_ROWS, _LANES).transpose(0, 2, 1, 3, 4)
  s0 = (jnp.zeros((batch, num_v_heads, k_dim, v_dim), jnp.float32) if initial_state is None
        else initial_state.astype(jnp.float32))

  def one(qc, kc, vc, tile, s):
    outs, s_news = _forward_heads([qc], [kc], [vc], [_mm_nt(kc, kc)], [_mm_nt(qc, kc)], [tile],
                                  [s], k_dim, True)
    return outs[0], s_news[0]

  step_fn = jax.vmap(jax.vmap(one))

  def step(s, xs):
    qc, kc, vc, tile = xs
    out, s_new = step_fn(qc, kc, vc, tile, s)
    return s_new, out

  xs = tuple(jnp.moveaxis(a, 2, 0) for a in (qh, kh, vh, gates))
  s_final, outs = lax.scan(step, s0, xs)          # outs [NC, B, Hv, C, V]
  o = outs.transpose(1, 0, 3, 2, 4).reshape(batch, nc * CHUNK, num_v_heads, v_dim)[:, :seq]
  return o.astype(q.dtype), s_final
