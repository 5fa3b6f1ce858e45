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
No side effects at import (benchmarks/estimate.py sets the profile flag, not this module).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tpu_kernels import ragged_dot as R  # noqa: E402


def _log2(x: int) -> int:
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
      group, tile = v, (v * r) >> _log2(bm)
    else:
      group, tile = v >> _log2(r // bm), v
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
    _log2(self.rows), _log2(self.block_m)
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


def xla_function(case: GmmCase):
  """The XLA baseline: jax.lax.ragged_dot with weights in its native (G, k, n) layout
  (no transpose charged to it), and the gated epilogue as a fused elementwise op.
  Quantized weights are dequantised first (w * scale in bf16: lax.ragged_dot takes one
  dtype), an XLA op of its own or fused, as XLA decides."""

  def fn(lhs, w, *rest):
    *scale, group_sizes = rest
    if scale:
      w = (w.astype(jnp.float32) * scale[0][:, None, :]).astype(lhs.dtype)
    z = jax.lax.ragged_dot(lhs, w, group_sizes, preferred_element_type=jnp.float32)
    if case.gated:
      z = jax.nn.silu(z[:, :case.n_out]) * z[:, case.n_out:]
    return z.astype(lhs.dtype)

  dt = jnp.dtype(case.dtype)
  n_full = case.num_rhs * case.n_out
  scale = [jax.ShapeDtypeStruct((case.groups, n_full), jnp.float32)] if case.quantized else []
  specs = [jax.ShapeDtypeStruct((case.m, case.k), dt),
           jax.ShapeDtypeStruct((case.groups, case.k, n_full), case.rhs_dtype), *scale,
           jax.ShapeDtypeStruct((case.groups,), jnp.int32)]
  return fn, specs


# How each model's experts call the kernel (scripts/ragged_dot_cases.py's MODELS): gpt-oss
# stores (G, k, n) weights with interleaved gate/up columns; the others (G, n, k) in bf16,
# and (G, k, n) once quantized (`quantize_experts_` stores 1-byte weights that way).
INTERLEAVED_GATE_UP = ("gpt-oss-20b",)


def gmm_case(case, chip: str) -> GmmCase:
  """The kernel call the op makes for a headline.GroupedMatmul `case` (weights in the layout
  the op gets them: int8 / fp8 always (G, k, n)): the gated kernel
  for concatenated gate/up halves, and for gpt-oss's interleaved gate/up the route
  `ragged_dot.gate_up_route` picks ("gate_pass" at these sizes: the plain kernel to a
  float32 (m, 2I), gated by a second pass, not rated here)."""
  interleaved = case.model in INTERLEAVED_GATE_UP
  common = dict(chip=chip, dtype=case.dtype, weight_dtype=case.weight_dtype,
                active_groups=case.active_groups if case.active_groups < case.groups else None,
                transpose_rhs=not interleaved and not case.quantized,
                lhs_quant=case.lhs_quant)
  if case.gated:
    weight_bytes = case.groups * case.k * case.n_weight * jnp.dtype(case.weight_dtype).itemsize
    route = R.gate_up_route(case.m, case.n_weight, "interleaved" if interleaved else
                            "concatenated", weight_bytes)
    if route == "gate_pass":
      return GmmCase(case.m, case.groups, case.k, case.n_weight, False, out_dtype="float32",
                     **common)
    assert route == "blocks", route
  return GmmCase(case.m, case.groups, case.k, case.n_out, case.gated, **common)


# ------------------------------------------------------------------ quantized decode table

SPEEDUP_GOAL = 1.8        # issue 28: >= 1.8x faster than the best bf16 anchor's prediction
QUANT_EFFICIENCY_GOAL = 0.85


def bf16_case_name(name: str) -> str:
  """The bf16 row a quantized row is compared with: same model, part and m."""
  for tag in (" int8 ", " fp8 ", " w8a8 "):
    name = name.replace(tag, " bf16 ")
  return name


def quantized_decode_table(rows: list[dict], case_names) -> str:
  """Markdown: each quantized row of `case_names` (headline.QUANTIZED_DECODE's int8 / fp8
  names) per chip against issue 28's goals, from estimate.py's rows (estimates.jsonl)."""

  def predicted(case, chip, source=None, implementation=None):
    return [r for r in rows if r["case"] == case and r["chip"] == chip and "predicted_us" in r
            and (source is None or r["source"] == source)
            and (implementation is None or implementation in r["implementation"])]

  us = lambda x: "" if x is None else f"{x:,.1f}"
  out = [f"| case | chip | ours µs | roofline µs | efficiency (>= {QUANT_EFFICIENCY_GOAL}) "
         f"| best bf16 anchor µs | ours vs it (>= {SPEEDUP_GOAL}x) | tokamax quantized µs "
         "| XLA µs | ours bf16 µs | goals met |",
         "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
  chips = sorted({r["chip"] for r in rows})
  for case in case_names:
    for chip in chips:
      ours = predicted(case, chip, "ours")
      if not ours:
        failed = [r for r in rows if r["case"] == case and r["chip"] == chip
                  and r["source"] == "ours"]
        why = (failed[0].get("error") or "")[:120] if failed else "no row yet"
        out.append(f"| {case} | {chip} | not rated: {why} |||||||||")
        continue
      o = ours[0]
      bf16 = bf16_case_name(case)
      anchors = predicted(bf16, chip, "anchor")
      best = min(anchors, key=lambda r: r["predicted_us"], default=None)
      speedup = best["predicted_us"] / o["predicted_us"] if best else None
      tokamax = predicted(case, chip, "anchor", "tokamax")
      xla = predicted(case, chip, "xla")
      ours_bf16 = predicted(bf16, chip, "ours")
      met = [f"efficiency {'met' if o['efficiency'] >= QUANT_EFFICIENCY_GOAL else 'missed'}",
             "speed-up " + ("no bf16 anchor rated" if speedup is None else
                            "met" if speedup >= SPEEDUP_GOAL else "missed")]
      best_cell = "" if best is None else \
          f"{us(best['predicted_us'])} ({best['implementation'].split(' (')[0]})"
      out.append(
          f"| {case} | {chip} | {us(o['predicted_us'])} | {us(o['roofline_us'])} "
          f"| {o['efficiency']:.2f} | {best_cell} "
          f"| {'' if speedup is None else f'{speedup:.2f}x'} "
          f"| {us(min((r['predicted_us'] for r in tokamax), default=None))} "
          f"| {us(xla[0]['predicted_us'] if xla else None)} "
          f"| {us(ours_bf16[0]['predicted_us'] if ours_bf16 else None)} | {', '.join(met)} |")
  return "\n".join(out) + "\n"


def why_not_rated(row: dict | None) -> str:
  """A short cell for a row without a prediction: its error, named."""
  if row is None:
    return "no row"
  error = row.get("error") or ""
  if "CompileTimeScopedVmemOom" in error:
    return "VMEM OOM"
  if "Static LLO profiling" in error or "static estimator aborts" in error:
    return "estimator aborts"
  return "error"


def tpu_inference_gmm_table(rows: list[dict], case_names) -> str:
  """Markdown: tpu-inference's megablox gmm beside ours at each case of `case_names`
  (headline.QUANTIZED_DECODE's names: bf16, int8 and fp8) per chip, from estimates.jsonl."""

  def find(case, chip, match):
    return next((r for r in rows if r["case"] == case and r["chip"] == chip and match(r)), None)

  us = lambda r: f"{r['predicted_us']:,.1f}" if r and "predicted_us" in r else why_not_rated(r)
  out = ["| case | chip | tpu-inference gmm µs | its efficiency | ours µs | roofline µs "
         "| ours ÷ tpu-inference |", "|---|---|---:|---:|---:|---:|---:|"]
  chips = sorted({r["chip"] for r in rows})
  for case in case_names:
    for chip in chips:
      theirs = find(case, chip, lambda r: "tpu-inference megablox gmm" in r["implementation"])
      ours = find(case, chip, lambda r: r["source"] == "ours")
      rated = lambda r: r is not None and "predicted_us" in r
      roofline = next((r["roofline_us"] for r in (ours, theirs) if r and r.get("roofline_us")),
                      None)
      efficiency = f"{theirs['efficiency']:.2f}" if rated(theirs) else ""
      ratio = (f"{ours['predicted_us'] / theirs['predicted_us']:.2f}x"
               if rated(ours) and rated(theirs) else "")
      out.append(f"| {case.removeprefix('ragged_dot ')} | {chip} | {us(theirs)} "
                 f"| {efficiency} | {us(ours)} "
                 f"| {'' if roofline is None else f'{roofline:,.1f}'} | {ratio} |")
  return "\n".join(out) + "\n"


if __name__ == "__main__":
  # python benchmarks/ragged_estimate.py [--tpu-inference | --w8a8] [estimates.jsonl]: the
  # quantized decode table (or the tpu-inference gmm table, or the int8-activation rows'
  # table) of docs/performance.md.
  import json
  import headline
  args = sys.argv[1:]
  versus_tpu_inference, w8a8 = "--tpu-inference" in args, "--w8a8" in args
  args = [a for a in args if a not in ("--tpu-inference", "--w8a8")]
  path = Path(args[0]) if args else Path(__file__).resolve().parent / "results" / "estimates.jsonl"
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
  if versus_tpu_inference:
    print(tpu_inference_gmm_table(rows, [c.name for c in headline.QUANTIZED_DECODE]), end="")
  elif w8a8:
    print(quantized_decode_table(rows, [c.name for c in headline.W8A8_DECODE]), end="")
  else:
    print(quantized_decode_table(rows, [c.name for c in headline.QUANTIZED_DECODE
                                        if c.quantized]), end="")
