"""Runs one typed JAX function on torch tensors, on the device the tensors live on."""

from __future__ import annotations

import functools
import importlib
import inspect
import os

import torch

SUPPORTED_DEVICE_TYPES = ("cpu", "tpu")

# Set to a chip name ("v5e", "v6e", "v5p", "v7") to override the detected TPU generation.
CHIP_ENV_VAR = "TPU_KERNELS_CHIP"


def device_type_of(op: str, tensors: dict[str, torch.Tensor]) -> str:
  """The one device type all `tensors` share: "cpu" or "tpu", else a RuntimeError naming them."""
  devices = {name: t.device for name, t in tensors.items() if t is not None}
  types = {d.type for d in devices.values()}
  if len(types) > 1:
    listing = ", ".join(f"{name} on {d}" for name, d in devices.items())
    raise RuntimeError(f"{op}: all tensors must be on the same device, got {listing}")
  (device_type,) = types
  if device_type not in SUPPORTED_DEVICE_TYPES:
    raise RuntimeError(
        f"{op}: tensors are on device type {device_type!r}; supported: 'tpu' (TorchTPU, "
        f"compiled Pallas kernel) and 'cpu' (Pallas interpret mode, for development)")
  return device_type


@functools.cache
def tpu_chip_name() -> str:
  """The TPU generation of this host, asked once and outside any trace.

  TPU_KERNELS_CHIP overrides; otherwise TorchTPU's `torch.tpu.get_device_name()`
  ("TPU v6e", read from PCI ids, no runtime initialisation) is mapped through the
  chip table.
  """
  from ..tpu_kernels import chips

  override = os.environ.get(CHIP_ENV_VAR)
  if override:
    return chips.get_chip(override).name
  name = torch.tpu.get_device_name()
  return chips.chip_from_device_kind(name).name


def _to_jax(t: torch.Tensor):
  """torch CPU tensor -> jax array without a copy (DLPack). Contiguous first: DLPack needs it."""
  import jax

  return jax.dlpack.from_dlpack(t.detach().contiguous())


def _to_torch(a) -> torch.Tensor:
  return torch.from_dlpack(a)


class JaxKernel:
  """A fully type-annotated JAX function, runnable on "cpu" and "tpu" torch tensors.

  The function is `<module>.<function>`, imported on first use (so importing a kernel
  package imports neither jax nor TorchTPU). `fn(*arrays, **statics)` must annotate
  every parameter (jax.Array for tensors, int / float / bool / str for statics) and its
  return (jax.Array or a tuple of them), as TorchTPU's `jax_op` requires. It must also
  take `chip: str` and `interpret: bool`, which this class fills in: the host's TPU
  generation and False on TPU, `cpu_chip` and True on CPU.

  `donate_argnums` (positions among the tensors) are donated to the TPU program: TorchTPU's
  `jax_op` jits the function with them, so the exported program aliases those inputs to
  outputs (`tf.aliasing_output`) and the runtime may write the results into the inputs'
  buffers. On CPU nothing is donated: the inputs are torch's memory, seen through DLPack.
  """

  def __init__(self, qualname: str, module: str, function: str, *, cpu_chip: str,
               donate_argnums: tuple[int, ...] = ()):
    self.qualname = qualname  # "namespace::name" of the op this function serves
    self.module = module
    self.function = function
    self.cpu_chip = cpu_chip
    self.donate_argnums = tuple(donate_argnums)

  @functools.cached_property
  def fn(self):
    fn = getattr(importlib.import_module(self.module), self.function)
    missing = {"chip", "interpret"} - set(inspect.signature(fn).parameters)
    if missing:
      raise TypeError(f"{self.module}.{self.function} must take {sorted(missing)}")
    return fn

  @functools.cached_property
  def _cpu_jit(self):
    import jax

    params = inspect.signature(self.fn, eval_str=True).parameters
    statics = [n for n, p in params.items() if p.annotation is not jax.Array]
    return jax.jit(self.fn, static_argnames=statics)

  @functools.cached_property
  def _tpu_op(self):
    from .registry import jax_op_once

    return jax_op_once(f"{self.qualname}_tpu_jax", self.fn, donate_argnums=self.donate_argnums)

  def __call__(self, tensors: dict[str, torch.Tensor], **statics):
    """Runs the function; `tensors` in the function's parameter order, by name."""
    device_type = device_type_of(self.qualname, tensors)
    if device_type == "tpu":
      return self._tpu_op(*tensors.values(), **statics, chip=tpu_chip_name(),
                          interpret=False)
    import jax

    out = self._cpu_jit(*map(_to_jax, tensors.values()), **statics, chip=self.cpu_chip,
                        interpret=True)
    return jax.tree.map(_to_torch, out)


def jax_kernels(package: str, add_op_namespace_prefix, *, cpu_chip: str):
  """The JaxKernel maker of one kernel package: `make(op_name, function)` serves the op
  `<namespace>::<op_name>` with `<package>._jax_functions.<function>`."""
  def make(op_name: str, function: str, *, donate_argnums: tuple[int, ...] = ()) -> JaxKernel:
    return JaxKernel(add_op_namespace_prefix(op_name), f"{package}._jax_functions", function,
                     cpu_chip=cpu_chip, donate_argnums=donate_argnums)
  return make
