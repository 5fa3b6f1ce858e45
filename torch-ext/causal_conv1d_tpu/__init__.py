"""causal-conv1d-tpu: the causal depthwise conv1d of Mamba and Gated DeltaNet layers as
Pallas TPU kernels, for PyTorch tensors on TPU (TorchTPU) or CPU.

    causal_conv1d_fn(x, weight, bias=None, activation=None, **kwargs) -> out
    causal_conv1d_update(x, conv_state, weight, bias=None, activation=None) -> out
                                                   (conv_state updated in place)
    causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation=None,
                          state_idx=0, **kwargs) -> out
    layers.CausalConv1dFn, layers.CausalConv1dUpdate, layers.CausalConv1dForward
                                                   (for kernelize)

The signatures, argument names, results and semantics are those of Transformers' hub
names "causal_conv1d_fn", "causal_conv1d_update" and "causal_conv1d_forward" (5.25): x
[B, D, T]; weight [D, W] (the depthwise conv's weight squeezed); bias [D] or None;
activation None, "silu" or "swish". Per channel d:

    z[b, d, t] = bias[d] + sum_i weight[d, i] * x[b, d, t - (W-1) + i]   (x = 0 before 0)
    out = act(z)

computed as Transformers does it: x cast to the weight's dtype, taps summed in float32, z
and the activation rounded to the weight's dtype, out in x's dtype. causal_conv1d_fn is
differentiable in x, weight and bias. Packed sequences (each starting from zeros): the
`cu_seq_lens_q` a model passes through (or `cu_seqlens`), int32 [N + 1] offsets in a
batch of 1, or Mamba's `seq_idx` [B, T] int32. causal_conv1d_update is one decode step (T
new tokens per sequence, usually 1) from conv_state [B, D, S] (S >= W-1, the last S
inputs), which it updates in place (donated on TPU: read once, written once); when a
gradient is wanted it runs as the conv of cat(conv_state, x) instead. causal_conv1d_forward is the layer-level function that reads and updates the
conv state in Transformers' cache and picks one of the two.

x given as the transposed view of a contiguous [B, T, D] tensor (how Transformers'
layers hand over their projection) goes to the kernel as that [B, T, D] memory, and out
comes back the same way: no transpose. dtypes: float32, bfloat16 (x, weight, state each
its own; bias the weight's); float16, float64 and int64 are refused, never cast.

On "tpu" tensors the compiled kernels run through TorchTPU; on "cpu" tensors the same
kernels run in Pallas interpret mode (slow; for development and tests), and cu_seqlens is
checked (0 .. T, non-decreasing) first. jax must be installed.
"""

from __future__ import annotations

import torch

from . import _shim, layers
from ._custom_ops import causal_conv1d_forward_op, causal_conv1d_update_op
from ._shim import validation
from ._shim.validation import check_int32, check_ndim, check_shape

