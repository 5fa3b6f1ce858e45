"""Static performance estimates from the TPU compiler's own cycle count (no TPU needed).

    python benchmarks/estimate.py [--chips v5e v6e] [--quick] [--cases SUBSTR ...]
                                  [--no-anchors] [--out benchmarks/results]

Every headline case (`benchmarks/headline.py`) is rated for each chip, for our kernel,
the XLA-native baseline and jax's own Pallas kernels (`benchmarks/anchors.py`), in one
run. A Pallas program is compiled ahead of time with libtpu's static LLO profile on;
each op of the compiled program then carries `estimated_cycles`. That estimate does not
cap HBM bandwidth, so

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth)
    roofline_us  = max(flops / peak, min_bytes / hbm_bandwidth)     (headline.py)
    efficiency   = roofline_us / predicted_us

where hbm_bytes counts every block the grid really fetches or writes back. These are
static estimates, not measurements: nothing here ran on a TPU.

How each implementation is rated (the details and checks live in each module):

  rms_norm         the whole program, as compiled (ours and plain-jnp XLA alike).
  ragged_dot       `ragged_estimate.py`: the kernel's SMEM visit table made visible to the
                   estimator, cycles extrapolated from 4 and 8 visits; the small kernel
                   that builds the table is not rated (the estimator crashes on it).
  flash_attention  `attention_estimate.py`: the GQA kernel's MHA program at the same
                   tiling (3-D blocks rate at 0), extrapolated in heads and, past
                   S=8192, per visited tile.
  paged_attention  `paged_estimate.py`: per-item values made visible, extrapolated from
                   truncated batches (and, past 4k, contexts).
  XLA baselines    plain jnp RMSNorm by the same estimator; `jax.lax.ragged_dot`,
                   `jax.nn.dot_product_attention` and the gathering paged attention by
                   XLA's own `cost_analysis()` (optimal_seconds, bytes accessed): the
                   estimator crashes on ragged_dot and takes >300 s / 19 GB on attention.
  anchors          `anchors.py` (its own subprocesses).

Each of ours is rated in a child process (`--child`): the estimator can abort the
process (libtpu 0.0.42 on the paged kernel for v5e) and its memory grows per compile.
A failed rating is a row with its error, never a crash.

Writes <out>/estimates.jsonl, <out>/estimates.md (the table every kernel card and the
README quote), <out>/estimates.png (every case) and <out>/estimates-<kernel>.png (one
kernel's cases: its card's chart, `charts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import tuning  # noqa: E402  (no jax)

# The static profile must be requested before libtpu loads, i.e. before jax is imported.
# (Not in the children that rate XLA by cost_analysis: the flag crashes ragged_dot.)
if os.environ.get("ESTIMATE_STATIC_PROFILE", "1") == "1":
  tuning.enable_static_profile()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, ragged_dot as R, rms_norm  # noqa: E402

import attention_estimate  # noqa: E402
import experts_layer_estimate  # noqa: E402
import headline  # noqa: E402
import paged_estimate  # noqa: E402
import ragged_estimate  # noqa: E402

OURS, XLA, ANCHOR = "ours", "xla", "anchor"


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of one headline case. `rate(chip)` returns the partial row:
  compiled, error, estimated_cycles (None for cost_analysis rows), hbm_bytes, method,
  and optionally compute_us (cost_analysis), note, tiling / config."""

  case: str
  implementation: str
  source: str                      # OURS, XLA or ANCHOR
  rate: Callable[[str], dict]
  static_profile: bool = True      # the child process needs the profile flag


# ------------------------------------------------------------------------ rating: ours


def _whole_program(build: Callable[[str], tuple], case, chip: str) -> dict:
  fn, specs = build(chip)
  report = aot.compile_for_chip(fn, specs, chip)
  if not report.ok:
    return dict(compiled=False, error=report.error)
  return dict(compiled=True, error=None, estimated_cycles=report.estimated_cycles,
              hbm_bytes=case.min_bytes(), method="static estimate of the whole program")


