"""The torch custom ops of gated-delta-rule-tpu: schema, fake (shape) functions, autograd.

Ops, in the namespace of this build (`_ops.NAMESPACE`, unique per kernel and version):

  chunk_gated_delta_rule(query, key, value, g, beta, initial_state?, cu_seqlens?, scale,
                         use_qk_l2norm_in_kernel, output_final_state) -> (o, final_state)
  fused_recurrent_gated_delta_rule(<the same>, max_seqlen) -> (o, final_state)
  chunk_gated_delta_rule_backward(query, key, value, g, beta, initial_state?, cu_seqlens?,
                                  grad_out, grad_final_state?, scale,
                                  use_qk_l2norm_in_kernel)
      -> (dq, dk, dv, dg, dbeta, d_initial_state)
  fused_recurrent_gated_delta_rule_in_place(query, key, value, g, beta, state!,
                                            cu_seqlens?, scale, use_qk_l2norm_in_kernel,
                                            max_seqlen) -> o

Shapes: query, key [B, T, Hk, K]; value, o [B, T, Hv, V]; g, beta [B, T, Hv]; states
[N, Hv, K, V] float32 (N = B, or the number of packed sequences). final_state is a (0,)
float32 placeholder unless output_final_state; d_initial_state one unless an initial state
was given. The two forward ops are differentiable through the backward op (the recurrent
kernel's gradient is the chunked backward on the same inputs; first order only).

The in-place op declares `state` mutated (`mutates_args`) and returns only o; on TPU the
state is donated (its JaxKernel's donate_argnums), so the decode kernel writes the new
state into the caller's buffer (`_shim.tensors.write_back` copies it in on CPU, where
nothing is donated). It has no gradient (decode).
"""

from __future__ import annotations

import torch

from . import _shim
from ._ops import add_op_namespace_prefix
from ._shim.tensors import absent, is_absent, or_absent, write_back
from .tpu_kernels.chips import DEFAULT_CHIP

_jax_kernel = _shim.jax_kernels(__package__, add_op_namespace_prefix, cpu_chip=DEFAULT_CHIP)
_chunk = _jax_kernel("chunk_gated_delta_rule", "chunk_gated_delta_rule")
_recurrent = _jax_kernel("fused_recurrent_gated_delta_rule", "fused_recurrent_gated_delta_rule")
_backward = _jax_kernel("chunk_gated_delta_rule_backward", "chunk_gated_delta_rule_backward")
# The state (tensor 5) is donated to the TPU program: see _jax_functions' docstring.
_in_place = _jax_kernel("fused_recurrent_gated_delta_rule_in_place",
                        "fused_recurrent_gated_delta_rule_in_place", donate_argnums=(5,))


def _tensors(query, key, value, g, beta, initial_state, cu_seqlens, **more):
  return {"query": query, "key": key, "value": value, "g": g, "beta": beta,
          "initial_state": or_absent(initial_state, query),
          "cu_seqlens": or_absent(cu_seqlens, query, torch.int32), **more}


def _num_states(query, cu_seqlens) -> int:
  return query.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def _forward_fake(query, key, value, g, beta, initial_state, cu_seqlens, scale,
                  use_qk_l2norm_in_kernel, output_final_state, *rest):
  o = value.new_empty(value.shape, dtype=query.dtype)
  if not output_final_state:
    return o, absent(query)
  states = (_num_states(query, cu_seqlens), value.shape[2], query.shape[3], value.shape[3])
  return o, query.new_empty(states, dtype=torch.float32)


# ----------------------------------------------------------------------------- backward op


def _backward_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
                   cu_seqlens: torch.Tensor | None, grad_out: torch.Tensor,
                   grad_final_state: torch.Tensor | None, scale: float,
                   use_qk_l2norm_in_kernel: bool) -> tuple[torch.Tensor, torch.Tensor,
                                                           torch.Tensor, torch.Tensor,
                                                           torch.Tensor, torch.Tensor]:
  tensors = _tensors(query, key, value, g, beta, initial_state, cu_seqlens, grad_out=grad_out,
                     grad_final_state=or_absent(grad_final_state, query))
  return tuple(_backward(tensors, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel))


