"""ragged-dot-tpu: grouped matmul and fused MoE experts as Pallas TPU kernels, for PyTorch
tensors on TPU (TorchTPU) or CPU.

    ragged_dot(lhs, rhs, group_sizes, *, group_offset=0, transpose_rhs=False,
               rhs_scale=None, bias=None, activation=None, out_dtype=None,
               lhs_quant=None) -> out [m, n]
    experts_forward(self, hidden_states, top_k_index, top_k_weights) -> [T, H]
        (for transformers' ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", ...))
    quantize_experts_(model, dtype="int8" | "float8_e4m3fn", activations=None | "int8")
        -> number of experts modules

ragged_dot: rows of group g (consecutive, group_sizes[g] of them, in order) multiply
rhs[g - group_offset]; rows of groups outside this shard's slice, and rows past
sum(group_sizes), come out as zeros. On "tpu" tensors the compiled kernel runs through
TorchTPU; on "cpu" tensors the same kernel runs in Pallas interpret mode (slow; for
development and tests). jax must be installed.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import types

import torch

from . import _shim
from ._custom_ops import QUANTIZED_DTYPES, experts_op, ragged_dot_op
from ._shim import validation
from ._shim.validation import check_int32, check_ndim, dtype_name

__all__ = ["SUPPORTED_ACTIVATIONS", "ExpertsPlan", "experts_forward", "experts_plan",
           "quantize_experts_", "ragged_dot"]

# Epilogue activations of the kernel (kernels/tpu_kernels/ragged_dot.py; listed here so that
# importing the package does not import jax; a test checks the two lists agree).
SUPPORTED_ACTIVATIONS = ("identity", "silu", "gelu_tanh", "gelu", "relu", "relu2")
COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
_QUANT_MAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
_LHS_QUANTS = ("int8",)   # kernels/tpu_kernels/ragged_dot.py's LHS_QUANTS (a test checks)


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
               out_dtype: torch.dtype | None = None,
               lhs_quant: str | None = None) -> torch.Tensor:
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
    lhs_quant: None, or "int8" with int8 rhs: lhs quantized per row (scale = max|row| /
      127) and multiplied int8 by int8 (W8A8; inference only, no gradient).
  Returns:
    [m, n]; rows in no local group are zero. Differentiable in lhs, float rhs and bias
    (quantized weights are frozen), but not with lhs_quant.
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
  _check_lhs_quant(op, lhs_quant, {"rhs": rhs})
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
                       "" if out_dtype is None else dtype_name(out_dtype), lhs_quant or "")


def _check_lhs_quant(op: str, lhs_quant: str | None, weights: dict[str, torch.Tensor]) -> None:
  """lhs_quant is None / "" or one of _LHS_QUANTS, and then every weight is int8."""
  if not lhs_quant:
    return
  if lhs_quant not in _LHS_QUANTS:
    raise ValueError(f"{op}: lhs_quant must be None or one of {_LHS_QUANTS}, got {lhs_quant!r}")
  others = {name: dtype_name(w.dtype) for name, w in weights.items() if w.dtype != torch.int8}
  if others:
    raise TypeError(f"{op}: lhs_quant={lhs_quant!r} multiplies int8 by int8: the weights must "
                    f"be int8 (with their scales), got {others}")


# ------------------------------------------------------------------ Transformers experts

# Two routes, both differentiable, both computing what Transformers' "eager" computes:
#   fused:   the experts op (kernels/tpu_kernels/moe.py): the gate/up projection with the gate
#            formed in the kernel's epilogue, the down projection, the routing weights and the
#            sum over the k experts of each token, in one JAX function.
#   generic: for what the epilogue does not compute (a gate or activation it does not know, a
#            post-expert norm): the ragged_dot op for gate/up with no epilogue, the module's own
#            `_apply_gate` (or `act_fn`) and `post_expert_norm` in torch, the ragged_dot op for
#            down. Slower (the [S, 2I] intermediate goes through HBM), never wrong.

# The kernel's gated epilogues that a module's own `_apply_gate` may compute (besides
# act(gate) * up for the activations of SUPPORTED_ACTIVATIONS), with their parameters:
#   "gpt_oss":      (clip(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
#   "clamped_silu": silu(min(gate, limit)) * clip(up, -limit, limit)
PARAMETRIC_GATES = ("gpt_oss", "clamped_silu")
_DEFAULT_ALPHA, _DEFAULT_LIMIT = 1.702, 7.0


@dataclasses.dataclass(frozen=True)
class ExpertsPlan:
  """How experts_forward runs a module: route "fused" (activation, is_concatenated, alpha,
  limit are the epilogue's statics) or "generic" (reason says why not fused)."""

  route: str
  activation: str = "identity"
  is_concatenated: bool = True
  alpha: float = _DEFAULT_ALPHA
  limit: float = _DEFAULT_LIMIT
  reason: str = ""


def _fused_activations() -> dict:
  """act_fn (a function, or the exact class of a module) -> the kernel's epilogue activation.

  Keyed by the objects themselves, never by names: a subclass, or another function of the
  same name, may compute something else. Transformers' activation classes are looked up in
  the already imported `transformers.activations` (a Transformers module comes with it).
  """
  fn = torch.nn.functional
  table = {torch.nn.SiLU: "silu", torch.nn.ReLU: "relu", torch.nn.Identity: "identity",
           fn.silu: "silu", fn.relu: "relu", torch.relu: "relu", fn.gelu: "gelu"}
  acts = sys.modules.get("transformers.activations")
  if acts is not None:
    for cls_name, activation in (
        ("SiLUActivation", "silu"), ("GELUActivation", "gelu"),
        # GELUTanh, NewGELU, FastGELU and AccurateGELU are all the tanh approximation
        # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
        ("GELUTanh", "gelu_tanh"), ("NewGELUActivation", "gelu_tanh"),
        ("FastGELUActivation", "gelu_tanh"), ("AccurateGELUActivation", "gelu_tanh"),
        ("ReLUSquaredActivation", "relu2"), ("LinearActivation", "identity")):
      cls = getattr(acts, cls_name, None)
      if cls is not None:
        table[cls] = activation
  return table


def _fused_activation(act_fn) -> str | None:
  """The kernel's epilogue activation equal to act_fn, or None."""
  if type(act_fn) is torch.nn.GELU:
    return "gelu_tanh" if act_fn.approximate == "tanh" else "gelu"
  table = _fused_activations()
  try:
    if act_fn in table:             # a plain function
      return table[act_fn]
  except TypeError:                 # unhashable callable
    return None
  return table.get(type(act_fn))


def _describe(act_fn) -> str:
  return getattr(act_fn, "__qualname__", None) or type(act_fn).__qualname__


# The epilogue formulas (kernels/tpu_kernels/ragged_dot.py: activation, gated) in torch float64,
# to recognise a module's own `_apply_gate` by what it computes.
def _activation_f64(name: str, x: torch.Tensor) -> torch.Tensor:
  if name == "identity":
    return x
  if name == "silu":
    return x * torch.sigmoid(x)
  if name == "gelu_tanh":
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x ** 3)))
  if name == "gelu":
    return 0.5 * x * (1.0 + torch.erf(x * 0.7071067811865476))
  if name == "relu":
    return torch.clamp(x, min=0.0)
  if name == "relu2":
    return torch.clamp(x, min=0.0) ** 2
  raise ValueError(name)


