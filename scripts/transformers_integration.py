"""Plugging the kernels into Transformers models: used by the main job (demo.py) and the tests.

rms-norm-tpu (transformers 5.25, kernels 0.19): Transformers' `@use_kernel_forward_from_hub`
decorators are live, `from_pretrained` kernelizes on load (`use_kernels` is on unless
USE_HUB_KERNELS is off) and `train()` / `eval()` kernelize again for the new mode, each
time against the kernel mapping registered in the process. So the recipe is to register
rms-norm-tpu's layers in that mapping (`use_rms_norm_tpu`, what the card shows), then load:

    use_rms_norm_tpu("tpu-kernels/rms-norm-tpu")               # the process-wide mapping
    model = AutoModelForCausalLM.from_pretrained(path)          # kernelized on load
    kernelize_rms_norm(model, "tpu-kernels/rms-norm-tpu")       # or: a model built otherwise

A mapping given to `kernels.kernelize` inside `use_kernel_mapping` does not last: the next
`train()` / `eval()` kernelizes again without it and puts the stock forward back (tested).
A `KernelConfig` is refused on a CPU model (its devices are cuda, rocm, xpu, npu, neuron,
tpu, mps) and is turned into a mapping for the mode of the moment, so on a TPU `train()`
after an inference load would fall back to the stock forward (read from modeling_utils.py
and utils/kernel_config.py; not run: no TPU here).

Which classes are RMSNorms (`rms_norm_layer`, one rule, by class, no hand list):
  1. a class Transformers decorates `@use_kernel_forward_from_hub("RMSNorm")` or
     `("RMSNormZeroCentered")`, or a subclass of one (the mark is a class attribute):
     layers.RMSNorm, resp. layers.GemmaRMSNorm;
  2. an undecorated class of transformers.models named `*RMSNorm` (so `*RMSNormGated`, the
     gated norms, are not) that `cls(hidden, eps=eps)` builds with exactly one parameter,
     `weight` of shape (hidden,), no buffer, and the epsilon in `variance_epsilon` or `eps`:
     layers.RMSNorm when the weight starts at 1 (`weight * x`), layers.GemmaRMSNorm when it
     starts at 0 (`(1 + weight) * x`; Gemma 1-3, Qwen3-Next, ...). These (among them the 13
     families whose norm lost its decorator in 5.24/5.25: gpt-oss, OLMo 2/3, ...) are marked
     with kernels' `replace_kernel_forward_from_hub(cls, cls.__name__)` under their own
     name, not Transformers' "RMSNorm", so that Transformers' own "RMSNorm" mapping (Liger's
     kernel on CUDA / ROCm) does not reach classes Transformers left undecorated; and with a
     condition (`configured_as_plain`), so that an instance built otherwise than
     `cls(hidden, eps=eps)` (Qwen4-exp's grouped norms) keeps its own forward; a weightless
     instance (Gemma 4's `with_scale=False` norms) runs the layer with a weight of ones.
Which formula a class computes is not decided here: the layers run the class's own forward
on a probe row once per class and dtype and refuse (NotImplementedError) a class whose
forward is not the layer's formula (rms_norm_class_mismatch compares them in full).
"""

from __future__ import annotations

import contextlib
import functools

import torch

_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             max_position_embeddings=128, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny_model(family: str, dtype: torch.dtype = torch.float32, seed: int = 0):
  """A small randomly initialised causal LM ("llama", "qwen3" or "gemma"), eval mode, CPU."""
  from transformers import AutoModelForCausalLM, GemmaConfig, LlamaConfig, Qwen3Config

  config_class = {"llama": LlamaConfig, "qwen3": Qwen3Config, "gemma": GemmaConfig}[family]
  config = config_class(**_TINY)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, dtype=dtype)
  # Norm weights start at exactly 1 (Gemma: 0, scale 1 + w): randomise them so that the
  # weight multiply (and its rounding) is really exercised.
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.normal_(0.0 if family == "gemma" else 1.0, 0.1)
  return model.eval()


# ------------------------------------------------------------------ rms-norm-tpu

