"""The method: how our kernels are shown to the static estimator, and how a rating becomes a
row.

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth)
    roofline_us  = max(flops / peak, min_bytes / hbm_bandwidth)
    efficiency   = roofline_us / predicted_us

  roofline.py          that arithmetic, and the targets (one home; everything imports it)
  ours.py              which method rates our kernel for a case kind (found by code)
  ragged_dot.py        grouped matmul: the SMEM visit table made visible
  flash_attention.py   attention: the MHA program at the GQA tiling
  paged_attention.py   paged decode and serving: per-item values made visible
  experts_layer.py     the whole experts layer, part by part
  rows.py              the full row: a rating plus predicted / roofline / efficiency / target
  calibration.py       the estimator against tokamax's real-chip times, and the "expected on
                       hardware" factor (its specs: calibration_specs.py)

Each module says what the estimator cannot see of its kernel and what is done about it, and
which hand counts check it. These are static estimates, not measurements.
"""
