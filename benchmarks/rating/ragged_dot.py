"""Static estimates of the grouped matmul: showing the estimator a real visit table.

The forward kernel (`ragged_dot._gmm_call`) reads its visit table (group, row tile, row
range and block indices per grid step) from SMEM through scalar prefetch, and its visit
count is a run-time grid size. libtpu's static estimator reads every SMEM value as 0
and guesses run-time grid sizes, so the plain kernel is estimated for an empty problem
(every step visits group 0, tile 0). Here, for *balanced routing* (m / G rows per group,
a power of two, as are the row blocks):

  * the visit count is passed as a static grid size (`num_visits=`), and
  * every table read (`ragged_dot._field`, in the kernel body and in the BlockSpec index
    maps), becomes max(table[FIELD * num_v + v], f_FIELD(v)),
    where f is the closed form of this case's table (shifts and products of the visit
    index, nothing the estimator mis-evaluates; the k-pin field, -1 here, is used as is).
    On hardware the table holds exactly f's values (checked against
    `ragged_dot.group_metadata` with concrete group sizes in `closed_form`), so the
    substituted kernel computes the same thing; the estimator now sees them.

Nothing in ragged_dot.py changes: the substitution patches `ragged_dot._field` while the
kernel is traced.

Rating (`rate_gmm`): the kernel's cycles at TRUNCATED_VISITS visits (identical per-visit
work), extrapolated linearly to the case's visit count; HBM bytes by replaying the grid
(`GmmCase.hbm_bytes`); the small kernel that builds the visit table is not rated (the
estimator crashes on its loops). A grouped-matmul case (cases/) is rated as the kernel call
the op makes for it (`gmm_case`); a w8a8 case adds the op that quantizes its rows
(`with_lhs_quantization`). No side effects at import (the caller sets the profile
flag).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from tpu_kernels import aot, chips, ragged_dot as R

from benchmarks.cases.headline import GroupedMatmul
from benchmarks.estimator.static_estimate import compile_on_chip
from benchmarks.estimator.xla_cost import glue_part

RATES = (GroupedMatmul,)   # the case kinds this method rates our kernel on (rating/ours.py)


def log2_exact(x: int) -> int:
  assert x > 0 and x & (x - 1) == 0, f"{x} is not a power of two"
  return x.bit_length() - 1


@dataclasses.dataclass(frozen=True)
class BalancedTable:
  """The visit table of balanced routing: m = G * rows, every group `rows` rows; with
  `total_groups` > groups, the groups past the first `groups` are empty (decode with
  fewer rows than experts: they are not visited)."""

  m: int
  groups: int
  block_m: int
  total_groups: int | None = None   # groups of the weights (None: `groups`)
  # Laid out for two visits per step (`R._paired_tiling`). Balanced routing with rows <
  # block_m (the only case the tiling pairs) needs no no-op entries, so the closed form
  # is the same; `check` builds the paired table to show it.
  paired: bool = False

  @property
  def rows(self) -> int:
    return self.m // self.groups

  @property
  def num_visits(self) -> int:
    # rows <= block_m: a tile holds block_m / rows whole groups, one visit per group;
    # rows > block_m: a group spans rows / block_m whole tiles, one visit per tile.
    return self.groups if self.rows <= self.block_m else self.m // self.block_m

  def value(self, field: int, v):
    """Field `field` of visit v (v: int, numpy or traced int32)."""
    r, bm = self.rows, self.block_m
    if r <= bm:
      group, tile = v, (v * r) >> log2_exact(bm)
    else:
      group, tile = v >> log2_exact(r // bm), v
    return {R._GROUP: group, R._TILE: tile, R._ROW_START: group * r,
            R._ROW_END: group * r + r, R._RHS_GROUP: group, R._LHS_TILE: tile,
            R._K_PIN: -1 + 0 * v}[field]

  @property
  def table_entries(self) -> int:
    """V of `group_metadata`'s (_NUM_FIELDS * V,) table."""
    return R.max_visits(self.m, self.block_m, self.total_groups or self.groups, self.paired)

  def group_sizes(self) -> jax.Array:
    """The routing this table is for: [total_groups or groups] int32 (the empty groups last)."""
    assert self.rows * self.groups == self.m
    log2_exact(self.rows), log2_exact(self.block_m)
    total = self.total_groups or self.groups
    return jnp.zeros((total,), jnp.int32).at[:self.groups].set(self.rows)

  def check(self, num_k_tiles: int) -> None:
    """The closed form equals ragged_dot.group_metadata for concrete group sizes."""
    sizes = self.group_sizes()
    total = sizes.shape[0]
    metadata = jax.jit(functools.partial(
        R.group_metadata, group_offset=0, num_local_groups=total, m=self.m,
        block_m=self.block_m, num_k_tiles=num_k_tiles, zero_visits=True, paired=self.paired,
        interpret=True))
    table, count = metadata(sizes)
    num_v = self.table_entries
    table = np.asarray(table).reshape(R._NUM_FIELDS, num_v)
    assert int(count) == self.num_visits, (int(count), self.num_visits)
    v = np.arange(self.num_visits)
    for field in range(R._NUM_FIELDS):
      want = np.broadcast_to(self.value(field, v), v.shape)
      np.testing.assert_array_equal(table[field, :self.num_visits], want,
                                    err_msg=f"field {field}")


