"""The typed JAX entry points behind the torch ops (imported on first use: it imports jax).

Each is fully annotated, as TorchTPU's `jax_op` requires: jax.Array for tensors, plain
Python types for statics; `chip` and `interpret` are filled in by the shim. Absent
optional tensors (initial_state, cu_seqlens, grad_final_state) and outputs not asked for
(the final state without output_final_state, the initial state's gradient without an
initial state) travel as (0,) float32 arrays (`_shim.tensors`).

The backward is JAX's VJP of the kernel's chunked function, whose custom VJP is the
Pallas backward (the states kernel, then the reverse kernel); the forward kernel that
jax.vjp traces is dead in the backward's program and XLA drops it (the AOT test of the
training program finds only the two backward kernels). The recurrent (decode) kernel's
VJP is the same chunked backward on the same inputs, so one backward serves both ops.

In-place decode: `fused_recurrent_gated_delta_rule_in_place`'s TPU op is built with
`donate_argnums=(5,)` (the state; see _custom_ops): the decode kernel aliases its state
input to its state output (`input_output_aliases`), so the exported program writes the
new state into the state's own buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._shim.tensors import present
from .tpu_kernels import gated_delta_rule as kernel


def _placeholder() -> jax.Array:
  return jnp.zeros((0,), jnp.float32)


def chunk_gated_delta_rule(query: jax.Array, key: jax.Array, value: jax.Array, g: jax.Array,
                           beta: jax.Array, initial_state: jax.Array, cu_seqlens: jax.Array,
                           scale: float, use_qk_l2norm_in_kernel: bool,
                           output_final_state: bool, chip: str,
                           interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(o [B, T, Hv, V] in q's dtype, final state [N, Hv, K, V] float32 or a placeholder)."""
  o, final = kernel.chunk_gated_delta_rule(
      query, key, value, g, beta, initial_state=present(initial_state),
      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
      cu_seqlens=present(cu_seqlens), scale=scale, chip=chip, interpret=interpret)
  return o, (final if output_final_state else _placeholder())


def chunk_gated_delta_rule_backward(
    query: jax.Array, key: jax.Array, value: jax.Array, g: jax.Array, beta: jax.Array,
    initial_state: jax.Array, cu_seqlens: jax.Array, grad_out: jax.Array,
    grad_final_state: jax.Array, scale: float, use_qk_l2norm_in_kernel: bool, chip: str,
    interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv, dg, dbeta, d initial_state or a placeholder) of
  sum(grad_out * o) + sum(grad_final_state * final), in the inputs' dtypes."""
  h0, dht = present(initial_state), present(grad_final_state)

  def forward(q, k, v, g_, b, *h0s):
    o, final = kernel.chunk_gated_delta_rule(
        q, k, v, g_, b, initial_state=h0s[0] if h0s else None,
        output_final_state=dht is not None, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=present(cu_seqlens), scale=scale, chip=chip, interpret=interpret)
    return o if dht is None else (o, final)

  primals = (query, key, value, g, beta) + (() if h0 is None else (h0,))
  _, vjp = jax.vjp(forward, *primals)
  grads = vjp(grad_out if dht is None else (grad_out, dht))
  return (*grads[:5], _placeholder() if h0 is None else grads[5])


def fused_recurrent_gated_delta_rule(query: jax.Array, key: jax.Array, value: jax.Array,
                                     g: jax.Array, beta: jax.Array, initial_state: jax.Array,
                                     cu_seqlens: jax.Array, scale: float,
                                     use_qk_l2norm_in_kernel: bool, output_final_state: bool,
                                     max_seqlen: int, chip: str,
                                     interpret: bool) -> tuple[jax.Array, jax.Array]:
  """The decode kernel: as chunk_gated_delta_rule (max_seqlen bounds a packed sequence's
  length; unused without cu_seqlens)."""
  cu = present(cu_seqlens)
  o, final = kernel.fused_recurrent_gated_delta_rule(
      query, key, value, g, beta, initial_state=present(initial_state),
      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
      cu_seqlens=cu, max_seqlen=None if cu is None else max_seqlen, scale=scale, chip=chip,
      interpret=interpret)
  return o, (final if output_final_state else _placeholder())


def fused_recurrent_gated_delta_rule_in_place(
    query: jax.Array, key: jax.Array, value: jax.Array, g: jax.Array, beta: jax.Array,
    state: jax.Array, cu_seqlens: jax.Array, scale: float, use_qk_l2norm_in_kernel: bool,
    max_seqlen: int, chip: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(o, the new state): the decode kernel from `state`, whose buffer (donated on TPU) the
  new state is written into."""
  cu = present(cu_seqlens)
  return kernel.fused_recurrent_gated_delta_rule(
      query, key, value, g, beta, initial_state=state, output_final_state=True,
      use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu,
      max_seqlen=None if cu is None else max_seqlen, scale=scale, chip=chip,
      interpret=interpret)
