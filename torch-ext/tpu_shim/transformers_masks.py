"""Reading Transformers' attention masks, for the attention packages' mask and attention
functions (flash-attention-tpu, paged-attention-tpu's serving loop).

    mask_pattern(mask_function) -> MaskPattern(kind, packed, sliding_window, ...)
    check_mask_function(op, module, register_hint)
    tag(mask, pattern, padding=...) / tags(mask) -> (sliding_window, causal, padding)

Transformers describes each forward's mask as a mask function (masking_utils: causal,
sliding-window and chunked overlays, packed-sequence wrappers) and hands it to the mask
function registered under the attention's name. `mask_pattern` recognises the patterns
the kernels compute themselves; the packages refuse the rest with their own message.

The attention call sees only what that mask function returned, and None also comes from
Transformers when the name has an attention function but no mask function of ours
(AttentionInterface.register(name, attention_forward) alone): a padded batch would then
attend to its padding. `check_mask_function` makes that a clear error: the mask
function registered under module.config._attn_implementation must carry MARK.
transformers is imported only when these are called.
"""

from __future__ import annotations

import dataclasses

import torch

# The attribute a package's own Transformers mask function carries (set to True).
MARK = "TPU_KERNELS_MASK_FUNCTION"


@dataclasses.dataclass(frozen=True)
class MaskPattern:
  """kind: "causal", "sliding", "chunked", "bidirectional" or "other".

  packed: int32-able [B, S] packed-sequence index when position_ids restart inside a row
  (Transformers' packed-sequence wrapper), else None. sliding_window: the window of kind
  "sliding" (a key is visible from q if q - window < k <= q). chunk_size / left_padding
  [B]: Transformers' chunked_overlay (Llama 4), for kind "chunked". name: the innermost
  mask function's qualified name (for error messages)."""

  kind: str
  packed: torch.Tensor | None = None
  sliding_window: int | None = None
  chunk_size: int | None = None
  left_padding: torch.Tensor | None = None
  name: str = ""


def _closure(fn) -> dict:
  code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None)
  if code is None or cells is None:
    return {}
  return {name: cell.cell_contents for name, cell in zip(code.co_freevars, cells)}


def qualname(fn) -> str:
  return getattr(fn, "__qualname__", type(fn).__name__)


def _and_parts(fn) -> tuple | None:
  if qualname(fn) != "and_masks.<locals>.and_mask":
    return None
  return tuple(_closure(fn).get("mask_functions", ()))


def mask_pattern(mask_function) -> MaskPattern:
  """What a Transformers mask function describes (see MaskPattern); never raises."""
  from transformers import masking_utils

  causal = masking_utils.causal_mask_function
  packed, fn = None, mask_function
  parts = _and_parts(fn)
  if parts is not None and len(parts) == 2 and [qualname(p) for p in parts] == [
      "packed_sequence_mask_function.<locals>.inner_mask",
      "remap_positions_for_packed_sequence.<locals>.inner_mask"]:
    packed = _closure(parts[0])["packed_sequence_mask"]
    fn = _closure(parts[1])["mask_function"]
    parts = _and_parts(fn)
  name = qualname(fn)
  if fn is causal:
    return MaskPattern("causal", packed, name=name)
  if fn is masking_utils.bidirectional_mask_function:
    return MaskPattern("bidirectional", packed, name=name)
  if parts is not None and len(parts) == 2 and parts[1] is causal:
    overlay = qualname(parts[0])
    if overlay == "sliding_window_overlay.<locals>.inner_mask":
      return MaskPattern("sliding", packed, name=name,
                         sliding_window=int(_closure(parts[0])["sliding_window"]))
    if overlay == "chunked_overlay.<locals>.inner_mask":
      chunk = _closure(parts[0])
      return MaskPattern("chunked", packed, chunk_size=int(chunk["chunk_size"]),
                         left_padding=chunk["left_padding"], name=overlay)
  return MaskPattern("other", packed, name=name)


def check_mask_function(op: str, module: torch.nn.Module, register_hint: str) -> None:
  """Raises RuntimeError unless the mask function that Transformers registered under
  `module.config._attn_implementation` carries MARK (is the calling package's own).

  register_hint names the function that registers the attention with its mask function,
  e.g. "register_attention(name)"."""
  from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

  name = getattr(getattr(module, "config", None), "_attn_implementation", None)
  mask_function = None
  # Transformers makes no mask at all for a name outside _global_mapping (masking_utils).
  if isinstance(name, str) and name in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
    mask_function = ALL_MASK_ATTENTION_FUNCTIONS[name]
  if getattr(mask_function, MARK, False) is True:
    return
  if mask_function is not None:
    made_by = f"the mask function registered as {name!r} is {qualname(mask_function)}"
  elif isinstance(name, str):
    made_by = f"no mask function is registered as {name!r}"
  else:
    made_by = f"{type(module).__name__} has no config._attn_implementation naming it"
  raise RuntimeError(
      f"{op}: cannot tell what made this attention_mask ({made_by}). Transformers then "
      f"passes attention_mask=None or a mask this kernel does not read, and a padded or "
      f"masked batch would attend to the wrong keys. Register the attention with "
      f"{register_hint}: it registers the kernel's mask function make_attention_mask "
      f"under the same name. AttentionInterface.register(name, attention_forward) alone "
      f"is not enough")


# Attributes of the tensors a package's mask function returns: the sliding window of the
# model's mask pattern (None for causal, chunked and bidirectional ones), whether the
# pattern is causal (all but bidirectional), and whether the tensor holds padding (False:
# made only to carry the rest). Some models build sliding-window masks but pass no
# sliding_window to the attention call (Phi-MoE), or build bidirectional masks for layers
# whose module says causal (config.is_causal=False): the pattern must travel with the mask.
_WINDOW = "tpu_kernels_mask_window"
_CAUSAL = "tpu_kernels_mask_causal"
_HAS_PADDING = "tpu_kernels_mask_padding"


def tag(mask: torch.Tensor, pattern: MaskPattern, *, padding: bool) -> torch.Tensor:
  """mask with the pattern (window, causal) and whether it holds padding attached;
  unchanged under torch.compile, which does not carry attributes set on a tensor it
  traces."""
  if not torch.compiler.is_compiling():
    setattr(mask, _WINDOW, pattern.sliding_window)
    setattr(mask, _CAUSAL, pattern.kind != "bidirectional")
    setattr(mask, _HAS_PADDING, padding)
  return mask


def tags(mask) -> tuple[int | None, bool, bool] | None:
  """(sliding_window, causal, holds padding) of a tensor `tag` marked, else None (also
  under torch.compile: the attention call then takes the pattern from its arguments and
  module)."""
  if (not isinstance(mask, torch.Tensor) or torch.compiler.is_compiling()
      or not hasattr(mask, _WINDOW)):
    return None
  return getattr(mask, _WINDOW), getattr(mask, _CAUSAL), getattr(mask, _HAS_PADDING)