def _gated_f64(name: str, gate, up, alpha: float, limit: float) -> torch.Tensor:
  if name == "gpt_oss":
    gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
    return (up + 1.0) * gate * torch.sigmoid(gate * alpha)
  if name == "clamped_silu":
    gate, up = torch.clamp(gate, max=limit), torch.clamp(up, -limit, limit)
    return gate * torch.sigmoid(gate) * up
  return _activation_f64(name, gate) * up


def _snapped(x: float) -> float:
  """x to 12 significant digits: a parameter solved from the probes (1.7020000000000002)
  back to the literal the module holds (1.702); the check that follows uses this value."""
  return float(f"{x:.12g}")


def _recognise_gate(apply_gate, width: int) -> tuple[str, bool, float, float] | None:
  """(activation, is_concatenated, alpha, limit) if `apply_gate` ([S, 2I] -> [S, I]) computes
  one of the kernel's gated epilogues, else None.

  Decided by evaluating it in float64 on probe inputs: the parameters of the clamped forms
  are solved from two probes (gate = c below the limit; up = 0 and up = 1e30, beyond any
  limit), then every candidate is checked on random gate/up values spanning +-3 limits.
  Agreement to 1e-6 (float32 rounding inside the gate passes) on all of them is required.
  """
  def call(gate, up, concatenated):
    x = torch.cat([gate, up], -1) if concatenated else torch.stack([gate, up], -1).flatten(-2)
    out = apply_gate(x)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(gate.shape):
      raise ValueError("not a gate of the [S, 2I] -> [S, I] kind")
    return out.to(torch.float64)

  gen = torch.Generator().manual_seed(0)
  rows = max(8, 8192 // width)
  c = 0.25
  for concatenated in (True, False):
    try:
      with torch.no_grad():
        ones = torch.ones(1, width, dtype=torch.float64)
        at_zero = float(call(c * ones, 0 * ones, concatenated)[0, 0])
        at_huge = float(call(c * ones, 1e30 * ones, concatenated)[0, 0])
        candidates = [(name, _DEFAULT_ALPHA, _DEFAULT_LIMIT) for name in SUPPORTED_ACTIVATIONS]
        ratio = at_zero / c               # gpt_oss: sigmoid(alpha * c)
        if 0.0 < ratio < 1.0 and at_zero != 0.0:
          candidates.append(("gpt_oss", math.log(ratio / (1.0 - ratio)) / c,
                             at_huge / at_zero - 1.0))
        candidates.append(("clamped_silu", _DEFAULT_ALPHA, at_huge / (c / (1.0 + math.exp(-c)))))
        for name, alpha, limit in candidates:
          if not (math.isfinite(alpha) and math.isfinite(limit) and limit > c):
            continue
          alpha, limit = _snapped(alpha), _snapped(limit)
          spread = 3.0 * min(limit, 1e6)
          gate = torch.cat([torch.randn(rows, width, generator=gen, dtype=torch.float64) * 4,
                            (torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2
                             - 1) * spread])
          up = torch.cat([torch.randn(rows, width, generator=gen, dtype=torch.float64) * 4,
                          (torch.rand(rows, width, generator=gen, dtype=torch.float64) * 2
                           - 1) * spread])
          want = _gated_f64(name, gate, up, alpha, limit)
          if torch.allclose(call(gate, up, concatenated), want, rtol=1e-6, atol=1e-6):
            return name, concatenated, alpha, limit
    except Exception:  # noqa: BLE001  (a gate that cannot run on the probe is not recognised)
      continue
  return None


# The tensors experts_forward itself reads; any other tensor is the gate's or a norm's.
_EXPERT_TENSORS = {f"{w}{suffix}" for w in ("gate_up_proj", "up_proj", "down_proj")
                   for suffix in ("", "_bias", "_scale")}
_SCALARS = (bool, int, float, str, type(None))
_CALLABLES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType)
# (module class, state key) -> recognised gate or None; the probe runs once per state.
_RECOGNISED_GATES: dict = {}


