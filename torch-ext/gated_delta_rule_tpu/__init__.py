"""gated-delta-rule-tpu: the gated delta rule (Gated DeltaNet, the linear attention of
Qwen3.5 / Qwen3-Next / OLMo-Hybrid) as Pallas TPU kernels, for PyTorch tensors on TPU
(TorchTPU) or CPU.

    chunk_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                           output_final_state=False, use_qk_l2norm_in_kernel=False,
                           cu_seqlens=None, **kwargs) -> (o, final_state or None)
    fused_recurrent_gated_delta_rule(<the same>) -> (o, final_state or None)
    fused_recurrent_gated_delta_rule_(query, key, value, g, beta, state, *,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=None,
                                      scale=None) -> o          (state updated in place)
    layers.ChunkGatedDeltaRule, layers.FusedRecurrentGatedDeltaRule   (for kernelize)

The first two have the signatures, argument names and returns of Transformers' hub names
"chunk_gated_delta_rule" and "fused_recurrent_gated_delta_rule" (its
`torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule`): the chunked kernel
(chunks of 64, WY form) for prefill and training, the recurrent kernel for decode (a call
with more than 16 tokens per sequence runs the chunked kernel). Both are differentiable in
query, key, value, g, beta and initial_state. The state they return is a new tensor; the
caller's tensors are never written. `fused_recurrent_gated_delta_rule_` is decode for a
caller that owns its states: it reads `state` once and writes the new state into it
(donated on TPU: no copy).

Math, per value head h (reading key head h // (Hv / Hk)), token by token from the state S
[K, V] (zeros or the initial state), q and k first l2-normalised if asked, q scaled by
`scale` (K^-0.5 by default):

    S <- exp(g_t) S;  delta = beta_t (v_t - S^T k_t);  S <- S + k_t delta^T;  o_t = S^T q_t

Shapes and dtypes: query, key [B, T, Hk, K] and value [B, T, Hv, V], float32 or bfloat16
(one dtype), Hv a multiple of Hk; g [B, T, Hv] float32 (the log-decay, <= 0); beta
[B, T, Hv] float32 or q's dtype; states [B, Hv, K, V] float32 ([N, Hv, K, V] with
cu_seqlens: N packed sequences in a batch of 1, each with its own state). Any T, K, V
(padded to 128 lanes inside). o is [B, T, Hv, V] in q's dtype. Everything inside is
float32. float16, float64 and int64 inputs are refused, never cast.

On "tpu" tensors the compiled kernels run through TorchTPU; on "cpu" tensors the same
kernels run in Pallas interpret mode (slow; for development and tests), and cu_seqlens is
checked (0 .. T, non-decreasing) first. jax must be installed.
"""

from __future__ import annotations

import torch

from . import _shim, layers
from ._custom_ops import (chunk_gated_delta_rule_op, fused_recurrent_gated_delta_rule_in_place_op,
                          fused_recurrent_gated_delta_rule_op)
from ._shim import validation
from ._shim.validation import check_int32, check_ndim, check_shape

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule",
           "fused_recurrent_gated_delta_rule_", "layers"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
# fla's keyword arguments that change the computation and that these kernels do not have:
# refused when set, never ignored.
_UNSUPPORTED_OPTIONS = ("head_first", "reverse", "gk", "gv", "ssm_state_indices",
                        "num_accepted_tokens", "inplace_final_state")


