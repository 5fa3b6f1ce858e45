"""The torch custom ops of ragged-dot-tpu: schema, fake (shape) functions and autograd.

Ops, in the namespace of this build (`_ops.NAMESPACE`, unique per kernel and version):

  ragged_dot(lhs, rhs, group_sizes, rhs_scale?, bias?, group_offset, transpose_rhs,
             activation, out_dtype, lhs_quant) -> out [m, n]
  ragged_dot_backward(lhs, rhs, group_sizes, rhs_scale?, bias?, grad_out, ...)
      -> (grad_lhs, grad_rhs, grad_bias)
  experts(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias?, down_bias?,
          gate_up_scale?, down_scale?, num_experts, has_gate, is_transposed,
          is_concatenated, activation, alpha, limit, lhs_quant) -> out [T, H]
  experts_backward(<experts inputs>, grad_out, <statics>)
      -> (grad_hidden, grad_top_k_weights, grad_gate_up, grad_down, grad_gate_up_bias,
          grad_down_bias)

Gradients that do not exist (quantized weights are frozen; absent biases) come back
from the backward ops as empty (0,) tensors and reach autograd as None. The forward
ops are differentiable through the backward ops (first order only); the backward
JAX functions recompute the forward under jax.vjp, so the Pallas backward kernels run.
`out_dtype` is a dtype name ("float32", "bfloat16") or "" for lhs's dtype. `lhs_quant` is
"" or "int8" (int8 activations as well as weights: inference only, so ragged_dot and
experts refuse a gradient with it; their backward ops do not take it).
"""

from __future__ import annotations

import torch

from . import _shim
from ._ops import add_op_namespace_prefix
from .tpu_kernels.chips import DEFAULT_CHIP

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)


_jax_kernel = _shim.jax_kernels(__package__, add_op_namespace_prefix, cpu_chip=DEFAULT_CHIP)
_ragged_forward = _jax_kernel("ragged_dot", "ragged_dot_forward")
_ragged_backward = _jax_kernel("ragged_dot_backward", "ragged_dot_backward")
_experts_forward = _jax_kernel("experts", "experts_forward")
_experts_backward = _jax_kernel("experts_backward", "experts_backward")


def _empty(like: torch.Tensor) -> torch.Tensor:
  """An empty (0,) float32 tensor: how an absent tensor travels to and from JAX."""
  return like.new_empty((0,), dtype=torch.float32)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
  return _empty(like) if t is None else t


def _out_dtype(lhs: torch.Tensor, out_dtype: str) -> torch.dtype:
  return getattr(torch, out_dtype) if out_dtype else lhs.dtype


def _out_width(rhs: torch.Tensor, transpose_rhs: bool) -> int:
  return rhs.shape[1] if transpose_rhs else rhs.shape[2]


# ----------------------------------------------------------------------------- ragged_dot


def _ragged_backward_impl(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
                          rhs_scale: torch.Tensor | None, bias: torch.Tensor | None,
                          grad_out: torch.Tensor, group_offset: int, transpose_rhs: bool,
                          activation: str, out_dtype: str
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  tensors = {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes,
             "rhs_scale": _or_empty(rhs_scale, lhs), "bias": _or_empty(bias, lhs),
             "grad_out": grad_out}
  d_lhs, d_rhs, d_bias = _ragged_backward(tensors, group_offset=group_offset,
                                          transpose_rhs=transpose_rhs, activation=activation,
                                          out_dtype=out_dtype)
  return d_lhs, d_rhs, d_bias


def _ragged_backward_fake(lhs, rhs, group_sizes, rhs_scale, bias, grad_out, group_offset,
                          transpose_rhs, activation, out_dtype):
  d_rhs = _empty(lhs) if rhs.dtype in QUANTIZED_DTYPES else torch.empty_like(rhs)
  d_bias = _empty(lhs) if bias is None else torch.empty_like(bias)
  return torch.empty_like(lhs), d_rhs, d_bias


ragged_dot_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("ragged_dot_backward"), _ragged_backward_impl,
    setup=lambda op: op.register_fake(_ragged_backward_fake))


def _ragged_forward_impl(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor,
                         rhs_scale: torch.Tensor | None, bias: torch.Tensor | None,
                         group_offset: int, transpose_rhs: bool, activation: str,
                         out_dtype: str, lhs_quant: str) -> torch.Tensor:
  tensors = {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes,
             "rhs_scale": _or_empty(rhs_scale, lhs), "bias": _or_empty(bias, lhs)}
  return _ragged_forward(tensors, group_offset=group_offset, transpose_rhs=transpose_rhs,
                         activation=activation, out_dtype=out_dtype, lhs_quant=lhs_quant)


def _ragged_forward_fake(lhs, rhs, group_sizes, rhs_scale, bias, group_offset, transpose_rhs,
                         activation, out_dtype, lhs_quant):
  return lhs.new_empty((lhs.shape[0], _out_width(rhs, transpose_rhs)),
                       dtype=_out_dtype(lhs, out_dtype))


def _ragged_setup_context(ctx, inputs, output):
  lhs, rhs, group_sizes, rhs_scale, bias, *statics, lhs_quant = inputs
  ctx.save_for_backward(lhs, rhs, group_sizes, rhs_scale, bias)
  ctx.statics, ctx.lhs_quant = statics, lhs_quant


def _no_gradient_with_int8_activations(op: str, lhs_quant: str) -> None:
  if lhs_quant:
    raise NotImplementedError(
        f"{op}: lhs_quant={lhs_quant!r} (int8 activations) is inference only: rounding the "
        "activations has no gradient. Run it under torch.no_grad(), or without lhs_quant "
        "(for experts: quantize_experts_(model, 'int8', activations='')).")