def _state_key(module: torch.nn.Module) -> tuple:
  """Everything a gate may read besides tensors: scalar and function attributes of the module
  and its submodules (an edit of `limit` or `act_fn` gives a new key)."""
  parts = []
  for name, sub in module.named_modules():
    items = tuple(sorted((k, v) for k, v in vars(sub).items()
                         if isinstance(v, _SCALARS + _CALLABLES)))
    parts.append((name, type(sub), items))
  return tuple(parts)


def _custom_gate(module, width: int) -> tuple[str, bool, float, float] | None:
  """The recognised gate of a module with its own `_apply_gate`, or None. While torch.compile
  traces, a gate not probed before counts as unknown (the probe reads values: it cannot be
  traced), so the generic route is compiled; calling the module once before compiling makes
  the fused one available."""
  key = (type(module), _state_key(module))
  if key not in _RECOGNISED_GATES:
    if torch.compiler.is_compiling():
      return None
    # Real tensors even when the caller traces with FakeTensors (torch.export, jax_op).
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
      _RECOGNISED_GATES[key] = _recognise_gate(module._apply_gate, width)
  return _RECOGNISED_GATES[key]


def _is_default_gate(module) -> bool:
  """True iff module._apply_gate is Transformers' default (act_fn(gate) * up on [gate | up])."""
  moe = sys.modules.get("transformers.integrations.moe")
  default = getattr(moe, "_default_apply_gate", None)
  return default is not None and getattr(module._apply_gate, "__func__", None) is default


