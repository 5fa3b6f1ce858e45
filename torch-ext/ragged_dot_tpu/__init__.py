"""ragged-dot-tpu: grouped matmul and fused MoE experts as Pallas TPU kernels, for PyTorch
tensors on TPU (TorchTPU) or CPU.

    ragged_dot(lhs, rhs, group_sizes, *, group_offset=0, transpose_rhs=False,
               rhs_scale=None, bias=None, activation=None, out_dtype=None) -> out [m, n]
    experts_forward(self, hidden_states, top_k_index, top_k_weights) -> [T, H]
        (for transformers' ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", ...))
    quantize_experts_(model, dtype="int8" | "float8_e4m3fn") -> number of experts modules

ragged_dot: rows of group g (consecutive, group_sizes[g] of them, in order) multiply
rhs[g - group_offset]; rows of groups outside this shard's slice, and rows past
sum(group_sizes), come out as zeros. On "tpu" tensors the compiled kernel runs through
TorchTPU; on "cpu" tensors the same kernel runs in Pallas interpret mode (slow; for
development and tests). jax must be installed.
"""

from __future__ import annotations

import torch

from . import _shim
from ._custom_ops import QUANTIZED_DTYPES, experts_op, ragged_dot_op
from ._shim import validation
from ._shim.validation import check_int32, check_ndim, dtype_name

__all__ = ["SUPPORTED_ACTIVATIONS", "experts_forward", "quantize_experts_", "ragged_dot"]

# Epilogue activations of the kernel (kernels/tpu_kernels/ragged_dot.py; listed here so that
# importing the package does not import jax; a test checks the two lists agree).
SUPPORTED_ACTIVATIONS = ("identity", "silu", "gelu_tanh", "gelu", "relu", "relu2")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
_QUANT_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _check_weight(op: str, name: str, w: torch.Tensor, compute_dtype: torch.dtype,
                  scale: torch.Tensor | None, scale_name: str, n_out: int) -> None:
  """A float weight in the compute dtype (no scale), or a quantized one with a float32 scale."""
  validation.check_tensor(op, name, w)
  if w.dtype in QUANTIZED_DTYPES:
    if scale is None:
      raise ValueError(f"{op}: {name} is {dtype_name(w.dtype)} (quantized) and needs "
                       f"{scale_name}, its per-output-channel float32 scale")
    validation.check_tensor(op, scale_name, scale)
    validation.check_float_dtype(op, scale_name, scale, (torch.float32,))
    validation.check_shape(op, scale_name, scale, (w.shape[0], n_out),
                           "one scale per group and output channel")
    return
  if w.dtype != compute_dtype:
    raise TypeError(f"{op}: {name} has dtype {dtype_name(w.dtype)}; it must have the input's "
                    f"dtype ({dtype_name(compute_dtype)}) or be quantized (int8, "
                    f"float8_e4m3fn, with a scale)")
  if scale is not None:
    raise ValueError(f"{op}: {scale_name} is only for quantized (int8 / float8_e4m3fn) "
                     f"weights; {name} is {dtype_name(w.dtype)}")


def _check_bias(op: str, name: str, bias, shape: tuple) -> None:
  if bias is None:
    return
  validation.check_tensor(op, name, bias)
  validation.check_float_dtype(op, name, bias, COMPUTE_DTYPES)
  validation.check_shape(op, name, bias, shape, "one bias per group and output channel")


def _check_int(op: str, name: str, value) -> int:
  if isinstance(value, bool) or not isinstance(value, int):
    raise TypeError(f"{op}: {name} must be a Python int, got {type(value).__name__}")
  return value