def _ragged_autograd(ctx, grad_out):
  _no_gradient_with_int8_activations("ragged_dot", ctx.lhs_quant)
  lhs, rhs, group_sizes, rhs_scale, bias = ctx.saved_tensors
  d_lhs, d_rhs, d_bias = ragged_dot_backward_op(lhs, rhs, group_sizes, rhs_scale, bias,
                                                grad_out.contiguous(), *ctx.statics)
  d_rhs = None if rhs.dtype in QUANTIZED_DTYPES else d_rhs
  d_bias = None if bias is None else d_bias
  return d_lhs, d_rhs, None, None, d_bias, None, None, None, None, None


def _setup_ragged(op):
  op.register_fake(_ragged_forward_fake)
  op.register_autograd(_ragged_autograd, setup_context=_ragged_setup_context)


ragged_dot_op = _shim.custom_op_once(add_op_namespace_prefix("ragged_dot"), _ragged_forward_impl,
                                     setup=_setup_ragged)


# -------------------------------------------------------------------------------- experts


def _experts_tensors(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                     down_bias, gate_up_scale, down_scale) -> dict[str, torch.Tensor]:
  return {"hidden": hidden, "top_k_index": top_k_index, "top_k_weights": top_k_weights,
          "gate_up": gate_up, "down": down,
          "gate_up_bias": _or_empty(gate_up_bias, hidden),
          "down_bias": _or_empty(down_bias, hidden),
          "gate_up_scale": _or_empty(gate_up_scale, hidden),
          "down_scale": _or_empty(down_scale, hidden)}


def _statics(num_experts, has_gate, is_transposed, is_concatenated, activation, alpha, limit):
  return dict(num_experts=num_experts, has_gate=has_gate, is_transposed=is_transposed,
              is_concatenated=is_concatenated, activation=activation, alpha=alpha, limit=limit)


def _experts_backward_impl(hidden: torch.Tensor, top_k_index: torch.Tensor,
                           top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                           down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                           down_bias: torch.Tensor | None, gate_up_scale: torch.Tensor | None,
                           down_scale: torch.Tensor | None, grad_out: torch.Tensor,
                           num_experts: int, has_gate: bool, is_transposed: bool,
                           is_concatenated: bool, activation: str, alpha: float, limit: float
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                      torch.Tensor, torch.Tensor]:
  tensors = _experts_tensors(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                             down_bias, gate_up_scale, down_scale)
  tensors["grad_out"] = grad_out
  return tuple(_experts_backward(tensors, **_statics(num_experts, has_gate, is_transposed,
                                                     is_concatenated, activation, alpha,
                                                     limit)))


def _experts_backward_fake(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                           down_bias, gate_up_scale, down_scale, grad_out, *statics):
  def weight_grad(w):
    return _empty(hidden) if w.dtype in QUANTIZED_DTYPES else torch.empty_like(w)

  def bias_grad(b):
    return _empty(hidden) if b is None else torch.empty_like(b)

  return (torch.empty_like(hidden), torch.empty_like(top_k_weights), weight_grad(gate_up),
          weight_grad(down), bias_grad(gate_up_bias), bias_grad(down_bias))


experts_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("experts_backward"), _experts_backward_impl,
    setup=lambda op: op.register_fake(_experts_backward_fake))


def _experts_forward_impl(hidden: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor, gate_up: torch.Tensor,
                          down: torch.Tensor, gate_up_bias: torch.Tensor | None,
                          down_bias: torch.Tensor | None, gate_up_scale: torch.Tensor | None,
                          down_scale: torch.Tensor | None, num_experts: int, has_gate: bool,
                          is_transposed: bool, is_concatenated: bool, activation: str,
                          alpha: float, limit: float, lhs_quant: str) -> torch.Tensor:
  tensors = _experts_tensors(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias,
                             down_bias, gate_up_scale, down_scale)
  return _experts_forward(tensors, lhs_quant=lhs_quant,
                          **_statics(num_experts, has_gate, is_transposed, is_concatenated,
                                     activation, alpha, limit))


def _experts_forward_fake(hidden, *rest):
  return torch.empty_like(hidden)


def _experts_setup_context(ctx, inputs, output):
  ctx.save_for_backward(*inputs[:9])
  ctx.statics, ctx.lhs_quant = inputs[9:-1], inputs[-1]


def _experts_autograd(ctx, grad_out):
  _no_gradient_with_int8_activations("experts", ctx.lhs_quant)
  saved = ctx.saved_tensors
  _, _, _, gate_up, down, gate_up_bias, down_bias, _, _ = saved
  d_hidden, d_weights, d_gate_up, d_down, d_gu_bias, d_down_bias = experts_backward_op(
      *saved, grad_out.contiguous(), *ctx.statics)
  return (d_hidden, None, d_weights,
          None if gate_up.dtype in QUANTIZED_DTYPES else d_gate_up,
          None if down.dtype in QUANTIZED_DTYPES else d_down,
          None if gate_up_bias is None else d_gu_bias,
          None if down_bias is None else d_down_bias,
          None, None, None, None, None, None, None, None, None, None)


def _setup_experts(op):
  op.register_fake(_experts_forward_fake)
  op.register_autograd(_experts_autograd, setup_context=_experts_setup_context)


experts_op = _shim.custom_op_once(add_op_namespace_prefix("experts"), _experts_forward_impl,
                                  setup=_setup_experts)
