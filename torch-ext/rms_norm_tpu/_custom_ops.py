"""The torch custom ops of rms-norm-tpu: schema, fake (shape) functions and autograd.

Ops, in the namespace of this build (`_ops.NAMESPACE`, unique per kernel and version):

  rms_norm(x, weight, eps, offset) -> out
  fused_add_rms_norm(x, residual, weight, eps, offset) -> (out, residual_out)
  rms_norm_backward(x, weight, grad_out, eps, offset) -> (grad_x, grad_weight)
  fused_add_rms_norm_backward(residual_out, weight, grad_out, grad_residual, eps, offset)
      -> (grad_sum, grad_weight)          grad_sum reaches both x and residual
  rms_norm_gated(x, gate, weight, eps, activation, norm_in_input_dtype) -> out
  rms_norm_gated_backward(x, gate, weight, grad_out, eps, activation, norm_in_input_dtype)
      -> (grad_x, grad_gate, grad_weight)

out has dtype promote(x, weight) (rms_norm_gated: x's dtype); residual_out has x's dtype.
The forward ops are differentiable through the backward ops (first order only).
"""

from __future__ import annotations

import torch

from . import _shim
from ._ops import add_op_namespace_prefix
from .tpu_kernels.chips import DEFAULT_CHIP


_jax_kernel = _shim.jax_kernels(__package__, add_op_namespace_prefix, cpu_chip=DEFAULT_CHIP)


_forward = _jax_kernel("rms_norm", "rms_norm_forward")
_fused_forward = _jax_kernel("fused_add_rms_norm", "fused_add_rms_norm_forward")
_backward = _jax_kernel("rms_norm_backward", "rms_norm_backward")
_fused_backward = _jax_kernel("fused_add_rms_norm_backward", "fused_add_rms_norm_backward")
_gated_forward = _jax_kernel("rms_norm_gated", "rms_norm_gated_forward")
_gated_backward = _jax_kernel("rms_norm_gated_backward", "rms_norm_gated_backward")


# ----------------------------------------------------------------------------- backward ops


def _backward_impl(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor,
                   eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
  return tuple(_backward({"x": x, "weight": weight, "grad_out": grad_out},
                         eps=eps, offset=offset))


def _fused_backward_impl(residual_out: torch.Tensor, weight: torch.Tensor,
                         grad_out: torch.Tensor, grad_residual: torch.Tensor, eps: float,
                         offset: float) -> tuple[torch.Tensor, torch.Tensor]:
  return tuple(_fused_backward({"residual_out": residual_out, "weight": weight,
                                "grad_out": grad_out, "grad_residual": grad_residual},
                               eps=eps, offset=offset))


def _backward_fake(x, weight, grad_out, eps, offset):
  return torch.empty_like(x), torch.empty_like(weight)


def _fused_backward_fake(residual_out, weight, grad_out, grad_residual, eps, offset):
  return torch.empty_like(residual_out), torch.empty_like(weight)


rms_norm_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("rms_norm_backward"), _backward_impl,
    setup=lambda op: op.register_fake(_backward_fake))
fused_add_rms_norm_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("fused_add_rms_norm_backward"), _fused_backward_impl,
    setup=lambda op: op.register_fake(_fused_backward_fake))


# ----------------------------------------------------------------------------- forward ops


def _forward_impl(x: torch.Tensor, weight: torch.Tensor, eps: float,
                  offset: float) -> torch.Tensor:
  return _forward({"x": x, "weight": weight}, eps=eps, offset=offset)


def _forward_fake(x, weight, eps, offset):
  return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _forward_setup_context(ctx, inputs, output):
  x, weight, eps, offset = inputs
  ctx.save_for_backward(x, weight)
  ctx.eps, ctx.offset = eps, offset


def _forward_backward(ctx, grad_out):
  x, weight = ctx.saved_tensors
  grad_x, grad_weight = rms_norm_backward_op(x, weight, grad_out.contiguous(), ctx.eps,
                                             ctx.offset)
  return grad_x, grad_weight, None, None


