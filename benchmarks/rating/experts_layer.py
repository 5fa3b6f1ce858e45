"""Static estimate of the whole experts layer (`moe.moe_experts`), part by part.

The layer is one jitted program of five parts, run one after another:

  route      moe.route: sort of the T*K expert ids (moe_route's kernel at decode, XLA's
             argsort else), group sizes, gather of the rows
  tables     two `ragged_dot_visit_table` kernels (one per projection): NOT rated, the
             static estimator crashes on their scalar loops (as for the headline gmm rows)
  gate/up    the gated grouped matmul, silu epilogue          (rating/ragged_dot.py's method)
  down       the grouped matmul, float32 out                  (rating/ragged_dot.py's method)
  combine    moe.combine: routing weights, unsort, sum over K  (float32; the Pallas
             kernel moe_combine.gather_weighted_sum, one DMA per row)

Each part's time is max(static cycles / clock, its HBM bytes / bandwidth) (the estimator does
not cap HBM bandwidth), and the layer's is their sum. The row's `estimated_cycles` is that
sum in clock cycles (so predicted = it), and `breakdown` keeps every part.

Kernels: rating/ragged_dot.py's visible-table method (cycles at 4 and 8 visits, extrapolated),
with a table for the routing of a decode step. `RoutedTable`: the m = T*K rows go to `hit`
experts (every (E / hit)-th one), m / hit rows each; every other expert is empty and is not
visited (the kernel's zero_visits). With m / hit rows <= block_m a visit is one expert, so
cycles and bytes are extrapolated linearly in visits to the expected number of distinct
experts hit (`ExpertsLayer.experts_hit`, the same as the roofline's). Visits added
by a group crossing a row-tile boundary under uneven routing are not counted (at most
tiles - 1 more).

Glue (route, combine; for gpt-oss at decode also the gate pass after a plain gate/up kernel,
the "gate_pass" route its interleaved columns take): the same functions moe_experts calls,
compiled for the chip with the static profile on: cycles from the estimate of every op (the
Pallas kernels of the route at decode, the combine and the gate pass included), HBM bytes
from XLA's own cost_analysis ("bytes accessed") of the same program, raised to the bytes
each part must move (a kernel's own DMAs are not in cost_analysis). The route's and the gate
pass's outputs take the layout XLA chooses, as inside the layer, where a kernel reads them
(estimator/xla_cost.py's `compile_glue`); the combine's keep the default of a program's
result, as the layer's own result does. An op the estimator returns INT64_MAX for (the
offloaded scatter-add that counted group sizes until 2026-12-04, and still does in
seed_prediction's grouped_mm glue) counts by its bytes only. cost_analysis counts a row
gather's bytes many times over (2.6 GB for the route's 268 MB gather at Qwen3's prefill;
59 MB for the 4 MB XLA combine at T=64, before the kernel), so a gather-heavy part is rated by
those bytes, an overestimate.

Each part is rated in its own child process (the estimator aborts processes), with one
fallback where it aborts: a kernel at 8 rows (v5e's LLO type check) is rated at 16 rows;
a glue part (v5e: "Static LLO profiling of gather_fusion failed") by XLA's
cost_analysis, a lower bound (no per-op cost; ~1-2k cycles per op where the estimator
sees them). Not modelled: the "split" route (no case takes it; NotImplementedError, a
"not rated" row), gpt-oss's biases and its (E, k, n) weight layout (rated as (E, n, k)).

The docs' breakdown table: `python benchmarks/report.py --print experts-layer`
(reports/tables.py). Each part's child: `python benchmarks/rating/experts_layer.py --part
CASE CHIP PART [--fallback]` (one ROW line).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import dataclasses  # noqa: E402
import os  # noqa: E402
from typing import Callable, NamedTuple  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__" and os.environ.get("ESTIMATE_STATIC_PROFILE", "1") == "1":
  children.enable_static_profile()   # a part's child (`_part_in_child`): before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, moe  # noqa: E402
from tpu_kernels import ragged_dot as R  # noqa: E402

from benchmarks import cases  # noqa: E402
from benchmarks.cases.experts_layer import ExpertsLayer  # noqa: E402
from benchmarks.estimator.xla_cost import glue_cost_analysis, glue_part  # noqa: E402
from benchmarks.rating import ragged_dot  # noqa: E402
from benchmarks.rating.roofline import prediction  # noqa: E402

RATES = (ExpertsLayer,)   # the case kind rated here (rating/ours.py), and its row's name:
IMPLEMENTATION = "pallas (whole layer)"


@dataclasses.dataclass(frozen=True)
class RoutedTable(ragged_dot.BalancedTable):
  """m rows over `hit` of the `groups` experts (each (groups / hit)-th), m / hit rows each.
  Visits past the table (the 8-visit probe of a 4-expert step) wrap around the experts and
  row tiles: the same work per visit, in range."""

  hit: int = 0

  @property
  def rows(self) -> int:
    return self.m // self.hit

  @property
  def num_visits(self) -> int:
    return self.hit if self.rows <= self.block_m else self.m // self.block_m

  def value(self, field: int, v):
    if self.rows > self.block_m:   # prefill: every expert hit, the balanced table
      assert self.hit == self.groups
      return super().value(field, v)
    stride = ragged_dot.log2_exact(self.groups // self.hit)
    tiles = self.m // self.block_m
    group = (v << stride) & (self.groups - 1)
    tile = ((v * self.rows) >> ragged_dot.log2_exact(self.block_m)) & (tiles - 1)
    start = v * self.rows
    return {R._GROUP: group, R._TILE: tile, R._ROW_START: start,
            R._ROW_END: start + self.rows, R._RHS_GROUP: group, R._LHS_TILE: tile,
            R._K_PIN: -1 + 0 * v}[field]

  def group_sizes(self) -> jax.Array:
    assert self.rows * self.hit == self.m and self.groups % self.hit == 0
    ragged_dot.log2_exact(self.rows), ragged_dot.log2_exact(self.block_m)
    stride = self.groups // self.hit
    return jnp.zeros((self.groups,), jnp.int32).at[::stride].set(self.rows)


@dataclasses.dataclass(frozen=True)
class RoutedGmm(ragged_dot.GmmCase):
  hit: int = 0

  def table(self) -> RoutedTable:
    return RoutedTable(self.m, self.groups, self.tiling().block_m, hit=self.hit)


# v5e's estimator aborts on the kernel with 8-row bf16 tiles (an LLO type check on vmatmul,
# "Expected vector-bf16packed, got vector-int16"): there the kernel is rated at 16 rows.
FALLBACK_ROWS = 16


def is_kernel(part: str) -> bool:
  return part.startswith(("gate/up", "down"))


def gate_up_route(case: ExpertsLayer) -> str:
  """The route the gated forward takes in moe_experts (ragged_dot.gate_up_route)."""
  weight_bytes = case.experts * 2 * case.width * case.hidden * jnp.dtype(case.dtype).itemsize
  return R.gate_up_route(case.rows, 2 * case.width, case.layout, weight_bytes)


def gmms(case: ExpertsLayer, chip: str, min_rows: int = 0) -> dict[str, RoutedGmm]:
  """The layer's two kernel calls at a routing of the case's rows over min(E, rows)
  experts (powers of two here), as moe_experts makes them (weights (E, n, k)); with
  `min_rows`, at least that many rows (the same experts, more rows each).

  Gate/up: "blocks" (Qwen: I a multiple of 128, concatenated) is the gated kernel;
  "gate_pass" (gpt-oss at decode: interleaved columns) the plain kernel with a float32
  [S, 2I] out, gated by a second pass (`ragged_dot.gate_pass`, the glue part "gate"); "lanes"
  (gpt-oss at prefill) the gated kernel that de-interleaves its accumulator. The "split"
  route (concatenated halves off the lane grid, at prefill: an XLA copy of the weights
  into gate and up, then the gated kernel; no case here) is not modelled:
  NotImplementedError."""
  hit = min(case.experts, case.rows)
  m = max(case.rows, min_rows)
  common = dict(groups=case.experts, chip=chip, dtype=case.dtype, hit=hit)
  route = gate_up_route(case)
  if route == "blocks":
    gate_up = ("gate/up+silu kernel", RoutedGmm(m, k=case.hidden, n_out=case.width,
                                                gated=True, **common))
  elif route == "gate_pass":
    gate_up = ("gate/up kernel (f32 out, gated after)", RoutedGmm(
        m, k=case.hidden, n_out=2 * case.width, gated=False, out_dtype="float32", **common))
  elif route == "lanes":
    gate_up = ("gate/up+gate kernel (interleaved columns)", RoutedGmm(
        m, k=case.hidden, n_out=case.width, gated=True, interleaved=True, **common))
  else:
    raise NotImplementedError(
        f"gate/up takes the {route!r} route here (an XLA copy of all gate/up weights into "
        "two arrays, then the gated kernel): not modelled by this estimate")
  return dict([gate_up, ("down kernel", RoutedGmm(m, k=case.width, n_out=case.hidden,
                                                 gated=False, out_dtype="float32",
                                                 **common))])


def _kernel_part(gmm: RoutedGmm, case: ExpertsLayer, rate_gmm: Callable) -> dict:
  r = rate_gmm(gmm, gmm.chip)
  table = gmm.table()
  visits, cycles, moved = table.num_visits, r["estimated_cycles"], r["hbm_bytes"]
  method = r["method"]
  if table.rows <= table.block_m:   # one visit per expert hit: extrapolate to experts_hit
    half = max(visits // 2, 1)
    per_visit_bytes = (moved - gmm.hbm_bytes(half)) / (visits - half) if visits > half else 0
    extra = case.experts_hit - visits
    cycles += r["cycles_per_visit"] * extra
    moved += per_visit_bytes * extra
    method += f", then to {case.experts_hit:.1f} visits (experts hit)"
  return dict(cycles=round(cycles), hbm_bytes=round(moved), method=method,
              tiling=r["tiling"], probe_table=dict(hit=table.hit, rows_per_expert=table.rows))


class GluePart(NamedTuple):
  """A glue program of the layer. `min_bytes`: what it must move at least, counted where
  cost_analysis cannot (a Pallas kernel's own bytes, the route's at decode, the combine's
  row DMAs, the gate pass, are not in XLA's "bytes accessed" of the custom call).
  `kernel_fed`: a kernel of the layer reads its outputs (`xla_cost.compile_glue`)."""
  fn: Callable
  specs: list
  min_bytes: int
  kernel_fed: bool


def glue_programs(case: ExpertsLayer, chip: str) -> dict[str, GluePart]:
  """route, combine (and gpt-oss's gate pass at decode) as moe_experts calls them on the
  chip. The route's rows go to gate/up and the gate pass's to down; the combine's result
  is the layer's."""
  dt = jnp.dtype(case.dtype)
  s = case.rows
  route = lambda hidden, ids: moe.route(hidden, ids, case.experts, chip=chip)
  combine = lambda y, perm, w: moe.combine(y, perm, w, out_dtype=dt, chip=chip)
  combine_bytes = (s * case.hidden * 4 + case.tokens * case.hidden * dt.itemsize
                   + s * (4 + dt.itemsize))     # y, out, pos, weights
  route_bytes = ((case.tokens + s) * case.hidden * dt.itemsize   # hidden in, rows out
                 + s * (4 + 4) + case.experts * 4)               # ids, pos, group sizes
  programs = {
      "route (sort, group sizes, gather)": GluePart(route, [
          jax.ShapeDtypeStruct((case.tokens, case.hidden), dt),
          jax.ShapeDtypeStruct((case.tokens, case.top_k), jnp.int32)], route_bytes, True),
      "combine (weights, unsort, sum over top-k)": GluePart(combine, [
          aot.RowMajor((s, case.hidden), jnp.float32),              # the down kernel's out
          jax.ShapeDtypeStruct((s,), jnp.int32),
          jax.ShapeDtypeStruct((case.tokens, case.top_k), dt)], combine_bytes, False),
  }
  if gate_up_route(case) == "gate_pass":   # ragged_dot._forward's gating after the kernel
    epilogue = R.Epilogue(activation=case.activation, gated=True)
    gate = lambda z: R.gate_pass(z, case.layout, epilogue, dt, chip)
    gate_bytes = s * 2 * case.width * 4 + s * case.width * dt.itemsize   # z in, gated out
    programs["gate (after the gate/up kernel)"] = GluePart(gate, [
        jax.ShapeDtypeStruct((s, 2 * case.width), jnp.float32)], gate_bytes, True)
  return programs


def rate_part(case: ExpertsLayer, chip: str, part: str, fallback: bool) -> dict:
  """One part of the layer (in a child: the estimator may abort the process)."""
  if is_kernel(part):
    gmm = gmms(case, chip, FALLBACK_ROWS if fallback else 0)[part]
    rated = _kernel_part(gmm, case, ragged_dot.rate_gmm)
    if fallback:
      rated["method"] += (f"; rated at {gmm.m} rows (the estimator aborts on this chip at "
                          f"{case.rows})")
    return rated
  glue = glue_programs(case, chip)[part]
  rate_glue = glue_cost_analysis if fallback else glue_part
  return rate_glue(glue.fn, glue.specs, chip, glue.min_bytes, glue.kernel_fed)


PART_TIMEOUT_S = 900


def _part_in_child(case: ExpertsLayer, chip: str, part: str) -> dict:
  errors = []
  for fallback in (False, True):
    profile = "0" if fallback and not is_kernel(part) else "1"
    rows, error = children.run_child(
        __file__, ["--part", case.name, chip, part] + (["--fallback"] if fallback else []),
        timeout=PART_TIMEOUT_S, env=children.child_env(ESTIMATE_STATIC_PROFILE=profile))
    if not error:
      part_row = rows[-1]
      if errors:
        part_row["first_attempt"] = errors[0]
      return part_row
    errors.append(error)
  raise RuntimeError(f"{part}: {' / '.join(errors)}")


def rate(case: ExpertsLayer, chip: str) -> dict:
  """The partial row of estimate.py for our whole layer; every part in its own child."""
  c = chips.get_chip(chip)
  names = list(gmms(case, chip)) + list(glue_programs(case, chip))
  parts = {name: _part_in_child(case, chip, name) for name in names}
  for p in parts.values():
    p.update(prediction(p["cycles"], p["hbm_bytes"], c))
  total_us = sum(p["predicted_us"] for p in parts.values())
  kernels_us = sum(p["predicted_us"] for n, p in parts.items() if is_kernel(n))
  unrated = [op for p in parts.values() for op in p.get("unrated_ops", [])]
  note = "the two small visit-table kernels (the estimator crashes on their loops)"
  if unrated:
    note += f"; the cycles of {', '.join(unrated)} (INT64_MAX from the estimator; its bytes count)"
  return dict(compiled=True, error=None,
              estimated_cycles=round(total_us * 1e-6 * c.clock_hz),
              hbm_bytes=sum(p["hbm_bytes"] for p in parts.values()),
              method="the layer part by part (benchmarks/rating/experts_layer.py): cycles = "
                     "sum over route, gate/up, down, combine of max(static cycles, HBM bytes "
                     "at full bandwidth) in clock cycles; kernels by rating/ragged_dot.py's "
                     f"visible table at {case.experts_hit:.1f} experts hit, glue as compiled "
                     "ops (XLA; the combine a Pallas kernel)" + ("; fallbacks: " + "; ".join(
                         f"{n}: {p['method'].split('; ')[-1]}" for n, p in parts.items()
                         if "first_attempt" in p) if any("first_attempt" in p
                                                         for p in parts.values()) else ""),
              note=note, kernels_us=kernels_us, glue_us=total_us - kernels_us,
              breakdown=parts)


if __name__ == "__main__":
  # --part CASE CHIP PART [--fallback]: one part in a child of `rate`, one ROW line
  _, flag, case_name, chip_name, part_name, *rest = sys.argv
  assert flag == "--part", sys.argv
  children.print_row(rate_part(cases.by_name(case_name), chip_name, part_name,
                               fallback=rest == ["--fallback"]))
