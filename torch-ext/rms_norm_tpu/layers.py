"""Layers for `kernels.kernelize`: their forward replaces a Transformers RMSNorm's.

kernelize binds `forward` to the model's own module, so `self.weight` and the
epsilon attribute are that module's. Per the kernels rules a layer class has no
__init__ and no members beyond `has_backward` / `can_torch_compile`.
"""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
  """Llama / Qwen / Mistral style: `weight * normalised(x)`, epsilon in `variance_epsilon`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from . import rms_norm

    return rms_norm(hidden_states, self.weight, self.variance_epsilon)


class GemmaRMSNorm(nn.Module):
  """Gemma style: `(1 + weight) * normalised(x)`, epsilon in `eps`, output in x's dtype."""

  has_backward = True
  can_torch_compile = True

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    from . import rms_norm

    return rms_norm(x, self.weight, self.eps, offset=1.0).to(x.dtype)
