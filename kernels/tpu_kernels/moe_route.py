"""The MoE route at decode as one Pallas kernel: the sort by index arithmetic, and the
gather of the rows by exact one-hot matmuls (moe.route's steps 1-4).

    route_rows(hidden[T, H], top_k_index[T, K] int, E) -> (x[S, H], pos[S], group_sizes[E])
    route_indices(top_k_index[T, K] int, E)           -> (pos[S], src[S], group_sizes[E])
    S = T * K, pair i = t * K + k, key[i] = top_k_index[t, k] (E where outside [0, E))
    pos[i]         = the sorted row of pair i in the stable sort of the pairs by key
                   = sum_{e < key[i]} count[e] + #{j < i : key[j] = key[i]}
    src[pos[i]]    = t,  x[s] = hidden[src[s]]   (the token each sorted row gathers)
    group_sizes[e] = count[e] = #{i : key[i] = e}, e < E

Why a kernel: at decode moe.route's XLA program is a stable argsort, a compare-and-sum, a
gather and their index ops, each an XLA op with ~2k cycles of fixed cost in libtpu's static
estimate (v6e, Qwen3-30B-A3B at T = 64: 30.2k cycles, and 11.2k more for the argsort that
inverted the permutation for moe.combine); route_rows rates 7.6k there. The counts are
small integer sums, which the kernel forms on the MXU and the VPU, exact:

  hits_k[e, t]  = [key[t, k] = e]                            [E', T'] f32, k < K
  per_token     = sum_k hits_k                               (<= K)
  before        = per_token @ strictly_upper[T', T']          pairs of earlier tokens, per e
  count[e]      = sum_t per_token[e, t]                      (an NT matmul with ones: a row)
  offset[e]     = strictly_lower[E', E'] @ count
  pos[t, k]     = sum_e hits_k * (before + offset) + #{j < k : key[t, j] = key[t, k]}
  pos (flat)    = sum_k pos_k @ spread_k,  spread_k[t, i] = [i = t * K + k]
  placed[s, t]  = sum_k [pos[t, k] = s]                      [S', T'], one 1 per real row
  src           = tokens @ placed^T                          (route_indices)
  x             = per byte b of hidden's bits: placed @ byte_b(hidden), reassembled
                                                             (route_rows)

Tokens lie on lanes (T' = T rounded up to 128, padded with key E: those pairs sort last,
past every real pair), experts on sublanes (E' = E + 1 rounded up to 8). Every matmul
operand is an integer a bfloat16 holds exactly (<= 256), so one bfloat16 pass is exact
whatever precision the MXU takes: K <= 256, token ids < T <= 256, the bytes of hidden, and
the counts (in `offset`) and pos (in the spread), which can pass 256, go in two parts,
v // 256 and v % 256 (S <= 65536). Sums are float32, exact below 2^24.

The gather moves bytes, not values: a one-hot matmul of the values would spread a NaN or
an inf in one token's row to every row (0 * inf), and could flush a denormal. Each byte of
a row's float32 bits (bfloat16: its top two) is a float32 0..255; the pick is exact and the
bits are reassembled. In interpret mode x is hidden[src] bit for bit but for a bfloat16
NaN's payload (XLA:CPU does not keep it; a NaN stays a NaN). On the chip the bfloat16 ->
float32 -> bfloat16 round trip is exact for every finite value; whether it keeps a
denormal bfloat16 (below 1.2e-38) rather than flushing it to zero cannot be checked here.

`fits` / `fits_rows` say where each applies (T <= 256 and the VMEM plans; route_rows
takes float32 and bfloat16 rows). Elsewhere moe.route sorts with XLA's argsort and gathers
with XLA.
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


def _shape_ok(tokens: int, top_k: int) -> bool:
  """The shapes both kernels take: 1 <= T <= MAX_TOKENS, 1 <= K <= 256."""
  return 1 <= tokens <= MAX_TOKENS and 1 <= top_k <= 256


def _check_ids(name: str, top_k_index: jax.Array, tokens: int | None = None) -> None:
  """top_k_index must be [T, K] integer ids within `_shape_ok` (and T = `tokens` if given):
  a float id would otherwise be truncated silently."""
  if top_k_index.ndim != 2 or not jnp.issubdtype(top_k_index.dtype, jnp.integer):
    raise ValueError(f"{name}: top_k_index must be [T, K] integer, got {top_k_index.shape} "
                     f"{top_k_index.dtype}")
  t, top_k = top_k_index.shape
  if tokens is not None and t != tokens:
    raise ValueError(f"{name}: top_k_index must be [{tokens}, K], got {top_k_index.shape}")
  if not _shape_ok(t, top_k):
    raise ValueError(f"{name} takes 1 <= T <= {MAX_TOKENS} and 1 <= K <= 256, got "
                     f"[{t}, {top_k}]")


def _indices_plan(tokens: int, top_k: int, num_experts: int) -> int:
  """VMEM bytes of the sort both kernels share: the K hit matrices, four [E', T'] sums,
  the [T', T'] and [E', E'] triangles, and a spread and a placed matrix [T', S'], all
  float32."""
  tp, ep, sp = _padded(tokens, top_k, num_experts)
  return 4 * ((top_k + 4) * ep * tp + tp * tp + ep * ep + 2 * tp * sp)


def fits(tokens: int, top_k: int, num_experts: int, chip: str) -> bool:
  """Whether route_indices applies: its shapes (`_shape_ok`) and its VMEM plan within the
  chip's budget."""
  return (_shape_ok(tokens, top_k) and _indices_plan(tokens, top_k, num_experts)
          <= vmem.vmem_budget(chips.get_chip(chip), None))


