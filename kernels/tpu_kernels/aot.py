"""Ahead-of-time compiles for a TPU generation, on a machine without a TPU.

libtpu's compiler (Mosaic, then LLO) runs on the host: compiling against a
topology description rejects what a real TPU would reject (illegal block shapes,
scoped-VMEM overflow) and reports how much VMEM each kernel reserves. Run with
JAX_PLATFORMS=cpu: the topology path then needs no TPU and no network.

    report = compile_for_chip(fn, [ShapeDtypeStruct(...), ...], chip="v6e")
    report.ok, report.vmem_bytes, report.error
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re

import jax

from . import chips

# Mosaic's custom call records the VMEM it reserves as
# "scoped_memory_configs":[{"memory_space":1,"offset":0,"size":N}, ...].
_SCOPED_MEMORY = re.compile(r'"scoped_memory_configs":\s*(\[[^\]]*\])')
# With LIBTPU_INIT_ARGS=--xla_jf_dump_static_llo_profile_to=DIR set before jax is imported,
# every op of the compiled program carries the static estimator's "estimated_cycles":"N".
_ESTIMATED_CYCLES = re.compile(r'"estimated_cycles":"?(\d+)')
STATIC_PROFILE_FLAG = "--xla_jf_dump_static_llo_profile_to"


@dataclasses.dataclass(frozen=True)
class CompileReport:
  """What libtpu said about one function compiled for one chip."""

  chip: str
  ok: bool
  scoped_vmem_bytes: int | None = None  # largest scoped-VMEM limit a Mosaic kernel compiled under
  num_kernels: int = 0               # Mosaic kernels in the compiled program
  kernel_names: tuple[str, ...] = ()  # their pallas_call names, in program order
  estimated_cycles: int | None = None  # static estimate of the whole program (flag set)
  error: str | None = None           # first line of the compiler's error when not ok

  def summary(self) -> str:
    if not self.ok:
      return f"{self.chip}: FAILED ({self.error})"
    limit = "?" if self.scoped_vmem_bytes is None else f"{self.scoped_vmem_bytes / 2**20:.0f} MiB"
    return f"{self.chip}: compiled, {self.num_kernels} Mosaic kernel(s), fits scoped VMEM {limit}"


@functools.cache
def topology_devices(chip_name: str) -> tuple | None:
  """The devices of the chip's AOT topology (needs libtpu, not a TPU), or None where the
  installed libtpu does not know it (every chip with a topology in the table is known to
  libtpu 0.0.42.1 and 0.0.50.1: v7's `TPU7x` too)."""
  from jax.experimental import topologies

  chip = chips.get_chip(chip_name)
  if chip.aot_topology is None:
    return None
  try:
    return tuple(topologies.get_topology_desc(chip.aot_topology, "tpu").devices)
  except Exception:   # libtpu's own error for a topology it does not know
    return None


def topology_known(chip_name: str) -> bool:
  """Whether the installed libtpu can compile for the chip."""
  return topology_devices(chip_name) is not None


def libtpu_version() -> str:
  from importlib import metadata
  return metadata.version("libtpu")


def topology_device(chip_name: str):
  """The first device of the chip's AOT topology (needs libtpu, not a TPU)."""
  devices = topology_devices(chip_name)
  if devices is None:
    chip = chips.get_chip(chip_name)
    raise ValueError(f"{chip.name} has no ahead-of-time topology in libtpu "
                     f"{libtpu_version()} ({chip.aot_topology})")
  return devices[0]


class RowMajor(jax.ShapeDtypeStruct):
  """An argument spec pinned to the row-major layout a Mosaic kernel's output has.

  Left free, a program's parameter gets the TPU's preferred layout for its shape, which
  for [256, 2880] float32 is column-major (256 pads less than 2880): XLA then copies it
  into row-major for a kernel, and places that copy in VMEM, where libtpu's static
  estimate aborts on the kernel's DMAs ("Unsupported DMA direction: 0 on GL/GLP"). A
  program rated alone whose argument is a kernel's output in the real layer (the
  combine's y, from the down kernel) gets the layout it has there."""


def _on_device(spec, device):
  from jax.experimental.layout import Format, Layout

  sharding = jax.sharding.make_single_device_sharding(device)
  if isinstance(spec, RowMajor):
    sharding = Format(Layout(major_to_minor=tuple(range(len(spec.shape)))), sharding)
  return jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sharding)


