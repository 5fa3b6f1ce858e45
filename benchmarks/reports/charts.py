"""The charts of results/estimates.jsonl: efficiency per case, one bar per implementation (ours,
XLA, every peer), one panel per chip: results/estimates.png (every case) and
estimates-<kernel>.png (one kernel's cases: its card's chart; scripts/build.py ships it).
matplotlib (Agg) writes the PNG with no date in it, so a chart is the same bytes for the
same rows and the same matplotlib (the lock's, requirements.txt).
"""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.peers.protocol import ANCHOR, OURS, XLA


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
