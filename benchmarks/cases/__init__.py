"""What is rated: the cases, one module per family, pure data and arithmetic (no jax).

A case is a frozen dataclass with
    name       its key in every results file (unique over `all_cases()`)
    kernel     the Hub repo it rates ("ragged-dot-tpu", ...)
    bound      "memory" or "compute": which efficiency target applies (rating/roofline.py)
    flops()    multiply-adds counted as 2
    min_bytes() every operand read once and every result written once (the roofline's bytes)
and, for a kind whose kernel is rated as one whole program, `program(chip) -> (fn, specs)`
(jax imported only when called; rating/ours.py).

A family module holds one question's cases in `CASES`. `all_cases()` is every family's:
the modules of this package that define `CASES`, found by code, the headline first (the
shapes every number is quoted at), then by module name. So a new family is one new module
here, and `benchmarks/estimate.py` rates it:

  headline.py          RMSNorm, grouped matmul, causal attention, paged decode: the headline
  diffusion.py         non-causal joint attention at Diffusers' shapes (issue 30)
  quantized_decode.py  int8 / fp8 expert weights at decode, and int8 activations (issue 28)
  experts_layer.py     the whole experts op as one program (issue 28)
  serving.py           paged attention at serving page sizes and batches (issue 28)
  seed_models.py       the seed's six models call by call at their real shapes (issue 60):
                       the calls no other family holds
  seed.py              the seed's decoder layer, one chip's share (benchmarks/seed_prediction.py)
  survey.py            other MoE models' expert shapes (benchmarks/ragged_survey.py, the tuner)

(seed.py and survey.py have no CASES: their commands rate them, estimate.py does not.)
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

ITEMSIZE = {"bfloat16": 2, "float32": 4, "int8": 1, "float8_e4m3fn": 1}
HEADLINE_FAMILY = f"{__name__}.headline"


@functools.cache
def families() -> tuple:
  """The family modules (those that define CASES), the headline first, then by name."""
  modules = [importlib.import_module(f"{__name__}.{info.name}")
             for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]
  found = [m for m in modules if hasattr(m, "CASES")]
  return tuple(sorted(found, key=lambda m: (m.__name__ != HEADLINE_FAMILY, m.__name__)))


@functools.cache
def all_cases() -> tuple:
  """Every case estimate.py rates, family by family."""
  cases = tuple(case for family in families() for case in family.CASES)
  names = [c.name for c in cases]
  duplicated = sorted({n for n in names if names.count(n) > 1})
  if duplicated:
    raise ValueError(f"case names must be unique: {duplicated}")
  return cases


def by_name(name: str):
  """The case of all_cases() called `name` (KeyError naming the known ones otherwise)."""
  for case in all_cases():
    if case.name == name:
      return case
  raise KeyError(f"no case {name!r}; known: {[c.name for c in all_cases()]}")