def _backward_fake(query, key, value, g, beta, initial_state, cu_seqlens, grad_out,
                   grad_final_state, scale, use_qk_l2norm_in_kernel):
  d_state = absent(query) if initial_state is None else torch.empty_like(initial_state)
  return (torch.empty_like(query), torch.empty_like(key), torch.empty_like(value),
          torch.empty_like(g), torch.empty_like(beta), d_state)


chunk_gated_delta_rule_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("chunk_gated_delta_rule_backward"), _backward_impl,
    setup=lambda op: op.register_fake(_backward_fake))


# ----------------------------------------------------------------------------- forward ops


def _chunk_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor | None,
                cu_seqlens: torch.Tensor | None, scale: float, use_qk_l2norm_in_kernel: bool,
                output_final_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
  return tuple(_chunk(_tensors(query, key, value, g, beta, initial_state, cu_seqlens),
                      scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      output_final_state=output_final_state))


def _recurrent_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
                    cu_seqlens: torch.Tensor | None, scale: float,
                    use_qk_l2norm_in_kernel: bool, output_final_state: bool,
                    max_seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
  return tuple(_recurrent(_tensors(query, key, value, g, beta, initial_state, cu_seqlens),
                          scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          output_final_state=output_final_state, max_seqlen=max_seqlen))


def _setup_context(ctx, inputs, output):
  query, key, value, g, beta, initial_state, cu_seqlens, scale, l2norm = inputs[:9]
  ctx.save_for_backward(query, key, value, g, beta, initial_state, cu_seqlens)
  ctx.scale, ctx.l2norm = scale, l2norm


def _forward_backward(ctx, grad_out, grad_final_state):
  query, key, value, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
  if grad_out is None:   # only the final state was used downstream
    grad_out = torch.zeros_like(value, dtype=query.dtype)
  if grad_final_state is not None and is_absent(grad_final_state):
    grad_final_state = None   # the (0,) placeholder of a final state not asked for
  grads = chunk_gated_delta_rule_backward_op(
      query, key, value, g, beta, initial_state, cu_seqlens, grad_out.contiguous(),
      None if grad_final_state is None else grad_final_state.contiguous(), ctx.scale,
      ctx.l2norm)
  d_state = None if initial_state is None else grads[5]
  none_for_statics = (None,) * (len(ctx.needs_input_grad) - 7)
  return (*grads[:5], d_state, None, *none_for_statics)


def _setup(op):
  op.register_fake(_forward_fake)
  op.register_autograd(_forward_backward, setup_context=_setup_context)


chunk_gated_delta_rule_op = _shim.custom_op_once(
    add_op_namespace_prefix("chunk_gated_delta_rule"), _chunk_impl, setup=_setup)
fused_recurrent_gated_delta_rule_op = _shim.custom_op_once(
    add_op_namespace_prefix("fused_recurrent_gated_delta_rule"), _recurrent_impl,
    setup=_setup)


# ----------------------------------------------------------------------------- in place


def _in_place_impl(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                   cu_seqlens: torch.Tensor | None, scale: float,
                   use_qk_l2norm_in_kernel: bool, max_seqlen: int) -> torch.Tensor:
  tensors = {"query": query, "key": key, "value": value, "g": g, "beta": beta, "state": state,
             "cu_seqlens": or_absent(cu_seqlens, query, torch.int32)}
  o, new_state = _in_place(tensors, scale=scale,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                           max_seqlen=max_seqlen)
  write_back(state, new_state)
  return o


def _in_place_fake(query, key, value, g, beta, state, cu_seqlens, scale,
                   use_qk_l2norm_in_kernel, max_seqlen):
  return value.new_empty(value.shape, dtype=query.dtype)


fused_recurrent_gated_delta_rule_in_place_op = _shim.custom_op_once(
    add_op_namespace_prefix("fused_recurrent_gated_delta_rule_in_place"), _in_place_impl,
    mutates_args=("state",), setup=lambda op: op.register_fake(_in_place_fake))