# Transformers' hub layer names of its plain RMS norms -> the rms-norm-tpu layer.
LAYER_FOR_HUB_NAME = {"RMSNorm": "RMSNorm", "RMSNormZeroCentered": "GemmaRMSNorm"}
# Where a norm keeps its epsilon: the attributes the layers read (layers._epsilon).
EPSILON_ATTRIBUTES = ("variance_epsilon", "eps")
# The devices the mapping covers: "tpu" (TorchTPU), "cpu" (Pallas interpret mode).
DEVICES = ("cpu", "tpu")
# Undecorated classes this module marked for kernelize (under their own name).
_MARKED: set[type] = set()
_PROBE_HIDDEN, _PROBE_EPS = 8, 1e-6


def hub_layer_name(cls: type) -> str | None:
  """The hub layer name Transformers gave `cls` with `@use_kernel_forward_from_hub` (on
  it or on a base class), or None; a mark made by this module does not count."""
  for klass in cls.__mro__:
    if "kernel_layer_name" in vars(klass):
      return None if klass in _MARKED else klass.kernel_layer_name
  return None


def _epsilon(module) -> float | None:
  return next((getattr(module, a) for a in EPSILON_ATTRIBUTES if hasattr(module, a)), None)


@functools.cache
def undecorated_rms_norm_verdict(cls: type) -> tuple[str | None, str]:
  """(rms-norm-tpu layer or None, why) for a class without a hub layer name: rule 2 of
  the module docstring, judged on cls(8, eps=1e-6)."""
  if not cls.__module__.startswith("transformers.models."):
    return None, "not a class of transformers.models"
  if not cls.__name__.endswith("RMSNorm"):
    return None, "not named *RMSNorm"
  try:
    norm = cls(_PROBE_HIDDEN, eps=_PROBE_EPS)
  except Exception as e:  # noqa: BLE001  (any failure: not built like an RMSNorm)
    return None, f"not built by {cls.__name__}(hidden_size, eps=eps): {type(e).__name__}: {e}"
  params = {name: tuple(p.shape) for name, p in norm.named_parameters()}
  if "weight" not in params:
    return None, "has no weight"
  if params != {"weight": (_PROBE_HIDDEN,)} or any(True for _ in norm.buffers()):
    return None, f"has more state than one weight of the hidden size: {sorted(params)}"
  if _epsilon(norm) != _PROBE_EPS:
    return None, f"keeps its epsilon in none of {EPSILON_ATTRIBUTES}"
  weight = norm.weight.detach()
  if bool((weight == 1).all()):
    return "RMSNorm", "weight starts at 1: weight * x"
  if bool((weight == 0).all()):
    return "GemmaRMSNorm", "weight starts at 0: (1 + weight) * x"
  return None, "its weight starts neither at 1 (weight * x) nor at 0 ((1 + weight) * x)"


def rms_norm_layer(cls: type) -> str | None:
  """The rms-norm-tpu layer that replaces the forward of norm class `cls` (the rule of the
  module docstring), or None when `cls` is not a plain RMSNorm."""
  if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
    return None
  hub = hub_layer_name(cls)
  if hub is not None:
    return LAYER_FOR_HUB_NAME.get(hub)
  return undecorated_rms_norm_verdict(cls)[0]


@functools.lru_cache(maxsize=None)
def _plain_state(cls: type, hidden: int, eps: float) -> tuple:
  return _state(cls(hidden, eps=eps))


def _state(module) -> tuple:
  """What `configured_as_plain` compares: parameter names and shapes, public attributes
  (not tensors, not callables)."""
  params = tuple((name, tuple(p.shape)) for name, p in module.named_parameters())
  attributes = tuple(sorted(
      (k, v) for k, v in vars(module).items()   # not the forward kernelize binds
      if not k.startswith("_") and k != "training" and not callable(v)
      and not isinstance(v, torch.Tensor)))
  return params, attributes


