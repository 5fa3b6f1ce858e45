"""The full row of a rating: what benchmarks/estimate.py writes to results/estimates.jsonl.

`finish_row` adds to a rating's partial row (compiled, error, estimated_cycles or compute_us,
hbm_bytes, method, ...) the case's kernel, bound, target and roofline, and the prediction
and efficiency (roofline.py). A rating with no cycles and no compute time is a row with its
error, never a prediction.
"""

from __future__ import annotations

from benchmarks import cases
from benchmarks.peers.protocol import Implementation
from benchmarks.rating import roofline


def finish_row(impl: Implementation, chip_name: str, partial: dict) -> dict:
  """The full row: the rating plus predicted / roofline / efficiency / target."""
  from tpu_kernels import chips
  case = cases.by_name(impl.case)
  chip = chips.get_chip(chip_name)
  row = dict(kernel=case.kernel, case=impl.case, implementation=impl.implementation,
             source=impl.source, chip=chip_name, bound=case.bound,
             target=roofline.TARGET_EFFICIENCY[case.bound],
             roofline_us=roofline.roofline_us(case, chip),
             compiled=False, error=None)
  row.update(partial)
  cycles = row.get("estimated_cycles")
  if cycles:
    row["compute_us"] = roofline.compute_us(cycles, chip)
  if row.get("compute_us") is None or not row.get("hbm_bytes"):
    row["error"] = row["error"] or "no estimate (estimated_cycles 0 or missing)"
    return row
  row["hbm_us"] = roofline.hbm_us(row["hbm_bytes"], chip)
  row["predicted_us"] = max(row["compute_us"], row["hbm_us"])
  row["efficiency"] = row["roofline_us"] / row["predicted_us"]
  return row
