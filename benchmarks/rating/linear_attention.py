"""Static estimates of the linear-attention kernels (gated-delta-rule-tpu, causal-conv1d-tpu)
where a whole-program rating would rate them wrong (rating/ours.py rates the conv's
prefill cases whole):

  * chunked prefill and training (`GdnChunked`): the whole program at T = 4096 has 8 x 64
    grid steps of big bodies, and the estimator took 16 GB and over two minutes on its
    forward before it was stopped. Every chunk does the same work (the grid walks the
    chunks in order, the first and last chunk add a fixed amount: the state's first load
    and last write), so the program is compiled at the case's heads and batch over its
    first TRUNCATED_CHUNKS[direction] chunks and its cycles (every op of it: the Mosaic
    kernels and the XLA glue around them, relayouts and gate tiles) extrapolated linearly
    to all of its chunks. Checked on v6e, forward: 124,331 / 229,778 / 446,368 cycles at
    2 / 4 / 8 chunks (52.7k then 54.1k a chunk, the glue's relayouts growing a little
    faster than linearly at first); the fit from 4 and 8 is used.
  * decode steps (`GdnDecode`, `ConvUpdate`): the kernel aliases the state to the new
    state (`input_output_aliases`), so the program is compiled with the state donated, as
    the layer's cache update calls it. Undonated, XLA copies the state first: on v6e a
    copy of 355,008 cycles beside the 198,069 of the decode kernel.

hbm_bytes is the case's roofline bytes (every operand read once, every result written
once): the kernels read each block once (their grids never revisit one), and where the
estimate is above the bytes' time it decides the prediction anyway. No side effects at
import (the caller sets the profile flag).
"""

from __future__ import annotations

from benchmarks.cases.causal_conv1d import ConvUpdate
from benchmarks.cases.gated_delta_rule import CHUNK, GdnChunked, GdnDecode
from benchmarks.estimator.static_estimate import UNESTIMATED, op_cycles

RATES = (GdnChunked, GdnDecode, ConvUpdate)   # the case kinds rated here (rating/ours.py)
TRUNCATED_CHUNKS = {"fwd": (4, 8), "fwd+bwd": (2, 4)}


def program_cycles(fn, specs, chip: str, donate_argnums=()) -> tuple[int, list[str]]:
  """(the sum of the estimates of every op of `fn` compiled for `chip`, the ops the
  estimator could not rate: INT64_MAX, left out), the arguments `donate_argnums` donated."""
  import jax
  from tpu_kernels import aot
  device = aot.topology_device(chip)
  args = [aot._on_device(s, device) for s in specs]
  text = jax.jit(fn, donate_argnums=donate_argnums).trace(*args).lower().compile().as_text()
  ops = op_cycles(text)
  if not ops:
    raise RuntimeError("the compiled program carries no estimated_cycles (profile flag off?)")
  return (sum(c for _, c in ops if c < UNESTIMATED),
          [name for name, c in ops if c >= UNESTIMATED])


def _row(cycles: float, case, method: str, unrated: list[str], **extra) -> dict:
  if unrated:
    method += f"; {', '.join(unrated)}: the estimator returns INT64_MAX, left out"
  return dict(compiled=True, error=None, estimated_cycles=round(cycles),
              hbm_bytes=case.min_bytes(), method=method, **extra)


def rate_chunked(case: GdnChunked, chip: str) -> dict:
  """The program's cycles at two truncations in chunks, extrapolated linearly."""
  (c1, c2) = TRUNCATED_CHUNKS[case.direction]
  rated, unrated = [], []
  for chunks in (c1, c2):
    cycles, missing = program_cycles(*case.program(chip, tokens=chunks * CHUNK), chip)
    rated.append(cycles)
    unrated += missing
  per_chunk = (rated[1] - rated[0]) / (c2 - c1)
  total = -(-case.tokens // CHUNK)
  return _row(rated[0] + per_chunk * (total - c1), case,
              f"static estimate of the whole program (kernels and XLA glue) at the first {c1} "
              f"and {c2} chunks of {CHUNK} tokens, extrapolated linearly to {total}",
              sorted(set(unrated)), cycles_per_chunk=per_chunk,
              truncated=[dict(chunks=c, cycles=r) for c, r in zip((c1, c2), rated)])


def rate_donated(case, chip: str) -> dict:
  """The whole program, compiled with the case's state donated."""
  cycles, unrated = program_cycles(*case.program(chip), chip, donate_argnums=case.donated)
  return _row(cycles, case, "static estimate of the whole program, the state donated "
              "(updated in place, as the layer's cache calls it)", unrated)


def rate(case, chip: str) -> dict:
  """Our kernel's partial row for a linear-attention case (rating/ours.py)."""
  return rate_chunked(case, chip) if isinstance(case, GdnChunked) else rate_donated(case, chip)