__all__ = ["causal_conv1d_fn", "causal_conv1d_forward", "causal_conv1d_update", "layers"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
ACTIVATIONS = (None, "silu", "swish")
MAX_WIDTH = 16
# Dao-AILab causal_conv1d_fn options these kernels do not have: refused when set.
_UNSUPPORTED_OPTIONS = ("initial_states", "return_final_states", "final_states_out")


def _check_conv(op: str, x, weight, bias, activation) -> tuple[int, int, int]:
  """(B, D, T) of valid arguments; clear errors, nothing cast."""
  validation.check_tensor(op, "x", x)
  check_ndim(op, "x", x, 3, "[batch, dim, seq]")
  validation.check_float_dtype(op, "x", x, COMPUTE_DTYPES)
  batch, dim, seq = x.shape
  validation.check_tensor(op, "weight", weight)
  check_ndim(op, "weight", weight, 2, "[dim, width]: the depthwise conv's weight squeezed")
  validation.check_float_dtype(op, "weight", weight, COMPUTE_DTYPES)
  if weight.shape[0] != dim or not 1 <= weight.shape[1] <= MAX_WIDTH:
    raise ValueError(f"{op}: weight must be [dim, width] with dim {dim} (x's) and 1 <= width "
                     f"<= {MAX_WIDTH}, got {tuple(weight.shape)}")
  if bias is not None:
    validation.check_tensor(op, "bias", bias)
    check_shape(op, "bias", bias, (dim,), "[dim]")
    validation.check_same_dtype(op, "bias", bias, "weight", weight)
  if activation not in ACTIVATIONS:
    raise NotImplementedError(f"{op}: activation {activation!r} is not supported (one of "
                              f"{ACTIVATIONS})")
  return batch, dim, seq


def _check_cu_seqlens(op: str, cu_seqlens, batch: int, seq: int) -> None:
  check_int32(op, "cu_seqlens", cu_seqlens)
  check_ndim(op, "cu_seqlens", cu_seqlens, 1, "[num_seqs + 1]")
  if cu_seqlens.shape[0] < 2:
    raise ValueError(f"{op}: cu_seqlens must hold num_seqs + 1 >= 2 offsets, got "
                     f"{tuple(cu_seqlens.shape)}")
  if batch != 1:
    raise ValueError(f"{op}: packed sequences (cu_seqlens) need batch 1, got batch {batch}")
  if cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling():
    cu = cu_seqlens.tolist()
    if cu[0] != 0 or cu[-1] != seq or any(b < a for a, b in zip(cu, cu[1:])):
      raise ValueError(f"{op}: cu_seqlens must rise from 0 to the sequence length {seq}, got "
                       f"{cu}")


def _packing(op: str, kwargs: dict, batch: int, seq: int):
  """(cu_seqlens, seq_idx) from the keyword arguments: `cu_seqlens`, or the `cu_seq_lens_q`
  Transformers' packed-sequence path passes through a layer's kwargs; Mamba's `seq_idx`."""
  for name in _UNSUPPORTED_OPTIONS:
    value = kwargs.get(name)
    if value is not None and value is not False:
      raise NotImplementedError(f"{op}: {name} is not supported by this kernel")
  cu_seqlens, cu_seq_lens_q = kwargs.get("cu_seqlens"), kwargs.get("cu_seq_lens_q")
  if cu_seqlens is not None and cu_seq_lens_q is not None and cu_seqlens is not cu_seq_lens_q:
    raise ValueError(f"{op}: both cu_seqlens and cu_seq_lens_q were given; pass one")
  cu_seqlens = cu_seq_lens_q if cu_seqlens is None else cu_seqlens
  seq_idx = kwargs.get("seq_idx")
  if cu_seqlens is not None and seq_idx is not None:
    raise ValueError(f"{op}: pass cu_seqlens (cu_seq_lens_q) or seq_idx, not both")
  if cu_seqlens is not None:
    _check_cu_seqlens(op, cu_seqlens, batch, seq)
  if seq_idx is not None:
    check_int32(op, "seq_idx", seq_idx)
    check_shape(op, "seq_idx", seq_idx, (batch, seq), "[batch, seq]")
  return cu_seqlens, seq_idx


def causal_conv1d_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                     activation: str | None = None, **kwargs) -> torch.Tensor:
  """Causal depthwise conv1d over x [B, D, T] (module docstring); out in x's shape and dtype.

  kwargs: packing (`cu_seq_lens_q` / `cu_seqlens`: int32 [N + 1], batch 1; or `seq_idx`:
  int32 [B, T]); a model's other pass-through keywords are ignored, as Transformers' own
  function ignores them. Differentiable in x, weight and bias."""
  op = "causal_conv1d_fn"
  batch, dim, seq = _check_conv(op, x, weight, bias, activation)
  cu_seqlens, seq_idx = _packing(op, kwargs, batch, seq)
  _shim.device_type_of(op, {"x": x, "weight": weight, "bias": bias, "cu_seqlens": cu_seqlens,
                            "seq_idx": seq_idx})
  if seq == 0 or dim == 0:
    return torch.empty_like(x)
  # Transformers' x is the transposed view of its [B, T, D] projection: the kernel takes
  # that memory as is (channels-last) and gives out back the same way.
  channels_last = not x.is_contiguous() and x.transpose(1, 2).is_contiguous()
  xk = x.transpose(1, 2) if channels_last else x.contiguous()
  out = causal_conv1d_forward_op(xk, weight.contiguous(),
                                 None if bias is None else bias.contiguous(), cu_seqlens,
                                 seq_idx, activation or "", channels_last)
  return out.transpose(1, 2) if channels_last else out