def _nt(a: jax.Array, b: jax.Array) -> jax.Array:
  """a [m, c] . b [n, c]^T -> [m, n] float32."""
  return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)


def _sort(ids_ref, key_ref, num_experts: int, pairs: int):
  """The kernels' common part: ids [K, T] -> (pos [1, S] int32; placed [S', T'] float32,
  placed[s, t] = 1 where sorted row s is token t's; counts [1, E'] float32)."""
  top_k, tokens = ids_ref.shape
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
  first_row = iota(jnp.int32, (8, tp), 0) == 0
  pos_split = jnp.zeros((8, sp), f32)     # row 0: pos // 256, rows 1-7: pos % 256
  placed = jnp.zeros((sp, tp), f32)
  for k in range(top_k):
    pos_k = jnp.sum(hits[k] * base, axis=0, keepdims=True)            # [1, T']
    for j in range(k):                    # a repeated id within a token: after its first
      pos_k += (key[j:j + 1] == key[k:k + 1]).astype(f32)
    high = jnp.floor(pos_k * (1 / 256))
    spread = (pair == token_of_row * top_k + k).astype(f32)            # [T', S']
    pos_split += jnp.dot(jnp.where(first_row, high, pos_k - 256 * high), spread,
                         preferred_element_type=f32)
    placed += (row == pos_k.astype(jnp.int32)).astype(f32)             # [S', T']
  pos = (256 * pos_split[:1, :pairs] + pos_split[1:2, :pairs]).astype(jnp.int32)
  return pos, placed, counts[:1]


def _route_indices_kernel(ids_ref, pos_ref, src_ref, sizes_ref, key_ref, *, num_experts):
  pairs = pos_ref.shape[1]
  pos, placed, counts = _sort(ids_ref, key_ref, num_experts, pairs)
  tokens = jax.lax.broadcasted_iota(jnp.int32, (8, placed.shape[1]), 1).astype(jnp.float32)
  pos_ref[...] = pos
  src_ref[...] = _nt(tokens, placed)[:1, :pairs].astype(jnp.int32)     # sum_t t placed[s, t]
  sizes_ref[...] = counts[:, :num_experts].astype(jnp.int32)


# Lanes of hidden per step of route_rows' gather: the byte planes of a chunk and their
# gathered [S', chunk] float32 results stay within v5e's budget at S' = 512.
_GATHER_LANES = 256
# The bytes of a row's bits that route_rows moves, as shifts of the float32 bits: all four
# for float32; for bfloat16 the top two (its float32 value is its bits followed by 16
# zeros). Other dtypes take route_indices and XLA's gather.
_BYTE_SHIFTS = {jnp.dtype(jnp.float32): (0, 8, 16, 24), jnp.dtype(jnp.bfloat16): (16, 24)}


