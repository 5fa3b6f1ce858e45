"""megablox's grouped matmul (`gmm`) as a peer: jax's (`GmmAnchor`), which tokamax's ragged_dot
and tpu-inference's gmm fork, and what the three share.

megablox `gmm`: lhs [m, k] x rhs [G, k, n] (its natural layout), bf16 out, at balanced group
sizes. Its group metadata (group_offsets, group_ids, m_tile_ids) and its number of active
m-tiles come from `make_group_metadata` at run time, from SMEM. Here the tile count is a
static grid size and every read of the metadata, in the kernel body and the index maps,
yields max(value, closed form of balanced routing) (`GmmClosedForm`: equal on hardware,
checked against megablox's own make_group_metadata with concrete group sizes). Cycles are
rated at GMM_TRUNCATED_VISITS active tiles and extrapolated linearly (`extrapolate_visits`);
bytes by replaying the grid (`grid_bytes`).

jax's anchor: at gmm's default tiling (128, 128, 128) and at (512, 1024, 1024) clipped to
divisors of the case. gate_up is the plain [m, 2048] x [2048, 1536] matmul: silu(gate) * up
is NOT fused in gmm (its extra pass is not counted). jax's megablox has no quantized path
(bf16 / f32 operands only).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
from unittest import mock

from benchmarks.cases import ITEMSIZE
from benchmarks.cases.headline import GroupedMatmul
from benchmarks.estimator import visible


def jax_version() -> str:
  import jax
  return jax.__version__


def jax_pallas_op(name: str):
  """jax.experimental.pallas.ops.tpu.<name> as a module (packages re-export functions under
  their modules' names, e.g. megablox.gmm)."""
  return importlib.import_module(f"jax.experimental.pallas.ops.tpu.{name}")


def log2_exact(x: int) -> int:
  assert x > 0 and x & (x - 1) == 0, f"{x} is not a power of two"
  return x.bit_length() - 1


def divisor_tile(dim: int, target: int) -> int:
  """The largest multiple of 128 <= target that divides dim (dim itself if dim <= target)."""
  if dim <= target:
    return dim
  for t in range(target - target % 128, 127, -128):
    if dim % t == 0:
      return t
  raise ValueError(f"no 128-multiple tile <= {target} divides {dim}")


@dataclasses.dataclass(frozen=True)
class GmmClosedForm:
  """megablox make_group_metadata for balanced routing: m = groups * rows, powers of two;
  with total_groups > groups, the groups past the first `groups` are empty (not visited)."""

  m: int
  groups: int
  tm: int
  total_groups: int | None = None

  @property
  def rows(self) -> int:
    return self.m // self.groups

  @property
  def num_tiles(self) -> int:
    return self.groups if self.rows <= self.tm else self.m // self.tm

  def group_offset(self, g):
    if not self.total_groups:
      return g * self.rows
    import jax.numpy as jnp   # g: int, numpy or traced
    return jnp.minimum(g, self.groups) * self.rows

  def group_id(self, v):
    return v if self.rows <= self.tm else v >> log2_exact(self.rows // self.tm)

  def m_tile_id(self, v):
    return (v * self.rows) >> log2_exact(self.tm) if self.rows <= self.tm else v

  def check(self, make_group_metadata=None) -> None:
    """Equals megablox's make_group_metadata (or the given one, of the same signature) with
    concrete balanced group sizes."""
    import numpy as np
    import jax
    import jax.numpy as jnp
    make_group_metadata = make_group_metadata or jax_pallas_op("megablox.gmm").make_group_metadata
    assert self.rows * self.groups == self.m
    log2_exact(self.rows), log2_exact(self.tm)
    total = self.total_groups or self.groups
    sizes = jnp.zeros((total,), jnp.int32).at[:self.groups].set(self.rows)
    (offsets, gids, mtiles), num = jax.jit(lambda s: make_group_metadata(
        group_sizes=s, m=self.m, tm=self.tm, start_group=jnp.int32(0),
        num_nonzero_groups=total, visit_empty_groups=False))(sizes)
    v, g = np.arange(self.num_tiles), np.arange(total + 1)
    assert int(num) == self.num_tiles, (int(num), self.num_tiles)
    np.testing.assert_array_equal(np.asarray(offsets), self.group_offset(g))
    np.testing.assert_array_equal(np.asarray(gids)[:self.num_tiles], self.group_id(v))
    np.testing.assert_array_equal(np.asarray(mtiles)[:self.num_tiles], self.m_tile_id(v))


GMM_TRUNCATED_VISITS = (4, 8)


def tile(dim: int, target: int) -> int:
  """divisor_tile, or `target` (a masked last block) when no 128-multiple divides dim
  (gpt-oss's 2880 = 2^6 * 45)."""
  try:
    return divisor_tile(dim, target)
  except ValueError:
    return target


def extrapolate_visits(cycles: dict, num_tiles: int) -> float:
  """Cycles of `num_tiles` active m-tiles, linear through the ratings at
  GMM_TRUNCATED_VISITS ({json([visits]): cycles}): identical per-visit work."""
  (v1, v2) = GMM_TRUNCATED_VISITS
  k1, k2 = cycles[json.dumps([v1])], cycles[json.dumps([v2])]
  return k1 + (k2 - k1) / (v2 - v1) * (num_tiles - v1)


def grid_bytes(closed_form, tiling: tuple[int, int, int], k: int, n: int, weight_itemsize: int,
               scale_rows: int = 0, visits: int | None = None) -> int:
  """Bytes megablox's forward grid (n tiles, active m tiles, k tiles) moves, replayed through
  its index maps: lhs by m tile, rhs and (`scale_rows` > 0) its f32 scale block of
  scale_rows x tn by group, out by m tile; bf16 activations. `visits`: the first that many
  active tiles (default all)."""
  cf = closed_form
  tm, tk, tn = tiling
  n_tiles, k_tiles = -(-n // tn), -(-k // tk)
  visits = cf.num_tiles if visits is None else visits
  steps = ((j, v, kk) for j in range(n_tiles) for v in range(visits) for kk in range(k_tiles))
  blocks = [
      ("lhs", lambda j, v, kk: (cf.m_tile_id(v), kk), tm * tk * 2),
      ("rhs", lambda j, v, kk: (cf.group_id(v), kk, j), tk * tn * weight_itemsize),
      ("out", lambda j, v, kk: (cf.m_tile_id(v), j), tm * tn * 2)]
  if scale_rows:
    blocks.append(("scale", lambda j, v, kk: (cf.group_id(v), j), scale_rows * tn * 4))
  return visible.replay(steps, blocks)


# Beside the quantized-decode rows (cases/quantized_decode.py) one tiling each: the large
# one, the faster of the two tilings at every bf16 headline row. jax's megablox gmm has no
# quantized path (bf16 / f32 operands only): beside the quantized rows only tokamax's
# ragged_dot is rated (tpu-inference's quantized gmm: tpu_inference_ops/gmm.py). tokamax's
# heuristic config (128x128x128) at Qwen3-30B-A3B gate_up int8 m=64 rated 6,408 µs on v5e
# (vs 338 µs at the large tiling) and aborts the estimator on v6e ("Unsupported DMA
# direction"), as it does on v5e at Mixtral-8x7B: not rated here.
QUANTIZED_TILING = "512x1024x1024"


@dataclasses.dataclass(frozen=True)
class GmmAnchor:
  """jax's megablox gmm on one grouped-matmul case (this module's docstring)."""

  m: int
  part: str
  tiling_name: str          # "default" or "512x1024x1024"
  groups: int = 128
  model: str = "Qwen3-30B-A3B"        # one of headline.MOE_MODELS (groups: its experts)
  weight_dtype: str = "bfloat16"      # tokamax only: int8 / float8_e4m3fn weights

  @property
  def case(self):
    if (self.model, self.weight_dtype) == ("Qwen3-30B-A3B", "bfloat16"):
      return GroupedMatmul(self.m, self.part, groups=self.groups)
    case = GroupedMatmul.of(self.model, self.m, self.part, self.weight_dtype)
    assert case.groups == self.groups, (case, self.groups)
    return case

  @property
  def key(self) -> str:
    extra = "" if (self.model, self.weight_dtype) == ("Qwen3-30B-A3B", "bfloat16") else \
        f":{self.model}:{self.weight_dtype}"
    return f"gmm:{self.m}:{self.part}:{self.tiling_name}:{self.groups}{extra}"

  @property
  def tiling(self) -> tuple[int, int, int]:
    c = self.case
    if self.tiling_name == "default":
      return (128, 128, 128)   # gmm's default tiling argument
    tm, tk, tn = (int(x) for x in self.tiling_name.split("x"))
    return (min(tm, self.m), tile(c.k, tk), tile(c.n_weight, tn))

  @property
  def closed_form(self) -> GmmClosedForm:
    c = self.case
    if c.active_groups < self.groups:   # decode: fewer rows than experts
      return GmmClosedForm(self.m, c.active_groups, self.tiling[0], self.groups)
    return GmmClosedForm(self.m, self.groups, self.tiling[0])

  @property
  def implementation(self) -> str:
    tm, tk, tn = self.tiling
    label = "default tiling" if self.tiling_name == "default" else "tiling"
    return f"jax megablox gmm (jax {jax_version()}, {label} {tm}x{tk}x{tn})"

  truncations = tuple([v] for v in GMM_TRUNCATED_VISITS)

  @property
  def method(self) -> str:
    return (f"static estimate of the gmm kernel at {GMM_TRUNCATED_VISITS[0]} and "
            f"{GMM_TRUNCATED_VISITS[1]} active m-tiles (static grid, metadata made visible), "
            f"extrapolated linearly to {self.closed_form.num_tiles}")

  @property
  def note(self) -> str:
    extra = (" gate_up: plain matmul to [m, 1536]; silu(gate) * up is not fused in gmm "
             "(its extra elementwise pass, ~m*1536*2*2 + m*768*2 bytes, is not counted)."
             if self.part.startswith("gate_up") else "")
    return ("Balanced routing (m / 128 rows per expert); rhs in gmm's [G, k, n] layout; "
            "bf16 output (preferred_element_type=bf16); the XLA ops of make_group_metadata "
            "are not rated (the metadata is an input)." + extra)

  def config(self) -> dict:
    tm, tk, tn = self.tiling
    cf = self.closed_form
    return dict(tm=tm, tk=tk, tn=tn, m=self.m, k=self.case.k, n=self.case.n_weight,
                groups=self.groups, active_tiles=cf.num_tiles, transpose_rhs=False)

  def validate(self) -> None:
    self.closed_form.check()

  def build(self, trunc, chip: str = "v6e"):
    (visits,) = trunc
    import jax
    import jax.numpy as jnp
    G = jax_pallas_op("megablox.gmm")
    c, cf = self.case, self.closed_form
    m, k, n = self.m, c.k, c.n_weight
    num_meta = m // self.tiling[0] + self.groups - 1
    forms = ((cf.group_offset, cf.group_id, cf.m_tile_id), None)

    def fn(lhs, rhs, offsets, gids, mtiles):
      metadata = lambda **kw: ((offsets, gids, mtiles), visits)
      with visible.visible_prefetch(G, forms), \
          mock.patch.object(G, "make_group_metadata", metadata):
        return G.gmm(lhs, rhs, jnp.zeros((self.groups,), jnp.int32),
                     preferred_element_type=jnp.bfloat16, tiling=self.tiling)

    S = jax.ShapeDtypeStruct
    return fn, [S((m, k), jnp.bfloat16), S((self.groups, k, n), jnp.bfloat16),
                S((self.groups + 1,), jnp.int32), S((num_meta,), jnp.int32),
                S((num_meta,), jnp.int32)]

  def extrapolate(self, cycles: dict) -> float:
    return extrapolate_visits(cycles, self.closed_form.num_tiles)

  def hbm_bytes(self, visits: int | None = None) -> int:
    c = self.case
    # a quantized rhs: its (G, 1, n) scale, repeated to an (8, tn) f32 block (quant_block_spec)
    return grid_bytes(self.closed_form, self.tiling, c.k, c.n_weight,
                      ITEMSIZE[c.weight_dtype], scale_rows=8 if c.quantized else 0,
                      visits=visits)

  def hand(self, chip) -> dict:
    """Every active tile is a full tm-row matmul over all of k and n (rows of other groups
    are computed and masked); weights of a new group are fetched per visit."""
    c, cf = self.case, self.closed_form
    tm = self.tiling[0]
    mxu_flops = 2 * tm * c.k * c.n_weight * cf.num_tiles
    hand_us = max(mxu_flops / chip.bf16_flops_per_s,
                  self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6
    return dict(hand_mxu_flops=mxu_flops, hand_us=hand_us,
                hand_count=f"{cf.num_tiles} tiles x 2*{tm}*{c.k}*{c.n_weight} flops at peak "
                           f"vs replayed bytes at HBM bandwidth")
