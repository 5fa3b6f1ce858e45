"""Layers for `kernels.kernelize`: their forward replaces a Transformers RMSNorm's.

kernelize binds `forward` to the model's own module, so `self.weight` and the
epsilon attribute are that module's. Per the kernels rules a layer class has no
__init__ and no members beyond `has_backward` / `can_torch_compile`.

    RMSNorm       weight * normalised(x): Transformers' use_kernel_forward_from_hub("RMSNorm")
                  classes (Llama, Qwen, Mistral, ...) and undecorated ones of that formula
                  (gpt-oss, OLMo 2 / 3, ...)
    GemmaRMSNorm  (1 + weight) * normalised(x), output in x's dtype: Gemma's norms and
                  use_kernel_forward_from_hub("RMSNormZeroCentered") (Qwen3.5)
    RMSNormGated  weight * normalised(x) * act(gate), output in x's dtype:
                  use_kernel_forward_from_hub("RMSNormGated") (the linear-attention layers
                  of Qwen3.5, Qwen3-Next, OLMo-Hybrid: SiLU; Kimi Linear, Bailing-hybrid,
                  GLM-5-Next: sigmoid), forward(hidden_states, gate); the activation is
                  the module's `activation` attribute (see the end of this docstring)

Both read the module's `weight` and its epsilon from `variance_epsilon` or, if it has none,
`eps` (Transformers' classes use one or the other whatever their formula); a module without
an epsilon, or whose `weight` is not a tensor, is refused (NotImplementedError). A module
with no `weight` at all (or `weight = None`: Gemma 3n's and Gemma 4's `with_scale=False`
norms, `normalised(x)` with no scale) runs the kernel with a weight of ones in x's dtype
(scale 1, whichever layer), and is checked against its own forward like the others (its
own key: one class may build both kinds).

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

RMSNormGated: the classes round in one of two ways (Qwen3.5 / Qwen3-Next / OLMo-Hybrid
round the normalised x to x's dtype before the weight multiply; Kimi Linear /
Bailing-hybrid / GLM-5-Next stay in float32 until the output), which differ in bfloat16
only. The first call per (class, x dtype, gate dtype, weight dtype, device type), outside
torch.compile, runs the class's own forward and the kernel on probe rows: in float32 with
a probe weight (the formula and the module's activation: anything else raises
NotImplementedError), then in the call's dtypes with the module's weight under both
roundings, keeping the one that matches (none within rounding: NotImplementedError).
Under torch.compile a class not yet checked takes the first rounding.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

# Relative to the probe row's largest output: the kernel rounds once, a class may round
# the normalised x first (two roundings of at most 2**-9 each in bfloat16); another formula
# (1 + w against w) is off by about the whole output.
_PROBE_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2.0**-6, torch.float16: 2.0**-9}
# (module class, offset, weightless, x dtype, weight dtype, device type) -> the dtype its own
# forward returns (the offset: one class mapped to both layers is checked against each
# formula; weightless: one class may build norms with and without a weight).
_CHECKED: dict = {}
# Where Transformers' norms keep their epsilon, in the order read.
_EPSILON_ATTRIBUTES = ("variance_epsilon", "eps")


def _epsilon(module: nn.Module, layer: str, weightless_allowed: bool = False) -> float:
  eps = None
  for attribute in _EPSILON_ATTRIBUTES:   # a plain loop: torch.compile traces it
    eps = getattr(module, attribute, None)
    if eps is not None:
      break
  weight = getattr(module, "weight", None)
  if eps is None or not (isinstance(weight, torch.Tensor)
                         or (weight is None and weightless_allowed)):
    missing = ("tensor `weight`" if eps is not None
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
                               layer: str, weightless: bool = False) -> torch.dtype:
  """Runs the module class's own forward and the kernel on one probe row, on x's device:

  1. the formula: in float32, on a shallow copy of the module whose weight is the probe's
     own (0.25 to 0.75: neither the 1 nor the 0 a fresh norm starts at), so that the verdict
     does not depend on the module's weights (a norm that scales x before it normalises
     equals (1 + w) * normalised(x) at w = 0), within 1e-5 of the largest output; a
     weightless module (no `weight`) against the kernel with a weight of ones, offset 0;
  2. the rounding: in x's dtype with the module's own weight (ones in x's dtype if it has
     none), within _PROBE_TOLERANCE.

  Returns the dtype the class's forward gives for x's dtype, or raises NotImplementedError.
  """
  from . import rms_norm

  hidden, tolerance = x.shape[-1], _PROBE_TOLERANCE.get(x.dtype)
  formula = "" if weightless else ("(1 + weight) * " if offset else "weight * ")
  if tolerance is None:
    raise NotImplementedError(f"rms-norm-tpu layers.{layer}: x of dtype {x.dtype}")
  probe = _probe_row(hidden, torch.float32, x.device)
  if weightless:
    twin, weight = module, torch.ones(hidden, dtype=torch.float32, device=x.device)
  else:
    weight = 0.5 + 0.25 * torch.cos(3.0 * torch.arange(hidden, dtype=torch.float32,
                                                       device=x.device))
    twin = copy.copy(module)   # shares every tensor with module; only its weight is the probe's
    twin._parameters = dict(module._parameters,
                            weight=nn.Parameter(weight, requires_grad=False))
  with torch.no_grad():
    error, scale = _probe_error(type(module).forward(twin, probe),
                                rms_norm(probe, weight, eps, offset=offset), module, layer, probe)
  if not error <= _PROBE_TOLERANCE[torch.float32] * max(scale, 1e-30):
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward is not "
        f"{formula}x * rsqrt(mean(x^2) + eps): on a float32 probe row it differs from "
        f"the kernel by {error:.3g} (largest output {scale:.3g}). Do not map it to "
        f"layers.{layer}" + ("" if offset else "; a (1 + weight) norm maps to "
                             "layers.GemmaRMSNorm"))
  probe = _probe_row(hidden, x.dtype, x.device)
  own_weight = (torch.ones(hidden, dtype=x.dtype, device=x.device) if weightless
                else module.weight.detach())
  with torch.no_grad():
    own = type(module).forward(module, probe)
    # The class may round the normalised x to x's dtype, whatever dtype it returns.
    error, scale = _probe_error(own, rms_norm(probe, own_weight, eps, offset=offset),
                                module, layer, probe)
  if not error <= tolerance * max(scale, 1e-30):
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {type(module).__name__}'s own forward computes "
        f"{formula}x * rsqrt(mean(x^2) + eps) in float32 but differs from the kernel in "
        f"{x.dtype} by {error:.3g} (largest output {scale:.3g}), more than rounding; do "
        f"not map it to layers.{layer}")
  return own.dtype


def _forward(module: nn.Module, x: torch.Tensor, eps: float, offset: float,
             layer: str) -> torch.Tensor:
  from . import rms_norm

  weight = getattr(module, "weight", None)
  weightless = weight is None
  if weightless:   # normalised(x), no scale (_epsilon let it through): a weight of ones
    weight, offset = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device), 0.0
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
  key = (type(module), offset, weightless, x.dtype, weight.dtype, x.device.type)
  out_dtype = _CHECKED.get(key)
  if out_dtype is None:
    out_dtype = _CHECKED[key] = _check_against_own_forward(module, x, eps, offset, layer,
                                                           weightless)
  return out.to(out_dtype)


class RMSNorm(nn.Module):
  """Llama / Qwen / Mistral style: `weight * normalised(x)`; x (..., hidden), weight
  (hidden,), or none (`normalised(x)`: Gemma 3n's and Gemma 4's with_scale=False);
  epsilon in `variance_epsilon` or `eps`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    eps = _epsilon(self, "RMSNorm", weightless_allowed=True)
    return _forward(self, hidden_states, eps, 0.0, "RMSNorm")


