"""What flash attention and paged attention share: the masked-logit value, the
lane-replicated softmax statistics, the softmax's exp on raw logits, and the checks of the
softmax options.

Pure JAX, no kernel of its own. Both kernel modules import it; the build vendors it
into each of their Hub repos (build.toml kernel-modules).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)
# Masked logits: finite, so that max / exp never see inf - inf.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
LANES = 128
NT = (((1,), (1,)), ((), ()))   # dot_general dimension numbers of a @ b.T
NN = (((1,), (0,)), ((), ()))   # a @ b
TN = (((0,), (0,)), ((), ()))   # a.T @ b


def lanes(x, width: int):
  """(rows, 128) with equal lanes -> (rows, width). Whole-vreg copies when width is a
  multiple of 128 (the softmax statistics are kept lane-replicated for this reason:
  a (rows, 1) column would need a lane broadcast per use)."""
  if width % LANES == 0:
    return jnp.tile(x, (1, width // LANES))
  if width < LANES:
    return x[:, :width]
  return jnp.broadcast_to(x[:, :1], (x.shape[0], width))


def scaled_exp(unit: float):
  """x -> exp(unit * x), for an online softmax kept in raw logits (unit = sm_scale): one
  exp2 of x * (unit log2 e), since exp is an exp2 after a multiply by log2 e anyway. For
  unit 1.0 (logits already scaled) plain exp."""
  if unit == 1.0:
    return jnp.exp
  factor = unit * math.log2(math.e)
  return lambda x: jnp.exp2(x * factor)


def check_softmax_options(sliding_window, soft_cap, sinks, num_q_heads: int) -> None:
  """ValueError / TypeError for a bad window, soft-cap or sinks array."""
  if sliding_window is not None and (not isinstance(sliding_window, (int, np.integer))
                                     or sliding_window < 1):
    raise ValueError(f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
  if soft_cap is not None and not soft_cap > 0:
    raise ValueError(f"soft_cap must be None or > 0, got {soft_cap!r}")
  if sinks is not None:
    if sinks.shape != (num_q_heads,):
      raise ValueError(f"sinks must have shape ({num_q_heads},) (one per query head), got "
                       f"{sinks.shape}")
    if sinks.dtype not in FLOAT_DTYPES:
      raise TypeError(f"sinks must be float32 or bfloat16, got {sinks.dtype}")