def experts_plan(module) -> ExpertsPlan:
  """The route experts_forward takes for a Transformers experts module, and why."""
  if getattr(module, "has_post_expert_norm", False):
    return ExpertsPlan("generic", reason="post-expert norm (applied in torch between the down "
                                         "projection and the routing weights)")
  has_gate = bool(getattr(module, "has_gate", True))
  if not has_gate or _is_default_gate(module):
    activation = _fused_activation(module.act_fn)
    if activation is None:
      return ExpertsPlan("generic", reason=f"activation {_describe(module.act_fn)} is not one "
                                           f"of the kernel's epilogues {SUPPORTED_ACTIVATIONS}")
    # Transformers' default gate chunks [gate | up]: the concatenated layout.
    return ExpertsPlan("fused", activation)
  # The probe sees a gate's tensors only as they are now, and the cache keys on scalars: a
  # gate that may read a tensor of the module (a learned limit, say) is never fused.
  others = [n for n, _ in [*module.named_parameters(), *module.named_buffers()]
            if n not in _EXPERT_TENSORS]
  if others:
    return ExpertsPlan("generic", reason=f"{type(module).__name__}._apply_gate may read the "
                                         f"module's tensors {others}")
  up_proj = module.gate_up_proj
  width = up_proj.shape[2 if getattr(module, "is_transposed", False) else 1] // 2
  gate = _custom_gate(module, width)
  if gate is None:
    return ExpertsPlan("generic", reason=f"{type(module).__name__}._apply_gate is not one of "
                                         f"the kernel's gated epilogues")
  activation, is_concatenated, alpha, limit = gate
  return ExpertsPlan("fused", activation, is_concatenated, alpha, limit)