def _xla_cost(build: Callable[[], tuple], chip: str) -> dict:
  """XLA's own cost model for a plain XLA program (no Mosaic kernel)."""
  fn, specs = build()
  device = aot.topology_device(chip)
  try:
    compiled = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower().compile()
  except Exception as e:  # noqa: BLE001  (the compiler's verdict is the row)
    return dict(compiled=False, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, list) else cost
  row = dict(compiled=True, error=None, estimated_cycles=None,
             hbm_bytes=int(cost["bytes accessed"]), xla_flops=float(cost["flops"]),
             method="XLA cost_analysis (optimal_seconds, bytes accessed)")
  optimal = float(cost["optimal_seconds"])
  if optimal > 0:
    row["compute_us"] = optimal * 1e6
  else:   # seen for the gathering paged attention: negative optimal_seconds
    row["compute_us"] = float(cost["flops"]) / chips.get_chip(chip).bf16_flops_per_s * 1e6
    row["method"] = (f"XLA cost_analysis: its optimal_seconds is invalid ({optimal:.3g}), so "
                     "its flops at peak and its bytes accessed at full bandwidth (a lower "
                     "bound for XLA)")
  return row


TRUNCATED_VISITS = (4, 8)


def _gmm(case: headline.GroupedMatmul, chip: str) -> ragged_estimate.GmmCase:
  return ragged_estimate.gmm_case(case, chip)


def _ragged_pallas(case: headline.GroupedMatmul, chip: str) -> dict:
  row = rate_gmm(_gmm(case, chip), chip)
  if case.lhs_quant:
    row = _with_lhs_quantization(row, case, chip)
  return row