@contextlib.contextmanager
def visible_table(table: BalancedTable, num_v: int):
  """While active, the forward kernel's table reads (`ragged_dot._field`, in its body and
  its index maps) yield max(SMEM value, closed form)."""

  def read(ref, field, v, _num_v=None):
    if field == R._K_PIN:   # -1 on hardware; max with the estimator's 0 would break it
      return jnp.asarray(table.value(field, v), jnp.int32)
    return jnp.maximum(ref[field * num_v + v], table.value(field, v))

  with mock.patch.object(R, "_field", read):
    yield


@dataclasses.dataclass(frozen=True)
class GmmCase:
  """One forward grouped matmul at balanced routing: lhs (m, k) in `dtype`, weights
  (G, n, k) (transpose_rhs) or (G, k, n) in `weight_dtype`, with a float32 (G, n) scale
  when that is int8 / float8_e4m3fn; output in `out_dtype` (default `dtype`).
  `lhs_quant` "int8" (int8 weights): the kernel takes lhs as int8 codes with float32 row
  scales [m, 1], as `ragged_dot`'s lhs_quant gives it; the quantization before it
  (`ragged_dot.quantize_rows`, a kernel of its own) is not part of this case."""

  m: int
  groups: int
  k: int
  n_out: int          # output columns (I for the gated gate/up projection)
  gated: bool         # gate/up halves of one (G, 2I, k) weight, silu epilogue
  chip: str
  dtype: str = "bfloat16"
  blocks: tuple[int, int, int] | None = None   # (block_m, block_k, block_n); None: the kernel's
  weight_dtype: str | None = None   # None: `dtype`
  out_dtype: str | None = None      # None: `dtype`
  active_groups: int | None = None  # groups with rows (None: all); the rest are empty
  transpose_rhs: bool = True
  interleaved: bool = False   # gated, gate/up columns interleaved (the "lanes" route)
  lhs_quant: str | None = None   # "int8": lhs as int8 codes and row scales

  @property
  def lhs_dtype(self):
    """The kernel's lhs: `dtype`, or int8 codes with lhs_quant."""
    return jnp.dtype(jnp.int8 if self.lhs_quant else self.dtype)

  @property
  def num_rhs(self) -> int:
    return 2 if self.gated else 1

  @property
  def rhs_dtype(self):
    return jnp.dtype(self.weight_dtype or self.dtype)

  @property
  def result_dtype(self):
    return jnp.dtype(self.out_dtype or self.dtype)

  @property
  def quantized(self) -> bool:
    return self.rhs_dtype in R.QUANTIZED_DTYPES

  @property
  def rows_groups(self) -> int:
    return self.active_groups or self.groups

  def tiling(self) -> R.Tiling:
    dt = self.lhs_dtype
    block_m, block_k, block_n = self.blocks or (None, None, None)
    return R.gmm_tiling(self.m, self.k, self.n_out, num_groups=self.groups, lhs_dtype=dt,
                        rhs_dtype=self.rhs_dtype, out_dtype=self.result_dtype,
                        num_rhs=self.num_rhs,
                        n_must_divide=self.n_out if self.gated and not self.interleaved else None,
                        chip=self.chip, block_m=block_m, block_k=block_k, block_n=block_n,
                        interleaved=self.interleaved)

  def table(self) -> BalancedTable:
    t = self.tiling()
    return BalancedTable(self.m, self.active_groups or self.groups, t.block_m,
                         None if self.active_groups is None else self.groups,
                         paired=t.visits_per_step == 2)

  def specs(self):
    """lhs, weight, [scale (G, n) float32 if quantized], [lhs row scales (m, 1) float32
    with lhs_quant], visit table."""
    n_full = self.num_rhs * self.n_out
    w_shape = (self.groups, n_full, self.k) if self.transpose_rhs else (self.groups, self.k, n_full)
    scale = [jax.ShapeDtypeStruct((self.groups, n_full), jnp.float32)] if self.quantized else []
    if self.lhs_quant:
      scale.append(jax.ShapeDtypeStruct((self.m, 1), jnp.float32))
    return [jax.ShapeDtypeStruct((self.m, self.k), self.lhs_dtype),
            jax.ShapeDtypeStruct(w_shape, self.rhs_dtype), *scale,
            jax.ShapeDtypeStruct((self.table_size,), jnp.int32)]

  @property
  def table_size(self) -> int:
    return R._NUM_FIELDS * self.table().table_entries

  def function(self, num_visits: int, interpret: bool = False):
    """fn(lhs, weight, [scale,] [lhs scale,] table): the kernel over the first
    `num_visits` visits of the balanced table, with the table visible to the estimator.

    The visit table is an input (what `group_metadata(group_sizes)` returns), not built
    in the program: the estimator crashes on the small kernel that builds it."""
    t, table = self.tiling(), self.table()
    num_v = table.table_entries
    epilogue = R.Epilogue(activation="silu", gated=True) if self.gated else R.Epilogue()

    def fn(lhs, w, *rest):
      *scale, visit_table = rest
      lhs_scale = scale.pop() if self.lhs_quant else None
      ops = lambda a: ([(a, 0), (a, self.n_out // t.block_n)]
                       if self.gated and not self.interleaved else [(a, 0)])
      metadata = lambda *args, **kwargs: (visit_table, jnp.int32(num_visits))
      with visible_table(table, num_v), mock.patch.object(R, "group_metadata", metadata):
        return R._gmm_call(lhs, ops(w), ops(scale[0]) if scale else [], [], None, 0, t,
                           n_out=self.n_out, transpose_rhs=self.transpose_rhs,
                           epilogue=epilogue, out_dtype=self.result_dtype, chip=self.chip,
                           interpret=interpret, num_visits=num_visits,
                           interleaved=self.interleaved, lhs_scale=lhs_scale)

    return fn

  def flops(self) -> int:
    return 2 * self.m * self.k * self.n_out * self.num_rhs

  def min_bytes(self) -> int:
    item, w_item = self.lhs_dtype.itemsize, self.rhs_dtype.itemsize
    n_full = self.n_out * self.num_rhs
    scales = self.rows_groups * n_full * 4 if self.quantized else 0
    scales += self.m * 4 if self.lhs_quant else 0
    return (item * self.m * self.k + w_item * self.rows_groups * self.k * n_full + scales +
            self.result_dtype.itemsize * self.m * self.n_out)

  def hbm_bytes(self, num_visits: int | None = None) -> int:
    """Bytes the grid moves: replays (n tile, visit, k tile) through the index maps; a
    block is fetched (or written back) whenever its block index changes between steps."""
    t, table = self.tiling(), self.table()
    visits = table.num_visits if num_visits is None else num_visits
    item, w_item = self.lhs_dtype.itemsize, self.rhs_dtype.itemsize
    out_item = self.result_dtype.itemsize
    bm, bk, bn = t.block_m, t.block_k, t.block_n
    n_tiles, k_tiles = -(-self.n_out // bn), -(-self.k // bk)
    moved, last = 0, {}

    def touch(name, index, nbytes):
      nonlocal moved
      if last.get(name) != index:
        moved += nbytes
        last[name] = index

    # Two visits per step (`R._paired_tiling`): visit v's weight, scale and bias blocks
    # are slot v % 2's, and the lhs and out blocks the tile of its step's first visit.
    slots = t.visits_per_step
    for j in range(n_tiles):
      for v in range(visits):
        slot = v % slots
        group = int(table.value(R._RHS_GROUP, v))   # the weight block the index maps read
        tile = int(table.value(R._TILE, v - slot))
        for kk in range(k_tiles):
          touch("lhs", (tile, kk), bm * bk * item)
          if self.lhs_quant:   # the (bm, 1) float32 row scales, lane-padded to 128 in HBM
            touch("lhs_scale", tile, bm * 128 * 4)
          for r in range(self.num_rhs):
            touch(f"rhs{r}.{slot}", (group, j, kk), bn * bk * w_item)
            if self.quantized:   # the (1, bn) float32 scale row of the group
              touch(f"scale{r}.{slot}", (group, j), bn * 4)
        touch("out", (tile, j), bm * bn * out_item)   # written back when the block changes
    return moved

  def hand_cycles_per_visit(self, clock_hz, flops_per_s, hbm_bytes_per_s) -> float:
    """Hand count of one visit (one row tile x one group, all n and k tiles): its weight
    blocks are new every visit (a new group), so max(MXU time of block_m rows at peak,
    weight DMA time at the HBM bandwidth), in cycles."""
    t = self.tiling()
    flops = 2 * t.block_m * self.k * self.n_out * self.num_rhs
    weight_bytes = self.k * self.n_out * self.num_rhs * self.rhs_dtype.itemsize
    return max(flops / flops_per_s, weight_bytes / hbm_bytes_per_s) * clock_hz


def gmm_case(case: GroupedMatmul, chip: str) -> GmmCase:
  """The kernel call the op makes for a grouped-matmul `case` (weights in the layout the op
  gets them: Transformers' (G, n, k) in bf16, int8 / fp8 always (G, k, n), as
  `quantize_experts_` stores them, gpt-oss's (G, k, n) with interleaved gate/up columns,
  `case.layout`): the gated kernel for
  concatenated gate/up halves, and for gpt-oss's interleaved gate/up the route
  `ragged_dot.gate_up_route` picks ("gate_pass" at these sizes: the plain kernel to a
  float32 (m, 2I), gated by a second pass, not rated here)."""
  interleaved = case.layout == "interleaved"
  common = dict(chip=chip, dtype=case.dtype, weight_dtype=case.weight_dtype,
                active_groups=case.active_groups if case.active_groups < case.groups else None,
                transpose_rhs=not interleaved and not case.quantized,
                lhs_quant=case.lhs_quant)
  if case.gated:
    route = R.gate_up_route(case.m, case.n_weight, case.layout, case.weight_bytes)
    if route == "gate_pass":
      return GmmCase(case.m, case.groups, case.k, case.n_weight, False, out_dtype="float32",
                     **common)
    assert route == "blocks", route
  return GmmCase(case.m, case.groups, case.k, case.n_out, case.gated, **common)


TRUNCATED_VISITS = (4, 8)


def rate_gmm(gmm: GmmCase, chip: str) -> dict:
  """Kernel cycles extrapolated from truncated visit counts (identical per-visit work)."""
  t, table = gmm.tiling(), gmm.table()
  table.check(num_k_tiles=-(-gmm.k // t.block_k))
  rated = []
  for visits in TRUNCATED_VISITS:
    text = compile_on_chip(gmm.function(visits), gmm.specs(), chip).as_text()
    rated.append(sum(aot.mosaic_kernel_cycles(text)))
  (v1, v2), (k1, k2) = TRUNCATED_VISITS, rated
  per_visit = (k2 - k1) / (v2 - v1)
  c = chips.get_chip(chip)
  return dict(compiled=True, error=None,
              estimated_cycles=round(k1 + per_visit * (table.num_visits - v1)),
              hbm_bytes=gmm.hbm_bytes(),
              method=f"static estimate at {TRUNCATED_VISITS} visits, extrapolated to "
                     f"{table.num_visits}",
              note="the small kernel that builds the visit table is not rated (the "
                   "estimator crashes on its loops)",
              cycles_per_visit=per_visit,
              hand_cycles_per_visit=gmm.hand_cycles_per_visit(c.clock_hz, c.bf16_flops_per_s,
                                                              c.hbm_bytes_per_s),
              tiling=dict(block_m=t.block_m, block_k=t.block_k, block_n=t.block_n,
                          vmem_limit_bytes=t.vmem_limit_bytes))


def with_lhs_quantization(kernel: dict, case: GroupedMatmul, chip: str) -> dict:
  """The kernel's row plus the op that quantizes lhs before it (`ragged_dot.quantize_rows`,
  its kernel, compiled alone), as the layer estimate sums its parts: each part's time is
  max(static cycles, HBM bytes at full bandwidth), the row's cycles their sum."""
  c = chips.get_chip(chip)
  lhs = jax.ShapeDtypeStruct((case.m, case.k), jnp.dtype(case.dtype))
  quantize = glue_part(   # bf16 in, int8 codes and f32 scales out
      functools.partial(R.quantize_rows, chip=chip), [lhs], chip,
      min_bytes=case.m * case.k * 3 + case.m * 4, kernel_fed=True)
  part_cycles = lambda cycles, nbytes: max(cycles, nbytes / c.hbm_bytes_per_s * c.clock_hz)
  quantize_cycles = part_cycles(quantize["cycles"], quantize["hbm_bytes"])
  row = dict(kernel)
  row.update(
      estimated_cycles=round(part_cycles(kernel["estimated_cycles"], kernel["hbm_bytes"])
                             + quantize_cycles),
      hbm_bytes=kernel["hbm_bytes"] + quantize["hbm_bytes"],
      method=kernel["method"] + "; plus the quantization of lhs (quantize_rows, "
             f"{quantize['ops']} op(s): {quantize['cycles']} cycles, {quantize['hbm_bytes']} "
             "bytes), each part max(cycles, bytes) and summed",
      kernel_cycles=kernel["estimated_cycles"], quantize_cycles=quantize["cycles"])
  return row


def rate(case: GroupedMatmul, chip: str) -> dict:
  """Our kernel's partial row for a grouped-matmul case (rating/ours.py)."""
  row = rate_gmm(gmm_case(case, chip), chip)
  if case.lhs_quant:
    row = with_lhs_quantization(row, case, chip)
  return row