def configured_as_plain(module) -> bool:
  """kernelize's condition for the undecorated classes: the module is built as
  `type(module)(hidden, eps=eps)` builds it (same parameters, same public attributes), or
  it is weightless (no parameter, no buffer, `weight` absent or None: Gemma 4's and Gemma
  3n's `with_scale=False` norms), which the layers run with a weight of ones once the class's
  own forward agrees on a probe row (they refuse it otherwise). Any other build (a group
  size, a bias) keeps its own forward."""
  weight, eps = getattr(module, "weight", None), _epsilon(module)
  if eps is None:
    return False
  if weight is None:
    return (not any(True for _ in module.parameters())
            and not any(True for _ in module.buffers()))
  if not isinstance(weight, torch.nn.Parameter) or weight.ndim != 1:
    return False
  return _state(module) == _plain_state(type(module), weight.shape[0], eps)


def rms_norm_modules(model) -> list[torch.nn.Module]:
  """The modules of `model` rms-norm-tpu replaces: every instance of a class Transformers
  decorates (rule 1), and of an undecorated RMSNorm class those `configured_as_plain`."""
  return [m for m in model.modules() if rms_norm_layer(type(m)) is not None
          and (hub_layer_name(type(m)) is not None or configured_as_plain(m))]


def rms_norm_layer_repository(repo_id: str, layer: str):
  """kernels' LayerRepository of an rms-norm-tpu layer (major version 1)."""
  from kernels import LayerRepository

  return LayerRepository(repo_id, layer_name=layer, version=1, trust_remote_code=[repo_id])


def use_rms_norm_tpu(repo_id: str, classes=(), *, devices=DEVICES) -> dict[str, str]:
  """The recipe: registers rms-norm-tpu's layers, for the whole process (kernels'
  register_kernel_mapping), on `devices` under Transformers' hub names "RMSNorm" and
  "RMSNormZeroCentered", and under its own name each undecorated RMSNorm class among
  `classes` (marked for kernelize first; decorated classes are skipped). Transformers'
  kernelize applies the mapping: from_pretrained on load, set_use_kernels(True) and every
  train() / eval(). Returns {layer name in the mapping: rms-norm-tpu layer}. Raises
  ValueError for a class of `classes` that is not an RMSNorm (rms_norm_layer)."""
  from kernels import register_kernel_mapping, replace_kernel_forward_from_hub

  names = dict(LAYER_FOR_HUB_NAME)
  for cls in classes:
    if hub_layer_name(cls) is not None:
      continue
    layer, why = undecorated_rms_norm_verdict(cls)
    if layer is None:
      raise ValueError(f"{cls.__name__} is not an RMSNorm rms-norm-tpu replaces: {why}")
    if "kernel_layer_name" not in vars(cls):
      replace_kernel_forward_from_hub(cls, cls.__name__, condition=configured_as_plain)
      _MARKED.add(cls)
    names[cls.kernel_layer_name] = layer
  register_kernel_mapping({name: {device: rms_norm_layer_repository(repo_id, layer)
                                  for device in devices} for name, layer in names.items()})
  return names


def kernelize_rms_norm(model, repo_id: str, *, mode=None):
  """Puts rms-norm-tpu under every RMSNorm of `model` (rms_norm_modules): use_rms_norm_tpu
  for its norm classes, then kernels.kernelize with fallback for layers that have no cpu /
  tpu mapping (rotary embeddings, activations: they keep their forward; a kernel that fails
  to load raises). Lasts through train() / eval() (the mapping is the process's).

  Raises ValueError if `model` has no RMSNorm, RuntimeError if any was not replaced (no
  silent fallback to the stock forward).
  """
  from kernels import KernelizeFallback, Mode, kernelize

  norms = rms_norm_modules(model)
  if not norms:
    raise ValueError(f"{type(model).__name__} has no RMSNorm module rms-norm-tpu replaces")
  use_rms_norm_tpu(repo_id, {type(m) for m in norms})
  kernelize(model, mode=Mode.INFERENCE if mode is None else mode,
            use_fallback=KernelizeFallback.DEFAULT)
  assert_rms_norms_kernelized(model, repo_id)
  return model


