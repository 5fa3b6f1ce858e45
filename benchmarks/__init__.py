"""The instrument: how fast each kernel would run on a TPU, against whom, and where it misses.

No TPU is used. A rating compiles a program ahead of time for a chip with libtpu's static
cycle estimate on and turns it into time, `predicted = max(cycles / clock, bytes moved /
HBM bandwidth)`, against the case's roofline (`rating/`). The parts, each in a room of its
own; arrows point one way, down this list (a part imports only the parts above it):

  cases/       WHAT is rated: each family of cases (shapes, flops, roofline bytes), pure data
  estimator/   THE INSTRUMENT: libtpu's static estimate and XLA's cost model, one child
               process per rating, SMEM values shown to the estimator, grid replays
  peers/       AGAINST WHOM: one module (or package) per peer, XLA, jax, tokamax and
               tpu-inference, behind one protocol (`peers/protocol.py`)
  rating/      THE METHOD for our kernels: the roofline, each kernel's substitutions and
               extrapolations, the experts layer part by part, calibration against real-chip
               times, the full row
  reports/     TABLES AND CHARTS, written from the stored ratings alone (`results/`)
  tuning/      the autotuners that write kernels/tpu_kernels/tuned/*.json
  probes/      one-off evidence behind a sentence of the docs (not part of any results file)

and the commands, each writing one results file (run from the repository root, any venv):

  python benchmarks/estimate.py         every case: ours, XLA's and every peer's
                                        (results/estimates.*)
  python benchmarks/calibration.py      the estimator against tokamax's real-chip times
                                        (results/calibration.*)
  python benchmarks/seed_prediction.py  the seed's 21.5x as a prediction
                                        (results/seed_prediction.json)
  python benchmarks/qwen35_decode_prediction.py
                                        Qwen3.5-9B's decode step, ours against the default
                                        (results/qwen35_decode_prediction.json)
  python benchmarks/ragged_survey.py    the grouped matmul on other MoE models
                                        (results/ragged_survey.jsonl)
  python benchmarks/report.py           every table and chart again from results/ (no rating)
  python benchmarks/wallclock.py        timing on a real TPU (`--smoke`: the harness on CPU)

Import scheme: `benchmarks` is a package, imported from the repository root
(`from benchmarks.cases import headline`). A module meant to run (a command, a tuner, a probe,
a rating's child process) is run as a script, `python benchmarks/<path>.py`, and first puts
the repository root in place of its own directory on sys.path (two lines under its
docstring). Child processes run the same way in any venv (`estimator/children.py`).
This module puts `kernels/` on sys.path, so `tpu_kernels` imports wherever `benchmarks` does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

if str(ROOT / "kernels") not in sys.path:
  sys.path.insert(0, str(ROOT / "kernels"))


def read_rows(path: str | Path) -> list[dict]:
  """The rows of a JSON-lines results file (none if it does not exist)."""
  path = Path(path)
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_rows(path: str | Path, rows: list[dict]) -> None:
  Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