def _experts_generic(module, hidden: torch.Tensor, top_k_index: torch.Tensor,
                     top_k_weights: torch.Tensor, up_name: str, weights: dict,
                     compute_dtype: torch.dtype) -> torch.Tensor:
  """The generic route: [T, H] in float32 (the caller casts).

  Pairs (token, expert) sorted by expert id (stable; ids outside [0, num_experts),
  expert-parallel placeholders and negative ids of dropped pairs, sort to the tail, in no
  group, so they come out as zero rows), then
  ragged_dot (gate/up, no epilogue) -> module._apply_gate or act_fn -> ragged_dot (down,
  float32) -> post_expert_norm (in the compute dtype, as eager applies it) -> routing
  weights (float32) -> token order -> sum over k.
  """
  num_experts = int(module.num_experts)
  tokens, top_k = top_k_index.shape
  transpose_rhs = not bool(getattr(module, "is_transposed", False))
  expert_ids = top_k_index.reshape(-1).to(torch.int64)
  in_range = (expert_ids >= 0) & (expert_ids < num_experts)
  sorted_ids, perm = torch.sort(torch.where(in_range, expert_ids, num_experts), stable=True)
  group_sizes = torch.zeros(num_experts + 1, dtype=torch.int32, device=hidden.device)
  group_sizes = group_sizes.scatter_add(0, sorted_ids,   # the last bin: out of range
                                        torch.ones_like(sorted_ids, dtype=torch.int32))
  group_sizes = group_sizes[:num_experts]
  x = hidden.to(compute_dtype)[perm // top_k]
  h = ragged_dot(x, weights[up_name], group_sizes, transpose_rhs=transpose_rhs,
                 rhs_scale=weights[f"{up_name}_scale"], bias=weights[f"{up_name}_bias"])
  h = module._apply_gate(h) if up_name == "gate_up_proj" else module.act_fn(h)
  # As Transformers' grouped_mm: the down projection's input in the weights' dtype.
  y = ragged_dot(h.to(compute_dtype), weights["down_proj"], group_sizes,
                 transpose_rhs=transpose_rhs, rhs_scale=weights["down_proj_scale"],
                 bias=weights["down_proj_bias"], out_dtype=torch.float32)
  if getattr(module, "has_post_expert_norm", False):
    y = module.post_expert_norm(y.to(compute_dtype)).float()
  y = y * top_k_weights.reshape(-1)[perm].float()[:, None]
  inverse = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.shape[0],
                                                                  device=perm.device))
  return y[inverse].reshape(tokens, top_k, y.shape[1]).sum(dim=1)


def experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
  """Transformers experts forward on the kernel (register it in ALL_EXPERTS_FUNCTIONS).

  `self` is a Transformers experts module (`@use_experts_implementation`): it reads
  num_experts, has_gate, has_bias, is_transposed, act_fn, `_apply_gate`,
  has_post_expert_norm / post_expert_norm, gate_up_proj / up_proj, down_proj, their biases,
  and the scales and `lhs_quant` flag `quantize_experts_` stores. `experts_plan(self)` says
  which route runs: fused (the gate in the kernel's epilogue) or generic (the module's own
  gate, activation or post-expert norm in torch between two ragged_dot calls). Ids outside
  [0, num_experts) (expert-parallel placeholders, negative ids of dropped pairs) contribute
  nothing. Differentiable on both routes, except with int8 activations (`lhs_quant`: fused
  route only, inference only). Returns [T, H] in hidden_states' dtype.
  """
  op = "experts_forward"
  has_gate = bool(getattr(self, "has_gate", True))
  has_bias = bool(getattr(self, "has_bias", False))
  is_transposed = bool(getattr(self, "is_transposed", False))
  num_experts = int(self.num_experts)
  up_name = "gate_up_proj" if has_gate else "up_proj"
  gate_up, down = getattr(self, up_name), self.down_proj
  gate_up_scale = getattr(self, f"{up_name}_scale", None)
  down_scale = getattr(self, "down_proj_scale", None)
  gate_up_bias = getattr(self, f"{up_name}_bias") if has_bias else None
  down_bias = self.down_proj_bias if has_bias else None
  lhs_quant = getattr(self, "lhs_quant", None) or ""

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

  _check_lhs_quant(op, lhs_quant, {up_name: gate_up, "down_proj": down})
  plan = experts_plan(self)
  if plan.route == "generic" and lhs_quant:
    raise NotImplementedError(
        f"{op}: lhs_quant={lhs_quant!r} runs on the fused route only; "
        f"{type(self).__name__} takes the generic route (experts_plan: {plan.reason})")
  if plan.route == "generic":
    weights = {up_name: gate_up, f"{up_name}_scale": gate_up_scale,
               f"{up_name}_bias": gate_up_bias, "down_proj": down,
               "down_proj_scale": down_scale, "down_proj_bias": down_bias}
    out = _experts_generic(self, hidden_states, top_k_index, top_k_weights, up_name, weights,
                           compute_dtype)
    return out.to(hidden_states.dtype)
  # int64 ids go to JAX as int32 explicitly (DLPack would narrow them silently otherwise).
  index = top_k_index.to(torch.int32).contiguous()
  out = experts_op(hidden_states.to(compute_dtype).contiguous(), index,
                   top_k_weights.contiguous(), gate_up.contiguous(), down.contiguous(),
                   None if gate_up_bias is None else gate_up_bias.contiguous(),
                   None if down_bias is None else down_bias.contiguous(),
                   gate_up_scale, down_scale, num_experts, has_gate, is_transposed,
                   plan.is_concatenated, plan.activation, plan.alpha, plan.limit, lhs_quant)
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


