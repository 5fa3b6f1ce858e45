"""The torch custom ops of flash-attention-tpu: schema, fake (shape) functions and autograd.

Ops, in the namespace of this build (`_ops.NAMESPACE`, unique per kernel and version):

  flash_attention(q, k, v, sinks?, q_segment_ids?, kv_segment_ids?, q_offset,
                  causal, sm_scale, sliding_window, soft_cap, zero_offset)
      -> (out [B, Hq, Sq, D], lse [B, Hq, Sq] float32)
  flash_attention_backward(q, k, v, sinks?, q_segment_ids?, kv_segment_ids?, q_offset,
                           grad_out, grad_lse?, <statics>) -> (dq, dk, dv, dsinks)

Absent optional tensors travel to JAX as empty (0,) tensors; dsinks comes back (0,)
without sinks and reaches autograd as None. q_offset is a (1,) int32 tensor, a runtime
value of the kernel: one compiled kernel serves every offset. zero_offset (static) says
the caller passed the int 0: then the kernel may take its folded causal grid (causal
self-attention prefill; flash_attention._fold_causal), a second compile at most.
sliding_window 0 and soft_cap 0.0 mean "none".
The forward op is differentiable (first order) in q, k, v and sinks, through out and lse;
the backward JAX function recomputes the forward under jax.vjp, so the Pallas backward
kernels run. An unused lse passes no cotangent (grad_lse None).
"""

from __future__ import annotations

import torch

from . import _shim
from ._ops import add_op_namespace_prefix
from .tpu_kernels.chips import DEFAULT_CHIP

_jax_kernel = _shim.jax_kernels(__package__, add_op_namespace_prefix, cpu_chip=DEFAULT_CHIP)
_forward = _jax_kernel("flash_attention", "flash_attention_forward")
_backward = _jax_kernel("flash_attention_backward", "flash_attention_backward")


def _empty(like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
  """An empty (0,) tensor: how an absent tensor travels to and from JAX."""
  return like.new_empty((0,), dtype=dtype)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
  return _empty(like, dtype) if t is None else t


def _tensors(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset) -> dict:
  return {"q": q, "k": k, "v": v, "sinks": _or_empty(sinks, q),
          "q_segment_ids": _or_empty(q_segment_ids, q, torch.int32),
          "kv_segment_ids": _or_empty(kv_segment_ids, q, torch.int32), "q_offset": q_offset}


def _statics(causal, sm_scale, sliding_window, soft_cap, zero_offset) -> dict:
  return dict(causal=causal, sm_scale=sm_scale, sliding_window=sliding_window,
              soft_cap=soft_cap, zero_offset=zero_offset)


def _backward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   sinks: torch.Tensor | None, q_segment_ids: torch.Tensor | None,
                   kv_segment_ids: torch.Tensor | None, q_offset: torch.Tensor,
                   grad_out: torch.Tensor, grad_lse: torch.Tensor | None, causal: bool,
                   sm_scale: float, sliding_window: int, soft_cap: float, zero_offset: bool
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
  tensors = _tensors(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset)
  tensors["grad_out"] = grad_out
  tensors["grad_lse"] = _or_empty(grad_lse, q)
  dq, dk, dv, dsinks = _backward(tensors, **_statics(causal, sm_scale, sliding_window,
                                                     soft_cap, zero_offset))
  return dq, dk, dv, dsinks


def _backward_fake(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset, grad_out,
                   grad_lse, *statics):
  dsinks = _empty(q) if sinks is None else torch.empty_like(sinks)
  return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dsinks


flash_attention_backward_op = _shim.custom_op_once(
    add_op_namespace_prefix("flash_attention_backward"), _backward_impl,
    setup=lambda op: op.register_fake(_backward_fake))


def _forward_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  sinks: torch.Tensor | None, q_segment_ids: torch.Tensor | None,
                  kv_segment_ids: torch.Tensor | None, q_offset: torch.Tensor, causal: bool,
                  sm_scale: float, sliding_window: int, soft_cap: float, zero_offset: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
  tensors = _tensors(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset)
  out, lse = _forward(tensors, **_statics(causal, sm_scale, sliding_window, soft_cap,
                                          zero_offset))
  return out, lse


def _forward_fake(q, k, v, *rest):
  return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


def _setup_context(ctx, inputs, output):
  q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset, *statics = inputs
  ctx.save_for_backward(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset)
  ctx.statics = statics
  # An unused output (usually lse) then reaches the backward as None, not as zeros: the
  # backward skips its cotangent instead of differentiating through it.
  ctx.set_materialize_grads(False)


def _autograd(ctx, grad_out, grad_lse):
  q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset = ctx.saved_tensors
  if grad_out is None:
    grad_out = torch.zeros_like(q)
  dq, dk, dv, dsinks = flash_attention_backward_op(
      q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset, grad_out.contiguous(),
      None if grad_lse is None else grad_lse.contiguous(), *ctx.statics)
  return (dq, dk, dv, None if sinks is None else dsinks, None, None, None, None, None, None,
          None, None)


def _setup(op):
  op.register_fake(_forward_fake)
  op.register_autograd(_autograd, setup_context=_setup_context)


flash_attention_op = _shim.custom_op_once(add_op_namespace_prefix("flash_attention"),
                                          _forward_impl, setup=_setup)
