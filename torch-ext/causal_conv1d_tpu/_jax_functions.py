"""The typed JAX entry points behind the torch ops (imported on first use: it imports jax).

Each is fully annotated, as TorchTPU's `jax_op` requires: jax.Array for tensors, plain
Python types for statics; `chip` and `interpret` are filled in by the shim. Absent
optional tensors (bias, cu_seqlens, seq_idx) and gradients not asked for (of an absent
bias) travel as (0,) float32 arrays (`_shim.tensors`); `activation` "" is none.

x is [B, D, T] (Transformers' layout) or, with channels_last, the [B, T, D] tensor whose
transposed view Transformers hands over (its projection's own memory: no transpose in
XLA). The backward is JAX's VJP of the kernel's function (its custom VJP: the Pallas
backward kernel).

In-place decode: `causal_conv1d_update`'s TPU op is built with `donate_argnums=(1,)` (the
conv state; see _custom_ops): the kernel aliases its state input to its state output
(`input_output_aliases`), so the exported program writes the new state into the state's
own buffer.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._shim.tensors import present
from .tpu_kernels import causal_conv1d as kernel


def _fn(x, weight, bias, cu_seqlens, seq_idx, activation, channels_last, chip, interpret):
  return kernel.causal_conv1d_fn(x, weight, bias, activation or None,
                                 cu_seqlens=present(cu_seqlens), seq_idx=present(seq_idx),
                                 channels_last=channels_last, chip=chip, interpret=interpret)


def causal_conv1d_forward(x: jax.Array, weight: jax.Array, bias: jax.Array,
                          cu_seqlens: jax.Array, seq_idx: jax.Array, activation: str,
                          channels_last: bool, chip: str, interpret: bool) -> jax.Array:
  """out, x's shape and dtype."""
  return _fn(x, weight, present(bias), cu_seqlens, seq_idx, activation, channels_last, chip,
             interpret)


def causal_conv1d_backward(x: jax.Array, weight: jax.Array, bias: jax.Array,
                           cu_seqlens: jax.Array, seq_idx: jax.Array, grad_out: jax.Array,
                           activation: str, channels_last: bool, chip: str,
                           interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(dx, dweight, dbias or a placeholder) of sum(grad_out * out)."""
  b = present(bias)

  def forward(x_, w, *bs):
    return _fn(x_, w, bs[0] if bs else None, cu_seqlens, seq_idx, activation, channels_last,
               chip, interpret)

  _, vjp = jax.vjp(forward, x, weight, *(() if b is None else (b,)))
  grads = vjp(grad_out)
  return grads[0], grads[1], (jnp.zeros((0,), jnp.float32) if b is None else grads[2])


def causal_conv1d_update(x: jax.Array, conv_state: jax.Array, weight: jax.Array,
                         bias: jax.Array, activation: str, chip: str,
                         interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(out in x's shape and dtype, the new conv state), the state aliased in the kernel."""
  return kernel.causal_conv1d_update(x, conv_state, weight, present(bias), activation or None,
                                     chip=chip, interpret=interpret)
