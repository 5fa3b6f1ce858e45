"""The norm column of the coverage table (scripts/coverage.py): a cell is a function
(kernels, family) -> str, "matches", "refused: <reason>" or "not applicable".

norm: every RMSNorm class of the family, by class (transformers_integration.rms_norm_layer:
  the classes Transformers decorates @use_kernel_forward_from_hub("RMSNorm") or
  ("RMSNormZeroCentered") and their subclasses, and the undecorated classes named *RMSNorm
  that cls(hidden, eps=eps) builds with one weight and an epsilon; not the gated
  *RMSNormGated norms, nor norms without a weight), kernelized with rms-norm-tpu
  (kernelize_rms_norm) and compared with its own forward (rms_norm_class_mismatch: float32,
  bfloat16, bfloat16 input with a float32 weight; float32 gradients) within the tolerances
  tests/torch/test_kernelize.py documents; the layer's NotImplementedError is a refusal,
  and so is a modeling module of the family that mentions RMSNorm and does not import.
"""

from __future__ import annotations

import importlib.util
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

  problems = [f"{name} does not import ({error})" for name, error in fam.import_errors.items()
              if "RMSNorm" in Path(importlib.util.find_spec(name).origin).read_text()]
  classes = fam.classes(lambda cls: ti.rms_norm_layer(cls) is not None)
  if not classes and not problems:
    return "not applicable"
  repo = _repo_id("rms-norm-tpu")
  with ti.kernel_mapping_scope():   # the mapping and marks end with the cell
    for cls in classes:
      for x_dtype, weight_dtype in ti.RMS_NORM_CASES:
        case = f"{cls.__name__} ({str(x_dtype)[6:]} x, {str(weight_dtype)[6:]} weight)"
        try:
          problem = ti.rms_norm_class_mismatch(cls, repo, x_dtype, weight_dtype,
                                               mode=Mode.TRAINING)
        except NotImplementedError as e:   # refused: the other cases would say the same
          problems.append(f"{case}: {e}")
          break
        except Exception as e:  # noqa: BLE001  (reported in the cell)
          problem = f"crash: {type(e).__name__}: {e}"
        if problem is not None:
          problems.append(f"{case}: {problem}")
  if problems:
    return "refused: " + "; ".join(problems)
  return "matches" if len(classes) == 1 else f"matches ({len(classes)} classes)"