def _check(op: str, query, key, value, g, beta, initial_state, cu_seqlens, scale) -> float:
  """Validates the arguments (clear errors, nothing cast); returns the scale."""
  for name, t in (("query", query), ("key", key), ("value", value)):
    validation.check_tensor(op, name, t)
    check_ndim(op, name, t, 4, "[batch, seq, heads, head_dim]")
  validation.check_float_dtype(op, "query", query, COMPUTE_DTYPES)
  validation.check_same_dtype(op, "key", key, "query", query)
  validation.check_same_dtype(op, "value", value, "query", query)
  check_shape(op, "key", key, tuple(query.shape), "the shape of query")
  batch, seq, num_k_heads, k_dim = query.shape
  if tuple(value.shape[:2]) != (batch, seq):
    raise ValueError(f"{op}: value must be [batch, seq, value_heads, head_dim] with query's "
                     f"batch and seq {(batch, seq)}, got {tuple(value.shape)}")
  num_v_heads, v_dim = value.shape[2:]
  if min(num_k_heads, k_dim, num_v_heads, v_dim) == 0:
    raise ValueError(f"{op}: heads and head dims must be positive, got query "
                     f"{tuple(query.shape)} and value {tuple(value.shape)}")
  if num_v_heads % num_k_heads:
    raise ValueError(f"{op}: the value heads ({num_v_heads}) must be a multiple of the key "
                     f"heads ({num_k_heads})")
  validation.check_tensor(op, "g", g)
  check_shape(op, "g", g, (batch, seq, num_v_heads), "[batch, seq, value_heads]")
  validation.check_float_dtype(op, "g", g, (torch.float32,))
  validation.check_tensor(op, "beta", beta)
  check_shape(op, "beta", beta, (batch, seq, num_v_heads), "[batch, seq, value_heads]")
  validation.check_float_dtype(op, "beta", beta, (torch.float32, query.dtype))
  num_states = batch
  if cu_seqlens is not None:
    check_int32(op, "cu_seqlens", cu_seqlens)
    check_ndim(op, "cu_seqlens", cu_seqlens, 1, "[num_seqs + 1]")
    if cu_seqlens.shape[0] < 2:
      raise ValueError(f"{op}: cu_seqlens must hold num_seqs + 1 >= 2 offsets, got "
                       f"{tuple(cu_seqlens.shape)}")
    if batch != 1:
      raise ValueError(f"{op}: packed sequences (cu_seqlens) need batch 1, got batch {batch}")
    num_states = cu_seqlens.shape[0] - 1
    if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
      cu = cu_seqlens.tolist()
      if cu[0] != 0 or cu[-1] != seq or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{op}: cu_seqlens must rise from 0 to the sequence length {seq}, "
                         f"got {cu}")
  if initial_state is not None:
    validation.check_tensor(op, "initial_state", initial_state)
    check_shape(op, "initial_state", initial_state, (num_states, num_v_heads, k_dim, v_dim),
                "[batch or num_seqs, value_heads, K, V]")
    validation.check_float_dtype(op, "initial_state", initial_state, (torch.float32,))
  if scale is None:
    return float(k_dim) ** -0.5
  scale = validation.check_finite_number(op, "scale", scale)
  if scale <= 0:
    raise ValueError(f"{op}: scale must be positive, got {scale}")
  return scale


def _options(op: str, kwargs: dict) -> float | None:
  """The keyword arguments beyond the hub signature: `scale` (fla's; default K^-0.5),
  `chunk_size` (Transformers' torch chunked function; a positive int: the result does not
  depend on it, the kernel's chunk is 64), fla options these kernels lack (refused when
  set). Anything else is a model's pass-through keyword (use_cache, cu_seq_lens_k, ...),
  ignored as Transformers' own functions ignore it. Returns scale."""
  chunk_size = kwargs.get("chunk_size", 64)
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
    raise ValueError(f"{op}: chunk_size must be a positive int, got {chunk_size!r}")
  for name in _UNSUPPORTED_OPTIONS:
    value = kwargs.get(name)
    if value is not None and value is not False:
      raise NotImplementedError(f"{op}: {name}={value!r} is not supported by these kernels")
  return kwargs.get("scale")


def _zero_length(query, value, initial_state, cu_seqlens, output_final_state):
  """T = 0: nothing to compute; the final state is the initial one (or zeros), as
  Transformers' torch functions return it."""
  o = value.new_zeros(value.shape, dtype=query.dtype)
  if not output_final_state:
    return o, None
  if initial_state is not None:
    return o, initial_state
  num_states = query.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
  return o, query.new_zeros((num_states, value.shape[2], query.shape[3], value.shape[3]),
                            dtype=torch.float32)


def _call(op: str, fn, query, key, value, g, beta, initial_state, output_final_state,
          use_qk_l2norm_in_kernel, cu_seqlens, kwargs, *statics):
  scale = _check(op, query, key, value, g, beta, initial_state, cu_seqlens,
                 _options(op, kwargs))
  _shim.device_type_of(op, {"query": query, "key": key, "value": value, "g": g, "beta": beta,
                            "initial_state": initial_state, "cu_seqlens": cu_seqlens})
  if query.shape[1] == 0:
    return _zero_length(query, value, initial_state, cu_seqlens, output_final_state)
  o, final = fn(query.contiguous(), key.contiguous(), value.contiguous(), g.contiguous(),
                beta.contiguous(), None if initial_state is None else initial_state.contiguous(),
                cu_seqlens, scale, bool(use_qk_l2norm_in_kernel), bool(output_final_state),
                *statics)
  return o, (final if output_final_state else None)


