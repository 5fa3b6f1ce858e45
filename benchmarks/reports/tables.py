"""The docs' tables generated from stored results (docs/performance.md and its pages under
docs/performance/ hold them as generated; tests compare):

  quantized_decode_table     int8 / fp8 decode rows (and the w8a8 rows) against issue 28's
                             goals, from estimates.jsonl
  tpu_inference_gmm_table    tpu-inference's megablox gmm beside ours, from estimates.jsonl
  experts_layer_table        the experts layer's breakdown, from estimates.jsonl
  seed_table, seed_parts_table  the seed prediction, from seed_prediction.json
  qwen35_step_table          Qwen3.5-9B's decode step (issue 59), from
                             qwen35_decode_prediction.json
  seed_models_table          the seed's six models call by call (issue 60), from
                             estimates.jsonl

`python benchmarks/report.py --print NAME` prints one (report.py lists the names).
"""

from __future__ import annotations

from benchmarks import cases
from benchmarks.rating import experts_layer, qwen35_decode, seed_prediction
from benchmarks.cases.seed import SEED_SPEEDUP, Layer
from benchmarks.cases.seed_models import SEED_MODELS
from benchmarks.estimator import children
from benchmarks.rating.roofline import TARGET_EFFICIENCY
from benchmarks.reports.summary import best_other


# ------------------------------------------------------------------ quantized decode (issue 28)

SPEEDUP_GOAL = 1.8        # issue 28: >= 1.8x faster than the best bf16 anchor's prediction
QUANT_EFFICIENCY_GOAL = 0.85


def bf16_case_name(name: str) -> str:
  """The bf16 row a quantized row is compared with: same model, part and m."""
  for tag in (" int8 ", " fp8 ", " w8a8 "):
    name = name.replace(tag, " bf16 ")
  return name


def quantized_decode_table(rows: list[dict], case_names) -> str:
  """Markdown: each quantized row of `case_names` (cases/quantized_decode.py's int8 / fp8
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
  (cases/quantized_decode.py's QUANTIZED_DECODE names: bf16, int8 and fp8) per chip, from
  estimates.jsonl."""

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


# ------------------------------------------------------------------ the experts layer


