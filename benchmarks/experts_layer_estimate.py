"""Static estimate of the whole experts layer (`moe.moe_experts`), part by part.

The layer is one jitted program of five parts, run one after another:

  route      moe.route: sort of the T*K expert ids (moe_route's kernel at decode, XLA's
             argsort else), group sizes, gather of the rows
  tables     two `ragged_dot_visit_table` kernels (one per projection): NOT rated, the
             static estimator crashes on their scalar loops (as for the headline gmm rows)
  gate/up    the gated grouped matmul, silu epilogue          (ragged_estimate's method)
  down       the grouped matmul, float32 out                  (ragged_estimate's method)
  combine    moe.combine: routing weights, unsort, sum over K  (float32; the Pallas
             kernel moe_combine.gather_weighted_sum, one DMA per row)

Each part's time is max(static cycles / clock, its HBM bytes / bandwidth) (the estimator does
not cap HBM bandwidth), and the layer's is their sum. The row's `estimated_cycles` is that
sum in clock cycles (so predicted = it), and `breakdown` keeps every part.

Kernels: ragged_estimate's visible-table method (cycles at 4 and 8 visits, extrapolated),
with a table for the routing of a decode step. `RoutedTable`: the m = T*K rows go to `hit`
experts (every (E / hit)-th one), m / hit rows each; every other expert is empty and is not
visited (the kernel's zero_visits). With m / hit rows <= block_m a visit is one expert, so
cycles and bytes are extrapolated linearly in visits to the expected number of distinct
experts hit (`headline.ExpertsLayer.experts_hit`, the same as the roofline's). Visits added
by a group crossing a row-tile boundary under uneven routing are not counted (at most
tiles - 1 more).

Glue (route, combine; for gpt-oss at decode also the gate pass after a plain gate/up
kernel, the "gate_pass" route its interleaved columns take): the same functions
moe_experts calls, compiled for the chip with the static profile on: cycles from the
estimate of every op (the Pallas kernels of the route at decode, the combine and the gate
pass included), HBM bytes from XLA's own cost_analysis ("bytes accessed") of the same
program, raised to the bytes each part must move (a kernel's own DMAs are not in
cost_analysis). The route's and the gate pass's outputs take the layout XLA chooses, as
inside the layer, where a kernel reads them (`_compile_glue`); the combine's keep the
default of a program's result, as the layer's own result does. An op the estimator returns
INT64_MAX for (the offloaded scatter-add that counted group sizes until 2026-12-04, and
still does in seed_prediction's grouped_mm glue) counts by its bytes only. cost_analysis
counts a row gather's bytes many times over (2.6 GB for the route's 268 MB gather at
Qwen3's prefill; 59 MB for the 4 MB XLA combine at T=64, before the kernel), so a
gather-heavy part is rated by those bytes, an overestimate.

Each part is rated in its own child process (the estimator aborts processes), with one
fallback where it aborts: a kernel at 8 rows (v5e's LLO type check) is rated at 16 rows;
a glue part (v5e: "Static LLO profiling of gather_fusion failed") by XLA's
cost_analysis, a lower bound (no per-op cost; ~1-2k cycles per op where the estimator
sees them). Not modelled: the "split" route (no case takes it; NotImplementedError, a
"not rated" row), gpt-oss's biases and its (E, k, n) weight layout (rated as (E, n, k)).

    python benchmarks/experts_layer_estimate.py --summary    # the docs' breakdown table
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
from pathlib import Path
from typing import Callable, NamedTuple

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import tuning  # noqa: E402  (no jax)

if __name__ == "__main__" and os.environ.get("ESTIMATE_STATIC_PROFILE", "1") == "1":
  tuning.enable_static_profile()   # a part's child (`_part_in_child`): before jax loads

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, moe  # noqa: E402
from tpu_kernels import ragged_dot as R  # noqa: E402

import headline  # noqa: E402
import ragged_estimate  # noqa: E402


@dataclasses.dataclass(frozen=True)
class RoutedTable(ragged_estimate.BalancedTable):
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
    stride = ragged_estimate._log2(self.groups // self.hit)
    tiles = self.m // self.block_m
    group = (v << stride) & (self.groups - 1)
    tile = ((v * self.rows) >> ragged_estimate._log2(self.block_m)) & (tiles - 1)
    start = v * self.rows
    return {R._GROUP: group, R._TILE: tile, R._ROW_START: start,
            R._ROW_END: start + self.rows, R._RHS_GROUP: group, R._LHS_TILE: tile,
            R._K_PIN: -1 + 0 * v}[field]

  def group_sizes(self) -> jax.Array:
    assert self.rows * self.hit == self.m and self.groups % self.hit == 0
    ragged_estimate._log2(self.rows), ragged_estimate._log2(self.block_m)
    stride = self.groups // self.hit
    return jnp.zeros((self.groups,), jnp.int32).at[::stride].set(self.rows)


@dataclasses.dataclass(frozen=True)
class RoutedGmm(ragged_estimate.GmmCase):
  hit: int = 0

  def table(self) -> RoutedTable:
    return RoutedTable(self.m, self.groups, self.tiling().block_m, hit=self.hit)


# v5e's estimator aborts on the kernel with 8-row bf16 tiles (an LLO type check on vmatmul,
# "Expected vector-bf16packed, got vector-int16"): there the kernel is rated at 16 rows.
FALLBACK_ROWS = 16


def is_kernel(part: str) -> bool:
  return part.startswith(("gate/up", "down"))


def gate_up_route(case: headline.ExpertsLayer) -> str:
  """The route the gated forward takes in moe_experts (ragged_dot.gate_up_route)."""
  weight_bytes = case.experts * 2 * case.width * case.hidden * jnp.dtype(case.dtype).itemsize
  return R.gate_up_route(case.rows, 2 * case.width, case.layout, weight_bytes)


def gmms(case: headline.ExpertsLayer, chip: str, min_rows: int = 0) -> dict[str, RoutedGmm]:
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


def _kernel_part(gmm: RoutedGmm, case: headline.ExpertsLayer, rate_gmm: Callable) -> dict:
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
  `kernel_fed`: a kernel of the layer reads its outputs (`_compile_glue`)."""
  fn: Callable
  specs: list
  min_bytes: int
  kernel_fed: bool