def assert_rms_norms_kernelized(model, repo_id: str) -> int:
  """Raises RuntimeError naming every RMSNorm of `model` (rms_norm_modules) whose forward
  is not rms-norm-tpu's layer from `repo_id`; returns how many there are."""
  norms = rms_norm_modules(model)
  names = {id(m): name for name, m in model.named_modules()}
  wrong = [f"{names[id(m)] or '<model>'} ({type(m).__name__})" for m in norms
           if m.__dict__.get("_kernel_repo")
           != rms_norm_layer_repository(repo_id, rms_norm_layer(type(m)))]
  if wrong:
    raise RuntimeError(f"{len(wrong)} of {len(norms)} RMSNorm modules do not run "
                       f"{repo_id}'s layer: " + ", ".join(wrong))
  return len(norms)


@contextlib.contextmanager
def kernel_mapping_scope():
  """Kernel mappings registered inside (use_rms_norm_tpu's, Transformers' own) and the
  classes marked inside are undone at exit, so that one test's mapping does not reach the
  models of the next (tests, the coverage walk). Forwards already replaced stay."""
  from kernels import use_kernel_mapping

  marked_before = set(_MARKED)
  try:
    with use_kernel_mapping({}, inherit_mapping=True):
      yield
  finally:
    for cls in _MARKED - marked_before:
      del cls.kernel_layer_name, cls.kernel_condition
      _MARKED.discard(cls)


# Every RMSNorm class against its own forward (tests/torch/test_rms_norm_all_families.py, the
# coverage table's norm column). Tolerances relative to the largest stock output: those
# tests/torch/test_kernelize.py documents for logits.
RMS_NORM_TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 2e-2}
# (x dtype, weight dtype): bfloat16 with a float32 weight is gpt-oss's (norms kept in f32).
RMS_NORM_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                  (torch.bfloat16, torch.float32)]
_NORM_HIDDEN = 48