def ragged_dot(lhs: torch.Tensor, rhs: torch.Tensor, group_sizes: torch.Tensor, *,
               group_offset: int = 0, transpose_rhs: bool = False,
               rhs_scale: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               activation: str | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
  """Grouped matmul: out[rows of group g] = act(lhs[rows] @ rhs[g - group_offset] * scale + bias).

  Args:
    lhs: [m, k] float32 / bfloat16, rows sorted by group.
    rhs: [G_local, k, n] ([G_local, n, k] if transpose_rhs) in lhs's dtype, or int8 /
      float8_e4m3fn with rhs_scale.
    group_sizes: [G_total] int32, rows per group (global groups); sum <= m.
    group_offset: rhs[i] is global group group_offset + i; 0 <= group_offset <=
      G_total - G_local (expert parallelism: each shard owns a slice of the groups).
    rhs_scale: [G_local, n] float32 per-output-channel scale (quantized rhs only).
    bias: [G_local, n], added after the scale, before the activation.
    activation: None or one of SUPPORTED_ACTIVATIONS, applied in the kernel's epilogue.
    out_dtype: torch.float32 / torch.bfloat16; default lhs's dtype.
  Returns:
    [m, n]; rows in no local group are zero. Differentiable in lhs, float rhs and bias
    (quantized weights are frozen).
  """
  op = "ragged_dot"
  validation.check_tensor(op, "lhs", lhs)
  validation.check_tensor(op, "rhs", rhs)
  validation.check_tensor(op, "group_sizes", group_sizes)
  validation.check_float_dtype(op, "lhs", lhs, COMPUTE_DTYPES)
  check_ndim(op, "lhs", lhs, 2, "[m, k]")
  check_ndim(op, "rhs", rhs, 3, "[groups, k, n] or [groups, n, k] with transpose_rhs")
  check_ndim(op, "group_sizes", group_sizes, 1, "[groups]")
  check_int32(op, "group_sizes", group_sizes)
  if not isinstance(transpose_rhs, bool):
    raise TypeError(f"{op}: transpose_rhs must be a bool, got {type(transpose_rhs).__name__}")
  groups_local, groups_total = rhs.shape[0], group_sizes.shape[0]
  if groups_local == 0:
    raise ValueError(f"{op}: rhs must hold at least one group, got shape {tuple(rhs.shape)}")
  k_dim, n_dim = (2, 1) if transpose_rhs else (1, 2)
  if rhs.shape[k_dim] != lhs.shape[1]:
    layout = "[groups, n, k] (transpose_rhs=True)" if transpose_rhs else "[groups, k, n]"
    raise ValueError(f"{op}: rhs {tuple(rhs.shape)} read as {layout} has k = "
                     f"{rhs.shape[k_dim]}, lhs has k = {lhs.shape[1]}")
  n = rhs.shape[n_dim]
  _check_weight(op, "rhs", rhs, lhs.dtype, rhs_scale, "rhs_scale", n)
  _check_bias(op, "bias", bias, (groups_local, n))
  group_offset = _check_int(op, "group_offset", group_offset)
  if not 0 <= group_offset <= groups_total - groups_local:
    raise ValueError(f"{op}: group_offset must be in [0, {groups_total - groups_local}] "
                     f"(len(group_sizes) {groups_total} - rhs groups {groups_local}), got "
                     f"{group_offset}")
  if activation is not None and activation not in SUPPORTED_ACTIVATIONS:
    raise ValueError(f"{op}: activation must be None or one of {SUPPORTED_ACTIVATIONS}, "
                     f"got {activation!r}")
  if out_dtype is not None and out_dtype not in COMPUTE_DTYPES:
    raise TypeError(f"{op}: out_dtype must be None, torch.float32 or torch.bfloat16, got "
                    f"{out_dtype}")
  device_type = _shim.device_type_of(op, {"lhs": lhs, "rhs": rhs, "group_sizes": group_sizes,
                                          "rhs_scale": rhs_scale, "bias": bias})
  if device_type == "cpu" and not torch.compiler.is_compiling():
    # Data-dependent checks, cheap on CPU (on TPU they would force a device sync).
    if bool((group_sizes < 0).any()):
      raise ValueError(f"{op}: group_sizes must be non-negative, got {group_sizes.tolist()}")
    total = int(group_sizes.sum())
    if total > lhs.shape[0]:
      raise ValueError(f"{op}: sum(group_sizes) = {total} exceeds lhs's {lhs.shape[0]} rows")
  return ragged_dot_op(lhs.contiguous(), rhs.contiguous(), group_sizes.contiguous(),
                       None if rhs_scale is None else rhs_scale.contiguous(),
                       None if bias is None else bias.contiguous(), group_offset, transpose_rhs,
                       activation or "identity",
                       "" if out_dtype is None else dtype_name(out_dtype))


# ------------------------------------------------------------------ Transformers experts

# act_fn class name -> the kernel's epilogue activation (exact matches only: a subclass may
# compute something else). GELUTanh, NewGELUActivation and nn.GELU('tanh') are one formula.
_ACTIVATIONS_BY_CLASS = {
    "SiLUActivation": "silu", "SiLU": "silu",
    "GELUTanh": "gelu_tanh", "NewGELUActivation": "gelu_tanh", "GELUActivation": "gelu",
    "ReLU": "relu", "ReLUSquaredActivation": "relu2",
    "Identity": "identity", "LinearActivation": "identity",
}
# Experts classes whose own `_apply_gate` is gpt-oss's clamped gate
# (min(gate, limit), clip(up, +-limit), (up + 1) * gate * sigmoid(alpha * gate)),
# with the gate/up layout given by `is_concatenated`.
_GPT_OSS_GATE_CLASSES = ("GptOssExperts", "OpenAIPrivacyFilterExperts")


def _activation_of(op: str, act_fn) -> str:
  name = type(act_fn).__name__
  if name == "GELU" and isinstance(act_fn, torch.nn.GELU):
    return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
  if name not in _ACTIVATIONS_BY_CLASS:
    raise NotImplementedError(
        f"{op}: activation {name} is not fused by this kernel; supported: "
        f"{', '.join(sorted(_ACTIVATIONS_BY_CLASS))}, torch.nn.GELU")
  return _ACTIVATIONS_BY_CLASS[name]


def _gate_of(op: str, module) -> tuple[str, bool, float, float]:
  """(activation, is_concatenated, alpha, limit) of the module's gate."""
  cls = type(module)
  apply_gate = getattr(cls, "_apply_gate", None)
  if apply_gate is not None and apply_gate.__name__ != "_default_apply_gate":
    if cls.__name__ not in _GPT_OSS_GATE_CLASSES:
      raise NotImplementedError(
          f"{op}: {cls.__name__} has its own _apply_gate, which this kernel does not know; "
          f"known custom gates: {', '.join(_GPT_OSS_GATE_CLASSES)} (gpt-oss's clamped gate)")
    return ("gpt_oss", bool(getattr(module, "is_concatenated", True)), float(module.alpha),
            float(module.limit))
  # Transformers' default gate chunks [gate | up]: the concatenated layout.
  return _activation_of(op, module.act_fn), True, 1.702, 7.0


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
  """Transformers experts forward on the fused kernel (register it in ALL_EXPERTS_FUNCTIONS).

  `self` is a Transformers experts module (`@use_experts_implementation`): it reads
  num_experts, has_gate, has_bias, is_transposed, is_concatenated, act_fn (or gpt-oss's
  alpha / limit), gate_up_proj / up_proj, down_proj, their biases, and the scales
  `quantize_experts_` stores. Ids >= num_experts (expert-parallel placeholders)
  contribute nothing. Returns [T, H] in hidden_states' dtype.
  """
  op = "experts_forward"
  if getattr(self, "has_post_expert_norm", False):
    raise NotImplementedError(f"{op}: experts with a post-expert norm (has_post_expert_norm) "
                              f"are not supported by this kernel")
  has_gate = bool(getattr(self, "has_gate", True))
  has_bias = bool(getattr(self, "has_bias", False))
  is_transposed = bool(getattr(self, "is_transposed", False))
  num_experts = int(self.num_experts)
  if has_gate:
    activation, is_concatenated, alpha, limit = _gate_of(op, self)
    up_name = "gate_up_proj"
  else:
    activation, is_concatenated, alpha, limit = _activation_of(op, self.act_fn), True, 1.702, 7.0
    up_name = "up_proj"
  gate_up, down = getattr(self, up_name), self.down_proj
  gate_up_scale = getattr(self, f"{up_name}_scale", None)
  down_scale = getattr(self, "down_proj_scale", None)
  gate_up_bias = getattr(self, f"{up_name}_bias") if has_bias else None
  down_bias = self.down_proj_bias if has_bias else None

  for name, t in (("hidden_states", hidden_states), ("top_k_index", top_k_index),
                  ("top_k_weights", top_k_weights)):
    validation.check_tensor(op, name, t)
  check_ndim(op, "hidden_states", hidden_states, 2, "[tokens, hidden]")
  check_ndim(op, "top_k_index", top_k_index, 2, "[tokens, top_k]")
  validation.check_shape(op, "top_k_weights", top_k_weights, tuple(top_k_index.shape),
                         "the shape of top_k_index")
  if top_k_index.shape[0] != hidden_states.shape[0]:
    raise ValueError(f"{op}: top_k_index has {top_k_index.shape[0]} rows, hidden_states "
                     f"{hidden_states.shape[0]}")
  if top_k_index.dtype not in (torch.int32, torch.int64):
    raise TypeError(f"{op}: top_k_index must be int32 or int64, got "
                    f"{dtype_name(top_k_index.dtype)}")
  validation.check_float_dtype(op, "top_k_weights", top_k_weights, COMPUTE_DTYPES)
  validation.check_float_dtype(op, "hidden_states", hidden_states, COMPUTE_DTYPES)
  for name, w in ((up_name, gate_up), ("down_proj", down)):
    validation.check_tensor(op, name, w)
    check_ndim(op, name, w, 3, "[experts, ., .]")
    if w.shape[0] != num_experts:
      raise ValueError(f"{op}: {name} has {w.shape[0]} experts, num_experts is {num_experts}")
  # Float weights set the compute dtype (as transformers casts the input to the weights');
  # quantized weights compute in the input's dtype.
  compute_dtype = next((w.dtype for w in (gate_up, down) if w.dtype not in QUANTIZED_DTYPES),
                       hidden_states.dtype)
  if compute_dtype not in COMPUTE_DTYPES:
    raise TypeError(f"{op}: expert weights have dtype {dtype_name(compute_dtype)}; the kernel "
                    f"computes in float32 or bfloat16 (never down-casts silently)")
  out_axis = 2 if is_transposed else 1
  _check_weight(op, up_name, gate_up, compute_dtype, gate_up_scale, f"{up_name}_scale",
                gate_up.shape[out_axis])
  _check_weight(op, "down_proj", down, compute_dtype, down_scale, "down_proj_scale",
                down.shape[out_axis])
  _check_bias(op, f"{up_name}_bias", gate_up_bias, (num_experts, gate_up.shape[out_axis]))
  _check_bias(op, "down_proj_bias", down_bias, (num_experts, down.shape[out_axis]))
  _shim.device_type_of(op, {"hidden_states": hidden_states, "top_k_index": top_k_index,
                            "top_k_weights": top_k_weights, up_name: gate_up, "down_proj": down})

  # int64 ids go to JAX as int32 explicitly (DLPack would narrow them silently otherwise).
  index = top_k_index.to(torch.int32).contiguous()
  out = experts_op(hidden_states.to(compute_dtype).contiguous(), index,
                   top_k_weights.contiguous(), gate_up.contiguous(), down.contiguous(),
                   None if gate_up_bias is None else gate_up_bias.contiguous(),
                   None if down_bias is None else down_bias.contiguous(),
                   gate_up_scale, down_scale, num_experts, has_gate, is_transposed,
                   is_concatenated, activation, alpha, limit)
  return out.to(hidden_states.dtype)


def _quantize(weight: torch.Tensor, out_axis: int, dtype: str):
  """Symmetric per-output-channel quantization: (q, scale[E, out] float32)."""
  w = weight.detach().float()
  reduce_axis = 2 if out_axis == 1 else 1
  amax = w.abs().amax(dim=reduce_axis)
  scale = torch.where(amax > 0, amax / _QUANT_MAX[dtype], torch.ones_like(amax))
  expanded = scale.unsqueeze(reduce_axis)
  q = (w / expanded).clamp(-_QUANT_MAX[dtype], _QUANT_MAX[dtype])
  if dtype == "int8":
    q = q.round().to(torch.int8)
  else:
    q = q.to(torch.float8_e4m3fn)
  return q, scale.contiguous()


def quantize_experts_(model: torch.nn.Module, dtype: str = "int8") -> int:
  """Quantizes every Transformers experts module of `model` in place, for `experts_forward`.

  gate_up_proj (or up_proj) and down_proj become int8 / float8_e4m3fn buffers with a
  symmetric per-output-channel float32 scale (`<name>_scale`, amax / 127 or amax / 448).
  The quantized weights are frozen (no gradient); biases stay as they are. The module's
  own eager forward cannot run on them: use experts_implementation="tpu_ragged_dot".
  Returns the number of experts modules quantized.
  """
  if dtype not in _QUANT_MAX:
    raise ValueError(f"quantize_experts_: dtype must be one of {tuple(_QUANT_MAX)}, got "
                     f"{dtype!r}")
  count = 0
  for module in model.modules():
    if not hasattr(module, "has_gate") or not isinstance(getattr(module, "down_proj", None),
                                                         torch.Tensor):
      continue
    out_axis = 2 if getattr(module, "is_transposed", False) else 1
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    for name in names:
      weight = getattr(module, name)
      if weight.dtype in QUANTIZED_DTYPES:
        continue
      q, scale = _quantize(weight, out_axis, dtype)
      if name in module._parameters:
        del module._parameters[name]
      else:
        delattr(module, name)
      module.register_buffer(name, q)
      module.register_buffer(f"{name}_scale", scale)
    count += 1
  return count