def glue_programs(case: headline.ExpertsLayer, chip: str) -> dict[str, GluePart]:
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


# The estimator's value for an op it cannot estimate: INT64_MAX (seen on v6e's offloaded
# scatter-add, `scatter_offload_custom_fusion`).
UNESTIMATED = 2 ** 62


def op_cycles(hlo_text: str) -> list[tuple[str, int]]:
  """(instruction name, estimated cycles) of every op of compiled HLO text that carries one."""
  out = []
  for instruction in re.split(r"\n\s*(?:ROOT\s+)?%", hlo_text.replace('\\"', '"')):
    found = aot._ESTIMATED_CYCLES.search(instruction)
    if found:
      name = instruction.strip().removeprefix("ROOT ").lstrip("%").split(" ", 1)[0]
      out.append((name, int(found.group(1))))
  return out


def _compile_glue(fn, specs, chip: str, kernel_fed: bool = False):
  """The glue program compiled for the chip, and XLA's cost_analysis of it. `kernel_fed`:
  its outputs go to a Mosaic kernel within the layer (the route's rows to gate/up, the
  gate pass's to down), so they take the layout XLA chooses (`Layout.AUTO`), as they do
  there. Else they keep the entry's default layout, as the layer's own result does: a
  result such as [256, 2880] bfloat16 then gets a copy into the TPU's column-major layout
  (7,550 cycles on v6e)."""
  from jax.experimental.layout import Format, Layout
  device = aot.topology_device(chip)
  args = [aot._on_device(s, device) for s in specs]
  jitted = (jax.jit(fn, out_shardings=Format(Layout.AUTO,
                                              jax.sharding.SingleDeviceSharding(device)))
            if kernel_fed else jax.jit(fn))
  compiled = jitted.trace(*args).lower().compile()
  cost = compiled.cost_analysis()
  return compiled, cost[0] if isinstance(cost, list) else cost


