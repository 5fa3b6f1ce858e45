"""The MoE route's sort at decode as one Pallas kernel of index arithmetic (moe.route's
steps 1-3), no sort.

    route_indices(top_k_index[T, K] int, num_experts) -> (pos[S], src[S], group_sizes[E])
    S = T * K, pair i = t * K + k, key[i] = top_k_index[t, k] (E where outside [0, E))
    pos[i]         = the sorted row of pair i in the stable sort of the pairs by key
                   = sum_{e < key[i]} count[e] + #{j < i : key[j] = key[i]}
    src[pos[i]]    = t                    (the token each sorted row gathers)
    group_sizes[e] = count[e] = #{i : key[i] = e}, e < E

Why a kernel: at decode moe.route's XLA program is a stable argsort, a compare-and-sum and
their index ops, each an XLA op with ~2k cycles of fixed cost in libtpu's static estimate
(v6e, Qwen3-30B-A3B at T = 64: 20.6k cycles before the gather, and 11.2k more for the
argsort that inverts the permutation for moe.combine). These counts are small integer sums,
so the kernel computes them on the MXU and the VPU in one launch (2.9k cycles there), exact:

  hits_k[e, t]  = [key[t, k] = e]                            [E', T'] f32, k < K
  per_token     = sum_k hits_k                               (<= K)
  before        = per_token @ strictly_upper[T', T']          pairs of earlier tokens, per e
  count[e]      = sum_t per_token[e, t]                      (an NT matmul with ones: a row)
  offset[e]     = strictly_lower[E', E'] @ count
  pos[t, k]     = sum_e hits_k * (before + offset) + #{j < k : key[t, j] = key[t, k]}
  pos (flat)    = sum_k pos_k @ spread_k,  spread_k[t, i] = [i = t * K + k]
  src           = sum_k tokens @ placed_k^T, placed_k[s, t] = [pos[t, k] = s]

Tokens lie on lanes (T' = T rounded up to 128, padded with key E: those pairs sort last,
past every real pair), experts on sublanes (E' = E + 1 rounded up to 8). Every matmul
operand is an integer a bfloat16 holds exactly (<= 256), so one bfloat16 pass is exact
whatever precision the MXU takes: K <= 256, token ids < T <= 256, and the counts (in
`offset`) and pos (in the spread), which can pass 256, go in two parts, v // 256 and
v % 256 (S <= 65536). Sums are float32, exact below 2^24.

The data stay out of it: the gather of the rows (moe.route) and the combine's row DMAs
(moe_combine) take src and pos as they come. `fits` says where it applies (T <= 256, and
its VMEM plan); elsewhere moe.route sorts with XLA.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from . import chips, vmem

# Token ids are matmul operands in one bfloat16 pass: exact up to 256. Past it moe.route
# sorts with XLA (prefill, where the argsort's fixed cost does not show).
MAX_TOKENS = 256


def _padded(tokens: int, top_k: int, num_experts: int) -> tuple[int, int, int]:
  """(T', E', S'): tokens on whole lane tiles, experts + the "outside" bucket on whole
  sublane tiles, pairs on whole lane tiles."""
  return (vmem.round_up(tokens, 128), vmem.round_up(num_experts + 1, 8),
          vmem.round_up(tokens * top_k, 128))


def fits(tokens: int, top_k: int, num_experts: int, chip: str) -> bool:
  """Whether route_indices applies: 1 <= T <= MAX_TOKENS, 1 <= K <= 256, and its VMEM plan
  (the K hit matrices, four [E', T'] sums, the [T', T'] and [E', E'] triangles, and a spread
  and a placed matrix [T', S'], all float32) within the chip's budget."""
  if not (1 <= tokens <= MAX_TOKENS and 1 <= top_k <= 256):
    return False
  tp, ep, sp = _padded(tokens, top_k, num_experts)
  plan = 4 * ((top_k + 4) * ep * tp + tp * tp + ep * ep + 2 * tp * sp)
  return plan <= vmem.vmem_budget(chips.get_chip(chip), None)


def _nt(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [m, c] . b [n, c]^T -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _route_indices_kernel(ids_ref, pos_ref, src_ref, sizes_ref, key_ref, *, num_experts):
  top_k, tokens = ids_ref.shape
  pairs = pos_ref.shape[1]
  tp, ep, sp = _padded(tokens, top_k, num_experts)
  f32 = jnp.float32
  iota = jax.lax.broadcasted_iota

  key_ref[...] = jnp.full(key_ref.shape, num_experts, jnp.int32)      # padded tokens: last
  ids = ids_ref[...]
  key_ref[:, :tokens] = jnp.where((ids >= 0) & (ids < num_experts), ids, num_experts)
  key = key_ref[...]                                                   # [K, T']

  expert = iota(jnp.int32, (ep, tp), 0)
  hits = [(expert == key[k:k + 1]).astype(f32) for k in range(top_k)]  # [E', T'] each
  per_token = sum(hits)
  before = jnp.dot(per_token, (iota(jnp.int32, (tp, tp), 0)
                               < iota(jnp.int32, (tp, tp), 1)).astype(f32),
                   preferred_element_type=f32)
  counts = _nt(jnp.ones((8, tp), f32), per_token)                      # [8, E'], rows equal
  lower = (iota(jnp.int32, (ep, ep), 1) < iota(jnp.int32, (ep, ep), 0)).astype(f32)
  counts_high = jnp.floor(counts[:1] * (1 / 256))                     # count = 256 h + l
  offset = (256 * _nt(lower, jnp.broadcast_to(counts_high, (tp, ep)))
            + _nt(lower, jnp.broadcast_to(counts[:1] - 256 * counts_high, (tp, ep))))
  base = before + offset                                               # [E', T']

  pair = iota(jnp.int32, (tp, sp), 1)
  token_of_row = iota(jnp.int32, (tp, sp), 0)
  row = iota(jnp.int32, (sp, tp), 0)
  tokens_f32 = iota(jnp.int32, (8, tp), 1).astype(f32)
  first_row = iota(jnp.int32, (8, tp), 0) == 0
  pos_split = jnp.zeros((8, sp), f32)     # row 0: pos // 256, rows 1-7: pos % 256
  src = jnp.zeros((8, sp), f32)
  for k in range(top_k):
    pos_k = jnp.sum(hits[k] * base, axis=0, keepdims=True)            # [1, T']
    for j in range(k):                    # a repeated id within a token: after its first
      pos_k += (key[j:j + 1] == key[k:k + 1]).astype(f32)
    high = jnp.floor(pos_k * (1 / 256))
    spread = (pair == token_of_row * top_k + k).astype(f32)            # [T', S']
    pos_split += jnp.dot(jnp.where(first_row, high, pos_k - 256 * high), spread,
                         preferred_element_type=f32)
    placed = (row == pos_k.astype(jnp.int32)).astype(f32)              # [S', T']
    src += _nt(tokens_f32, placed)
  pos_ref[...] = (256 * pos_split[:1, :pairs] + pos_split[1:2, :pairs]).astype(jnp.int32)
  src_ref[...] = src[:1, :pairs].astype(jnp.int32)
  sizes_ref[...] = counts[:1, :num_experts].astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def route_indices(top_k_index: jax.Array, num_experts: int, *,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """top_k_index [T, K] integer expert ids -> (pos [S] int32, src [S] int32,
  group_sizes [num_experts] int32), as the module docstring defines them: the same as a
  stable argsort of the ids (ids outside [0, num_experts) as num_experts) would give.
  Raises ValueError outside `fits`' shapes (checked without the VMEM plan)."""
  if top_k_index.ndim != 2 or not jnp.issubdtype(top_k_index.dtype, jnp.integer):
    raise ValueError(f"top_k_index must be [T, K] integer, got {top_k_index.shape} "
                     f"{top_k_index.dtype}")
  tokens, top_k = top_k_index.shape
  if not (1 <= tokens <= MAX_TOKENS and 1 <= top_k <= 256):
    raise ValueError(f"route_indices takes 1 <= T <= {MAX_TOKENS} and 1 <= K <= 256, got "
                     f"[{tokens}, {top_k}]")
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)
  pairs = tokens * top_k
  pos, src, sizes = pl.pallas_call(
      functools.partial(_route_indices_kernel, num_experts=num_experts),
      out_shape=(jax.ShapeDtypeStruct((1, pairs), jnp.int32),
                 jax.ShapeDtypeStruct((1, pairs), jnp.int32),
                 jax.ShapeDtypeStruct((1, num_experts), jnp.int32)),
      in_specs=[whole], out_specs=(whole, whole, whole),
      scratch_shapes=[pltpu.VMEM((top_k, _padded(tokens, top_k, num_experts)[0]), jnp.int32)],
      interpret=interpret, name="moe_route_indices",
  )(top_k_index.astype(jnp.int32).T)   # [K, T]: XLA's own layout of a [T, small K] array
  return pos[0], src[0], sizes[0]