def causal_conv1d_update(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None,
                         activation: str | None = None) -> torch.Tensor:
  """One decode step: x [B, D, T] (or [B, D]) new inputs, conv_state [B, D, S] (S >= W-1)
  the last S inputs of each sequence, updated in place to the last S of cat(conv_state, x)
  (through the weight's dtype, as Transformers casts them). Returns out in x's shape and
  dtype. The update kernel has no gradient: when one is wanted (grad mode and an input that
  requires it) the step runs as the conv of cat(conv_state, x) instead, differentiable in
  x, weight, bias and the state's old values (as Transformers' own function is)."""
  op = "causal_conv1d_update"
  x3 = x[:, :, None] if isinstance(x, torch.Tensor) and x.dim() == 2 else x
  batch, dim, _ = _check_conv(op, x3, weight, bias, activation)
  validation.check_tensor(op, "conv_state", conv_state)
  check_ndim(op, "conv_state", conv_state, 3, "[batch, dim, state_len]")
  validation.check_float_dtype(op, "conv_state", conv_state, COMPUTE_DTYPES)
  if tuple(conv_state.shape[:2]) != (batch, dim) or conv_state.shape[2] < weight.shape[1] - 1:
    raise ValueError(f"{op}: conv_state must be [batch, dim, S] = [{batch}, {dim}, >= "
                     f"{weight.shape[1] - 1}] (S >= width - 1), got {tuple(conv_state.shape)}")
  if not conv_state.is_contiguous():
    raise ValueError(f"{op}: conv_state must be contiguous (it is written in place)")
  _shim.device_type_of(op, {"x": x, "conv_state": conv_state, "weight": weight, "bias": bias})
  if torch.is_grad_enabled() and any(t is not None and t.requires_grad
                                     for t in (x, conv_state, weight, bias)):
    out = _update_differentiable(x3, conv_state, weight, bias, activation)
  else:
    out = causal_conv1d_update_op(x3.contiguous(), conv_state, weight.contiguous(),
                                  None if bias is None else bias.contiguous(),
                                  activation or "")
  return out[:, :, 0] if x.dim() == 2 else out


def _update_differentiable(x, conv_state, weight, bias, activation):
  """The update when a gradient is wanted (the update kernel has none): as Transformers
  computes it, out = the conv (causal_conv1d_fn, differentiable) of cat(conv_state, x) in
  the weight's dtype, its last T outputs; the state's new value (its last S inputs) is
  written in place outside autograd."""
  seq = x.shape[2]
  full = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
  with torch.no_grad():
    conv_state.copy_(full[:, :, -conv_state.shape[2]:])
  return causal_conv1d_fn(full, weight, bias, activation)[:, :, -seq:].to(x.dtype)


def causal_conv1d_forward(conv1d: torch.nn.Module, hidden_states: torch.Tensor, cache,
                          layer_idx: int, activation: str | None = None, state_idx: int = 0,
                          **kwargs) -> torch.Tensor:
  """Transformers' layer-level conv: `conv1d` (the depthwise nn.Conv1d) over hidden_states
  [B, D, T], reading and updating its conv state in `cache` (a Transformers Cache, or None)
  exactly as Transformers' `causal_conv1d_forward` does: a single-token step with a conv
  state (and the cache not recording its past) runs causal_conv1d_update on that state in
  place; anything else runs causal_conv1d_fn over the cache's returned states (the
  previous ones prepended, or zero padding on a first short prefill) and keeps the last T
  outputs. With packed sequences, the states prepended belong to the first sequence."""
  op = "causal_conv1d_forward"
  weight = getattr(conv1d, "weight", None)
  if not isinstance(weight, torch.Tensor) or weight.dim() != 3 or weight.shape[1] != 1:
    raise NotImplementedError(f"{op}: {type(conv1d).__name__} is not a depthwise conv1d "
                              f"(weight [dim, 1, width])")
  seq_len = hidden_states.shape[-1]
  conv_state = cache.get_conv_state(layer_idx, state_idx=state_idx) if cache is not None else None
  weight = weight.squeeze(1)
  if conv_state is not None and seq_len == 1 and not cache.is_recording_past(layer_idx):
    cache.increase_count(layer_idx, state_idx)
    return causal_conv1d_update(hidden_states, conv_state, weight, conv1d.bias,
                                activation=activation)
  if cache is not None:
    hidden_states = cache.update_conv_state(hidden_states, layer_idx, state_idx=state_idx,
                                            conv_kernel_size=conv1d.kernel_size[0])
  prepended = hidden_states.shape[-1] - seq_len
  if prepended:
    kwargs = _with_prepended(kwargs, prepended)
  out = causal_conv1d_fn(hidden_states, weight, conv1d.bias, activation=activation, **kwargs)
  return out[:, :, -seq_len:] if cache is not None else out


def _with_prepended(kwargs: dict, prepended: int) -> dict:
  """Packing keywords for an input with `prepended` states before its first token (they
  join the first sequence)."""
  kwargs, shifted = dict(kwargs), {}
  for name in ("cu_seqlens", "cu_seq_lens_q"):
    cu = kwargs.get(name)
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and cu.shape[0] >= 2:
      if id(cu) not in shifted:   # one tensor passed under both names stays one
        shifted[id(cu)] = torch.cat([cu[:1], cu[1:] + prepended])
      kwargs[name] = shifted[id(cu)]
  seq_idx = kwargs.get("seq_idx")
  if isinstance(seq_idx, torch.Tensor) and seq_idx.dim() == 2:
    kwargs["seq_idx"] = torch.cat([seq_idx[:, :1].expand(-1, prepended), seq_idx], dim=1)
  return kwargs
