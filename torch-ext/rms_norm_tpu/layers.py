"""Layers for `kernels.kernelize`: their forward replaces a Transformers RMSNorm's.

kernelize binds `forward` to the model's own module, so `self.weight` and the
epsilon attribute are that module's. Per the kernels rules a layer class has no
__init__ and no members beyond `has_backward` / `can_torch_compile`.

    RMSNorm       weight * normalised(x): Transformers' use_kernel_forward_from_hub("RMSNorm")
                  classes (Llama, Qwen, Mistral, ...) and undecorated ones of that formula
                  (gpt-oss, OLMo 2 / 3, ...)
    GemmaRMSNorm  (1 + weight) * normalised(x), output in x's dtype: Gemma's norms and
                  use_kernel_forward_from_hub("RMSNormZeroCentered") (Qwen3.5)

Both read the module's `weight` and its epsilon from `variance_epsilon` or, if it has none,
`eps` (Transformers' classes use one or the other whatever their formula); a module without
either, or without a weight, is refused (NotImplementedError).

Transformers' classes of one layer name differ in where they round (Llama rounds the
normalised x to x's dtype before the weight multiply, gpt-oss / OLMoE multiply in float32
and round once) and so in the output dtype when the weight's dtype is not x's (gpt-oss
keeps its norms in float32 in a bfloat16 model: x's dtype; Llama: the promoted one). And
nothing stops a class whose forward is another formula from carrying the layer name. So
the first call per (module class, layer formula, x dtype, weight dtype, device type),
outside torch.compile, runs the module's own forward and the kernel on one probe row,
in float32 with a weight of the probe's own (the formula, whatever the module's weights)
and in x's dtype with the module's weight (the rounding), and compares them: a different
formula raises NotImplementedError naming the class (never a silent wrong result), and the
output takes the dtype the class's forward gives. Under
torch.compile only the dtype is taken (from the class's forward traced on a zero row);
run the model once eagerly to have its norms checked.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# Relative to the probe row's largest output: the kernel rounds once, a class may round
# the normalised x first (two roundings of at most 2**-9 each in bfloat16); another formula
# (1 + w against w) is off by about the whole output.
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
# (module class, offset, x dtype, weight dtype, device type) -> the dtype its own forward
# returns (the offset: one class mapped to both layers is checked against each formula).
_CHECKED: dict = {}
# Where Transformers' norms keep their epsilon, in the order read.
_EPSILON_ATTRIBUTES = ("variance_epsilon", "eps")


def _epsilon(module: nn.Module, layer: str) -> float:
  eps = None
  for attribute in _EPSILON_ATTRIBUTES:   # a plain loop: torch.compile traces it
    eps = getattr(module, attribute, None)
    if eps is not None:
      break
  if eps is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
    missing = ("`weight`" if eps is not None
               else "epsilon attribute (`variance_epsilon` or `eps`)")
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__} has no {missing}, so it is "
        f"not the RMSNorm this layer replaces; do not map it to layers.{layer}")
  return eps


def _probe_row(hidden: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
  row = torch.linspace(-2.0, 3.0, hidden, dtype=torch.float32, device=device)
  return (row + 0.5 * torch.cos(7.0 * row)).to(dtype).reshape(1, hidden)


def _probe_error(own: torch.Tensor, got: torch.Tensor, module: nn.Module, layer: str,
                 probe: torch.Tensor) -> tuple[float, float]:
  """(max |got - own|, max |own|) in float64; NotImplementedError if the shapes differ."""
  if own.shape != got.shape:
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward returns shape "
        f"{tuple(own.shape)} {own.dtype} for a {tuple(probe.shape)} input; this layer "
        f"computes an RMSNorm over the last dimension")
  own64, got64 = own.double(), got.to(own.dtype).double()
  return float((got64 - own64).abs().max()), float(own64.abs().max())


def _check_against_own_forward(module: nn.Module, x: torch.Tensor, eps: float, offset: float,
                               layer: str) -> torch.dtype:
  """Runs the module class's own forward and the kernel on one probe row, on x's device:

  1. the formula: in float32, on a shallow copy of the module whose weight is the probe's
     own (0.25 to 0.75: neither the 1 nor the 0 a fresh norm starts at), so that the verdict
     does not depend on the module's weights (a norm that scales x before it normalises
     equals (1 + w) * normalised(x) at w = 0), within 1e-5 of the largest output;
  2. the rounding: in x's dtype with the module's own weight, within _PROBE_TOLERANCE.

  Returns the dtype the class's forward gives for x's dtype, or raises NotImplementedError.
  """
  from . import rms_norm

  hidden, tolerance = x.shape[-1], _PROBE_TOLERANCE.get(x.dtype)
  formula = "(1 + weight)" if offset else "weight"
  if tolerance is None:
    raise NotImplementedError(f"rms-norm-tpu layers.{layer}: x of dtype {x.dtype}")
  probe = _probe_row(hidden, torch.float32, x.device)
  weight = 0.5 + 0.25 * torch.cos(3.0 * torch.arange(hidden, dtype=torch.float32,
                                                     device=x.device))
  twin = copy.copy(module)   # shares every tensor with module; only its weight is the probe's
  twin._parameters = dict(module._parameters, weight=nn.Parameter(weight, requires_grad=False))
  with torch.no_grad():
    error, scale = _probe_error(type(module).forward(twin, probe),
                                rms_norm(probe, weight, eps, offset=offset), module, layer, probe)
  if not error <= _PROBE_TOLERANCE[torch.float32] * max(scale, 1e-30):
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward is not "
        f"{formula} * x * rsqrt(mean(x^2) + eps): on a float32 probe row it differs from "
        f"the kernel by {error:.3g} (largest output {scale:.3g}). Do not map it to "
        f"layers.{layer}" + ("" if offset else "; a (1 + weight) norm maps to "
                             "layers.GemmaRMSNorm"))
  probe = _probe_row(hidden, x.dtype, x.device)
  with torch.no_grad():
    own = type(module).forward(module, probe)
    # The class may round the normalised x to x's dtype, whatever dtype it returns.
    error, scale = _probe_error(own, rms_norm(probe, module.weight.detach(), eps, offset=offset),
                                module, layer, probe)
  if not error <= tolerance * max(scale, 1e-30):
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward computes "
        f"{formula} * x * rsqrt(mean(x^2) + eps) in float32 but differs from the kernel in "
        f"{x.dtype} by {error:.3g} (largest output {scale:.3g}), more than rounding; do "
        f"not map it to layers.{layer}")
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
  key = (type(module), offset, x.dtype, weight.dtype, x.device.type)
  out_dtype = _CHECKED.get(key)
  if out_dtype is None:
    out_dtype = _CHECKED[key] = _check_against_own_forward(module, x, eps, offset, layer)
  return out.to(out_dtype)


class RMSNorm(nn.Module):
  """Llama / Qwen / Mistral style: `weight * normalised(x)`; x (..., hidden), weight
  (hidden,); epsilon in `variance_epsilon` or `eps`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = _epsilon(self, "RMSNorm")
    return _forward(self, hidden_states, eps, 0.0, "RMSNorm")


class GemmaRMSNorm(nn.Module):
  """Gemma style (also Qwen3.5's zero-centred norm): `(1 + weight) * normalised(x)`; x
  (..., hidden), weight (hidden,); epsilon in `variance_epsilon` or `eps`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    eps = _epsilon(self, "GemmaRMSNorm")
    return _forward(self, x, eps, 1.0, "GemmaRMSNorm")
