"""Transformers models in a serving loop over PagedKVCache (continuous batching).

    kernel.register_attention()                      # "tpu_serving"
    model.set_attn_implementation("tpu_serving")
    batch = cache.schedule([("a", 16), ("b", 1)], num_tokens=32)
    logits = model(input_ids=packed_ids[None], position_ids=batch.positions[None],
                   use_cache=False, tpu_serving_step=ServingStep(cache, batch)).logits[0]

The model sees one packed row [1, T] holding every scheduled sequence's new tokens
(prefill chunks and decode tokens mixed, padding at the end) with their positions; each
attention layer gets the new tokens' rotary-applied keys and values, writes them into
its layer of the cache (write_kv_cache_) and attends over the cache
(ragged_paged_attention). Transformers' own KV cache is off (use_cache=False): the paged
cache is the only one. The per-step metadata travels as the keyword argument
`tpu_serving_step`, which Transformers hands to every attention call.
"""

from __future__ import annotations

import dataclasses

import torch

from ._shim import transformers_masks, validation
from .cache import PagedBatch, PagedKVCache

DEFAULT_ATTENTION_NAME = "tpu_serving"
STEP_KWARG = "tpu_serving_step"


@dataclasses.dataclass(frozen=True)
class ServingStep:
  """What the attention layers of one forward need: the cache and the step's metadata."""

  cache: PagedKVCache
  batch: PagedBatch


def make_attention_mask(batch_size: int = 1, q_length: int = 0, kv_length: int = 0,
                        q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
                        **kwargs):
  """Transformers mask function (AttentionMaskInterface): no mask. The attention computes
  its own causal (and sliding-window) visibility from the paging metadata, so any other
  pattern the model asks for (chunked, bidirectional, or/and overlays such as image
  tokens, a causal mask to materialize and add to) raises NotImplementedError. A
  sliding-window pattern returns an empty [B, 0] base carrying its window in its shape
  (transformers_masks.encode_mask: [B, 0, 3, 3, code, 3]), which the attention
  applies, in eager and under torch.compile alike."""
  if mask_function is None:
    return None
  pattern = transformers_masks.mask_pattern(mask_function)
  if pattern.kind not in ("causal", "sliding"):
    raise NotImplementedError(
        f"paged-attention-tpu serving: the model asks for a mask pattern the paged "
        f"attention does not compute ({pattern.kind}: {pattern.name}); it computes causal "
        f"and sliding-window causal attention per sequence, not chunked or bidirectional "
        f"attention or or/and overlays (image tokens, blockwise)")
  # The model asks for a materialized mask to add to or read (Doge's dynamic mask,
  # Falcon's ALiBi, indexers), packed steps included.
  if transformers_masks.asks_for_materialized_mask(pattern, kwargs):
    raise NotImplementedError(
        "paged-attention-tpu serving: the model asks for its causal mask materialized "
        "(allow_is_causal_skip=False) to add to it or read it itself; the paged attention "
        "takes no mask")
  if pattern.kind == "sliding":
    # The window travels with the mask: some models pass no sliding_window (Phi-MoE).
    empty = torch.zeros(batch_size, 0, dtype=torch.bool, device=kwargs.get("device", "cpu"))
    return transformers_masks.encode_mask(empty, pattern, padding=False)
  return None


setattr(make_attention_mask, transformers_masks.MARK, True)   # see check_mask_function


_UNSUPPORTED_KWARGS = ("position_bias", "cu_seq_lens_q", "cu_seq_lens_k")


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, sliding_window: int | None = None,
                      softcap: float | None = None, s_aux: torch.Tensor | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
  """Transformers attention function (AttentionInterface) over the paged cache.

  query [1, Hq, T, D], key / value [1, Hkv, T, D]: the packed new tokens of one step.
  Writes key / value to layer module.layer_idx of kwargs["tpu_serving_step"].cache at
  the step's slots, then attends. Returns (attn_output [1, T, Hq, D], None).
  """
  op = "paged-attention-tpu attention_forward"
  # Without this package's mask function, an unsupported mask pattern would go unnoticed.
  transformers_masks.check_mask_function(op, module, "register_attention(name)")
  step = kwargs.get(STEP_KWARG)
  if not isinstance(step, ServingStep):
    raise ValueError(f"{op}: call the model with {STEP_KWARG}=ServingStep(cache, batch) "
                     f"(got {type(step).__name__}): the paged cache and the step's paging "
                     f"metadata")
  if dropout:
    raise NotImplementedError(f"{op}: attention dropout ({dropout}) is not supported (serving)")
  for name in _UNSUPPORTED_KWARGS:
    if kwargs.get(name) is not None:
      raise NotImplementedError(f"{op}: {name} is not supported")
  if query.shape[0] != 1:
    raise ValueError(f"{op}: pack every sequence into one row: query batch must be 1, got "
                     f"{query.shape[0]}")
  layer = getattr(module, "layer_idx", None)
  if layer is None:
    raise ValueError(f"{op}: the attention module has no layer_idx")
  q = query[0].transpose(0, 1)          # [T, Hq, D]
  k = key[0].transpose(0, 1)            # [T, Hkv, D]
  v = value[0].transpose(0, 1)
  cache = step.cache
  if k.dtype != cache.k[layer].dtype and cache.k[layer].dtype not in (torch.int8,
                                                                      torch.float8_e4m3fn):
    raise TypeError(f"{op}: the model computes in {k.dtype}, the cache holds "
                    f"{cache.k[layer].dtype}: allocate the cache in the model's dtype")
  if attention_mask is not None:
    decoded = None
    if isinstance(attention_mask, torch.Tensor):
      decoded = transformers_masks.decode_mask(attention_mask)
    if decoded is None:
      raise NotImplementedError(
          f"{op}: got an attention_mask of shape {tuple(getattr(attention_mask, 'shape', ()))}"
          f": the paged attention takes no mask, only what its mask function makes (None, or "
          f"a sliding window carried in an empty mask's shape)")
    sliding_window = decoded[1]     # the model's mask pattern (make_attention_mask)
  sinks = s_aux
  if sinks is not None and sinks.dtype not in (torch.float32, query.dtype):
    sinks = sinks.float()
  out = cache.write_and_attend(layer, q, k, v, step.batch, sm_scale=scaling,
                               sliding_window=sliding_window, soft_cap=softcap,
                               sinks=None if sinks is None else sinks.detach())
  return out.unsqueeze(0), None


def register_attention(name: str = DEFAULT_ATTENTION_NAME) -> str:
  """Registers `attention_forward` (and a mask function that builds no mask but refuses
  patterns the paged attention does not compute) with
  Transformers under `name`; then `attn_implementation=name` serves through the paged
  cache. Returns `name`.

  The name may not contain "flash", "sdpa", "flex_attention", "eager", "paged", "|", "/"
  or ":": Transformers treats such names specially ("paged|..." selects its own
  continuous-batching attention, "flash" a FlashAttention install, "/" a Hub repo).
  """
  validation.check_attention_name("register_attention", name, DEFAULT_ATTENTION_NAME)
  from transformers import AttentionInterface, AttentionMaskInterface

  AttentionInterface.register(name, attention_forward)
  AttentionMaskInterface.register(name, make_attention_mask)
  return name