def scoped_vmem_per_kernel(hlo_text: str) -> list[int]:
  """The scoped-VMEM limit (bytes) of each Mosaic custom call in compiled HLO text.

  Mosaic refuses to compile a kernel whose buffers exceed this limit
  (CompileTimeScopedVmemOom), so a successful compile proves the kernel fits it.
  """
  sizes = []
  for line in hlo_text.splitlines():
    if 'custom_call_target="tpu_custom_call"' not in line:
      continue
    match = _SCOPED_MEMORY.search(line.replace('\\"', '"'))
    configs = json.loads(match.group(1)) if match else []
    sizes.append(sum(int(c.get("size", 0)) for c in configs))
  return sizes


_BACKEND_CONFIG = re.compile(r'backend_config = "((?:[^"\\]|\\.)*)"')


def scoped_vmem_asked(mlir_text: str) -> list[int]:
  """The scoped-VMEM limit (bytes) each Mosaic custom call of a lowered or exported
  StableHLO module asks for (its backend config's scoped_memory_configs), in order."""
  sizes = []
  for line in mlir_text.splitlines():
    if "stablehlo.custom_call @tpu_custom_call" not in line:
      continue
    match = _BACKEND_CONFIG.search(line)
    config = json.loads(match.group(1).replace("\\22", '"')) if match else {}
    sizes.append(sum(int(c.get("size", 0)) for c in config.get("scoped_memory_configs", [])))
  return sizes


_KERNEL_NAME = re.compile(r'op_name="[^"]*?([A-Za-z0-9_]+)/pallas_call')
_INSTRUCTION_NAME = re.compile(r'^\s*(?:ROOT\s+)?%([^ ]+) = ')


def kernel_names(hlo_text: str) -> tuple[str, ...]:
  """A name for each Mosaic custom call in compiled HLO text: its pallas_call name from
  the op metadata, or else (backward passes carry no metadata) the HLO instruction name,
  which contains the pallas_call name, e.g. "transpose_jvp_ragged_dot__.1"."""
  names = []
  for line in hlo_text.splitlines():
    if 'custom_call_target="tpu_custom_call"' in line:
      match = _KERNEL_NAME.search(line) or _INSTRUCTION_NAME.search(line)
      names.append(match.group(1) if match else "?")
  return tuple(names)


def estimated_cycles(hlo_text: str) -> int | None:
  """Sum of the static cycle estimates of all ops in compiled HLO text (None if absent).

  Ops run one after another, so the sum is the program's estimate. Input fusions put a
  Mosaic kernel inside a fusion; the estimate then sits on the fusion, counted once.
  """
  found = [int(m.group(1)) for m in _ESTIMATED_CYCLES.finditer(hlo_text.replace('\\"', '"'))]
  return sum(found) if found else None


def mosaic_kernel_cycles(hlo_text: str) -> list[int]:
  """The static estimate of each Mosaic kernel (tpu_custom_call) of compiled HLO text, in
  order, for programs whose XLA ops around the kernels are not part of what is rated.
  An instruction may span several lines (a kernel's backend config can hold newlines),
  so the text is split at instruction starts, not at line ends. RuntimeError if a
  kernel carries no estimate (inside an input fusion the estimate sits on the fusion)."""
  cycles = []
  for instruction in re.split(r"\n\s*(?:ROOT\s+)?%", hlo_text.replace('\\"', '"')):
    if 'custom_call_target="tpu_custom_call"' in instruction:
      found = _ESTIMATED_CYCLES.search(instruction)
      if found is None:
        raise RuntimeError("a Mosaic kernel carries no estimated_cycles (input fusion?)")
      cycles.append(int(found.group(1)))
  return cycles


def compile_for_chip(fn, arg_specs, chip: str) -> CompileReport:
  """Compiles `fn(*args)` for `chip` ahead of time and reports the outcome.

  arg_specs: jax.ShapeDtypeStruct per positional argument (placed on the chip here).
  A compile error is reported, not raised, so a matrix of shapes can be surveyed.
  """
  device = topology_device(chip)
  specs = [_on_device(s, device) for s in arg_specs]
  try:
    compiled = jax.jit(fn).trace(*specs).lower().compile()
  except Exception as e:  # the compiler's verdict is the result
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return CompileReport(chip=chip, ok=False, error=f"{type(e).__name__}: {message[:300]}")
  text = compiled.as_text()
  per_kernel = scoped_vmem_per_kernel(text)
  return CompileReport(chip=chip, ok=True, scoped_vmem_bytes=max(per_kernel, default=None),
                       num_kernels=len(per_kernel), kernel_names=kernel_names(text),
                       estimated_cycles=estimated_cycles(text))