def chunk_gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           g: torch.Tensor, beta: torch.Tensor,
                           initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False,
                           use_qk_l2norm_in_kernel: bool = False,
                           cu_seqlens: torch.Tensor | None = None, **kwargs
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
  """The gated delta rule by chunks of 64 tokens (prefill, training); module docstring.

  Args:
    query, key: [B, T, Hk, K]; value: [B, T, Hv, V]; float32 / bfloat16, one dtype.
    g: [B, T, Hv] float32 log-decay; beta: [B, T, Hv] float32 or query's dtype.
    initial_state: None (zeros) or [B, Hv, K, V] float32 ([N, Hv, K, V] with cu_seqlens).
    output_final_state: also return the final state(s).
    use_qk_l2norm_in_kernel: l2-normalise query and key first (eps 1e-6).
    cu_seqlens: None, or [N + 1] int32 offsets of N sequences packed in a batch of 1.
    kwargs: scale (default K^-0.5), chunk_size (validated, not used: the result does not
      depend on it); a model's other pass-through keywords are ignored.
  Returns:
    (o [B, T, Hv, V] in query's dtype, final state [B or N, Hv, K, V] float32 or None).
  """
  return _call("chunk_gated_delta_rule", chunk_gated_delta_rule_op, query, key, value, g,
               beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
               kwargs)


def fused_recurrent_gated_delta_rule(query: torch.Tensor, key: torch.Tensor,
                                     value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                                     initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False,
                                     use_qk_l2norm_in_kernel: bool = False,
                                     cu_seqlens: torch.Tensor | None = None, **kwargs
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
  """The gated delta rule token by token (decode): the arguments and result of
  `chunk_gated_delta_rule`, run by the recurrent kernel (one read and one write of the
  state per call; more than 16 tokens per sequence run the chunked kernel). The state
  returned is a new tensor: Transformers copies it into its cache. Differentiable."""
  # A packed call re-packs to [N, max_seqlen] tokens; the call's length bounds every
  # sequence's, statically (no read of cu_seqlens from the device).
  return _call("fused_recurrent_gated_delta_rule", fused_recurrent_gated_delta_rule_op, query,
               key, value, g, beta, initial_state, output_final_state,
               use_qk_l2norm_in_kernel, cu_seqlens, kwargs, int(query.shape[1]))


def fused_recurrent_gated_delta_rule_(query: torch.Tensor, key: torch.Tensor,
                                      value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                                      state: torch.Tensor, *,
                                      use_qk_l2norm_in_kernel: bool = False,
                                      cu_seqlens: torch.Tensor | None = None,
                                      scale: float | None = None) -> torch.Tensor:
  """Decode with the state updated in place: `state` [B or N, Hv, K, V] float32 (required)
  is read once and the new state written into it (on TPU the state is donated to the
  program, which writes into its buffer). Returns o [B, T, Hv, V] in query's dtype. No
  gradient: for serving loops that own their states (Transformers' cache copies the state
  the hub function returns instead)."""
  op = "fused_recurrent_gated_delta_rule_"
  if state is None:
    raise ValueError(f"{op}: state is required (the tensor updated in place)")
  scale = _check(op, query, key, value, g, beta, state, cu_seqlens, scale)
  _shim.device_type_of(op, {"query": query, "key": key, "value": value, "g": g, "beta": beta,
                            "state": state, "cu_seqlens": cu_seqlens})
  if not state.is_contiguous():
    raise ValueError(f"{op}: state must be contiguous (it is written in place)")
  if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value, g, beta,
                                                               state)):
    raise RuntimeError(f"{op}: the in-place decode has no gradient; use "
                       f"fused_recurrent_gated_delta_rule (a new state, differentiable) or "
                       f"run under torch.no_grad()")
  if query.shape[1] == 0:
    return value.new_zeros(value.shape, dtype=query.dtype)
  return fused_recurrent_gated_delta_rule_in_place_op(
      query.contiguous(), key.contiguous(), value.contiguous(), g.contiguous(),
      beta.contiguous(), state, cu_seqlens, scale, bool(use_qk_l2norm_in_kernel),
      int(query.shape[1]))
