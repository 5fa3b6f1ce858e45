"""Input checks run before any kernel: each error names the argument and the rule."""

from __future__ import annotations

import math
import numbers

import torch

KERNEL_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dtype_name(dtype) -> str:
  """"bfloat16" for torch.bfloat16: how error messages name a dtype."""
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
  allowed_names = ", ".join(dtype_name(d) for d in allowed)
  hint = ""
  if tensor.dtype in (torch.float64, torch.int64, torch.complex128):
    hint = (f"; 64-bit dtypes are not computed on TPU and are never down-cast silently: "
            f"convert {name} explicitly (e.g. {name}.float())")
  raise TypeError(f"{op}: {name} has dtype {dtype_name(tensor.dtype)}, expected one of "
                  f"{allowed_names}{hint}")


def check_shape(op: str, name: str, tensor: torch.Tensor, expected: tuple, what: str) -> None:
  if tuple(tensor.shape) != tuple(expected):
    raise ValueError(f"{op}: {name} must have shape {tuple(expected)} ({what}), "
                     f"got {tuple(tensor.shape)}")


def check_same_dtype(op: str, name: str, tensor: torch.Tensor, other_name: str,
                     other: torch.Tensor) -> None:
  if tensor.dtype != other.dtype:
    raise TypeError(f"{op}: {name} must have the dtype of {other_name} "
                    f"({dtype_name(other.dtype)}), got {dtype_name(tensor.dtype)}")


def check_ndim(op: str, name: str, tensor: torch.Tensor, ndim: int, what: str) -> None:
  """`what` names the dimensions, e.g. "[batch, heads, seq, head_dim]"."""
  if tensor.dim() != ndim:
    raise ValueError(f"{op}: {name} must be {ndim}-D ({what}), got shape {tuple(tensor.shape)}")


def check_int32(op: str, name: str, value) -> torch.Tensor:
  """An int32 tensor: lengths, page tables and segment ids are never narrowed silently."""
  tensor = check_tensor(op, name, value)
  if tensor.dtype != torch.int32:
    raise TypeError(f"{op}: {name} must be int32, got {dtype_name(tensor.dtype)}; convert it "
                    f"explicitly ({name}.to(torch.int32)): 64-bit integers are never narrowed "
                    f"silently")
  return tensor


# Substrings Transformers gives special meaning in an attn_implementation name: "flash" is
# taken for a FlashAttention install and imported as one, "paged|..." selects its own
# continuous-batching attention, "/" (and ":") a Hub kernel repo.
RESERVED_ATTENTION_WORDS = ("flash", "sdpa", "flex_attention", "eager", "paged", "|", "/", ":")


def check_attention_name(op: str, name, default: str) -> str:
  """A name under which an attention function may be registered with Transformers."""
  if not isinstance(name, str) or not name:
    raise TypeError(f"{op}: name must be a non-empty str, got {name!r}")
  clashes = [word for word in RESERVED_ATTENTION_WORDS if word in name]
  if clashes:
    raise ValueError(f"{op}: name {name!r} contains {clashes[0]!r}, which Transformers "
                     f"treats specially; choose another name (default {default!r})")
  return name


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
