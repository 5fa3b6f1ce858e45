"""Op registration that survives a package being imported twice in one process.

The same built kernel can be imported under two module names (for example once
from a local path and once through `kernels.get_kernel`). Its op namespace is the
same both times (it is derived from the kernel's name, version and content), and
torch refuses to define an op twice, so the second import reuses the first
definition. Different versions or contents get different namespaces.
"""

from __future__ import annotations

import torch
from torch._library import custom_ops


def custom_op_once(qualname: str, fn, *, mutates_args=(), schema: str | None = None,
                   setup=None):
  """`torch.library.custom_op(qualname, fn)`, or the op already defined under that name.

  `setup(op)` registers the fake and autograd; it runs only for a new definition.
  """
  existing = custom_ops.OPDEFS.get(qualname)
  if existing is not None:
    return existing
  op = torch.library.custom_op(qualname, fn, mutates_args=mutates_args, schema=schema)
  if setup is not None:
    setup(op)
  return op


def jax_op_once(qualname: str, fn, *, donate_argnums: tuple[int, ...] = ()):
  """TorchTPU's `jax_op(qualname, fn, donate_argnums=...)`, or the op already registered
  under that name."""
  existing = custom_ops.OPDEFS.get(qualname)
  if existing is not None:
    return existing
  from torch.tpu.pallas import jax_op  # TorchTPU: only ever imported on the TPU path

  return jax_op(qualname, fn, donate_argnums=donate_argnums or None)