def _route_rows_kernel(ids_ref, hidden_ref, pos_ref, sizes_ref, x_ref, key_ref, planes_ref, *,
                       num_experts):
  """route_indices' kernel with the gather fused: x[s] = hidden[src[s]] as one-hot
  matmuls over the bytes of hidden's bits (each byte a float32 0..255: the one-hot pick is
  exact, and no NaN or inf ever meets the MXU, so no row leaks into another)."""
  pairs, width = x_ref.shape
  tokens = hidden_ref.shape[0]
  pos, placed, counts = _sort(ids_ref, key_ref, num_experts, pairs)
  pos_ref[...] = pos
  sizes_ref[...] = counts[:, :num_experts].astype(jnp.int32)

  shifts = _BYTE_SHIFTS[jnp.dtype(x_ref.dtype)]
  planes_ref[...] = jnp.zeros(planes_ref.shape, jnp.float32)   # padded tokens: zero bytes
  for start in range(0, width, _GATHER_LANES):
    lanes = min(_GATHER_LANES, width - start)
    bits = jax.lax.bitcast_convert_type(
        hidden_ref[:, start:start + lanes].astype(jnp.float32), jnp.int32)
    for b, shift in enumerate(shifts):
      planes_ref[b, :tokens, :lanes] = ((bits >> shift) & 0xFF).astype(jnp.float32)
    out = None
    for b, shift in enumerate(shifts):
      picked = jnp.dot(placed, planes_ref[b, :, :lanes], preferred_element_type=jnp.float32)
      part = picked[:pairs].astype(jnp.int32) << shift
      out = part if out is None else out | part
    x_ref[:, start:start + lanes] = jax.lax.bitcast_convert_type(
        out, jnp.float32).astype(x_ref.dtype)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def route_indices(top_k_index: jax.Array, num_experts: int, *,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """top_k_index [T, K] integer expert ids -> (pos [S] int32, src [S] int32,
  group_sizes [num_experts] int32), as the module docstring defines them: the same as a
  stable argsort of the ids (ids outside [0, num_experts) as num_experts) would give.
  Raises ValueError outside `fits`' shapes (checked without the VMEM plan)."""
  _check_ids("route_indices", top_k_index)
  tokens, top_k = top_k_index.shape
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


def _rows_plan(tokens: int, top_k: int, num_experts: int, hidden: int, dtype) -> int:
  """VMEM bytes of route_rows beyond route_indices' plan: hidden and x whole, the byte
  planes of a chunk and their gathered float32 results."""
  tp, _, sp = _padded(tokens, top_k, num_experts)
  planes = len(_BYTE_SHIFTS[jnp.dtype(dtype)])
  lanes = min(_GATHER_LANES, vmem.lane_padded(hidden))
  return ((tokens + sp) * vmem.lane_padded(hidden) * jnp.dtype(dtype).itemsize
          + planes * (tp + 2 * sp) * lanes * 4)


def fits_rows(tokens: int, top_k: int, num_experts: int, hidden: int, dtype, chip: str) -> bool:
  """Whether route_rows applies: route_indices' shapes, hidden float32 or bfloat16, and
  both plans within the chip's VMEM budget together (so it implies `fits`)."""
  if jnp.dtype(dtype) not in _BYTE_SHIFTS or not _shape_ok(tokens, top_k):
    return False
  plan = (_indices_plan(tokens, top_k, num_experts)
          + _rows_plan(tokens, top_k, num_experts, hidden, dtype))
  return plan <= vmem.vmem_budget(chips.get_chip(chip), None)


@functools.partial(jax.jit, static_argnames=("num_experts", "interpret"))
def route_rows(hidden: jax.Array, top_k_index: jax.Array, num_experts: int, *,
               interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
  """hidden [T, H] float32 / bfloat16, top_k_index [T, K] integer expert ids ->
  (x [S, H] hidden's dtype, x[s] = hidden[src[s]] bit for bit; pos [S] int32;
  group_sizes [num_experts] int32): route_indices with the gather of the rows fused.
  Differentiable w.r.t. hidden (a custom VJP: a token's row gets the sum of the
  cotangents of its K sorted rows). Raises ValueError outside `fits_rows`' shapes and
  dtypes (checked without the VMEM plan)."""
  if hidden.ndim != 2 or jnp.dtype(hidden.dtype) not in _BYTE_SHIFTS:
    raise ValueError(f"route_rows gathers [T, H] float32 or bfloat16 rows, got "
                     f"{hidden.shape} {hidden.dtype}")
  _check_ids("route_rows", top_k_index, hidden.shape[0])
  return _route_rows(hidden, top_k_index.astype(jnp.int32), num_experts, interpret)


def _route_rows_call(hidden, top_k_index, num_experts, interpret):
  tokens, width = hidden.shape
  top_k = top_k_index.shape[1]
  tp = _padded(tokens, top_k, num_experts)[0]
  whole = pl.BlockSpec(memory_space=pltpu.VMEM)
  pairs = tokens * top_k
  planes = len(_BYTE_SHIFTS[jnp.dtype(hidden.dtype)])
  pos, sizes, x = pl.pallas_call(
      functools.partial(_route_rows_kernel, num_experts=num_experts),
      out_shape=(jax.ShapeDtypeStruct((1, pairs), jnp.int32),
                 jax.ShapeDtypeStruct((1, num_experts), jnp.int32),
                 jax.ShapeDtypeStruct((pairs, width), hidden.dtype)),
      in_specs=[whole, whole], out_specs=(whole, whole, whole),
      scratch_shapes=[pltpu.VMEM((top_k, tp), jnp.int32),
                      pltpu.VMEM((planes, tp, min(_GATHER_LANES, width)), jnp.float32)],
      interpret=interpret, name="moe_route_rows",
  )(top_k_index.T, hidden)
  return x, pos[0], sizes[0]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _route_rows(hidden, top_k_index, num_experts, interpret):
  return _route_rows_call(hidden, top_k_index, num_experts, interpret)


def _route_rows_fwd(hidden, top_k_index, num_experts, interpret):
  x, pos, sizes = _route_rows_call(hidden, top_k_index, num_experts, interpret)
  return (x, pos, sizes), pos.reshape(top_k_index.shape)


def _route_rows_bwd(num_experts, interpret, pos, cotangents):
  """hidden's cotangent: each token's row gets the sum of its K sorted rows' (in float32),
  a gather by pos; the integer ids get none."""
  dx = cotangents[0]                                                   # [S, H]
  dh = jnp.sum(dx.astype(jnp.float32)[pos], axis=1)                    # [T, H]
  return dh.astype(dx.dtype), None


_route_rows.defvjp(_route_rows_fwd, _route_rows_bwd)
