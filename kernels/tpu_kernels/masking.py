"""Zeroing part of a block inside a kernel body, on every chip: the one home of that select.

Kernels zero the parts of a VMEM block that hold stale or garbage data (maybe NaN) before
it goes into a matmul, where a zero weight does not hide a NaN (0 * NaN = NaN): ragged_dot
the k tail of its last k block, paged attention the keys outside an item's range.

On chips without a bf16 vector unit (`chips.Chip.bf16_vpu` False: v5e, v5p) a bf16
select yields packed int16, and libtpu 0.0.42's LLO type check rejects it where it feeds a
matmul ("Expected vector-int16, got vector-int32" in a `vunpack.i.l.s16`): the compile for
the static estimate aborts. There the select runs in f32 and rounds back, which is exact.
Other dtypes (f32, and int8 / fp8 codes) select as they are.
"""

from __future__ import annotations

import jax.numpy as jnp

from . import chips


def selects_in_f32(chip: str) -> bool:
  """Whether `zero_unless` on `chip` selects a bf16 block in f32."""
  return not chips.get_chip(chip).bf16_vpu


def zero_unless(keep, x, *, in_f32: bool):
  """x where keep, else 0, in x's dtype (keep: bool, broadcastable to x).
  in_f32 (`selects_in_f32`): select a bf16 x in f32 and round back (exact)."""
  if in_f32 and x.dtype == jnp.bfloat16:
    return jnp.where(keep, x.astype(jnp.float32), 0.0).astype(x.dtype)
  return jnp.where(keep, x, jnp.zeros_like(x))