def _fused_forward_impl(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                        eps: float, offset: float) -> tuple[torch.Tensor, torch.Tensor]:
  return tuple(_fused_forward({"x": x, "residual": residual, "weight": weight},
                              eps=eps, offset=offset))


def _fused_forward_fake(x, residual, weight, eps, offset):
  out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))
  return out, torch.empty_like(x)


def _fused_setup_context(ctx, inputs, output):
  _, _, weight, eps, offset = inputs
  _, residual_out = output
  ctx.save_for_backward(residual_out, weight)
  ctx.eps, ctx.offset = eps, offset


def _fused_backward_autograd(ctx, grad_out, grad_residual):
  residual_out, weight = ctx.saved_tensors
  if grad_out is None:  # only the residual was used downstream
    grad_out = torch.zeros_like(residual_out, dtype=torch.promote_types(residual_out.dtype,
                                                                         weight.dtype))
  if grad_residual is None:
    grad_sum, grad_weight = rms_norm_backward_op(residual_out, weight, grad_out.contiguous(),
                                                 ctx.eps, ctx.offset)
  else:
    grad_sum, grad_weight = fused_add_rms_norm_backward_op(
        residual_out, weight, grad_out.contiguous(), grad_residual.contiguous(), ctx.eps,
        ctx.offset)
  return grad_sum, grad_sum, grad_weight, None, None


def _setup_forward(op):
  op.register_fake(_forward_fake)
  op.register_autograd(_forward_backward, setup_context=_forward_setup_context)


def _setup_fused_forward(op):
  op.register_fake(_fused_forward_fake)
  op.register_autograd(_fused_backward_autograd, setup_context=_fused_setup_context)


rms_norm_op = _shim.custom_op_once(add_op_namespace_prefix("rms_norm"), _forward_impl,
                                   setup=_setup_forward)
fused_add_rms_norm_op = _shim.custom_op_once(add_op_namespace_prefix("fused_add_rms_norm"),
                                             _fused_forward_impl, setup=_setup_fused_forward)


# ----------------------------------------------------------------------------- gated norm


def _gated_backward_impl(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                         grad_out: torch.Tensor, eps: float, activation: str,
                         norm_in_input_dtype: bool
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  return tuple(_gated_backward({"x": x, "gate": gate, "weight": weight, "grad_out": grad_out},
                               eps=eps, activation=activation,
                               norm_in_input_dtype=norm_in_input_dtype))


def _gated_backward_fake(x, gate, weight, grad_out, eps, activation, norm_in_input_dtype):
  return torch.empty_like(x), torch.empty_like(gate), torch.empty_like(weight)


rms_norm_gated_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("rms_norm_gated_backward"), _gated_backward_impl,
    setup=lambda op: op.register_fake(_gated_backward_fake))


def _gated_forward_impl(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float,
                        activation: str, norm_in_input_dtype: bool) -> torch.Tensor:
  return _gated_forward({"x": x, "gate": gate, "weight": weight}, eps=eps,
                        activation=activation, norm_in_input_dtype=norm_in_input_dtype)


def _gated_forward_fake(x, gate, weight, eps, activation, norm_in_input_dtype):
  return torch.empty_like(x)


def _gated_setup_context(ctx, inputs, output):
  x, gate, weight, eps, activation, norm_in_input_dtype = inputs
  ctx.save_for_backward(x, gate, weight)
  ctx.statics = (eps, activation, norm_in_input_dtype)


def _gated_forward_backward(ctx, grad_out):
  x, gate, weight = ctx.saved_tensors
  grads = rms_norm_gated_backward_op(x, gate, weight, grad_out.contiguous(), *ctx.statics)
  return (*grads, None, None, None)


def _setup_gated_forward(op):
  op.register_fake(_gated_forward_fake)
  op.register_autograd(_gated_forward_backward, setup_context=_gated_setup_context)


rms_norm_gated_op = _shim.custom_op_once(add_op_namespace_prefix("rms_norm_gated"),
                                         _gated_forward_impl, setup=_setup_gated_forward)
