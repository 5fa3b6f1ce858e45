"""Tensor conventions every kernel package's ops share: absent optional tensors, and
results written back into a tensor an op mutates.

A `jax_op` signature is fixed, so an optional tensor that is absent travels to JAX as an
empty (0,) tensor (`absent` / `or_absent` on the torch side; `present` on the JAX side
turns it back into None, or an output that was not asked for into a placeholder). An op
that updates a tensor in place (a cache, a recurrent state) donates it on TPU, so the JAX
result usually comes back in that tensor's own buffer; `write_back` copies it in when it
did not (CPU, where nothing is donated: the inputs are torch's memory seen through DLPack).

`present` takes jax arrays but imports nothing: the torch side never imports jax.
"""

from __future__ import annotations

import torch


def absent(like: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
  """An empty (0,) tensor on `like`'s device: how an absent optional tensor travels."""
  return like.new_empty((0,), dtype=dtype)


def or_absent(t: torch.Tensor | None, like: torch.Tensor,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
  """`t`, or `absent(like, dtype)` when it is None."""
  return absent(like, dtype) if t is None else t


def is_absent(t: torch.Tensor) -> bool:
  """Whether `t` is the placeholder of an absent tensor (or an output not asked for)."""
  return t.dim() == 1 and t.shape[0] == 0


def present(a):
  """JAX side: the array, or None for the (0,) placeholder `absent` made. (Every optional
  tensor of the kernels has at least one non-empty dimension when it is present.)"""
  return None if a.ndim == 1 and a.shape[0] == 0 else a


def write_back(target: torch.Tensor, result: torch.Tensor) -> None:
  """Puts an op's updated `result` into the tensor it mutates. TPU: with the donation
  honoured the result already lives in target's buffer (nothing to copy); CPU: a fresh
  JAX buffer, copied into the caller's tensor."""
  if result.data_ptr() != target.data_ptr():
    target.copy_(result)
