"""Plugging the kernels into Transformers models: used by the main job (demo.py) and the tests.

    model = tiny_model("qwen3", torch.float32)        # random weights, built from a config
    kernelize_rms_norm(model, "tpu-kernels/rms-norm-tpu", mode=Mode.INFERENCE)

With transformers 5.23 and kernels 0.17, transformers' `@use_kernel_forward_from_hub`
is a stub (transformers wants kernels >= 0.18.2), so its RMSNorm classes carry no kernel
layer name. `kernelize_rms_norm` finds them by the decorator in their source
(`rms_norm_layer`; `hub_rms_norm_classes` walks every family), marks them with kernels' own
`replace_kernel_forward_from_hub` (what the decorator would have done), then runs
`kernels.kernelize` with a mapping to the Hub repo. The repo resolves through
LOCAL_KERNELS when that is set (as in the tests and the main job), else the Hub.
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import torch

# Norm classes Transformers does not decorate with use_kernel_forward_from_hub -> the layer
# of rms-norm-tpu that replaces their forward (the decorated ones: LAYER_FOR_HUB_NAME).
LAYER_FOR_CLASS = {"GemmaRMSNorm": "GemmaRMSNorm"}

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


# Transformers' hub layer names (use_kernel_forward_from_hub(name)) -> the rms-norm-tpu layer.
LAYER_FOR_HUB_NAME = {"RMSNorm": "RMSNorm", "RMSNormZeroCentered": "GemmaRMSNorm"}
# A top-level class decorated @use_kernel_forward_from_hub("<name>") (other decorators and
# comment lines may stand between).
_HUB_DECORATED = re.compile(
    r'^@use_kernel_forward_from_hub\(\s*"([^"]+)"\s*\)[ \t]*\n(?:[@#].*\n)*class (\w+)\b', re.M)


@functools.cache
def _hub_decorated_classes(path: str) -> dict[str, str]:
  """{class name: hub layer name} of a source file's decorated top-level classes."""
  return {cls: name for name, cls in _HUB_DECORATED.findall(Path(path).read_text())}


def hub_layer_name(cls: type) -> str | None:
  """The name of the `@use_kernel_forward_from_hub(name)` decorating a Transformers class,
  read from its module's source (with kernels 0.17 the decorator is a stub: the class
  carries no mark), or None."""
  if not cls.__module__.startswith("transformers."):
    return None
  path = getattr(sys.modules.get(cls.__module__), "__file__", None)
  return _hub_decorated_classes(path).get(cls.__name__) if path else None


def rms_norm_layer(cls: type) -> str | None:
  """The rms-norm-tpu layer that replaces a Transformers norm class's forward, or None."""
  return LAYER_FOR_HUB_NAME.get(hub_layer_name(cls)) or LAYER_FOR_CLASS.get(cls.__name__)


@functools.cache
def hub_rms_norm_classes() -> tuple[tuple[str, type], ...]:
  """(family, class) for every class of the installed Transformers' modeling modules
  whose hub layer name is a key of LAYER_FOR_HUB_NAME (a module that fails to import
  raises). Imports every modeling module that has one (5-15 s here)."""
  import importlib

  import transformers.models

  found = []
  for path in sorted(Path(transformers.models.__path__[0]).glob("*/modeling_*.py")):
    names = [cls for cls, name in _hub_decorated_classes(str(path)).items()
             if name in LAYER_FOR_HUB_NAME]
    if names:
      module = importlib.import_module(f"transformers.models.{path.parent.name}.{path.stem}")
      found += [(path.parent.name, getattr(module, cls)) for cls in names]
  return tuple(found)


def rms_norm_modules(model) -> list[torch.nn.Module]:
  return [m for m in model.modules() if rms_norm_layer(type(m)) is not None]


def kernelize_rms_norm(model, repo_id: str, *, mode=None, device: str = "cpu",
                       revision: str = "v1"):
  """Replaces the forward of every RMSNorm in `model` by rms-norm-tpu's layers.

  Raises if any RMSNorm could not be replaced (no silent fallback to the stock forward).
  """
  from kernels import (LayerRepository, Mode, kernelize, replace_kernel_forward_from_hub,
                       use_kernel_mapping)

  mode = Mode.INFERENCE if mode is None else mode
  layers = set()
  for module in rms_norm_modules(model):
    layer = rms_norm_layer(type(module))
    if getattr(type(module), "kernel_layer_name", None) != layer:
      replace_kernel_forward_from_hub(type(module), layer)
    layers.add(layer)
  mapping = {layer: {device: LayerRepository(repo_id, layer_name=layer, revision=revision)}
             for layer in layers}
  with use_kernel_mapping(mapping, inherit_mapping=False):
    return kernelize(model, mode=mode, device=device, use_fallback=False)


# Every family's RMSNorm class against its own forward (tests/torch/test_rms_norm_all_families.py,
# the coverage table's norm column). Tolerances relative to the largest stock output: those
# tests/torch/test_kernelize.py documents for logits.
RMS_NORM_TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 2e-2}
# (x dtype, weight dtype): bfloat16 with a float32 weight is gpt-oss's (norms kept in f32).
RMS_NORM_CASES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                  (torch.bfloat16, torch.float32)]
_NORM_HIDDEN = 48


def tiny_rms_norm(cls: type, weight_dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
  """cls(48, eps=1e-5), its weight drawn around its initial value with std 0.1."""
  torch.manual_seed(seed)
  norm = cls(_NORM_HIDDEN, 1e-5)
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
  if norm.forward.__func__ is cls.forward:
    return "not kernelized"
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
