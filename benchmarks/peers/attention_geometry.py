"""The block grid of an attention case, as jax's and tokamax's attention anchors lay it out.

jax's flash and splash and tokamax all need a sequence that is a block multiple, so a caller
pads S to `padded_seq` and the anchor is rated on the padded full grid (`AttentionCase`).
A causal grid visits the blocks on or below the diagonal (`causal_rows`); tokamax lists them
row-major in SMEM, which the estimator reads as 0, so its anchors (and
rating/calibration_specs.py) answer each read by a closed form of the list
(`triangle_row`, `triangle_col`: compares and shifts, no division, which SMEM index maps
lack).
"""

from __future__ import annotations

from benchmarks.cases.headline import Attention


def causal_rows(nq_rows: int, nk: int, first_row: int = 0) -> tuple[int, int]:
  """(blocks on or below the diagonal, steps) of rows first_row.. of a square causal grid."""
  run = sum(min(i + 1, nk) for i in range(first_row, first_row + nq_rows))
  return run, nq_rows * nk


class AttentionCase:
  """What the attention anchors share: the case they rate (the causal headline case of
  length `seq`, or `joint`, a non-causal diffusion.JointAttention), and the length their
  kernels run at. jax's flash and splash and tokamax all need a block multiple, so a
  caller pads S to `padded_seq` and the anchor is rated on the padded full grid: the
  padded rows and keys count as work, the mask that would hide the padded keys (one
  partial kv block a row) is not rated (a lower bound on their cost), and the pad / slice
  copies' bytes are counted (`pad_copy_bytes`, as for ours)."""

  @property
  def case(self):
    return self.joint if self.joint is not None else Attention(self.seq)

  @property
  def causal(self) -> bool:
    return self.case.causal

  @property
  def padded_seq(self) -> int:
    return -(-self.case.seq // self.block) * self.block

  @property
  def nq(self) -> int:
    return self.padded_seq // self.block

  @property
  def total_heads(self) -> int:
    return self.case.batch * self.case.q_heads

  @property
  def key_suffix(self) -> str:
    return "" if self.joint is None else f":joint:{self.joint.model}"

  def pad_copy_bytes(self) -> int:
    """q padded and out sliced back (each reads one length, writes the other), k and v
    padded: 0 when S is a block multiple."""
    c, s = self.case, self.padded_seq
    if s == c.seq:
      return 0
    return 2 * (c.seq + s) * c.batch * (c.q_heads + c.kv_heads) * c.head_dim * 2

  @property
  def ragged_note(self) -> str:
    if self.padded_seq == self.case.seq:
      return ""
    return (f" S={self.case.seq} is not a multiple of {self.block} (the kernel needs one): "
            f"rated padded to {self.padded_seq} with a full mask (padded rows and keys "
            "computed; the mask hiding the padded keys, one partial kv block a row, not "
            "rated: a lower bound), pad / slice copies' bytes counted.")

  def heads_text(self) -> str:
    c = self.case
    return f"{self.total_heads} heads" if c.batch == 1 else \
        f"{self.total_heads} heads (B={c.batch} x {c.q_heads})"


def triangle_row(g, compares: int):
  """The row of grid index g (jnp or int) in a row-major list of a square grid's
  on-or-below-diagonal blocks (row i holds i + 1 blocks and starts at i (i + 1) / 2), by
  `compares` threshold tests (rows - 1 suffice): no division, which SMEM index maps lack."""
  import jax.numpy as jnp
  thresholds = [t * (t + 1) // 2 for t in range(1, compares + 1)]
  if isinstance(g, int):
    return sum(g >= t for t in thresholds)
  i = jnp.int32(0)
  for t in thresholds:
    i = i + (g >= t).astype(jnp.int32)
  return i


def triangle_col(g, row):
  """The column of grid index g in that list, given its row (triangle_row)."""
  return g - ((row * (row + 1)) >> 1)
