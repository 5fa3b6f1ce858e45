"""The typed JAX entry points behind the torch ops (imported on first use: it imports jax).

Each is fully annotated, as TorchTPU's `jax_op` requires: jax.Array for tensors,
plain Python types for static values. `chip` and `interpret` are filled in by the
shim (the host's TPU generation on TPU; interpret mode on CPU).
"""

from __future__ import annotations

import jax

from .tpu_kernels import rms_norm as kernel


def _config(eps: float, offset: float, chip: str, interpret: bool) -> kernel.RmsNormConfig:
  return kernel.RmsNormConfig(eps=eps, offset=offset, chip=chip, interpret=interpret)


def rms_norm_forward(x: jax.Array, weight: jax.Array, eps: float, offset: float,
                     chip: str, interpret: bool) -> jax.Array:
  return kernel.rms_norm_forward(x, weight, config=_config(eps, offset, chip, interpret))


def fused_add_rms_norm_forward(x: jax.Array, residual: jax.Array, weight: jax.Array,
                               eps: float, offset: float, chip: str,
                               interpret: bool) -> tuple[jax.Array, jax.Array]:
  return kernel.rms_norm_forward(x, weight, residual,
                                 config=_config(eps, offset, chip, interpret))


def rms_norm_backward(x: jax.Array, weight: jax.Array, grad_out: jax.Array, eps: float,
                      offset: float, chip: str,
                      interpret: bool) -> tuple[jax.Array, jax.Array]:
  return kernel.rms_norm_backward(x, weight, grad_out,
                                  config=_config(eps, offset, chip, interpret))


def fused_add_rms_norm_backward(residual_out: jax.Array, weight: jax.Array,
                                grad_out: jax.Array, grad_residual: jax.Array, eps: float,
                                offset: float, chip: str,
                                interpret: bool) -> tuple[jax.Array, jax.Array]:
  return kernel.rms_norm_backward(residual_out, weight, grad_out, grad_residual,
                                  config=_config(eps, offset, chip, interpret))


def _gated_config(eps: float, activation: str, norm_in_input_dtype: bool, chip: str,
                  interpret: bool) -> kernel.RmsNormGatedConfig:
  return kernel.RmsNormGatedConfig(eps=eps, activation=activation,
                                   norm_in_input_dtype=norm_in_input_dtype, chip=chip,
                                   interpret=interpret)


def rms_norm_gated_forward(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float,
                           activation: str, norm_in_input_dtype: bool, chip: str,
                           interpret: bool) -> jax.Array:
  return kernel.rms_norm_gated_forward(
      x, gate, weight,
      config=_gated_config(eps, activation, norm_in_input_dtype, chip, interpret))


def rms_norm_gated_backward(x: jax.Array, gate: jax.Array, weight: jax.Array,
                            grad_out: jax.Array, eps: float, activation: str,
                            norm_in_input_dtype: bool, chip: str,
                            interpret: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
  return kernel.rms_norm_gated_backward(
      x, gate, weight, grad_out,
      config=_gated_config(eps, activation, norm_in_input_dtype, chip, interpret))
