"""The device backend shim shared by every kernel package (vendored into each as `_shim`).

A kernel package defines each op once, as a `torch.library.custom_op` with its
own fake and autograd, and runs it through a `JaxKernel`: a fully type-annotated
JAX function that this shim executes on whatever device the tensors are on:

  * "tpu": TorchTPU's `torch.tpu.pallas.jax_op` wraps the same JAX function into a
    TPU op (compiled Mosaic kernel, tensors passed without copies). Built lazily,
    on the first TPU call, so that nothing imports TorchTPU on a CPU-only machine.
  * "cpu": the tensors go to JAX through DLPack (zero-copy), the Pallas kernel
    runs in interpret mode, and the results come back through DLPack.
  * anything else, or tensors on different devices: a RuntimeError naming them.

jax is imported on first use, never at package import.
"""

from __future__ import annotations

from .dispatch import (JaxKernel, SUPPORTED_DEVICE_TYPES, device_type_of, jax_kernels,
                       tpu_chip_name)
from .registry import custom_op_once
from . import tensors, validation

__all__ = ["JaxKernel", "SUPPORTED_DEVICE_TYPES", "custom_op_once", "device_type_of",
           "jax_kernels", "tensors", "tpu_chip_name", "validation"]