def experts_layer_table(rows: list[dict]) -> str:
  """The breakdown table of the docs from estimate.py's rows (estimates.jsonl)."""
  lines = ["| model | T | chip | roofline µs | ours µs | efficiency | kernels µs | glue µs "
           "| glue parts µs | lax.ragged_dot layer µs |",
           "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]
  for r in rows:
    if r["implementation"] != "pallas (whole layer)":
      continue
    case = cases.by_name(r["case"])
    xla = next((o for o in rows if o["case"] == r["case"] and o["chip"] == r["chip"]
                and o["source"] == "xla" and "predicted_us" in o), None)
    xla_us = f"{xla['predicted_us']:,.0f}" if xla else "not rated"
    head = f"| {case.model} | {case.tokens} | {r['chip']} | {r['roofline_us']:,.1f} "
    if "predicted_us" not in r:
      lines.append(head + f"| not rated: {r['error'][:120]} ||||| {xla_us} |")
      continue
    glue = ", ".join(f"{n.split(' (')[0]} {p['predicted_us']:,.1f}"
                     + (" (cost_analysis)" if "first_attempt" in p
                        and not experts_layer.is_kernel(n) else "")
                     for n, p in r["breakdown"].items() if not experts_layer.is_kernel(n))
    lines.append(head + f"| {r['predicted_us']:,.1f} | {r['efficiency']:.2f} "
                 f"| {r['kernels_us']:,.1f} | {r['glue_us']:,.1f} | {glue} | {xla_us} |")
  return "\n".join(lines)


# ------------------------------------------------------------------ the seed prediction


def _seed_us(x) -> str:
  return "not rated" if x is None else f"{x:,.1f}"


def seed_table(results: dict) -> str:
  """The docs' table (static estimates) from the results file."""
  layer = Layer(**results["layer"])
  lines = ["| chip | part | ours µs | default (grouped_mm) µs | default, no weight copy µs |",
           "|---|---|---:|---:|---:|"]
  for chip, parts in results["chips"].items():
    s = seed_prediction.summary(results)[chip]
    shared = _seed_us(s["shared_us"])
    lines.append(f"| {chip} | shared: norms, attention, router (same in both) "
                 f"| {shared} | {shared} | {shared} |")
    lines.append(f"| {chip} | experts (16 local of 128, 512 routed rows) | "
                 f"{_seed_us(s['ours_experts_us'])} | {_seed_us(s['default_experts_us'])} | "
                 f"{_seed_us(s['default_no_copy_experts_us'])} |")
    layer_us = lambda e: None if e is None or s["shared_us"] is None else s["shared_us"] + e
    lines.append(f"| {chip} | **decoder layer** | {_seed_us(layer_us(s['ours_experts_us']))} | "
                 f"{_seed_us(layer_us(s['default_experts_us']))} | "
                 f"{_seed_us(layer_us(s['default_no_copy_experts_us']))} |")
    ratio = lambda k: f"{s[k]:.2f}x" if s.get(k) else "not rated"
    lines.append(f"| {chip} | predicted speed-up, experts / layer (seed: "
                 f"{SEED_SPEEDUP[layer.model]}x) | | {ratio('default_experts_ratio')} / "
                 f"{ratio('default_layer_ratio')} | {ratio('default_no_copy_experts_ratio')} / "
                 f"{ratio('default_no_copy_layer_ratio')} |")
  return "\n".join(lines)


def seed_parts_table(results: dict) -> str:
  """Every rated part: µs, how."""
  lines = ["| chip | program | part | µs | compute µs | HBM µs | method |",
           "|---|---|---|---:|---:|---:|---|"]
  for chip, parts in results["chips"].items():
    for group, ps in parts.items():
      for name, p in ps.items():
        if "predicted_us" not in p:
          lines.append(f"| {chip} | {group} | {name} | not rated: {p.get('error', '')[:100]} |||")
          continue
        lines.append(f"| {chip} | {group} | {name} | {p['predicted_us']:,.1f} | "
                     f"{p['compute_us']:,.1f} | {p['hbm_us']:,.1f} | {p['method'][:90]} |")
  return "\n".join(lines)


def qwen35_step_table(results: dict) -> str:
  """Qwen3.5-9B's decode step part by part (µs per call, calls per step), ours against the
  default, and the step's totals, per chip (static estimates)."""
  step = qwen35_decode.Qwen35DecodeStep(**results["step"])
  lines = ["| chip | part | calls | ours µs | default µs | ours / step µs | default / step µs |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for chip, rated in results["chips"].items():
    for part in qwen35_decode.parts(step):
      got = rated.get(part.name, {})
      sides = (["shared", "shared"] if part.sides == ("shared",) else ["ours", "default"])
      cells = []
      for side in sides:
        p = got.get(side, {})
        cells.append(f"{p['predicted_us']:,.1f}" if "predicted_us" in p else "not rated")
      per_step = [f"{part.count * got[s]['predicted_us']:,.0f}"
                  if "predicted_us" in got.get(s, {}) else "" for s in sides]
      if not per_step[0] and per_step[1]:   # step_totals counts the default's time for ours
        per_step[0] = f"{per_step[1]} (the default's)"
      lines.append(f"| {chip} | {part.name} | {part.count} | {cells[0]} | {cells[1]} | "
                   f"{per_step[0]} | {per_step[1]} |")
    t = results["summary"][chip]
    us = lambda x: "not rated" if x is None else f"{x:,.0f}"
    speedup = f"{t['speedup']:.2f}x" if t.get("speedup") else "not rated"
    differing = (f"{t['differing_speedup']:.2f}x" if t.get("differing_speedup")
                 else "not rated")
    lines.append(f"| {chip} | the parts the kernels change ({differing}) | | | | "
                 f"{us(t['ours_differing_us'])} | {us(t['default_differing_us'])} |")
    lines.append(f"| {chip} | **decode step** (predicted speed-up {speedup}) | | | | "
                 f"**{us(t['ours_us'])}** | **{us(t['default_us'])}** |")
  notes = [f"* {chip}, {note}" for chip, t in results["summary"].items()
           for note in t["substituted"]]
  return "\n".join(lines + ([""] + notes if notes else []))


LEVEL = 0.02   # within 2% of the best peer's prediction: level


def seed_model_status(ours: dict, best: dict | None) -> str:
  """"ahead 1.25x of <peer>", "level with <peer>", "behind by 1.25x <peer>", or "no peer
  rated"; then the efficiency against its target where the case is memory-bound."""
  if best is None:
    verdict = "no peer rated"
  else:
    ratio = best["predicted_us"] / ours["predicted_us"]
    name = best["implementation"].split(" (")[0]
    verdict = (f"level with {name}" if abs(ratio - 1) <= LEVEL else
               f"ahead {ratio:.2f}x of {name}" if ratio > 1 else
               f"behind by {1 / ratio:.2f}x {name}")
  target = TARGET_EFFICIENCY[ours["bound"]]
  if ours["bound"] == "memory":
    miss = "" if ours["efficiency"] >= target else f", short of {target}"
    verdict += f"; {ours['efficiency']:.2f} of roofline{miss}"
  return verdict


def seed_models_table(rows: list[dict]) -> str:
  """Markdown: every call of cases/seed_models.py's SEED_MODELS, per chip where rated (ours
  µs, the best peer, the verdict), else why not (static estimates, estimates.jsonl)."""
  lines = ["| model | call | per forward | chip | ours µs | best peer µs | verdict |",
           "|---|---|---:|---|---:|---:|---|"]
  for c in SEED_MODELS:
    count = "" if c.per_forward is None else str(c.per_forward)
    head = f"| {c.model} | {c.call} | {count} |"
    if c.case is None:
      lines.append(f"{head} | | | no case: {c.why} |")
      continue
    ours = [r for r in rows if r["case"] == c.case.name and r["source"] == "ours"]
    if not ours:
      lines.append(f"{head} | | | not rated yet (`{c.case.name}`) |")
      continue
    for r in sorted(ours, key=lambda r: r["chip"]):
      if "predicted_us" not in r:
        lines.append(f"{head} {r['chip']} | | | not rated: "
                     f"{children.short_error(r.get('error') or '')} |")
        continue
      best = best_other(rows, r)
      peer = f"{best['predicted_us']:,.2f}" if best else ""
      lines.append(f"{head} {r['chip']} | {r['predicted_us']:,.2f} | {peer} | "
                   f"{seed_model_status(r, best)} |")
  return "\n".join(lines)