def quantize_experts_(model: torch.nn.Module, dtype: str = "int8",
                      activations: str | None = None) -> int:
  """Quantizes every Transformers experts module of `model` in place, for `experts_forward`.

  gate_up_proj (or up_proj) and down_proj become int8 / float8_e4m3fn buffers with a
  symmetric per-output-channel float32 scale (`<name>_scale` [experts, out], amax / 127 or
  amax / 448), stored [experts, in, out] whatever the module's layout was, and the module's
  `is_transposed` becomes True (the attribute Transformers' experts modules use to say
  so). Why: the kernel reads [G, k, n] weights without transposing each block for the MXU;
  for 1-byte weights in Transformers' [G, n, k] layout that transpose is not hidden under
  the weight DMA at decode (libtpu's static estimate, v6e: 1,892 against 2,276 cycles per
  768 x 2048 int8 block; docs/performance.md, "Quantized decode"). The quantized weights
  are frozen (no gradient); biases stay as they are. The module's own eager forward cannot
  run on them: use experts_implementation="tpu_ragged_dot".

  activations="int8" (int8 weights only) also sets the module's `lhs_quant`: experts_forward
  then quantizes the rows fed to each projection per row (scale = max|row| / 127) and
  multiplies int8 by int8 (W8A8, as tpu-inference's dynamic activation quantization). It
  changes the result (each activation by up to half a step), has no gradient, and pays
  only where int8 weights alone leave the kernel compute-bound (docs/performance.md,
  "int8 activations"). None leaves the flag as it is; "" clears it.
  Returns the number of experts modules quantized (modules already quantized count too).
  """
  if dtype not in _QUANT_MAX:
    raise ValueError(f"quantize_experts_: dtype must be one of {tuple(_QUANT_MAX)}, got "
                     f"{dtype!r}")
  if activations and (activations not in _LHS_QUANTS or dtype != "int8"):
    raise ValueError(f"quantize_experts_: activations must be None, '' or one of "
                     f"{_LHS_QUANTS} with dtype 'int8', got {activations!r} with {dtype!r}")
  count = 0
  for module in model.modules():
    if not hasattr(module, "has_gate") or not isinstance(getattr(module, "down_proj", None),
                                                         torch.Tensor):
      continue
    names = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    quantized = [getattr(module, name).dtype in QUANTIZED_DTYPES for name in names]
    if all(quantized):
      if activations and any(getattr(module, name).dtype != torch.int8 for name in names):
        raise ValueError(f"quantize_experts_: activations={activations!r} needs int8 expert "
                         f"weights; {type(module).__name__}'s are already "
                         f"{dtype_name(getattr(module, names[0]).dtype)}")
    elif any(quantized):   # one layout flag covers both weights: never half-converted
      raise ValueError(f"quantize_experts_: {type(module).__name__} has one quantized and one "
                       f"float expert weight; quantize both or neither")
    else:
      transposed = bool(getattr(module, "is_transposed", False))
      for name in names:
        q, scale = _quantize(getattr(module, name), 2 if transposed else 1, dtype)
        if not transposed:
          q = q.transpose(1, 2).contiguous()   # [E, out, in] -> [E, in, out]
        if name in module._parameters:
          del module._parameters[name]
        else:
          delattr(module, name)
        module.register_buffer(name, q)
        module.register_buffer(f"{name}_scale", scale)
      module.is_transposed = True
    if activations is not None:
      module.lhs_quant = activations
    count += 1
  return count