def glue_part(fn, specs, chip: str, min_bytes: int = 0, kernel_fed: bool = False) -> dict:
  """An XLA program `fn(*specs)` rated as compiled for the chip (the static profile on):
  cycles = the sum of its ops' estimates, hbm_bytes = max(cost_analysis's bytes accessed,
  min_bytes); ops, method, and the ops the estimator could not rate. The layer's glue, the
  seed prediction's parts and estimate.py's row quantization use it."""
  compiled, cost = _compile_glue(fn, specs, chip, kernel_fed)
  ops = op_cycles(compiled.as_text())
  if not ops:
    raise RuntimeError("the compiled glue carries no estimated_cycles (profile flag off?)")
  unrated = [name for name, c in ops if c >= UNESTIMATED]
  accessed = int(cost.get("bytes accessed", 0))   # absent for a lone Pallas kernel
  part = dict(cycles=sum(c for _, c in ops if c < UNESTIMATED),
              hbm_bytes=max(accessed, min_bytes), ops=len(ops),
              method="static estimate of the compiled ops; bytes: cost_analysis")
  if min_bytes > accessed:
    part["method"] += (f" ({accessed}) raised to the {min_bytes} the "
                       "part must move (a kernel's own DMAs are not in cost_analysis)")
  if unrated:
    part["unrated_ops"] = unrated
    part["method"] += (f"; {', '.join(unrated)}: the estimator returns INT64_MAX, counted "
                       "by its bytes only")
  return part


def glue_cost_analysis(fn, specs, chip: str, min_bytes: int = 0,
                       kernel_fed: bool = False) -> dict:
  """A glue part by XLA's cost_analysis (no profile flag): where the static estimator
  aborts on it (v5e: gathers and scatters, "Unsupported DMA direction: 10 on VL/VLP")."""
  _, cost = _compile_glue(fn, specs, chip, kernel_fed)
  seconds = float(cost["optimal_seconds"])
  if seconds <= 0:
    raise RuntimeError(f"cost_analysis gives optimal_seconds {seconds}")
  return dict(cycles=round(seconds * chips.get_chip(chip).clock_hz),
              hbm_bytes=max(int(cost["bytes accessed"]), min_bytes),
              method="XLA cost_analysis (optimal_seconds, bytes accessed; a lower bound: "
                     "no per-op cost): the static estimator aborts on this part")


def rate_part(case: headline.ExpertsLayer, chip: str, part: str, fallback: bool) -> dict:
  """One part of the layer (in a child: the estimator may abort the process)."""
  import estimate   # here, not at import: estimate.py imports this module
  if is_kernel(part):
    gmm = gmms(case, chip, FALLBACK_ROWS if fallback else 0)[part]
    rated = _kernel_part(gmm, case, estimate.rate_gmm)
    if fallback:
      rated["method"] += (f"; rated at {gmm.m} rows (the estimator aborts on this chip at "
                          f"{case.rows})")
    return rated
  glue = glue_programs(case, chip)[part]
  rate_glue = glue_cost_analysis if fallback else glue_part
  return rate_glue(glue.fn, glue.specs, chip, glue.min_bytes, glue.kernel_fed)


PART_TIMEOUT_S = 900


def _part_in_child(case: headline.ExpertsLayer, chip: str, part: str) -> dict:
  errors = []
  for fallback in (False, True):
    profile = "0" if fallback and not is_kernel(part) else "1"
    rows, error = tuning.run_child(
        __file__, ["--part", case.name, chip, part] + (["--fallback"] if fallback else []),
        timeout=PART_TIMEOUT_S, env=tuning.child_env(ESTIMATE_STATIC_PROFILE=profile))
    if not error:
      part_row = rows[-1]
      if errors:
        part_row["first_attempt"] = errors[0]
      return part_row
    errors.append(error)
  raise RuntimeError(f"{part}: {' / '.join(errors)}")


def rate(case: headline.ExpertsLayer, chip: str) -> dict:
  """The partial row of estimate.py for our whole layer; every part in its own child."""
  c = chips.get_chip(chip)
  names = list(gmms(case, chip)) + list(glue_programs(case, chip))
  parts = {name: _part_in_child(case, chip, name) for name in names}
  for p in parts.values():
    p["compute_us"] = p["cycles"] / c.clock_hz * 1e6
    p["hbm_us"] = p["hbm_bytes"] / c.hbm_bytes_per_s * 1e6
    p["predicted_us"] = max(p["compute_us"], p["hbm_us"])
  total_us = sum(p["predicted_us"] for p in parts.values())
  kernels_us = sum(p["predicted_us"] for n, p in parts.items() if is_kernel(n))
  unrated = [op for p in parts.values() for op in p.get("unrated_ops", [])]
  note = "the two small visit-table kernels (the estimator crashes on their loops)"
  if unrated:
    note += f"; the cycles of {', '.join(unrated)} (INT64_MAX from the estimator; its bytes count)"
  return dict(compiled=True, error=None,
              estimated_cycles=round(total_us * 1e-6 * c.clock_hz),
              hbm_bytes=sum(p["hbm_bytes"] for p in parts.values()),
              method="the layer part by part (benchmarks/experts_layer_estimate.py): cycles = "
                     "sum over route, gate/up, down, combine of max(static cycles, HBM bytes "
                     "at full bandwidth) in clock cycles; kernels by ragged_estimate's "
                     f"visible table at {case.experts_hit:.1f} experts hit, glue as compiled "
                     "ops (XLA; the combine a Pallas kernel)" + ("; fallbacks: " + "; ".join(
                         f"{n}: {p['method'].split('; ')[-1]}" for n, p in parts.items()
                         if "first_attempt" in p) if any("first_attempt" in p
                                                         for p in parts.values()) else ""),
              note=note, kernels_us=kernels_us, glue_us=total_us - kernels_us,
              breakdown=parts)


