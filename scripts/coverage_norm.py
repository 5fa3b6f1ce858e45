"""The norm column of the coverage table (scripts/coverage.py): a cell is a function
(kernels, family) -> str, "matches", "refused: <reason>" or "not applicable".

norm: every class of the family decorated @use_kernel_forward_from_hub("RMSNorm") or
  ("RMSNormZeroCentered") (transformers_integration.hub_rms_norm_classes), kernelized with
  rms-norm-tpu and compared with its own forward (rms_norm_class_mismatch: float32,
  bfloat16, bfloat16 input with a float32 weight; float32 gradients) within the
  tolerances tests/torch/test_kernelize.py documents; the layer's NotImplementedError is
  a refusal.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import transformers_integration as ti  # noqa: E402


def _repo_id(name: str) -> str:
  import build

  return f"{build.load_manifest()['collection']['hub-org']}/{name}"


def norm_cell(kernels, fam) -> str:
  """The norm column (module docstring)."""
  from kernels import Mode

  classes = [cls for family, cls in ti.hub_rms_norm_classes() if family == fam.name]
  if not classes:
    return "not applicable"
  repo = _repo_id("rms-norm-tpu")
  problems = []
  for cls in classes:
    for x_dtype, weight_dtype in ti.RMS_NORM_CASES:
      case = f"{cls.__name__} ({str(x_dtype)[6:]} x, {str(weight_dtype)[6:]} weight)"
      try:
        problem = ti.rms_norm_class_mismatch(cls, repo, x_dtype, weight_dtype,
                                             mode=Mode.TRAINING)
      except NotImplementedError as e:
        problem = str(e)
      except Exception as e:  # noqa: BLE001  (reported in the cell)
        problem = f"crash: {type(e).__name__}: {e}"
      if problem is not None:
        problems.append(f"{case}: {problem}")
  if problems:
    return "refused: " + "; ".join(problems)
  return "matches" if len(classes) == 1 else f"matches ({len(classes)} classes)"
