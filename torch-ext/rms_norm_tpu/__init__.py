"""rms-norm-tpu: RMSNorm as Pallas TPU kernels, for PyTorch tensors on TPU (TorchTPU) or CPU.

    rms_norm(x, weight, eps=1e-6, *, offset=0.0) -> out
    fused_add_rms_norm(x, residual, weight, eps=1e-6, *, offset=0.0) -> (out, residual)
    rms_norm_gated(x, gate, weight, eps=1e-6, *, activation="silu",
                   norm_in_input_dtype=True) -> out
    layers.RMSNorm, layers.GemmaRMSNorm, layers.RMSNormGated   (for kernels.kernelize)

x: (..., hidden) float32 / bfloat16 / float16, any leading dimensions, any hidden
size; weight: (hidden,). out has dtype promote(x.dtype, weight.dtype); math is f32.
`offset` is added to the weight (1.0 gives Gemma's `x * (1 + w)`). On "tpu" tensors
the compiled kernel runs through TorchTPU; on "cpu" tensors the same kernel runs in
Pallas interpret mode (slow; for development and tests). jax must be installed.

The gated norm (Transformers' "RMSNormGated": Qwen3.5, Qwen3-Next, OLMo-Hybrid, Kimi
Linear, ...) is weight * normalised(x) * act(gate), act SiLU or sigmoid; x and gate
(..., hidden) float32 / bfloat16, out in x's dtype (float16 is refused).
"""

from __future__ import annotations

import torch

from . import _shim, layers
from ._custom_ops import fused_add_rms_norm_op, rms_norm_gated_op, rms_norm_op
from ._shim import validation

__all__ = ["fused_add_rms_norm", "layers", "rms_norm", "rms_norm_gated"]

GATED_DTYPES = (torch.float32, torch.bfloat16)
# Gate activations, by the names Transformers' ACT2FN gives them ("swish" is SiLU).
GATE_ACTIVATIONS = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


def _check_common(op: str, x, weight, eps, offset) -> tuple[float, float]:
  validation.check_tensor(op, "x", x)
  validation.check_tensor(op, "weight", weight)
  validation.check_float_dtype(op, "x", x)
  validation.check_float_dtype(op, "weight", weight)
  validation.check_min_ndim(op, "x", x, 1)
  if x.shape[-1] == 0:
    raise ValueError(f"{op}: x must have a non-empty last (hidden) dimension, got shape "
                     f"{tuple(x.shape)}")
  validation.check_shape(op, "weight", weight, (x.shape[-1],), "the last dimension of x")
  eps = validation.check_finite_number(op, "eps", eps, minimum=0.0)
  offset = validation.check_finite_number(op, "offset", offset)
  return eps, offset


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             offset: float = 0.0) -> torch.Tensor:
  """RMSNorm over the last dimension: x * rsqrt(mean(x^2) + eps) * (offset + weight).

  Args:
    x: (..., hidden), float32 / bfloat16 / float16, on "tpu" or "cpu".
    weight: (hidden,), same device, float32 / bfloat16 / float16.
    eps: finite, >= 0.
    offset: added to weight (0 for Llama/Qwen, 1 for Gemma).
  Returns:
    (..., hidden) in promote_types(x.dtype, weight.dtype). Differentiable in x and weight.
  """
  eps, offset = _check_common("rms_norm", x, weight, eps, offset)
  _shim.device_type_of("rms_norm", {"x": x, "weight": weight})
  return rms_norm_op(x.contiguous(), weight.contiguous(), eps, offset)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *, offset: float = 0.0
                       ) -> tuple[torch.Tensor, torch.Tensor]:
  """(rms_norm(x + residual), x + residual) in one pass, for pre-norm residual blocks.

  residual must have x's shape and dtype; the sum is rounded to that dtype before it
  is normalised, exactly as the unfused `residual = x + residual; rms_norm(residual)`.
  Returns (out, new_residual); differentiable in x, residual and weight.
  """
  op = "fused_add_rms_norm"
  eps, offset = _check_common(op, x, weight, eps, offset)
  validation.check_tensor(op, "residual", residual)
  validation.check_shape(op, "residual", residual, tuple(x.shape), "the shape of x")
  validation.check_same_dtype(op, "residual", residual, "x", x)
  _shim.device_type_of(op, {"x": x, "residual": residual, "weight": weight})
  return fused_add_rms_norm_op(x.contiguous(), residual.contiguous(), weight.contiguous(),
                               eps, offset)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                   eps: float = 1e-6, *, activation: str = "silu",
                   norm_in_input_dtype: bool = True) -> torch.Tensor:
  """Gated RMSNorm: weight * x * rsqrt(mean(x^2) + eps) * act(gate), over the last dimension.

  Args:
    x: (..., hidden), float32 / bfloat16, on "tpu" or "cpu".
    gate: x's shape, float32 / bfloat16 (taken in float32).
    weight: (hidden,), float32 / bfloat16.
    eps: finite, >= 0.
    activation: "silu" (or "swish") or "sigmoid".
    norm_in_input_dtype: True rounds the normalised x to x's dtype before the weight
      multiply, and that product to promote(weight, x) (Qwen3.5, Qwen3-Next, OLMo-Hybrid,
      Qwen4-Exp); False keeps everything in float32 (Kimi Linear, Bailing-hybrid,
      GLM-5-Next, Lara-mini). Identical for float32 inputs.
  Returns:
    x's shape and dtype. Differentiable in x, gate and weight.
  """
  op = "rms_norm_gated"
  for name, t in (("x", x), ("gate", gate), ("weight", weight)):
    validation.check_tensor(op, name, t)
    validation.check_float_dtype(op, name, t, GATED_DTYPES)
  validation.check_min_ndim(op, "x", x, 1)
  if x.shape[-1] == 0:
    raise ValueError(f"{op}: x must have a non-empty last (hidden) dimension, got shape "
                     f"{tuple(x.shape)}")
  validation.check_shape(op, "gate", gate, tuple(x.shape), "the shape of x")
  validation.check_shape(op, "weight", weight, (x.shape[-1],), "the last dimension of x")
  eps = validation.check_finite_number(op, "eps", eps, minimum=0.0)
  if activation not in GATE_ACTIVATIONS:
    raise NotImplementedError(f"{op}: gate activation {activation!r} is not supported (one "
                              f"of {sorted(GATE_ACTIVATIONS)})")
  _shim.device_type_of(op, {"x": x, "gate": gate, "weight": weight})
  return rms_norm_gated_op(x.contiguous(), gate.contiguous(), weight.contiguous(), eps,
                           GATE_ACTIVATIONS[activation], bool(norm_in_input_dtype))