def xla_program(case: headline.ExpertsLayer):
  """The XLA baseline of the whole layer: moe's XLA sort (`sort_pairs_xla`), the gather and
  XLA's combine around two jax.lax.ragged_dot calls (weights in their native (E, k, n)
  layout) and the case's gate (columns and activation), one program."""
  dt = jnp.dtype(case.dtype)

  def fn(hidden, ids, weights, gate_up, down):
    pos, src, sizes = moe.sort_pairs_xla(ids, case.experts)
    x = hidden.at[src].get(mode="promise_in_bounds")
    z = jax.lax.ragged_dot(x, gate_up, sizes, preferred_element_type=jnp.float32)
    epilogue = R.Epilogue(activation=case.activation, gated=True)
    h = epilogue(*R._split_columns(z, case.layout, case.width, 1)).astype(dt)
    y = jax.lax.ragged_dot(h, down, sizes, preferred_element_type=jnp.float32)
    return moe.combine_xla(y, pos.reshape(case.tokens, case.top_k), weights).astype(dt)

  specs = [jax.ShapeDtypeStruct((case.tokens, case.hidden), dt),
           jax.ShapeDtypeStruct((case.tokens, case.top_k), jnp.int32),
           jax.ShapeDtypeStruct((case.tokens, case.top_k), dt),
           jax.ShapeDtypeStruct((case.experts, case.hidden, 2 * case.width), dt),
           jax.ShapeDtypeStruct((case.experts, case.width, case.hidden), dt)]
  return fn, specs


def summary(rows: list[dict]) -> str:
  """The breakdown table of the docs from estimate.py's rows (estimates.jsonl)."""
  lines = ["| model | T | chip | roofline µs | ours µs | efficiency | kernels µs | glue µs "
           "| glue parts µs | lax.ragged_dot layer µs |", "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
  for r in rows:
    if r["implementation"] != "pallas (whole layer)":
      continue
    case = headline.by_name(r["case"])
    xla = next((o for o in rows if o["case"] == r["case"] and o["chip"] == r["chip"]
                and o["source"] == "xla" and "predicted_us" in o), None)
    xla_us = f"{xla['predicted_us']:,.0f}" if xla else "not rated"
    head = f"| {case.model} | {case.tokens} | {r['chip']} | {r['roofline_us']:,.1f} "
    if "predicted_us" not in r:
      lines.append(head + f"| not rated: {r['error'][:120]} ||||| {xla_us} |")
      continue
    glue = ", ".join(f"{n.split(' (')[0]} {p['predicted_us']:,.1f}"
                     + (" (cost_analysis)" if "first_attempt" in p and not is_kernel(n) else "")
                     for n, p in r["breakdown"].items() if not is_kernel(n))
    lines.append(head + f"| {r['predicted_us']:,.1f} | {r['efficiency']:.2f} "
                 f"| {r['kernels_us']:,.1f} | {r['glue_us']:,.1f} | {glue} | {xla_us} |")
  return "\n".join(lines)


if __name__ == "__main__":
  if sys.argv[1:] == ["--summary"]:   # the docs' table from benchmarks/results/estimates.jsonl
    print(summary(tuning.read_log(Path(__file__).parent / "results" / "estimates.jsonl")))
    sys.exit(0)
  # --part CASE CHIP PART [--fallback]: one part in a child of `rate`, one ROW line
  _, flag, case_name, chip_name, part_name, *rest = sys.argv
  assert flag == "--part", sys.argv
  tuning.print_row(rate_part(headline.by_name(case_name), chip_name, part_name,
                             fallback=rest == ["--fallback"]))