def _with_lhs_quantization(kernel: dict, case: headline.GroupedMatmul, chip: str) -> dict:
  """The kernel's row plus the op that quantizes lhs before it (`ragged_dot.quantize_rows`,
  its kernel, compiled alone), as the layer estimate sums its parts: each part's time is
  max(static cycles, HBM bytes at full bandwidth), the row's cycles their sum."""
  c = chips.get_chip(chip)
  lhs = jax.ShapeDtypeStruct((case.m, case.k), jnp.dtype(case.dtype))
  quantize = experts_layer_estimate.glue_part(   # bf16 in, int8 codes and f32 scales out
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


def rate_gmm(gmm: ragged_estimate.GmmCase, chip: str) -> dict:
  """Kernel cycles extrapolated from truncated visit counts (identical per-visit work)."""
  t, table = gmm.tiling(), gmm.table()
  table.check(num_k_tiles=-(-gmm.k // t.block_k))
  rated = []
  for visits in TRUNCATED_VISITS:
    fn, specs = gmm.function(visits), gmm.specs()
    text = jax.jit(fn).trace(*[aot._on_device(s, aot.topology_device(chip))
                               for s in specs]).lower().compile().as_text()
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


def _paged_pallas(case: headline.PagedDecode, chip: str) -> dict:
  r = paged_estimate.estimate(case, chip)
  return dict(compiled=True, error=None, estimated_cycles=r["estimated_cycles"],
              hbm_bytes=r["hbm_bytes"], method=r["method"],
              tiling=dict(block_kv=r["block_kv"], pages_per_block=r["pages_per_block"]))


def _paged_batch_pallas(case: headline.PagedBatch, chip: str) -> dict:
  r = paged_estimate.estimate_batch(case, chip)
  return dict(compiled=True, error=None, estimated_cycles=r["estimated_cycles"],
              hbm_bytes=r["hbm_bytes"], method=r["method"],
              tiling=dict(block_q=r["block_q"], block_kv=r["block_kv"],
                          pages_per_block=r["pages_per_block"]), classes=r["classes"])


def ours_and_xla(case) -> list[Implementation]:
  name = case.name
  if isinstance(case, headline.RmsNorm):
    x = jax.ShapeDtypeStruct((case.rows, case.hidden), case.dtype)
    w = jax.ShapeDtypeStruct((case.hidden,), case.dtype)
    return [
        Implementation(name, "pallas", OURS, functools.partial(_whole_program, lambda chip: (
            functools.partial(rms_norm.rms_norm, chip=chip), [x, w]), case)),
        Implementation(name, "xla (jnp)", XLA, functools.partial(_whole_program, lambda chip: (
            rms_norm.rms_norm_reference, [x, w]), case)),
    ]
  if isinstance(case, headline.GroupedMatmul) and case.lhs_quant:
    # No XLA row: lax.ragged_dot has no int8 x int8 with row and column scales (the int8
    # row's XLA baseline, which dequantizes the weights, is the comparison).
    return [Implementation(name, "pallas", OURS, functools.partial(_ragged_pallas, case))]
  if isinstance(case, headline.GroupedMatmul):
    return [
        Implementation(name, "pallas", OURS, functools.partial(_ragged_pallas, case)),
        Implementation(name, "xla (lax.ragged_dot)", XLA, lambda chip: _xla_cost(
            lambda: ragged_estimate.xla_function(_gmm(case, chip)), chip),
            static_profile=False),
    ]
  if isinstance(case, (headline.Attention, headline.JointAttention)):
    return [
        Implementation(name, "pallas", OURS, functools.partial(attention_estimate.estimate, case)),
        Implementation(name, "xla (nn.dot_product_attention)", XLA, lambda chip: _xla_cost(
            lambda: attention_estimate.xla_program(case), chip), static_profile=False),
    ]
  if isinstance(case, headline.PagedDecode):
    return [
        Implementation(name, "pallas", OURS, functools.partial(_paged_pallas, case)),
        Implementation(name, "xla (gather + softmax)", XLA, lambda chip: _xla_cost(
            lambda: paged_estimate.xla_program(case), chip), static_profile=False),
    ]
  if isinstance(case, headline.ExpertsLayer):   # the whole experts op (experts_layer_estimate)
    return [
        Implementation(name, "pallas (whole layer)", OURS, functools.partial(
            experts_layer_estimate.rate, case)),
        Implementation(name, "xla (lax.ragged_dot layer)", XLA, lambda chip: _xla_cost(
            lambda: experts_layer_estimate.xla_program(case), chip), static_profile=False),
    ]

  if isinstance(case, headline.PagedBatch):
    # No XLA row: the gathering baseline materialises every token's whole context.
    return [Implementation(name, "pallas", OURS, functools.partial(_paged_batch_pallas, case))]
  raise TypeError(f"no rating for {type(case).__name__}")


QUICK = (headline.RmsNorm(8, 4096),)


def implementations(quick: bool, cases=None, with_anchors: bool = True,
                    names=None) -> list[Implementation]:
  """What a run rates: ours, XLA's and (unless quick or not with_anchors) the anchors, for
  the cases whose name contains one of `cases` and, if `names` is given, only the
  implementations whose name contains one of `names`."""
  chosen = QUICK if quick else headline.ALL_CASES
  if cases:
    chosen = [c for c in chosen if any(s in c.name for s in cases)]
  out = [impl for case in chosen for impl in ours_and_xla(case)]
  if with_anchors and not quick:
    import anchors   # only here: its import is light, its ratings run in subprocesses
    case_names = {c.name for c in chosen}
    out += [Implementation(a.case, a.implementation, ANCHOR, a.rate)
            for a in anchors.anchors() if a.case in case_names]
  if names:
    out = [impl for impl in out if any(n in impl.implementation for n in names)]
  return out


# ------------------------------------------------------------------------ the row


def finish_row(impl: Implementation, chip_name: str, partial: dict) -> dict:
  """The full row: the rating plus predicted / roofline / efficiency / target."""
  case = headline.by_name(impl.case)
  chip = chips.get_chip(chip_name)
  row = dict(kernel=case.kernel, case=impl.case, implementation=impl.implementation,
             source=impl.source, chip=chip_name, bound=case.bound,
             target=headline.TARGET_EFFICIENCY[case.bound],
             roofline_us=headline.roofline_us(case, chip),
             compiled=False, error=None)
  row.update(partial)
  cycles = row.get("estimated_cycles")
  if cycles:
    row["compute_us"] = cycles / chip.clock_hz * 1e6
  if row.get("compute_us") is None or not row.get("hbm_bytes"):
    row["error"] = row["error"] or "no estimate (estimated_cycles 0 or missing)"
    return row
  row["hbm_us"] = row["hbm_bytes"] / chip.hbm_bytes_per_s * 1e6
  row["predicted_us"] = max(row["compute_us"], row["hbm_us"])
  row["efficiency"] = row["roofline_us"] / row["predicted_us"]
  return row


def _rate_in_child(impl: Implementation, chip: str) -> dict:
  env = tuning.child_env(ESTIMATE_STATIC_PROFILE="1" if impl.static_profile else "0")
  rows, error = tuning.run_child(__file__, ["--child", impl.case, impl.implementation, chip],
                                 timeout=CHILD_TIMEOUT_S, env=env)
  return dict(compiled=False, error=error) if error else rows[-1]


CHILD_TIMEOUT_S = 900


def _child_main(case: str, implementation: str, chip: str) -> None:
  impl = next(i for i in implementations(False, [case], with_anchors=False)
              if i.case == case and i.implementation == implementation)
  try:
    partial = impl.rate(chip)
  except Exception as e:  # noqa: BLE001  (a failed rating is a row)
    partial = dict(compiled=False, error=f"{type(e).__name__}: {str(e).strip()[:300]}")
  tuning.print_row(partial)


def rate(impl: Implementation, chip: str) -> dict:
  start = time.time()
  partial = impl.rate(chip) if impl.source == ANCHOR else _rate_in_child(impl, chip)
  row = finish_row(impl, chip, partial)
  row["rate_seconds"] = round(time.time() - start, 1)
  return row


# ------------------------------------------------------------------------ output


def _us(x) -> str:
  return "" if x is None else f"{x:,.2f}"


def _error(message: str | None) -> str:
  """A table cell for an error: no log prefix, at most 160 characters."""
  message = re.sub(r"F\d{4} [\d:.]+\s+\d+ \S+\] ", "", message or "")
  return message[:160] + ("..." if len(message) > 160 else "")


def expected_on_hardware_us(r: dict) -> str:
  """The "expected on hardware" cell: the static prediction times calibration.py's factor for
  the row's kernel and chip (the median measured / predicted ratio of tokamax's real-chip
  timings rated by this estimator), or "" where no timing calibrates that kernel / chip. Only
  Mosaic-kernel rows (static cycle counts) get it: the factor calibrates that instrument."""
  import calibration   # reads benchmarks/results/calibration.jsonl; needs no tokamax
  factor = calibration.expected_factor(r["chip"], r["kernel"]) if r.get("kernel") else None
  if factor is None or r.get("estimated_cycles") is None:
    return ""
  expected = r["predicted_us"] * factor[0]
  if expected < r["roofline_us"]:   # a factor < 1 never takes a row past its roofline
    return f"{r['roofline_us']:,.2f} (x{factor[0]:.2f}, held at the roofline)"
  return f"{expected:,.2f} (x{factor[0]:.2f})"


EXPECTED_NOTE = (
    "expected on hardware = predicted x the median measured / predicted ratio of the same "
    "kernel family on the same chip, from `benchmarks/calibration.py` (tokamax 0.0.17's "
    "autotuning times on real chips, rated by this estimator at the same shapes and configs; "
    "flash_attention rows use tokamax's flash attention entries, ragged_dot rows its "
    "ragged_dot entries); never below the row's roofline (a factor < 1 says the estimator "
    "over-counts the calibrating kernel, not that the hardware beats its peak). Blank: no real-chip timing calibrates that kernel on that chip "
    "(rms_norm, paged attention; v5e attention and v6e ragged_dot: see docs/performance.md#"
    "calibration), or the row is rated by XLA's cost_analysis, not the static cycle count. "
    "An estimate of an estimate, not a measurement.")


def markdown(rows: list[dict]) -> str:
  lines = ["| case | impl | chip | cycles | compute µs | HBM µs | predicted µs | roofline µs "
           "| efficiency | expected on hardware µs |",
           "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    if "predicted_us" not in r:
      lines.append(f"| {r['case']} | {r['implementation']} | {r['chip']} "
                   f"| not rated: {_error(r['error'])} |||||||")
      continue
    cycles = "cost_analysis" if r.get("estimated_cycles") is None else \
        f"{r['estimated_cycles']:,}"
    lines.append(f"| {r['case']} | {r['implementation']} | {r['chip']} | {cycles} "
                 f"| {_us(r['compute_us'])} | {_us(r['hbm_us'])} | {_us(r['predicted_us'])} "
                 f"| {_us(r['roofline_us'])} | {r['efficiency']:.2f} "
                 f"| {expected_on_hardware_us(r)} |")
  lines += ["", f"Column note: {EXPECTED_NOTE}"]
  lines += ["", *targets(rows), "", "How each row was rated:", ""]
  seen = set()
  for r in rows:
    key = (r["case"], r["implementation"], r["chip"])
    if key in seen or not r.get("method"):
      continue
    seen.add(key)
    extra = f" Not counted: {r['note']}." if r.get("note") else ""
    lines.append(f"* {r['case']} / {r['implementation']} / {r['chip']}: {r['method']}.{extra}")
  return "\n".join(lines) + "\n"


def targets(rows: list[dict]) -> list[str]:
  """Our kernel against issue 6's targets and the best other implementation, per case."""
  out = ["Targets (issue 6: efficiency >= 0.85 memory-bound, >= 0.75 compute-bound; "
         "predicted no slower than the best anchor or baseline):", "",
         "| case | chip | ours µs | efficiency | target | best other | its µs | ours vs best |",
         "|---|---|---:|---:|---:|---|---:|---:|"]
  for r in rows:
    if r["source"] != OURS:
      continue
    others = [o for o in rows if o["case"] == r["case"] and o["chip"] == r["chip"]
              and o["source"] != OURS and "predicted_us" in o]
    best = min(others, key=lambda o: o["predicted_us"], default=None)
    if "predicted_us" not in r:
      out.append(f"| {r['case']} | {r['chip']} | not rated: {_error(r['error'])} |||||||")
      continue
    eff = f"{r['efficiency']:.2f} " + ("(met)" if r["efficiency"] >= r["target"] else
                                       f"(short by {r['target'] - r['efficiency']:.2f})")
    if best is None:
      versus, best_name, best_us = "no other rated", "", ""
    else:
      ratio = best["predicted_us"] / r["predicted_us"]
      # Within half a percent is level, not "faster": the estimate is not that precise.
      versus = f"{ratio:.2f}x " + ("(level)" if abs(ratio - 1) < 0.005 else
                                   "(faster)" if ratio > 1 else "(slower)")
      best_name, best_us = best["implementation"], _us(best["predicted_us"])
    out.append(f"| {r['case']} | {r['chip']} | {_us(r['predicted_us'])} | {eff} "
               f"| {r['target']:.2f} | {best_name} | {best_us} | {versus} |")
  return out


def _short(implementation: str) -> str:
  """A bar label: the implementation without its version parenthesis."""
  label = re.sub(r", jax [0-9.]+", "", implementation)
  return re.sub(r" \(jax [0-9.]+,? ?", " (", label).replace(" ()", "")


def chart_path(out: Path, kernel: str | None = None) -> Path:
  """<out>/estimates.png, or one kernel's <out>/estimates-<kernel>.png (the build puts the
  latter in the kernel's Hub repo for its card)."""
  return out / ("estimates.png" if kernel is None else f"estimates-{kernel}.png")


def charts(rows: list[dict], out: Path) -> list[Path]:
  """The chart of every case, and one per kernel (cases are named "<kernel> ...")."""
  paths = [chart_path(out)]
  chart(rows, paths[0])
  for kernel in dict.fromkeys(r["case"].split(" ")[0] for r in rows):
    paths.append(chart_path(out, kernel))
    chart([r for r in rows if r["case"].split(" ")[0] == kernel], paths[-1])
  return paths


def chart(rows: list[dict], path: Path) -> None:
  """Efficiency per case, one bar per implementation (ours, XLA, anchors), labelled, one
  panel per chip (PNG). Unrated implementations get no bar."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  chip_names = sorted({r["chip"] for r in rows})
  cases = list(dict.fromkeys(r["case"] for r in rows))
  order = {OURS: 0, XLA: 1, ANCHOR: 2}
  colors = {OURS: "#1f77b4", XLA: "#8c8c8c", ANCHOR: "#ff7f0e"}
  per_case = {c: sorted(dict.fromkeys((r["source"], r["implementation"]) for r in rows
                                      if r["case"] == c), key=lambda x: order[x[0]])
              for c in cases}
  height = sum(len(v) + 1.5 for v in per_case.values())
  fig, axes = plt.subplots(1, len(chip_names), figsize=(9 * len(chip_names), 0.22 * height + 1.5),
                           squeeze=False, sharey=True)
  for ax, chip in zip(axes[0], chip_names):
    y, ticks = 0.0, []
    for case in cases:
      ticks.append((y, case))
      for source, impl in per_case[case]:
        y += 1
        r = next((r for r in rows if r["chip"] == chip and r["case"] == case
                  and r["implementation"] == impl), None)
        rated = r is not None and "efficiency" in r
        value = r["efficiency"] if rated else 0.0
        ax.barh(y, value, height=0.8, color=colors[source])
        label = (f"{value:.2f} " if rated else "not rated: ") + \
            ("ours (pallas)" if source == OURS else _short(impl))
        ax.text(value + 0.01, y, label, va="center", fontsize=6)
      y += 1.5
    for target, style in ((0.85, "--"), (0.75, ":")):
      ax.axvline(target, color="black", linestyle=style, linewidth=0.8)
    ax.set_xlim(0, 1.6)
    ax.set_xticks([0, 0.25, 0.5, 0.75, 0.85, 1.0])
    ax.set_title(f"{chip}: efficiency = roofline / predicted (static estimate, not measured)",
                 fontsize=9)
    ax.set_yticks([t for t, _ in ticks])
    ax.set_yticklabels([c for _, c in ticks], fontsize=7, fontweight="bold")
  axes[0][0].invert_yaxis()   # shared by every panel: invert once (cases top to bottom)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


HEADER = ("Static estimates (libtpu cycle count, not a TPU measurement). "
          "Generated by `python benchmarks/estimate.py`; the method is in its docstring.\n\n")


def merged(old: list[dict], new: list[dict]) -> list[dict]:
  """`old` with each row that `new` re-rates (same case, implementation and chip) replaced
  in place; new rows for other keys are added after the last old row of their case."""
  key = lambda r: (r["case"], r["implementation"], r["chip"])
  fresh = {key(r): r for r in new}
  out = [fresh.pop(key(r), r) for r in old]
  for r in new:
    if key(r) in fresh:
      last = max((i for i, o in enumerate(out) if o["case"] == r["case"]), default=len(out) - 1)
      out.insert(last + 1, fresh.pop(key(r)))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--quick", action="store_true", help="decode-size RMSNorm only (seconds)")
  parser.add_argument("--cases", nargs="+", help="only cases whose name contains one of these")
  parser.add_argument("--no-anchors", action="store_true", help="ours and XLA only")
  parser.add_argument("--implementations", nargs="+",
                      help="only implementations whose name contains one of these (with --merge: "
                           "add or refresh some rows)")
  parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
  parser.add_argument("--merge", action="store_true",
                      help="keep the rows of --out's estimates.jsonl that this run does not "
                           "re-rate (with --cases: refresh some cases, rewrite every output)")
  parser.add_argument("--markdown-only", action="store_true",
                      help="rewrite --out's estimates.md from its estimates.jsonl (no rating; "
                           "e.g. after benchmarks/calibration.py changed the expected column)")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)   # see _rate_in_child
  args = parser.parse_args(argv)
  if args.child:
    _child_main(*args.child)
    return 0
  if args.markdown_only:
    (args.out / "estimates.md").write_text(
        HEADER + markdown(tuning.read_log(args.out / "estimates.jsonl")))
    return 0
  rows = []
  for impl in implementations(args.quick, args.cases, not args.no_anchors, args.implementations):
    for chip in args.chips:
      rows.append(rate(impl, chip))
      print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  if args.merge:
    rows = merged(tuning.read_log(args.out / "estimates.jsonl"), rows)
  (args.out / "estimates.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  table = markdown(rows)
  (args.out / "estimates.md").write_text(HEADER + table)
  charts(rows, args.out)
  print(table)
  ours = [r for r in rows if r["source"] == OURS]
  return 0 if all("predicted_us" in r for r in ours) else 1


if __name__ == "__main__":
  sys.exit(main())
