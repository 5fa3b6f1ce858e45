"""The TPU generations this collection targets: one table, imported everywhere.

Kernels take a chip *name* as a static parameter and look it up here; they never
ask the runtime which device they run on while tracing (that breaks ahead-of-time
compiles and hides the chip from the cache key).

Sources of the figures (per TensorCore as JAX sees one device):
  * VMEM capacity, MXU width, HBM bandwidth, bf16 peak: jax 0.10.2
    ``jax/_src/pallas/mosaic/tpu_info.py`` and Google's public TPU pages.
  * Default scoped-VMEM limit (what Mosaic allows a kernel without a
    ``vmem_limit_bytes`` override): measured with ahead-of-time compiles against
    libtpu 0.0.42.1 for v5e / v6e / v5p (checked by tests/jax/test_aot_compile.py::
    test_default_scoped_vmem_limit_matches_chip_table).
  * SMEM capacity: measured with ahead-of-time compiles (a scalar-prefetched table of
    256Ki int32 overflows "1.00M of 1.00M smem" on v5e and v6e); v7's is assumed equal.
  * v7 (Ironwood): each of a chip's two TensorCores is its own JAX device (libtpu
    0.0.50.1's `TPU7x:2x2x1` topology holds 8 devices for 4 chips, `core_on_chip` 0 and
    1), so its row is half the published per-chip figures (192 GB HBM, 7.4 TB/s, 2.31
    PFLOP/s bf16); that compiler reports 94.74G of HBM available to a program. VMEM
    (63.94M) and the default scoped limit (32 MiB: a 32 MiB kernel compiles, 33 MiB
    does not) measured with ahead-of-time compiles against libtpu 0.0.50.1 on
    2026-12-06 (tests/jax/test_v7_aot.py). v5p's two TensorCores are one device
    (megacore), so its row is per chip.
  * Clock: the value the libtpu static cycle estimator uses.
  * bf16 vector unit: v6e and later compute elementwise bf16 natively; on v5e libtpu
    0.0.42 works on bf16 as packed int16 (its LLO type check names `vector-int16`
    where a bf16 select feeds a matmul, so kernels select in f32 there: masking.py;
    v6e's does not). v5p is assumed like v5e,
    v7 like v6e.
v7 (Ironwood) is compiled for as `TPU7x:2x2x1` (libtpu 0.0.42.1 and 0.0.50.1 both know
it; until 2026-12-06 this table held no topology for it, on the belief that 0.0.42 had
none). It has no clock here, so no static estimate of it becomes time.
"""

from __future__ import annotations

import dataclasses

MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Chip:
  """One TPU generation, per TensorCore (one JAX device)."""

  name: str                          # short name used everywhere: "v6e"
  device_kinds: tuple[str, ...]      # jax `Device.device_kind` / torch.tpu.get_device_name() strings
  vmem_bytes: int                    # physical VMEM per TensorCore
  default_scoped_vmem_bytes: int     # Mosaic's per-kernel limit without an override
  smem_bytes: int                    # scalar memory: scalar-prefetched tables live here
  mxu_size: int                      # the MXU is mxu_size x mxu_size
  bf16_vpu: bool                     # the vector unit computes in bf16 (v6e on); older
                                     # ones work on bf16 as packed 16-bit integers
  clock_hz: float | None             # None where no public / compiler figure exists
  bf16_flops_per_s: float
  hbm_bytes_per_s: float
  hbm_bytes: int
  aot_topology: str | None           # name for jax.experimental.topologies, if libtpu knows it

  @property
  def max_vmem_limit_bytes(self) -> int:
    """The largest `vmem_limit_bytes` we let a caller ask for.

    Leaves 1/8 of physical VMEM to the compiler (internal scratch, spills).
    """
    return self.vmem_bytes - self.vmem_bytes // 8


CHIPS: dict[str, Chip] = {
    chip.name: chip
    for chip in (
        Chip(
            name="v5e",
            device_kinds=("TPU v5e", "TPU v5 lite"),
            vmem_bytes=128 * MiB,
            default_scoped_vmem_bytes=16 * MiB,
            smem_bytes=1 * MiB,
            mxu_size=128,
            bf16_vpu=False,
            clock_hz=1.5e9,
            bf16_flops_per_s=197e12,
            hbm_bytes_per_s=819e9,
            hbm_bytes=16 * 1024 * MiB,
            aot_topology="v5e:2x2",
        ),
        Chip(
            name="v6e",
            device_kinds=("TPU v6e", "TPU v6 lite"),
            vmem_bytes=128 * MiB,
            default_scoped_vmem_bytes=32 * MiB,
            smem_bytes=1 * MiB,
            mxu_size=256,
            bf16_vpu=True,
            clock_hz=1.75e9,
            bf16_flops_per_s=918e12,
            hbm_bytes_per_s=1640e9,
            hbm_bytes=32 * 1024 * MiB,
            aot_topology="v6e:2x2",
        ),
        Chip(
            name="v5p",
            device_kinds=("TPU v5p", "TPU v5"),
            vmem_bytes=64 * MiB,
            default_scoped_vmem_bytes=16 * MiB,
            smem_bytes=1 * MiB,
            mxu_size=128,
            bf16_vpu=False,
            clock_hz=1.75e9,
            bf16_flops_per_s=459e12,
            hbm_bytes_per_s=2765e9,
            hbm_bytes=95 * 1024 * MiB,
            aot_topology="v5p:2x2x1",
        ),
        Chip(
            # Ironwood: 2 TensorCores per chip, each one JAX device; figures per
            # TensorCore, half the published per-chip ones (module docstring).
            name="v7",
            device_kinds=("TPU7x", "TPU7", "TPU v7"),
            vmem_bytes=64 * MiB,
            default_scoped_vmem_bytes=32 * MiB,
            smem_bytes=1 * MiB,
            mxu_size=256,
            bf16_vpu=True,
            clock_hz=None,
            bf16_flops_per_s=2.31e15 / 2,
            hbm_bytes_per_s=7.4e12 / 2,
            hbm_bytes=96 * 1024 * MiB,
            aot_topology="TPU7x:2x2x1",
        ),
    )
}

DEFAULT_CHIP = "v6e"


def get_chip(name: str) -> Chip:
  """The chip called `name` ("v5e", "v6e", "v5p", "v7"), or a ValueError listing the known ones."""
  try:
    return CHIPS[name]
  except KeyError:
    raise ValueError(
        f"unknown TPU chip {name!r}; known chips: {', '.join(CHIPS)}") from None


def chip_from_device_kind(device_kind: str) -> Chip:
  """Maps a jax `Device.device_kind` (e.g. "TPU v6 lite") to its Chip.

  Called by the torch shim *before* tracing, once per device, never inside a kernel.
  """
  for chip in CHIPS.values():
    if device_kind in chip.device_kinds:
      return chip
  raise ValueError(
      f"TPU device kind {device_kind!r} is not supported; supported: "
      + ", ".join(k for c in CHIPS.values() for k in c.device_kinds))
