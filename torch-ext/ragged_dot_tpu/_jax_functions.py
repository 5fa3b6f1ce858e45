"""The typed JAX entry points behind the torch ops (imported on first use: it imports jax).

Each is fully annotated, as TorchTPU's `jax_op` requires: jax.Array for tensors,
plain Python types for static values. `chip` and `interpret` are filled in by the
shim (the host's TPU generation on TPU; interpret mode on CPU).

Optional tensors (scales, biases) travel as arrays of shape (0,) when absent: a
jax_op signature is fixed, and a (0,) array is free. Gradients that do not exist
(quantized weights, absent biases) come back as (0,) arrays too.
Backward functions recompute the forward under jax.vjp, so the kernel's own Pallas
backward (its custom_vjp) runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tpu_kernels import moe
from .tpu_kernels import ragged_dot as kernel



def _opt(a: jax.Array):
  return None if a.ndim == 1 and a.shape[0] == 0 else a


def _none_array() -> jax.Array:
  return jnp.zeros((0,), jnp.float32)


def _is_quantized(w: jax.Array) -> bool:
  return w.dtype in kernel.QUANTIZED_DTYPES


def _activation(name: str):
  return None if name == "identity" else name


def _out_dtype(name: str):
  return None if not name else jnp.dtype(name)


# ------------------------------------------------------------------------------ ragged_dot


def _ragged_dot(lhs, rhs, bias, group_sizes, rhs_scale, group_offset, transpose_rhs,
                activation, out_dtype, chip, interpret, lhs_quant=""):
  return kernel.ragged_dot(lhs, rhs, group_sizes, group_offset=group_offset,
                           transpose_rhs=transpose_rhs, rhs_scale=rhs_scale, bias=bias,
                           activation=_activation(activation), out_dtype=_out_dtype(out_dtype),
                           chip=chip, interpret=interpret, lhs_quant=lhs_quant or None)


def ragged_dot_forward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                       rhs_scale: jax.Array, bias: jax.Array, group_offset: int,
                       transpose_rhs: bool, activation: str, out_dtype: str, lhs_quant: str,
                       chip: str, interpret: bool) -> jax.Array:
  """lhs_quant: "" or "int8" (forward only: ragged_dot_backward runs without it, and the
  torch op refuses a gradient with it)."""
  return _ragged_dot(lhs, rhs, _opt(bias), group_sizes, _opt(rhs_scale), group_offset,
                     transpose_rhs, activation, out_dtype, chip, interpret, lhs_quant)


def ragged_dot_backward(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                        rhs_scale: jax.Array, bias: jax.Array, grad_out: jax.Array,
                        group_offset: int, transpose_rhs: bool, activation: str,
                        out_dtype: str, chip: str,
                        interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(d_lhs, d_rhs, d_bias); d_rhs is (0,) for quantized rhs, d_bias (0,) without a bias."""
  scale, b = _opt(rhs_scale), _opt(bias)
  train_rhs = not _is_quantized(rhs)

  def f(lhs_, rhs_, b_):
    return _ragged_dot(lhs_, rhs_ if train_rhs else rhs, b_ if b is not None else None,
                       group_sizes, scale, group_offset, transpose_rhs, activation, out_dtype,
                       chip, interpret)

  primals = (lhs, rhs if train_rhs else _none_array(), b if b is not None else _none_array())
  _, vjp = jax.vjp(f, *primals)
  d_lhs, d_rhs, d_bias = vjp(grad_out.astype(_out_dtype(out_dtype) or lhs.dtype))
  return d_lhs, d_rhs, d_bias


# ------------------------------------------------------------------------------- experts


def _experts(hidden, top_k_index, top_k_weights, gate_up, down, gate_up_bias, down_bias,
             gate_up_scale, down_scale, num_experts, has_gate, is_transposed, is_concatenated,
             activation, alpha, limit, lhs_quant, chip, interpret):
  return moe.moe_experts(hidden, top_k_index, top_k_weights, gate_up, down,
                         gate_up_bias=gate_up_bias, down_bias=down_bias,
                         gate_up_scale=gate_up_scale, down_scale=down_scale,
                         num_experts=num_experts, has_gate=has_gate,
                         is_transposed=is_transposed, is_concatenated=is_concatenated,
                         activation=activation, alpha=alpha, limit=limit, chip=chip,
                         interpret=interpret, lhs_quant=lhs_quant or None)


def experts_forward(hidden: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array,
                    gate_up: jax.Array, down: jax.Array, gate_up_bias: jax.Array,
                    down_bias: jax.Array, gate_up_scale: jax.Array, down_scale: jax.Array,
                    num_experts: int, has_gate: bool, is_transposed: bool,
                    is_concatenated: bool, activation: str, alpha: float, limit: float,
                    lhs_quant: str, chip: str, interpret: bool) -> jax.Array:
  """lhs_quant: "" or "int8" (moe_experts' lhs_quant; forward only: experts_backward
  runs without it, and the torch op refuses a gradient with it)."""
  return _experts(hidden, top_k_index, top_k_weights, gate_up, down, _opt(gate_up_bias),
                  _opt(down_bias), _opt(gate_up_scale), _opt(down_scale), num_experts,
                  has_gate, is_transposed, is_concatenated, activation, alpha, limit,
                  lhs_quant, chip, interpret)


def experts_backward(hidden: jax.Array, top_k_index: jax.Array, top_k_weights: jax.Array,
                     gate_up: jax.Array, down: jax.Array, gate_up_bias: jax.Array,
                     down_bias: jax.Array, gate_up_scale: jax.Array, down_scale: jax.Array,
                     grad_out: jax.Array, num_experts: int, has_gate: bool,
                     is_transposed: bool, is_concatenated: bool, activation: str, alpha: float,
                     limit: float, chip: str, interpret: bool
                     ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array,
                                jax.Array]:
  """(d_hidden, d_top_k_weights, d_gate_up, d_down, d_gate_up_bias, d_down_bias).

  Weight gradients are (0,) for quantized (frozen) weights, bias gradients (0,) without
  biases.
  """
  present = {
      "gate_up": not _is_quantized(gate_up), "down": not _is_quantized(down),
      "gate_up_bias": _opt(gate_up_bias) is not None, "down_bias": _opt(down_bias) is not None,
  }
  fixed = {"gate_up": gate_up, "down": down, "gate_up_bias": None, "down_bias": None}
  given = {"gate_up": gate_up, "down": down, "gate_up_bias": gate_up_bias,
           "down_bias": down_bias}
  names = tuple(present)

  def f(hidden_, weights_, *trainable):
    p = {n: (t if present[n] else fixed[n]) for n, t in zip(names, trainable)}
    return _experts(hidden_, top_k_index, weights_, p["gate_up"], p["down"], p["gate_up_bias"],
                    p["down_bias"], _opt(gate_up_scale), _opt(down_scale), num_experts,
                    has_gate, is_transposed, is_concatenated, activation, alpha, limit, "",
                    chip, interpret)

  primals = [given[n] if present[n] else _none_array() for n in names]
  _, vjp = jax.vjp(f, hidden, top_k_weights, *primals)
  return tuple(vjp(grad_out.astype(hidden.dtype)))