class GemmaRMSNorm(nn.Module):
  """Gemma style (also Qwen3.5's zero-centred norm): `(1 + weight) * normalised(x)`; x
  (..., hidden), weight (hidden,), or none (`normalised(x)`, scale 1); epsilon in
  `variance_epsilon` or `eps`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    eps = _epsilon(self, "GemmaRMSNorm", weightless_allowed=True)
    return _forward(self, x, eps, 1.0, "GemmaRMSNorm")


# ----------------------------------------------------------------------------- gated norm

# (module class, x dtype, gate dtype, weight dtype, device type) -> norm_in_input_dtype:
# the rounding the class's own forward matches.
_GATED_CHECKED: dict = {}
# Probe rows of the gated check: x at several scales (so that roundings of the normalised
# x and of the product show), and a gate spanning the activation's curve.
_GATED_PROBE_SCALES = (1.0, 0.37, 5.3, 1.9)


def _gated_probe(hidden: int, dtype: torch.dtype, device: torch.device):
  row = _probe_row(hidden, torch.float32, device)
  x = torch.cat([row * s for s in _GATED_PROBE_SCALES]).to(dtype)
  gate = torch.cat([torch.roll(row, shift, dims=1) * 1.3 - 0.4
                    for shift in range(len(_GATED_PROBE_SCALES))]).to(dtype)
  return x, gate


def _gate_activation(module: nn.Module) -> str:
  from . import GATE_ACTIVATIONS

  activation = getattr(module, "activation", None)
  if not isinstance(activation, str) or activation not in GATE_ACTIVATIONS:
    raise NotImplementedError(
        f"rms-norm-tpu layers.RMSNormGated: {type(module).__name__}'s `activation` is "
        f"{activation!r}, not one of {sorted(GATE_ACTIVATIONS)}")
  return activation


def _check_gated_against_own_forward(module: nn.Module, x: torch.Tensor, gate: torch.Tensor,
                                     eps: float, activation: str) -> bool:
  """The rounding (norm_in_input_dtype) under which the kernel matches the module class's
  own forward, or NotImplementedError (the module docstring's RMSNormGated check)."""
  from . import rms_norm_gated

  layer, name = "RMSNormGated", type(module).__name__
  hidden, device = x.shape[-1], x.device
  tolerance = _PROBE_TOLERANCE.get(x.dtype)
  if tolerance is None:
    raise NotImplementedError(f"rms-norm-tpu layers.{layer}: x of dtype {x.dtype}")
  px, pg = _gated_probe(hidden, torch.float32, device)
  weight = 0.5 + 0.25 * torch.cos(3.0 * torch.arange(hidden, dtype=torch.float32,
                                                     device=device))
  twin = copy.copy(module)   # shares every tensor with module; only its weight is the probe's
  twin._parameters = dict(module._parameters, weight=nn.Parameter(weight, requires_grad=False))
  with torch.no_grad():
    error, scale = _probe_error(type(module).forward(twin, px, pg),
                                rms_norm_gated(px, pg, weight, eps, activation=activation),
                                module, layer, px)
  if not error <= _PROBE_TOLERANCE[torch.float32] * max(scale, 1e-30):
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {name}'s own forward is not weight * x * "
        f"rsqrt(mean(x^2) + eps) * {activation}(gate): on float32 probe rows it differs "
        f"from the kernel by {error:.3g} (largest output {scale:.3g}). Do not map it to "
        f"layers.{layer}")
  px, pg = _gated_probe(hidden, x.dtype, device)
  pg = pg.to(gate.dtype)
  errors = {}
  with torch.no_grad():
    own = type(module).forward(module, px, pg)
    if own.dtype != x.dtype:
      raise NotImplementedError(f"rms-norm-tpu layers.{layer}: {name}'s own forward returns "
                                f"{own.dtype} for {x.dtype} input; the kernel returns x's dtype")
    for norm_in_input_dtype in (True, False):
      got = rms_norm_gated(px, pg, module.weight.detach(), eps, activation=activation,
                           norm_in_input_dtype=norm_in_input_dtype)
      errors[norm_in_input_dtype], scale = _probe_error(own, got, module, layer, px)
  best = min(errors, key=lambda k: (errors[k], not k))   # a tie keeps True
  if not errors[best] <= tolerance * max(scale, 1e-30):
    raise NotImplementedError(
        f"rms-norm-tpu layers.{layer}: {name}'s own forward computes the gated norm in "
        f"float32 but differs from the kernel in {x.dtype} by {errors[best]:.3g} (largest "
        f"output {scale:.3g}) under either rounding, more than rounding; do not map it to "
        f"layers.{layer}")
  return best


class RMSNormGated(nn.Module):
  """Transformers' "RMSNormGated": `weight * normalised(x) * act(gate)`, x and gate
  (..., hidden), weight (hidden,), the activation in the module's `activation`, epsilon in
  `variance_epsilon` or `eps`; output in x's dtype."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states: torch.Tensor, gate: torch.Tensor = None) -> torch.Tensor:
    from . import rms_norm_gated

    eps = _epsilon(self, "RMSNormGated")
    activation = _gate_activation(self)
    if gate is None:
      raise ValueError(f"rms-norm-tpu layers.RMSNormGated: {type(self).__name__} was called "
                       f"without a gate")
    key = (type(self), hidden_states.dtype, gate.dtype, self.weight.dtype,
           hidden_states.device.type)
    norm_in_input_dtype = _GATED_CHECKED.get(key)
    if norm_in_input_dtype is None:
      if torch.compiler.is_compiling():
        norm_in_input_dtype = True
      else:
        norm_in_input_dtype = _GATED_CHECKED[key] = _check_gated_against_own_forward(
            self, hidden_states, gate, eps, activation)
    return rms_norm_gated(hidden_states, gate, self.weight, eps, activation=activation,
                          norm_in_input_dtype=norm_in_input_dtype)
