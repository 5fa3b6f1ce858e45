"""Input checks run before any kernel: each error names the argument and the rule."""

from __future__ import annotations

import math
import numbers

import torch

KERNEL_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _dtype_name(dtype) -> str:
  return str(dtype).removeprefix("torch.")


def check_tensor(op: str, name: str, value) -> torch.Tensor:
  if not isinstance(value, torch.Tensor):
    raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
  return value


def check_float_dtype(op: str, name: str, tensor: torch.Tensor,
                      allowed=KERNEL_FLOAT_DTYPES) -> None:
  """Rejects dtypes the kernel does not take, with a hint for 64-bit ones (no silent down-cast)."""
  if tensor.dtype in allowed:
    return
  allowed_names = ", ".join(_dtype_name(d) for d in allowed)
  hint = ""
  if tensor.dtype in (torch.float64, torch.int64, torch.complex128):
    hint = (f"; 64-bit dtypes are not computed on TPU and are never down-cast silently: "
            f"convert {name} explicitly (e.g. {name}.float())")
  raise TypeError(f"{op}: {name} has dtype {_dtype_name(tensor.dtype)}, expected one of "
                  f"{allowed_names}{hint}")


def check_shape(op: str, name: str, tensor: torch.Tensor, expected: tuple, what: str) -> None:
  if tuple(tensor.shape) != tuple(expected):
    raise ValueError(f"{op}: {name} must have shape {tuple(expected)} ({what}), "
                     f"got {tuple(tensor.shape)}")


def check_same_dtype(op: str, name: str, tensor: torch.Tensor, other_name: str,
                     other: torch.Tensor) -> None:
  if tensor.dtype != other.dtype:
    raise TypeError(f"{op}: {name} must have the dtype of {other_name} "
                    f"({_dtype_name(other.dtype)}), got {_dtype_name(tensor.dtype)}")


def check_min_ndim(op: str, name: str, tensor: torch.Tensor, ndim: int) -> None:
  if tensor.dim() < ndim:
    raise ValueError(f"{op}: {name} must have at least {ndim} dimension(s), "
                     f"got shape {tuple(tensor.shape)}")


def check_finite_number(op: str, name: str, value, *, minimum: float | None = None) -> float:
  """A real, finite Python number (not a tensor), at least `minimum` when given."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{op}: {name} must be a real number, got {type(value).__name__}")
  value = float(value)
  if not -math.inf < value < math.inf:  # (math.isfinite is opaque to torch.compile; NaN fails too)
    raise ValueError(f"{op}: {name} must be finite, got {value}")
  if minimum is not None and value < minimum:
    raise ValueError(f"{op}: {name} must be >= {minimum}, got {value}")
  return value
