"""Writing every results file and every generated block of the docs again from the stored
ratings (benchmarks/report.py is the command).

Results files: for each results directory with an estimates.jsonl (results/ and
results/jax012/: the TorchTPU stack's run), its estimates.md and charts; results/
calibration.md from calibration.jsonl.

Generated blocks: a docs page holds a table made from results between

    <!-- generated: NAME (python benchmarks/report.py) -->

    ...the table...

    <!-- end generated -->

`write_blocks` replaces each block's lines with `block(NAME)` (the table between two blank
lines); `blocks` reads what a page holds now (tests compare). A block stands where the prose
that reads it is; moving it is a docs edit, regenerating it is this module's. Each kernel
(`case.kernel` over `cases.all_cases()`) has its `summary-<kernel>` table, found by code.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from benchmarks import RESULTS, ROOT, read_rows
from benchmarks.cases import all_cases
from benchmarks.cases.quantized_decode import QUANTIZED_DECODE, W8A8_DECODE
from benchmarks.rating import qwen35_decode, seed_prediction
from benchmarks.reports import calibration, charts, estimates, summary, tables

ESTIMATES = RESULTS / "estimates.jsonl"
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^<!-- generated: (\S+) \(python benchmarks/report\.py\) -->\n(.*?)"
                   r"^<!-- end generated -->$", re.S | re.M)


def _rows() -> list[dict]:
  return read_rows(ESTIMATES)


def _kernel_table(kernel: str):
  return lambda: summary.kernel_table(_rows(), kernel)


def _seed() -> dict:
  return json.loads(seed_prediction.RESULTS_FILE.read_text())


TABLES = {
    "quantized-decode": lambda: tables.quantized_decode_table(
        _rows(), [c.name for c in QUANTIZED_DECODE if c.quantized]),
    "w8a8-decode": lambda: tables.quantized_decode_table(_rows(), [c.name for c in W8A8_DECODE]),
    "tpu-inference-gmm": lambda: tables.tpu_inference_gmm_table(
        _rows(), [c.name for c in QUANTIZED_DECODE]),
    "experts-layer": lambda: tables.experts_layer_table(_rows()) + "\n",
    "jax012-targets": lambda: "\n".join(
        estimates.targets(read_rows(RESULTS / "jax012" / "estimates.jsonl"))[2:]) + "\n",
    "seed": lambda: tables.seed_table(_seed()) + "\n",
    "seed-parts": lambda: tables.seed_parts_table(_seed()) + "\n",
    "seed-models": lambda: tables.seed_models_table(_rows()) + "\n",
    "qwen35-decode-step": lambda: tables.qwen35_step_table(
        json.loads(qwen35_decode.RESULTS_FILE.read_text())) + "\n",
    **{f"summary-{kernel}": _kernel_table(kernel)
       for kernel in dict.fromkeys(c.kernel for c in all_cases())},
}


def results_dirs() -> list[Path]:
  """The results directories a run of benchmarks/estimate.py wrote (an estimates.jsonl)."""
  return sorted(p.parent for p in RESULTS.rglob("estimates.jsonl"))


def write_results(out: Path | None = None) -> list[Path]:
  """Writes every results table and chart from its rows into `out` (None: in place), the
  same relative paths as under results/. Returns the paths written."""
  written = []
  for directory in results_dirs():
    target = (out or RESULTS) / directory.relative_to(RESULTS)
    target.mkdir(parents=True, exist_ok=True)
    rows = read_rows(directory / "estimates.jsonl")
    (target / "estimates.md").write_text(estimates.HEADER + estimates.markdown(rows))
    written += [target / "estimates.md", *charts.charts(rows, target)]
  target = out or RESULTS
  (target / "calibration.md").write_text(calibration.markdown(read_rows(
      RESULTS / "calibration.jsonl")))
  return written + [target / "calibration.md"]


def pages() -> list[Path]:
  return sorted(DOCS.rglob("*.md"))


def block(name: str) -> str:
  """What the block NAME holds: its table, between blank lines."""
  return "\n" + TABLES[name]() + "\n"


def blocks(path: Path) -> dict[str, str]:
  """{name: the text a page's block holds now}."""
  return {m.group(1): m.group(2) for m in BLOCK.finditer(path.read_text())}


def write_blocks() -> list[Path]:
  """Regenerates every generated block of every docs page; returns the pages changed."""
  changed = []
  for path in pages():
    text = path.read_text()
    new = BLOCK.sub(lambda m: (f"<!-- generated: {m.group(1)} (python benchmarks/report.py) "
                               f"-->\n{block(m.group(1))}<!-- end generated -->"), text)
    if new != text:
      path.write_text(new)
      changed.append(path)
  return changed
