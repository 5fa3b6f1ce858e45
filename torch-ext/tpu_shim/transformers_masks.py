"""Reading Transformers' attention masks, for the attention packages' mask and attention
functions (flash-attention-tpu, paged-attention-tpu's serving loop).

    mask_pattern(mask_function) -> MaskPattern(kind, packed, sliding_window, ...)
    check_mask_function(op, module, register_hint)
    encode_mask(base, pattern, padding=...) -> mask [B, S, 3, 3, code, 3] (a view)
    decode_mask(mask) -> (base [B, S], sliding_window, causal, padding) or None
    asks_for_materialized_mask(pattern, kwargs)

Transformers describes each forward's mask as a mask function (masking_utils: causal,
sliding-window and chunked overlays, packed-sequence wrappers) and hands it to the mask
function registered under the attention's name. `mask_pattern` recognises the patterns
the kernels compute themselves; the packages refuse the rest with their own message.

What a mask function returns carries the pattern to the attention call in its SHAPE:
encode_mask(base [B, S], ...) is a zero-stride expanded view

    [B, S, 3, 3, code, 3],   code = 1 + causal + 2 * has_padding + 4 * sliding_window

of the bool valid-key mask or int32 segment ids (window 0: none; allocates nothing;
`[..., 0, 0, 0, 0]` is the base again; the size-3 axes catch a model's slicing), and
decode_mask reads it back. Python attributes on the tensor would be
dropped by torch.compile; sizes are static in a traced graph, so eager and compiled calls
read the same pattern through one code path (section "the pattern, in the shape").

The attention call sees only what that mask function returned, and None also comes from
Transformers when the name has an attention function but no mask function of ours
(AttentionInterface.register(name, attention_forward) alone): a padded batch would then
attend to its padding. `check_mask_function` makes that a clear error: the mask
function registered under module.config._attn_implementation must carry MARK.
transformers is imported only when these are called.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import re

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


def _packed_parts(fn):
  """(base mask function, packed-sequence index [B, S]) of Transformers' packed-sequence
  composition, else None. masking_utils (5.24+) builds it, when position_ids restart
  inside a row, as

      and_masks(remap_positions_for_packed_sequence(base, position_ids),
                packed_sequence_mask_function(packed_sequence_mask))

  The remap calls `base` on the tokens' positions instead of their indices. Inside one
  packed sequence those positions are consecutive (a sequence ends wherever position_ids
  do not step by 1: find_packed_sequence_indices), so a causal or sliding-window `base` on
  positions is that `base` on indices there, and the packed index (as segment ids) removes
  the rest. Any other composition (a blockwise overlay between the two, an overlay outside
  them) is not this one and reads as another pattern."""
  parts = _and_parts(fn)
  if parts is None or [qualname(p) for p in parts] != [
      "remap_positions_for_packed_sequence.<locals>.inner_mask",
      "packed_sequence_mask_function.<locals>.inner_mask"]:
    return None
  base = _closure(parts[0]).get("mask_function")
  packed = _closure(parts[1]).get("packed_sequence_mask")
  return None if base is None or packed is None else (base, packed)


def mask_pattern(mask_function) -> MaskPattern:
  """What a Transformers mask function describes (see MaskPattern); never raises."""
  from transformers import masking_utils

  causal = masking_utils.causal_mask_function
  packed, fn = None, mask_function
  packed_parts = _packed_parts(fn)
  if packed_parts is not None:
    fn, packed = packed_parts
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


# ---------------------------------------------------------------- the pattern, in the shape
#
# A mask function returns one tensor per pattern, read back by the attention call. The
# pattern travels in that tensor's SHAPE, not in Python attributes (which torch.compile
# does not carry): `encode_mask` returns a zero-stride expanded view of the [B, S] base
#
#     [B, S, MARK, MARK, code, MARK],  code = 1 + causal + 2 * has_padding + 4 * window
#
# (window 0: no sliding window; MARK = 3). expand allocates nothing, and sizes are static
# under torch.compile (a traced graph specializes on them), so eager and compiled calls
# read the same pattern through one code path; `mask[..., 0, 0, 0, 0]` is the base again.
# has_padding False: the base was made only to carry the pattern (all keys valid). Some
# models build sliding-window masks but pass no sliding_window to the attention call
# (Phi-MoE), or build bidirectional masks for layers whose module says causal
# (config.is_causal=False): the mask's pattern is the model's (what eager attention
# applies), so the attention call follows it.
# Why the MARK axes: slicing can only shrink sizes, and the slices models apply to 4-D
# masks on their way to the attention (`mask[:, :, :q]`, `mask[:, :, :, :kv]`,
# `mask[..., :kv]`) land on a MARK axis: either they keep it (a slice to >= MARK keys
# changes nothing) or they shrink it and decode_mask refuses the tensor, where a flag
# axis of size 1 or 2 would have been read as another pattern.
MARK_SIZE = 3
MASK_NDIM = 6


def encode_mask(base: torch.Tensor, pattern: MaskPattern, *, padding: bool) -> torch.Tensor:
  """base [B, S] (bool valid keys, or int32 segment ids) as the view described above."""
  if base.dim() != 2:
    raise ValueError(f"encode_mask: the base must be [B, S], got {tuple(base.shape)}")
  code = (1 + int(pattern.kind != "bidirectional") + 2 * int(padding)
          + 4 * (pattern.sliding_window or 0))
  return base[:, :, None, None, None, None].expand(*base.shape, MARK_SIZE, MARK_SIZE, code,
                                                   MARK_SIZE)


def decode_mask(mask: torch.Tensor):
  """(base [B, S], sliding_window or None, causal, has_padding) of a tensor `encode_mask`
  made; None for a tensor of another rank. Raises ValueError for a 6-D tensor whose
  MARK axes are not MARK_SIZE (sliced by the model on its way to the attention)."""
  if mask.dim() != MASK_NDIM:
    return None
  mark_a, mark_b, code, mark_c = (int(n) for n in mask.shape[2:])
  if (mark_a, mark_b, mark_c) != (MARK_SIZE,) * 3 or code < 1:
    raise ValueError(f"a 6-D attention_mask of shape {tuple(mask.shape)} is not one the "
                     f"kernel's mask function made ([B, S, {MARK_SIZE}, {MARK_SIZE}, code, "
                     f"{MARK_SIZE}]): the model changed it on its way to the attention")
  code -= 1
  return mask[..., 0, 0, 0, 0], code // 4 or None, bool(code & 1), bool(code & 2)


# ---------------------------------------------------------------- models that read the mask
#
# A model that passes allow_is_causal_skip=False to Transformers' mask creation asks for
# its causal mask materialized [B, 1, Sq, Skv] to add to it or read it (Doge's dynamic
# mask, Falcon's ALiBi, sparse-attention indexers). The mask functions refuse that; but
# Transformers also sets allow_is_causal_skip=False itself for packed sequences (and
# under torch.compile every batch given position_ids but no 2-D mask counts as packed),
# so from the call alone such a model's request is not told apart from packing. The
# family's modeling source says it: read once per configuration module (cached; under
# torch.compile a constant of the trace).
_ASKS_MATERIALIZED = re.compile(r"""allow_is_causal_skip["']?\s*[=:]\s*False""")


@torch.compiler.assume_constant_result
def family_materializes_masks(config_module: str) -> bool:
  """True iff the modeling module next to `config_module` (a Transformers configuration
  module's name, e.g. "transformers.models.doge.configuration_doge") passes
  allow_is_causal_skip=False to a mask creation."""
  return _family_materializes_masks(config_module)


@functools.cache
def _family_materializes_masks(config_module: str) -> bool:
  if ".configuration_" not in config_module:
    return False
  spec = importlib.util.find_spec(config_module.replace(".configuration_", ".modeling_"))
  if spec is None or not spec.origin or not spec.origin.endswith(".py"):
    return False
  return bool(_ASKS_MATERIALIZED.search(pathlib.Path(spec.origin).read_text()))


def asks_for_materialized_mask(pattern: MaskPattern, kwargs: dict) -> bool:
  """Whether the model asked Transformers for its causal or sliding mask materialized
  (see above): `kwargs` are the mask function's extra keyword arguments."""
  if pattern.kind not in ("causal", "sliding") or kwargs.get("allow_is_causal_skip", True):
    return False
  if pattern.packed is None:
    return True       # Transformers turns the skip off itself only for packing and overlays
  config = kwargs.get("config")
  return config is not None and family_materializes_masks(type(config).__module__)
