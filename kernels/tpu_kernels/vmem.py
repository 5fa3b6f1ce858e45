"""VMEM and SMEM budgets and tile arithmetic shared by every kernel.

A kernel's tiles are chosen so that everything it keeps in VMEM at once (the
double-buffered input/output blocks plus its f32 temporaries) fits a *budget*: a
fraction of the scoped-VMEM limit the kernel is compiled with. The rest is
headroom for Mosaic's internal scratch and register spills, whose size we cannot
see before compiling. `vmem_limit_bytes`, when given, raises (or lowers) that
limit and is passed to Mosaic as is.
"""

from __future__ import annotations

import numpy as np

from .chips import Chip, MiB  # noqa: F401  (MiB re-exported for tile arithmetic)

# Share of the scoped-VMEM limit a kernel plans to fill with its own buffers.
BUDGET_FRACTION = 0.5
# Share of SMEM a kernel may fill with scalar-prefetched tables (page tables, visit
# tables). Mosaic keeps its own scalars there too; jax's paged attention overflows SMEM
# exactly by prefetching a whole page table (vllm#9350), so tables are chunked to this.
SMEM_BUDGET_FRACTION = 0.25


def resolve_vmem_limit(chip: Chip, vmem_limit_bytes: int | None) -> int:
  """The scoped-VMEM limit a kernel compiles with: the caller's, or the chip default.

  Raises ValueError for a limit that is not positive or beyond what the chip can give.
  """
  if vmem_limit_bytes is None:
    return chip.default_scoped_vmem_bytes
  if not isinstance(vmem_limit_bytes, (int, np.integer)) or vmem_limit_bytes <= 0:
    raise ValueError(f"vmem_limit_bytes must be a positive int, got {vmem_limit_bytes!r}")
  if vmem_limit_bytes > chip.max_vmem_limit_bytes:
    raise ValueError(
        f"vmem_limit_bytes={vmem_limit_bytes} exceeds what {chip.name} allows "
        f"({chip.max_vmem_limit_bytes} of {chip.vmem_bytes} bytes of VMEM)")
  return int(vmem_limit_bytes)


def vmem_budget(chip: Chip, vmem_limit_bytes: int | None) -> int:
  """Bytes a kernel may plan for its own buffers under the resolved limit."""
  return int(resolve_vmem_limit(chip, vmem_limit_bytes) * BUDGET_FRACTION)


def smem_budget_words(chip: Chip) -> int:
  """32-bit words of scalar-prefetched tables a kernel may plan for on `chip`."""
  return int(chip.smem_bytes * SMEM_BUDGET_FRACTION) // 4


def sublane_multiple(dtype) -> int:
  """Row granularity of a VMEM tile for `dtype`: 8 rows of 32 bits, packed for narrower types.

  f32 -> 8, bf16/f16 -> 16, int8/fp8 -> 32.
  """
  itemsize = np.dtype(dtype).itemsize
  return 8 * max(1, 4 // itemsize)


def lane_padded(n: int) -> int:
  """`n` rounded up to whole 128-wide lanes: how much VMEM a row of n elements occupies."""
  return -(-n // 128) * 128


def round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def round_down(n: int, multiple: int) -> int:
  return (n // multiple) * multiple


def prefers_column_major(rows: int, cols: int) -> bool:
  """Whether the TPU's default HBM layout of a 2-D [rows, cols] array is column-major.

  The TPU runtime stores arrays in (8, 128) tiles and, for a 2-D shape, puts whichever
  dimension pads less into the 128-wide lanes: [196608, 64] and [4096, 2880] live
  column-major, [4096, 4096] and [8, 64] row-major (a tie keeps row-major). A Mosaic kernel
  reads and writes row-major, so XLA copies a column-major operand into row-major before the
  kernel and back after it, unless the kernel takes the transpose, which is then free.
  (Checked against libtpu's own default layout, `client.get_default_layout`, by
  tests/jax/test_aot_compile.py; it differs only for one-wide arrays of 7 or 8 rows.)
  """
  return round_up(cols, 8) * round_up(rows, 128) < round_up(rows, 8) * round_up(cols, 128)

