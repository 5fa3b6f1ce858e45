"""The roofline, the prediction and the targets: the arithmetic every rating shares.

    roofline_us   = max(flops / bf16 peak, min_bytes / HBM bandwidth)      (the case's)
    predicted_us  = max(cycles / clock, hbm_bytes / HBM bandwidth)         (a rating's)
    efficiency    = roofline_us / predicted_us

`hbm_bytes` are the bytes the program really moves (every block its grid fetches or writes
back), since libtpu's estimator does not cap HBM bandwidth. The chip's numbers (clock, peak,
bandwidth) come from `tpu_kernels.chips`. The targets are issue 6's: efficiency >= 0.85
where the case is memory-bound, >= 0.75 where it is compute-bound.
"""

from __future__ import annotations

TARGET_EFFICIENCY = {"memory": 0.85, "compute": 0.75}


def roofline_us(case, chip) -> float:
  """max(flops / bf16 peak, min_bytes / HBM bandwidth) in µs: the fastest `case` (anything
  with flops() and min_bytes()) could run on `chip` (a chips.Chip)."""
  return max(case.flops() / chip.bf16_flops_per_s, case.min_bytes() / chip.hbm_bytes_per_s) * 1e6


def compute_us(cycles: float, chip) -> float:
  """`cycles` of static estimate at `chip`'s clock, in µs."""
  return cycles / chip.clock_hz * 1e6


def hbm_us(hbm_bytes: float, chip) -> float:
  """`hbm_bytes` at `chip`'s HBM bandwidth, in µs."""
  return hbm_bytes / chip.hbm_bytes_per_s * 1e6


def prediction(cycles: float, hbm_bytes: float, chip) -> dict:
  """compute_us, hbm_us and predicted_us = max(compute_us, hbm_us) of `cycles` of static
  estimate and `hbm_bytes` moved on `chip` (a chips.Chip)."""
  compute, hbm = compute_us(cycles, chip), hbm_us(hbm_bytes, chip)
  return dict(compute_us=compute, hbm_us=hbm, predicted_us=max(compute, hbm))
