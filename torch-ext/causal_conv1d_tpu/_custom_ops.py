"""The torch custom ops of causal-conv1d-tpu: schema, fake (shape) functions, autograd.

Ops, in the namespace of this build (`_ops.NAMESPACE`, unique per kernel and version):

  causal_conv1d_forward(x, weight, bias?, cu_seqlens?, seq_idx?, activation,
                        channels_last) -> out
  causal_conv1d_backward(x, weight, bias?, cu_seqlens?, seq_idx?, grad_out, activation,
                         channels_last) -> (dx, dweight, dbias)
  causal_conv1d_update(x, conv_state!, weight, bias?, activation) -> out

x [B, D, T] (or [B, T, D] with channels_last), weight [D, W], bias [D], conv_state
[B, D, S]; out has x's shape and dtype; dbias is a (0,) placeholder without a bias.
activation "" means none. causal_conv1d_forward is differentiable in x, weight and bias
through the backward op (first order).

causal_conv1d_update declares conv_state mutated (`mutates_args`) and returns only out;
on TPU the state is donated (its JaxKernel's donate_argnums), so the kernel writes it in
the caller's buffer (`_shim.tensors.write_back` copies it in on CPU). It has no gradient
(decode; the public function runs a step that needs one through causal_conv1d_forward).
"""

from __future__ import annotations

import torch

from . import _shim
from ._ops import add_op_namespace_prefix
from ._shim.tensors import absent, or_absent, write_back
from .tpu_kernels.chips import DEFAULT_CHIP

_jax_kernel = _shim.jax_kernels(__package__, add_op_namespace_prefix, cpu_chip=DEFAULT_CHIP)
_forward = _jax_kernel("causal_conv1d_forward", "causal_conv1d_forward")
_backward = _jax_kernel("causal_conv1d_backward", "causal_conv1d_backward")
# The conv state (tensor 1) is donated to the TPU program: see _jax_functions' docstring.
_update = _jax_kernel("causal_conv1d_update", "causal_conv1d_update", donate_argnums=(1,))


def _tensors(x, weight, bias, cu_seqlens, seq_idx, **more):
  return {"x": x, "weight": weight, "bias": or_absent(bias, x),
          "cu_seqlens": or_absent(cu_seqlens, x, torch.int32),
          "seq_idx": or_absent(seq_idx, x, torch.int32), **more}


# ----------------------------------------------------------------------------- backward op


def _backward_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, seq_idx: torch.Tensor | None,
                   grad_out: torch.Tensor, activation: str,
                   channels_last: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
  return tuple(_backward(_tensors(x, weight, bias, cu_seqlens, seq_idx, grad_out=grad_out),
                         activation=activation, channels_last=channels_last))


def _backward_fake(x, weight, bias, cu_seqlens, seq_idx, grad_out, activation, channels_last):
  return (torch.empty_like(x), torch.empty_like(weight),
          absent(x) if bias is None else torch.empty_like(bias))


causal_conv1d_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("causal_conv1d_backward"), _backward_impl,
    setup=lambda op: op.register_fake(_backward_fake))


# ----------------------------------------------------------------------------- forward op


def _forward_impl(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  cu_seqlens: torch.Tensor | None, seq_idx: torch.Tensor | None,
                  activation: str, channels_last: bool) -> torch.Tensor:
  return _forward(_tensors(x, weight, bias, cu_seqlens, seq_idx), activation=activation,
                  channels_last=channels_last)


def _forward_fake(x, weight, bias, cu_seqlens, seq_idx, activation, channels_last):
  return torch.empty_like(x)


def _setup_context(ctx, inputs, output):
  x, weight, bias, cu_seqlens, seq_idx, activation, channels_last = inputs
  ctx.save_for_backward(x, weight, bias, cu_seqlens, seq_idx)
  ctx.activation, ctx.channels_last = activation, channels_last


def _forward_backward(ctx, grad_out):
  x, weight, bias, cu_seqlens, seq_idx = ctx.saved_tensors
  dx, dweight, dbias = causal_conv1d_backward_op(x, weight, bias, cu_seqlens, seq_idx,
                                                 grad_out.contiguous(), ctx.activation,
                                                 ctx.channels_last)
  return dx, dweight, (None if bias is None else dbias), None, None, None, None


def _setup_forward(op):
  op.register_fake(_forward_fake)
  op.register_autograd(_forward_backward, setup_context=_setup_context)


causal_conv1d_forward_op = _shim.custom_op_once(
    add_op_namespace_prefix("causal_conv1d_forward"), _forward_impl, setup=_setup_forward)


# ----------------------------------------------------------------------------- update


def _update_impl(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None, activation: str) -> torch.Tensor:
  out, new_state = _update({"x": x, "conv_state": conv_state, "weight": weight,
                            "bias": or_absent(bias, x)}, activation=activation)
  write_back(conv_state, new_state)
  return out


def _update_fake(x, conv_state, weight, bias, activation):
  return torch.empty_like(x)


causal_conv1d_update_op = _shim.custom_op_once(
    add_op_namespace_prefix("causal_conv1d_update"), _update_impl, mutates_args=("conv_state",),
    setup=lambda op: op.register_fake(_update_fake))
