"""Plugging the kernels into Transformers models: used by the main job (demo.py) and the tests.

    model = tiny_model("qwen3", torch.float32)        # random weights, built from a config
    kernelize_rms_norm(model, "tpu-kernels/rms-norm-tpu", mode=Mode.INFERENCE)

With transformers 5.23 and kernels 0.17, transformers' `@use_kernel_forward_from_hub`
is a stub (transformers wants kernels >= 0.18.2), so its RMSNorm classes carry no kernel
layer name. `kernelize_rms_norm` marks them with kernels' own
`replace_kernel_forward_from_hub` (what the decorator would have done), then runs
`kernels.kernelize` with a mapping to the Hub repo. The repo resolves through
LOCAL_KERNELS when that is set (as in the tests and the main job), else the Hub.
"""

from __future__ import annotations

import torch

# Transformers RMSNorm classes -> the layer of rms-norm-tpu that replaces their forward.
# Llama-style classes keep epsilon in `variance_epsilon`, Gemma's in `eps` with (1 + w).
LAYER_FOR_CLASS = {
    "LlamaRMSNorm": "RMSNorm",
    "Qwen3RMSNorm": "RMSNorm",
    "Qwen2RMSNorm": "RMSNorm",
    "MistralRMSNorm": "RMSNorm",
    "GemmaRMSNorm": "GemmaRMSNorm",
}

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


def rms_norm_modules(model) -> list[torch.nn.Module]:
  return [m for m in model.modules() if type(m).__name__ in LAYER_FOR_CLASS]


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
    layer = LAYER_FOR_CLASS[type(module).__name__]
    if getattr(type(module), "kernel_layer_name", None) != layer:
      replace_kernel_forward_from_hub(type(module), layer)
    layers.add(layer)
  mapping = {layer: {device: LayerRepository(repo_id, layer_name=layer, revision=revision)}
             for layer in layers}
  with use_kernel_mapping(mapping, inherit_mapping=False):
    return kernelize(model, mode=mode, device=device, use_fallback=False)
