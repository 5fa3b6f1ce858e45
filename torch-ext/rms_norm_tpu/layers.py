"""Layers for `kernels.kernelize`: their forward replaces a Transformers RMSNorm's.

kernelize binds `forward` to the model's own module, so `self.weight` and the
epsilon attribute are that module's. Per the kernels rules a layer class has no
__init__ and no members beyond `has_backward` / `can_torch_compile`.

    RMSNorm       Transformers' use_kernel_forward_from_hub("RMSNorm") classes (Llama, Qwen,
                  Mistral, gpt-oss, ...): weight * normalised(x), epsilon in variance_epsilon
    GemmaRMSNorm  (1 + weight) * normalised(x), epsilon in eps, output in x's dtype: Gemma's
                  norms and use_kernel_forward_from_hub("RMSNormZeroCentered") (Qwen3.5)

Transformers' classes of one layer name differ in where they round (Llama rounds the
normalised x to x's dtype before the weight multiply, gpt-oss / OLMoE multiply in float32
and round once) and so in the output dtype when the weight's dtype is not x's (gpt-oss
keeps its norms in float32 in a bfloat16 model: x's dtype; Llama: the promoted one). And
nothing stops a class whose forward is another formula from carrying the layer name. So
the first call per (module class, x dtype, weight dtype, device type), outside
torch.compile, runs the module's own forward and the kernel on one probe row and
compares them: a different formula raises NotImplementedError naming the class (never a
silent wrong result), and the output takes the dtype the class's forward gives. Under
torch.compile only the dtype is taken (from the class's forward traced on a zero row);
run the model once eagerly to have its norms checked.
"""

from __future__ import annotations

import torch
from torch import nn

# Relative to the probe row's largest output: the kernel rounds once, a class may round
# the normalised x first (two roundings of at most 2**-9 each in bfloat16); another formula
# (1 + w against w) is off by about the whole output.
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
# (module class, x dtype, weight dtype, device type) -> the dtype its own forward returns.
_CHECKED: dict = {}


def _epsilon(module: nn.Module, attribute: str, layer: str) -> float:
  eps = getattr(module, attribute, None)
  if eps is None:
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__} has no `{attribute}` "
        f"attribute, so it is not the RMSNorm this layer replaces; do not map it to "
        f"layers.{layer}")
  return eps


def _check_against_own_forward(module: nn.Module, x: torch.Tensor, eps: float, offset: float,
                               layer: str) -> torch.dtype:
  """Runs the module class's own forward and the kernel on one probe row of x's dtype and
  device; returns the class's output dtype or raises NotImplementedError."""
  from . import rms_norm

  hidden = x.shape[-1]
  probe = torch.linspace(-2.0, 3.0, hidden, dtype=torch.float32, device=x.device)
  probe = (probe + 0.5 * torch.cos(7.0 * probe)).to(x.dtype).reshape(1, hidden)
  with torch.no_grad():
    own = type(module).forward(module, probe)
    got = rms_norm(probe, module.weight.detach(), eps, offset=offset)
  # The class may round the normalised x to x's dtype, whatever dtype it returns.
  tolerance = _PROBE_TOLERANCE.get(x.dtype)
  if own.shape != got.shape or tolerance is None:
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward returns shape "
        f"{tuple(own.shape)} {own.dtype} for a {tuple(probe.shape)} input; this layer "
        f"computes an RMSNorm over the last dimension")
  own64, got64 = own.double(), got.to(own.dtype).double()
  error = float((got64 - own64).abs().max())
  scale = float(own64.abs().max())
  if not error <= tolerance * max(scale, 1e-30):
    formula = "(1 + weight)" if offset else "weight"
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward is not "
        f"{formula} * x * rsqrt(mean(x^2) + eps): on a probe row it differs from the "
        f"kernel by {error:.3g} (largest output {scale:.3g}). Do not map it to "
        f"layers.{layer}" + ("" if offset else "; a (1 + weight) norm maps to "
                             "layers.GemmaRMSNorm"))
  return own.dtype


def _forward(module: nn.Module, x: torch.Tensor, eps: float, offset: float,
             layer: str) -> torch.Tensor:
  from . import rms_norm

  weight = module.weight
  out = rms_norm(x, weight, eps, offset=offset)
  if torch.compiler.is_compiling():
    # No value check while tracing (it would depend on data). With equal dtypes every
    # known class returns x's dtype; otherwise the class's own forward, traced on a zero
    # row, gives its output dtype (its value is unused: the compiler drops it).
    if x.dtype == weight.dtype:
      return out
    with torch.no_grad():
      own = type(module).forward(module, x.new_zeros((1, x.shape[-1])))
    return out.to(own.dtype)
  key = (type(module), x.dtype, weight.dtype, x.device.type)
  out_dtype = _CHECKED.get(key)
  if out_dtype is None:
    out_dtype = _CHECKED[key] = _check_against_own_forward(module, x, eps, offset, layer)
  return out.to(out_dtype)


class RMSNorm(nn.Module):
  """Llama / Qwen / Mistral style: `weight * normalised(x)`, epsilon in `variance_epsilon`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = _epsilon(self, "variance_epsilon", "RMSNorm")
    return _forward(self, hidden_states, eps, 0.0, "RMSNorm")


class GemmaRMSNorm(nn.Module):
  """Gemma style (also Qwen3.5's zero-centred norm): `(1 + weight) * normalised(x)`,
  epsilon in `eps`, output in x's dtype."""

  has_backward = True
  can_torch_compile = True

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    eps = _epsilon(self, "eps", "GemmaRMSNorm")
    return _forward(self, x, eps, 1.0, "GemmaRMSNorm")
