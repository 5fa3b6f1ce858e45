"""Our kernel's row for a case: which method rates it, found by code.

A method module of this package names the case kinds it rates in `RATES` and rates a case
with `rate(case, chip) -> partial row`; its rows are named `IMPLEMENTATION` ("pallas" unless
the module names another):

  ragged_dot.py       grouped matmul: the visit table made visible, extrapolated in visits
  flash_attention.py  causal and non-causal attention: the MHA program at the GQA tiling,
                      extrapolated in heads and, past S=8192, per visited tile
  paged_attention.py  paged decode and serving steps: per-item values made visible,
                      extrapolated from truncated batches (and, past 4k, contexts)
  experts_layer.py    the whole experts layer, part by part

A case kind no method module names is rated as one whole program, if the case builds it
(`case.program(chip) -> (fn, specs)`): the static estimate of every Mosaic kernel in it, at
the case's roofline bytes (RMSNorm's way, and a new kernel's first: a kernel with no
data-dependent SMEM values needs no method module). Each rating runs in
benchmarks/estimate.py's child process, with the static profile on.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil

from benchmarks import rating
from benchmarks.peers.protocol import OURS, Implementation

DEFAULT_IMPLEMENTATION = "pallas"


@functools.cache
def methods() -> dict:
  """{case kind: the method module that rates our kernel on it}, from every module of this
  package with `RATES`."""
  found = {}
  for info in pkgutil.iter_modules(rating.__path__):
    module = importlib.import_module(f"{rating.__name__}.{info.name}")
    for kind in getattr(module, "RATES", ()):
      if kind in found:
        raise ValueError(f"{kind.__name__} is rated by {found[kind].__name__} and "
                         f"{module.__name__}")
      found[kind] = module
  return found


def whole_program(case, chip: str) -> dict:
  """The partial row of a case rated as one whole program (`case.program(chip)`)."""
  from benchmarks.estimator.static_estimate import whole_program as rate_program
  fn, specs = case.program(chip)
  return rate_program(fn, specs, chip, case.min_bytes())


def implementations(case) -> list[Implementation]:
  """Our row for `case` ([] if nothing rates its kind)."""
  module = methods().get(type(case))
  if module is not None:
    name = getattr(module, "IMPLEMENTATION", DEFAULT_IMPLEMENTATION)
    return [Implementation(case.name, name, OURS, functools.partial(module.rate, case))]
  if hasattr(case, "program"):
    return [Implementation(case.name, DEFAULT_IMPLEMENTATION, OURS,
                           functools.partial(whole_program, case))]
  return []