def tiny_rms_norm(cls: type, weight_dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
  """cls(48, eps=1e-5), its weight drawn around its initial value with std 0.1."""
  torch.manual_seed(seed)
  norm = cls(_NORM_HIDDEN, eps=1e-5)
  with torch.no_grad():
    norm.weight.copy_(norm.weight + 0.1 * torch.randn(_NORM_HIDDEN))
  return norm.to(weight_dtype)


def rms_norm_input(dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
  gen = torch.Generator().manual_seed(seed)
  return (torch.randn(2, 5, _NORM_HIDDEN, generator=gen) * 3.0).to(dtype)


def rms_norm_class_mismatch(cls: type, repo_id: str, x_dtype: torch.dtype,
                            weight_dtype: torch.dtype, *, mode=None) -> str | None:
  """Kernelizes a tiny `cls` (kernelize_rms_norm) and compares it with the class's own
  forward: None when they match (dtype exactly, values within RMS_NORM_TOLERANCE; in
  float32 training mode also the gradients of x and the weight within 1e-4), else what
  differs. The layer's NotImplementedError (a refusal) propagates."""
  from kernels import Mode

  mode = Mode.INFERENCE if mode is None else mode
  norm = tiny_rms_norm(cls, weight_dtype)
  x = rms_norm_input(x_dtype)
  kernelize_rms_norm(torch.nn.ModuleList([norm]), repo_id, mode=mode)
  want = cls.forward(norm, x)
  got = norm(x)
  if got.dtype != want.dtype or got.shape != want.shape:
    return f"{got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
  scale = want.double().abs().max().item()
  error = (got.double() - want.double()).abs().max().item()
  if not error <= RMS_NORM_TOLERANCE[x_dtype] * scale:
    return f"max error {error:.3g} (largest output {scale:.3g})"
  if Mode.TRAINING in mode and x_dtype == torch.float32:
    x = x.requires_grad_()
    direction = torch.randn_like(want)
    grads = []
    for forward in (lambda t: cls.forward(norm, t), norm):
      norm.weight.grad, x.grad = None, None
      (forward(x) * direction).sum().backward()
      grads.append((x.grad.clone(), norm.weight.grad.clone()))
    for name, want_grad, got_grad in zip(("x", "weight"), grads[0], grads[1]):
      if not (got_grad - want_grad).abs().max().item() <= 1e-4 * want_grad.abs().max().item():
        return f"gradient of {name} off"
  return None


# ------------------------------------------------------------------ flash-attention-tpu
#
#   kernel = register_tpu_attention("tpu-kernels/flash-attention-tpu")   # "tpu_attention"
#   model = tiny_attention_model("gemma2", torch.float32, attn_implementation="tpu_attention")
#
# Families: "llama" (GQA), "qwen3" (GQA, q/k norms), "gemma2" (attention logit soft-cap,
# sliding window on every other layer), "gpt_oss" (sinks, sliding window on every other
# layer, MoE: two experts, both used by every token). The window (8) is shorter than the test sequences so that it matters, and
# the weights are drawn with std 0.2 (not Transformers' 0.02), which makes the attention
# far from uniform: at 0.02 every row of a tiny Llama is within 10% of the mean over its
# keys, and a wrong mask or soft-cap would hardly show.

ATTENTION_FAMILIES = ("llama", "qwen3", "gemma2", "gpt_oss")
ATTENTION_WINDOW = 8
_TINY_ATTENTION = dict(_TINY, initializer_range=0.2)


def register_tpu_attention(repo_id: str, name: str | None = None, version: int = 1):
  """Loads flash-attention-tpu with get_kernel and registers its attention (and mask
  function) with Transformers under `name` (default the kernel's, "tpu_attention").
  Returns the kernel module; `attn_implementation=<name>` then runs on it."""
  from kernels import get_kernel

  kernel = get_kernel(repo_id, version=version)
  kernel.register_attention(*(() if name is None else (name,)))
  return kernel


EXPERTS_NAME = "tpu_ragged_dot"


def register_ragged_experts(repo_id: str, name: str = EXPERTS_NAME, version: int = 1):
  """Loads ragged-dot-tpu with get_kernel and registers its `experts_forward` as
  Transformers' experts implementation `name`. Returns the kernel module;
  `model.set_experts_implementation(name)` then runs a MoE model's experts on it."""
  from kernels import get_kernel
  from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

  kernel = get_kernel(repo_id, version=version)
  ALL_EXPERTS_FUNCTIONS.register(name, kernel.experts_forward)
  return kernel


def tiny_attention_config(family: str, num_hidden_layers: int = 2):
  """The config of a tiny causal LM of `family` (ATTENTION_FAMILIES), hidden 64, 4 query
  heads and 2 KV heads of 16."""
  import transformers as tr

  common = dict(_TINY_ATTENTION, num_hidden_layers=num_hidden_layers)
  if family == "llama":
    return tr.LlamaConfig(**common)
  if family == "qwen3":
    return tr.Qwen3Config(**common)
  if family == "gemma2":
    # query_pre_attn_scalar = head_dim: scaling 1/4 (the default 256 would shrink every
    # logit below the cap); cap 2.0: reached by these logits, so the tanh is exercised.
    return tr.Gemma2Config(**common, sliding_window=ATTENTION_WINDOW,
                           attn_logit_softcapping=2.0, query_pre_attn_scalar=16)
  if family == "gpt_oss":
    # Every token to both experts: no top-k choice for rounding noise to flip.
    common.update(intermediate_size=32)
    return tr.GptOssConfig(**common, num_local_experts=2, num_experts_per_tok=2,
                           sliding_window=ATTENTION_WINDOW)
  raise ValueError(f"unknown family {family!r}; expected one of {ATTENTION_FAMILIES}")


def tiny_attention_model(family: str, dtype: torch.dtype = torch.float32, *,
                         num_hidden_layers: int = 2, seed: int = 0,
                         attn_implementation: str = "eager"):
  """A small randomly initialised causal LM of `family` (see tiny_attention_config), eval
  mode, CPU. Norm weights are randomised too (Qwen3's q/k norms around 2, which spreads
  its otherwise unit-scale logits)."""
  from transformers import AutoModelForCausalLM

  config = tiny_attention_config(family, num_hidden_layers)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, dtype=dtype,
                                           attn_implementation=attn_implementation)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if name.endswith(("q_norm.weight", "k_norm.weight")):
        p.normal_(2.0, 0.3)
      elif "norm" in name:
        p.normal_(0.0 if family == "gemma2" else 1.0, 0.1)
  return model.eval()


# ------------------------------------------------------------------ linear attention (issue 59)
#
#   use_linear_attention_tpu("tpu-kernels")                 # the process-wide mapping
#   model = AutoModelForCausalLM.from_pretrained(path)      # kernelized on load
#   kernelize_linear_attention(model, "tpu-kernels")        # or: a model built otherwise
#
# Transformers 5.25's linear-attention layers (Gated DeltaNet: Qwen3.5 dense and MoE,
# Qwen3-Next, OLMo-Hybrid, ...; the Mamba-style families' convs) call module-level
# functions that it wraps as kernels function layers under hub names
# (`use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`, ...) and lists
# on the calling layer (`use_kernelized_func`): kernelize replaces each layer's private copy
# of the function with the mapped layer's forward. Its gated norm is decorated
# `use_kernel_forward_from_hub("RMSNormGated")`. Transformers maps these names for cuda /
# rocm / xpu only (fla, mamba-ssm); the recipe registers the three repos' layers for "tpu"
# (and "cpu": interpret mode) in the process's mapping, the RMSNorm recipe's way, so that
# from_pretrained, set_use_kernels(True) and every train() / eval() apply it. The layers
# then receive the model's calls as they are (Transformers' fallback wrapper, and its
# ValueError on packed sequences, no longer runs).

# Transformers' hub name -> (kernel repo, layer of that repo).
LINEAR_ATTENTION_LAYERS = {
    "chunk_gated_delta_rule": ("gated-delta-rule-tpu", "ChunkGatedDeltaRule"),
    "fused_recurrent_gated_delta_rule": ("gated-delta-rule-tpu", "FusedRecurrentGatedDeltaRule"),
    "causal_conv1d_fn": ("causal-conv1d-tpu", "CausalConv1dFn"),
    "causal_conv1d_update": ("causal-conv1d-tpu", "CausalConv1dUpdate"),
    "causal_conv1d_forward": ("causal-conv1d-tpu", "CausalConv1dForward"),
    "RMSNormGated": ("rms-norm-tpu", "RMSNormGated"),
}


def linear_attention_layer_repository(org: str, hub_name: str):
  """kernels' LayerRepository (major version 1) of the layer mapped to `hub_name`."""
  from kernels import LayerRepository

  repo, layer = LINEAR_ATTENTION_LAYERS[hub_name]
  repo_id = f"{org}/{repo}"
  return LayerRepository(repo_id, layer_name=layer, version=1, trust_remote_code=[repo_id])


def use_linear_attention_tpu(org: str, *, devices=DEVICES) -> dict:
  """The recipe: registers, for the whole process (kernels' register_kernel_mapping), the
  layers of gated-delta-rule-tpu, causal-conv1d-tpu and rms-norm-tpu (published under
  `org`) for every hub name of LINEAR_ATTENTION_LAYERS on `devices`. Returns {hub name:
  LayerRepository}."""
  from kernels import register_kernel_mapping

  repos = {name: linear_attention_layer_repository(org, name) for name in LINEAR_ATTENTION_LAYERS}
  register_kernel_mapping({name: {device: repo for device in devices}
                           for name, repo in repos.items()})
  return repos


def linear_attention_calls(model) -> list[tuple[str, str, torch.nn.Module]]:
  """(module path, hub name, the module kernelize replaces the forward of) for every
  linear-attention call of `model` the recipe maps: each function layer a module lists
  (`_kernel_funcs`) under one of the hub names, and each module whose class is decorated
  with one (the gated norms)."""
  calls = []
  for path, module in model.named_modules():
    for func in getattr(module, "_kernel_funcs", {}).values():
      name = getattr(type(func), "kernel_layer_name", None)
      if name in LINEAR_ATTENTION_LAYERS:
        calls.append((path, name, func))
    name = hub_layer_name(type(module))
    if name in LINEAR_ATTENTION_LAYERS:
      calls.append((path, name, module))
  return calls


def assert_linear_attention_kernelized(model, org: str) -> int:
  """Raises RuntimeError naming every call of linear_attention_calls(model) whose forward is
  not the mapped layer from `org`'s repos; returns how many calls there are."""
  calls = linear_attention_calls(model)
  wrong = [f"{path or '<model>'}: {name}" for path, name, module in calls
           if module.__dict__.get("_kernel_repo")
           != linear_attention_layer_repository(org, name)]
  if wrong:
    raise RuntimeError(f"{len(wrong)} of {len(calls)} linear-attention calls do not run the "
                       f"kernels: " + ", ".join(wrong))
  return len(calls)


def kernelize_linear_attention(model, org: str, *, mode=None):
  """Puts the linear-attention kernels under every call of linear_attention_calls(model):
  use_linear_attention_tpu, then Transformers' own set_use_kernels(True) for a
  PreTrainedModel (what from_pretrained does on load; train() / eval() kernelize again),
  else kernels.kernelize (other layers keep their forward). `mode` (kernels' Mode) defaults
  to the model's training flag. Raises ValueError if the model has no such call,
  RuntimeError if any was not replaced (no silent stock fallback)."""
  from kernels import KernelizeFallback, Mode, kernelize
  from transformers import PreTrainedModel

  if not linear_attention_calls(model):
    raise ValueError(f"{type(model).__name__} makes no linear-attention call these kernels "
                     f"replace")
  use_linear_attention_tpu(org)
  if mode is None:
    mode = Mode.TRAINING if model.training else Mode.INFERENCE
  if isinstance(model, PreTrainedModel):
    model.set_use_kernels(True, mode=mode)
  else:
    kernelize(model, mode=mode, use_fallback=KernelizeFallback.DEFAULT)
  assert_linear_attention_kernelized(model, org)
  return model


class RecordKernelOps:
  """A torch dispatch mode that records which custom ops of the given loaded kernel
  packages run (by op name, e.g. "chunk_gated_delta_rule"), to see that a model's calls
  reached the kernels, not only that its forwards were swapped:

      with RecordKernelOps([gdn, conv, rms]) as ops:
        model(ids)
      assert "chunk_gated_delta_rule" in ops.called
  """

  def __init__(self, kernels):
    from torch.utils._python_dispatch import TorchDispatchMode

    namespaces = tuple(k.__name__.rsplit("_", 1)[0] for k in kernels)   # drop _cpu / _tpu
    called = self.called = set()

    class Mode(TorchDispatchMode):
      def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, name = func.name().partition("::")
        if namespace.startswith(namespaces):
          called.add(name.split(".")[0])
        return func(*args, **(kwargs or {}))

    self._mode = Mode()

  def __enter__(self):
    self._mode.__enter__()
    return self

  def __exit__(self, *exc):
    return self._mode.__exit__(*exc)


# Tiny hybrid models (linear attention + full attention), one of each layer kind, whose
# linear-attention shapes are the same for every family (so that the kernels' compiled
# programs are shared): 2 key heads and 4 value heads of 16, conv width 4 over 128
# channels. Weights drawn with std 0.2 (as the attention models'), norm weights around
# their initial value.
LINEAR_ATTENTION_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid")
_TINY_LINEAR = dict(_TINY, initializer_range=0.2,
                    layer_types=["linear_attention", "full_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4)
_TINY_LINEAR_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32)


def tiny_linear_attention_config(family: str):
  """The config of a tiny hybrid causal LM of `family` (LINEAR_ATTENTION_FAMILIES)."""
  import transformers as tr

  if family == "qwen3_5":
    return tr.Qwen3_5TextConfig(**_TINY_LINEAR)
  if family == "qwen3_5_moe":
    return tr.Qwen3_5MoeTextConfig(**_TINY_LINEAR, **_TINY_LINEAR_MOE)
  if family == "qwen3_next":
    return tr.Qwen3NextConfig(**_TINY_LINEAR, **_TINY_LINEAR_MOE)
  if family == "olmo_hybrid":
    return tr.OlmoHybridConfig(**_TINY_LINEAR)
  raise ValueError(f"unknown family {family!r}; expected one of {LINEAR_ATTENTION_FAMILIES}")


def tiny_linear_attention_model(family: str, dtype: torch.dtype = torch.float32, *,
                                seed: int = 0):
  """A small randomly initialised hybrid causal LM of `family` (see above), eval mode, CPU,
  eager attention."""
  from transformers import AutoModelForCausalLM

  config = tiny_linear_attention_config(family)
  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.add_(0.1 * torch.randn_like(p))
  return model.eval()
