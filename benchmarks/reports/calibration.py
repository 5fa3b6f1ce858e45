"""results/calibration.md from the rows of results/calibration.jsonl (rating/calibration.py):
per family and chip the median measured / predicted ratio and its spread, the measured
ceilings of tokamax's attention timings (from its caches, no estimator), and every entry.
"""

from __future__ import annotations

from benchmarks.rating.calibration import TOKAMAX_VERSION, measured_ceilings, summary


def markdown(rows: list[dict]) -> str:
  lines = [f"Measured: tokamax {TOKAMAX_VERSION}'s autotuning caches (real chips, median of "
           "each entry's timed runs). Predicted: this project's static estimator "
           "(benchmarks/calibration.py's docstring). ratio = measured / predicted.", "",
           "| family | chip | rated / listed | median ratio | 25-75% | min - max "
           "| median kernel-only ratio |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for s in summary(rows):
    if not s["rated"]:
      lines.append(f"| {s['family']} | {s['chip']} | 0 / {s['listed']} | not rated | | | |")
      continue
    lines.append(f"| {s['family']} | {s['chip']} | {s['rated']} / {s['listed']} "
                 f"| {s['median']:.2f} | {s['q25']:.2f} - {s['q75']:.2f} "
                 f"| {s['min']:.2f} - {s['max']:.2f} | {s['kernel_only_median']:.2f} |")
  lines += ["", "Measured ceilings (tokamax's own times, no estimator): fraction of the chip's "
            "bf16 peak (chips.py) reached by plain bf16 attention entries, best and worst per "
            "head_dim and mask.", "",
            "| chip | family | head_dim | mask | entries | best | worst | best entry |",
            "|---|---|---:|---|---:|---:|---:|---|"]
  for c in measured_ceilings():
    lines.append(f"| {c['chip']} | {c['family']} | {c['head_dim']} "
                 f"| {'causal' if c['causal'] else 'full'} | {c['entries']} | {c['best']:.2f} "
                 f"| {c['worst']:.2f} | {c['best_entry']} |")
  lines += ["", "Per entry (kernel-only ratio: measured / the kernel's prediction without the op's "
            "XLA glue):", "",
            "| family | chip | entry | config | measured µs | compute µs | HBM µs | glue µs "
            "| predicted µs | ratio | kernel-only ratio |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items()) or "op's own"
    if not r.get("rated"):
      lines.append(f"| {r['family']} | {r['chip']} | {r['entry']} | {cfg} "
                   f"| {r['measured_us']:,.1f} | {r['error'][:140]} ||||||")
      continue
    lines.append(f"| {r['family']} | {r['chip']} | {r['entry']} | {cfg} "
                 f"| {r['measured_us']:,.1f} | {r['compute_us']:,.1f} | {r['hbm_us']:,.1f} "
                 f"| {r['glue_us']:,.1f} | {r['predicted_us']:,.1f} | {r['ratio']:.2f} "
                 f"| {r['kernel_only_ratio']:.2f} |")
  return "\n".join(lines) + "\n"
