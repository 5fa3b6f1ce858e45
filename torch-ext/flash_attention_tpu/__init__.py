"""flash-attention-tpu: flash attention (forward and backward) as Pallas TPU kernels, for
PyTorch tensors on TPU (TorchTPU) or CPU.

    flash_attention(q, k, v, *, causal=False, sm_scale=None, sliding_window=None,
                    soft_cap=None, segment_ids=None, sinks=None, q_offset=0,
                    return_lse=False) -> out [B, Hq, Sq, D]  (or (out, lse [B, Hq, Sq]))
    register_attention(name="tpu_attention")   # then attn_implementation="tpu_attention"
    attention_forward(module, query, key, value, attention_mask, ...)   (Transformers)
    make_attention_mask(batch_size, q_length, kv_length, ...)            (Transformers)
    register_diffusers_backend(name="flash_tpu")   # then set_attention_backend("flash_tpu")
    set_diffusers_backend(model)                   # Diffusers (diffusers_backend.py)

SDPA layout: q [B, Hq, Sq, D], k and v [B, Hkv, Skv, D], Hq a multiple of Hkv (grouped-
query / multi-query attention without repeating K and V). For query row i (position
q_offset + i) and key j:

    s = sm_scale * q[i] . k[j]   (f32), then soft_cap * tanh(s / soft_cap) with soft_cap
    visible: j <= q_offset + i (causal), q_offset + i - j < sliding_window,
             q_segment_ids[i] == kv_segment_ids[j]
    out[i] = softmax over the visible keys (plus exp(sinks[h]) in the denominator) of s, @ v

A row that sees no key gives 0 (lse -inf) and no gradient, never NaN. On "tpu" tensors the
compiled kernel runs through TorchTPU; on "cpu" tensors the same kernel runs in Pallas
interpret mode (slow; for development and tests). jax must be installed.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from . import _shim
from ._custom_ops import flash_attention_op
from ._shim import transformers_masks, validation
from ._shim.validation import check_int32, check_ndim, dtype_name

__all__ = ["DEFAULT_ATTENTION_NAME", "attention_forward", "flash_attention",
           "make_attention_mask", "register_attention",
           # Diffusers (diffusers_backend.py)
           "DEFAULT_DIFFUSERS_BACKEND", "JointAttnProcessor", "diffusers_attention",
           "register_diffusers_backend", "set_diffusers_backend"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)
DEFAULT_ATTENTION_NAME = "tpu_attention"


def _segment_ids(op: str, segment_ids, batch: int, q_len: int, kv_len: int):
  """(q_segment_ids [B, Sq], kv_segment_ids [B, Skv]) int32, or (None, None)."""
  if segment_ids is None:
    return None, None
  if isinstance(segment_ids, (tuple, list)):
    if len(segment_ids) != 2:
      raise ValueError(f"{op}: segment_ids must be one [B, S] tensor or a pair (q_segment_ids "
                       f"[B, Sq], kv_segment_ids [B, Skv]), got a sequence of "
                       f"{len(segment_ids)}")
    q_seg, kv_seg = segment_ids
    names = ("q_segment_ids", "kv_segment_ids")
  else:
    if q_len != kv_len:
      raise ValueError(f"{op}: a single segment_ids tensor needs Sq == Skv (got Sq {q_len}, "
                       f"Skv {kv_len}); pass a pair (q_segment_ids [B, Sq], kv_segment_ids "
                       f"[B, Skv])")
    q_seg = kv_seg = segment_ids
    names = ("segment_ids", "segment_ids")
  for name, t, length in ((names[0], q_seg, q_len), (names[1], kv_seg, kv_len)):
    validation.check_tensor(op, name, t)
    check_int32(op, name, t)
    validation.check_shape(op, name, t, (batch, length), "[batch, sequence]")
  return q_seg.contiguous(), kv_seg.contiguous()


def _q_offset(op: str, q_offset, device: torch.device) -> torch.Tensor:
  """q_offset as the (1,) int32 tensor the op takes (the kernel reads it at run time)."""
  if isinstance(q_offset, torch.Tensor):
    check_int32(op, "q_offset", q_offset)
    if q_offset.numel() != 1 or q_offset.dim() > 1:
      raise ValueError(f"{op}: a tensor q_offset must hold one int32 (shape () or (1,)), got "
                       f"shape {tuple(q_offset.shape)}")
    if device.type == "cpu" and not torch.compiler.is_compiling() and int(q_offset) < 0:
      raise ValueError(f"{op}: q_offset must be >= 0, got {int(q_offset)}")
    return q_offset.reshape(1).contiguous()
  if isinstance(q_offset, bool) or not isinstance(q_offset, (int, torch.SymInt)):
    raise TypeError(f"{op}: q_offset must be an int or an int32 tensor, got "
                    f"{type(q_offset).__name__}")
  if q_offset < 0:
    raise ValueError(f"{op}: q_offset must be >= 0, got {q_offset}")
  return torch.tensor([q_offset], dtype=torch.int32, device=device)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = False,
                    sm_scale: float | None = None, sliding_window: int | None = None,
                    soft_cap: float | None = None, segment_ids=None,
                    sinks: torch.Tensor | None = None, q_offset: int | torch.Tensor = 0,
                    return_lse: bool = False):
  """Attention on the flash-attention kernel (see the module docstring for the math).

  Args:
    q: [B, Hq, Sq, D] float32 / bfloat16 (the SDPA layout).
    k: [B, Hkv, Skv, D] in q's dtype; Hq a multiple of Hkv.
    v: [B, Hkv, Skv, Dv] in q's dtype; Dv may differ from D (MLA: DeepSeek-V3's 192 / 128,
      MiMo-V2-Flash): see "Value head_dim" below.
    causal: key j visible from query i only if j <= q_offset + i.
    sm_scale: logit scale, default 1 / sqrt(D).
    sliding_window: None or int >= 1: key j visible only if q_offset + i - j <
      sliding_window (Transformers' convention: the query's own position and the
      sliding_window - 1 before it).
    soft_cap: None or > 0: logits become soft_cap * tanh(logits / soft_cap).
    segment_ids: None, one int32 [B, S] tensor (Sq == Skv), or a pair (q_segment_ids
      [B, Sq], kv_segment_ids [B, Skv]): attention only within equal ids.
    sinks: None or [Hq] (float32 or q's dtype): one learned logit per query head in the
      softmax denominator (gpt-oss).
    q_offset: position of query row 0 in the key sequence (chunked prefill), >= 0: an int
      or an int32 tensor of shape () or (1,) on q's device. The kernel reads it at run
      time: chunks at different offsets reuse one compiled kernel. The int 0 (the
      default) is also known when compiling: causal self-attention then runs on the
      kernel's folded grid, with no skipped steps (one more compile at most).
    return_lse: also return the log-sum-exp lse [B, Hq, Sq] float32.
  Returns:
    out [B, Hq, Sq, Dv] in q's dtype, or (out, lse). Differentiable in q, k, v and sinks
    (through out and lse).

  Value head_dim. The kernel takes one head_dim for q, k and v, so when Dv != D the
  narrower side is zero-padded to max(D, Dv) on the way in: zero channels of q and k add
  nothing to any q.k (sm_scale stays 1 / sqrt(D) of the real D), and zero channels of v
  give output channels that are sliced off. Exact, forward and backward (the padding's
  gradient is dropped); the cost is the padded tensors' extra bytes and the MXU work of
  the wider head: Dv = 128 under D = 192 moves v and the output at 1.5x.
  """
  op = "flash_attention"
  for name, t in (("q", q), ("k", k), ("v", v)):
    validation.check_tensor(op, name, t)
  validation.check_float_dtype(op, "q", q, COMPUTE_DTYPES)
  validation.check_same_dtype(op, "k", k, "q", q)
  validation.check_same_dtype(op, "v", v, "q", q)
  check_ndim(op, "q", q, 4, "[batch, q_heads, q_len, head_dim]")
  check_ndim(op, "k", k, 4, "[batch, kv_heads, kv_len, head_dim]")
  check_ndim(op, "v", v, 4, "[batch, kv_heads, kv_len, v_head_dim]")
  validation.check_shape(op, "v", v, (*k.shape[:3], v.shape[3]),
                         "k's batch, heads and length, any head_dim")
  batch, num_q_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  if min(q.shape) == 0 or min(k.shape) == 0 or v.shape[3] == 0:
    raise ValueError(f"{op}: q, k and v must have no empty dimension, got q {tuple(q.shape)}, "
                     f"k {tuple(k.shape)}, v {tuple(v.shape)}")
  if k.shape[0] != batch or k.shape[3] != head_dim:
    raise ValueError(f"{op}: k {tuple(k.shape)} must have q's batch ({batch}) and head_dim "
                     f"({head_dim}); q is {tuple(q.shape)}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"{op}: q's {num_q_heads} heads must be a multiple of k's {num_kv_heads} "
                     f"heads (grouped-query attention)")
  if not isinstance(causal, bool):
    raise TypeError(f"{op}: causal must be a bool, got {type(causal).__name__}")
  if not isinstance(return_lse, bool):
    raise TypeError(f"{op}: return_lse must be a bool, got {type(return_lse).__name__}")
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  sm_scale = validation.check_finite_number(op, "sm_scale", sm_scale)
  window = 0
  if sliding_window is not None:
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int):
      raise TypeError(f"{op}: sliding_window must be None or an int, got "
                      f"{type(sliding_window).__name__}")
    if sliding_window < 1:
      raise ValueError(f"{op}: sliding_window must be >= 1 (the query's own position and the "
                       f"sliding_window - 1 before it), got {sliding_window}")
    window = sliding_window
  cap = 0.0
  if soft_cap is not None:
    cap = validation.check_finite_number(op, "soft_cap", soft_cap)
    if cap <= 0:
      raise ValueError(f"{op}: soft_cap must be None or > 0, got {soft_cap}")
  q_seg, kv_seg = _segment_ids(op, segment_ids, batch, q_len, kv_len)
  if sinks is not None:
    validation.check_tensor(op, "sinks", sinks)
    validation.check_float_dtype(op, "sinks", sinks, (torch.float32,) if q.dtype == torch.float32
                                 else (torch.float32, q.dtype))
    validation.check_shape(op, "sinks", sinks, (num_q_heads,), "one logit per query head")
    sinks = sinks.contiguous()
  _shim.device_type_of(op, {
      "q": q, "k": k, "v": v, "sinks": sinks, "q_segment_ids": q_seg, "kv_segment_ids": kv_seg,
      "q_offset": q_offset if isinstance(q_offset, torch.Tensor) else None})
  offset = _q_offset(op, q_offset, q.device)
  # The int 0 (not a tensor, not a SymInt) is known now: causal self-attention may then
  # run on the kernel's folded grid (one grid step per visited tile).
  zero_offset = type(q_offset) is int and q_offset == 0
  v_head_dim = v.shape[3]
  width = max(head_dim, v_head_dim)      # one head_dim for the kernel (docstring)
  q, k, v = (torch.nn.functional.pad(t, (0, width - t.shape[3])) if t.shape[3] < width else t
             for t in (q, k, v))
  out, lse = flash_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), sinks, q_seg,
                                kv_seg, offset, causal, sm_scale, window, cap, zero_offset)
  if v_head_dim < width:
    out = out[..., :v_head_dim]
  return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------- Transformers
#
# Transformers builds each forward's attention mask through the mask function registered
# under the attention's name (AttentionMaskInterface), then hands it to every attention
# call. The kernel takes no arbitrary [B, 1, Sq, Skv] mask, so the mask function
# (`make_attention_mask`, like Transformers' own flash-attention mask) reduces the
# model's mask to what the kernel computes itself, and refuses any pattern it cannot
# reproduce:
#   * causal or sliding-window causal patterns (or bidirectional ones, for encoders):
#     the kernel applies them itself (causal, sliding_window). Every tensor the mask
#     function returns carries its pattern in its shape (transformers_masks.encode_mask:
#     window, causal, whether it holds padding; the same in eager and under
#     torch.compile), and the attention call takes them from it rather than from its own
#     sliding_window / is_causal arguments, which some models leave out (Phi-MoE's
#     window) or contradict (config.is_causal=False under causal modules); a plain causal
#     pattern without padding returns None and the call uses is_causal or the module's,
#     as SDPA does;
#   * padding: a bool [B, Skv] mask of the valid keys (sliding and bidirectional patterns
#     without a 2-D mask: all valid, tagged as no padding); the attention call turns real
#     padding into segment ids (keys: 1 valid / 0 padding, queries: 1);
#   * packed sequences (position_ids restarting inside a row, no 2-D mask): the packed
#     sequence index, an int32 [B, S] tensor, becomes the segment ids;
#   * chunked attention (Llama 4): causal within fixed-size chunks counted from each row's
#     first valid token; the chunk index of each key, int32 [B, Skv] (padding keys -1),
#     becomes the segment ids, the queries taking those of the last Sq keys.
# Anything else (or/and overlays such as image-token masks, bidirectional windows, static
# caches whose unfilled slots need a mask, a ready-made 4-D mask, a model that asks for its
# causal mask materialized to add to it or read it itself) raises NotImplementedError
# instead of computing another attention.
#
# The attention call cannot tell from its `attention_mask` alone what made it: None also
# comes from Transformers when the name has an attention function but no mask function
# (AttentionInterface.register(name, attention_forward) alone), and then a padded batch
# would attend to its padding. So `attention_forward` first checks that the mask function
# registered under the module's implementation name is this kernel's (it carries
# transformers_masks.MARK), and raises otherwise.


def _mask_pattern(mask_function) -> transformers_masks.MaskPattern:
  """The pattern of a Transformers mask function, if this kernel computes it; raises
  NotImplementedError otherwise."""
  pattern = transformers_masks.mask_pattern(mask_function)
  if pattern.kind == "chunked" and pattern.packed is not None:
    raise NotImplementedError(
        "flash-attention-tpu: chunked attention over packed sequences (position_ids that "
        "restart inside a row) is not supported; pass one sequence per row with a 2-D "
        "attention_mask, or use attn_implementation='eager' or 'sdpa'")
  if pattern.kind == "other":
    raise NotImplementedError(
        f"flash-attention-tpu: the model asks for a mask pattern this kernel cannot compute "
        f"({pattern.name}): it supports causal, sliding-window causal and chunked causal "
        f"masks, padding and packed sequences, not or/and overlays (image tokens, "
        f"blockwise) or bidirectional windows. Use attn_implementation='eager' or 'sdpa' "
        f"for this model")
  return pattern


def make_attention_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0,
                        kv_offset=0, mask_function=None,
                        attention_mask: torch.Tensor | None = None, **kwargs):
  """Transformers mask function (AttentionMaskInterface) for `attention_forward`.

  Returns None (a causal pattern, no padding), or, as the view
  transformers_masks.encode_mask makes ([B, S, 3, 3, code, 3]: the pattern in the
  shape), one of: a bool [B, kv_length] mask of the valid keys (all True
  when it only carries a sliding or bidirectional pattern), int32 [B, S] packed-sequence
  ids, or int32 [B, kv_length] chunk ids (chunked attention; padding -1). Raises
  NotImplementedError for patterns the kernel cannot compute.
  """
  from transformers import masking_utils

  mask_function = masking_utils.causal_mask_function if mask_function is None else mask_function
  pattern = _mask_pattern(mask_function)
  packed = pattern.packed
  # Causal patterns need the queries at the end of the keys (the attention call's q_offset
  # is Skv - Sq); bidirectional ones (encoders, cross-attention) do not look at positions.
  if pattern.kind != "bidirectional" and (
      isinstance(q_offset, torch.Tensor) or isinstance(kv_offset, torch.Tensor)
      or q_offset - kv_offset + q_length != kv_length):
    raise NotImplementedError(
        f"flash-attention-tpu: the queries must be the last {q_length} of the {kv_length} "
        f"keys (no cache, or a DynamicCache); got query offset {q_offset}, key offset "
        f"{kv_offset}. Static caches (cache_implementation='static') leave unfilled slots "
        f"that need a mask: use a DynamicCache")
  # A model that asks for its mask materialized adds to the [B, 1, Sq, Skv] mask or reads
  # it (Doge's dynamic mask, Falcon's ALiBi, sparse-attention indexers, T5Gemma 2's merged
  # attention), and would fail inside its own code on the reduced mask this function
  # returns, packed sequences included (transformers_masks.asks_for_materialized_mask).
  if transformers_masks.asks_for_materialized_mask(pattern, kwargs):
    raise NotImplementedError(
        "flash-attention-tpu: the model asks for its causal mask materialized as a [B, 1, "
        "Sq, Skv] tensor (allow_is_causal_skip=False) to add to it or read it itself (for "
        "example Doge's dynamic mask, Falcon's ALiBi, sparse-attention indexers); this "
        "kernel takes no arbitrary mask. Use attn_implementation='eager' or 'sdpa' for this "
        "model")
  if packed is not None:
    return transformers_masks.encode_mask(packed.to(torch.int32), pattern, padding=True)
  if attention_mask is not None:
    if attention_mask.dim() != 2:
      raise NotImplementedError(f"flash-attention-tpu: expected a 2-D padding mask, got shape "
                                f"{tuple(attention_mask.shape)}")
    attention_mask = attention_mask[:, -kv_length:].to(torch.bool)
    if attention_mask.shape[1] != kv_length:
      raise NotImplementedError(f"flash-attention-tpu: the 2-D attention mask covers "
                                f"{attention_mask.shape[1]} keys, the keys are {kv_length}")
  if pattern.kind == "chunked":
    # Key j sits at position kv_offset + j; chunks start at each row's first valid token
    # (Transformers' chunked_overlay). Padding keys get -1, which no valid query has.
    chunk_size, left_padding = pattern.chunk_size, pattern.left_padding
    device = left_padding.device if attention_mask is None else attention_mask.device
    positions = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    chunk_ids = torch.div(positions[None, :] - left_padding.to(device)[:, None], chunk_size,
                          rounding_mode="floor").to(torch.int32)
    if attention_mask is not None:
      chunk_ids = chunk_ids.masked_fill(~attention_mask, -1)
    chunk_ids = chunk_ids.expand(batch_size, kv_length).contiguous()
    return transformers_masks.encode_mask(chunk_ids, pattern, padding=True)
  if attention_mask is not None:
    return transformers_masks.encode_mask(attention_mask, pattern, padding=True)
  if pattern.kind in ("sliding", "bidirectional"):
    # Never None: the tensor carries the window and the causality to the attention call
    # (some models pass no sliding_window (Phi-MoE), or ask for bidirectional attention in
    # layers whose module says causal (config.is_causal=False)). Encoded as no padding:
    # no segment ids.
    valid = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
    return transformers_masks.encode_mask(valid, pattern, padding=False)
  return None


setattr(make_attention_mask, transformers_masks.MARK, True)   # see check_mask_function


@torch.compiler.assume_constant_result      # the same under torch.compile: a trace constant
def _family_takes_reduced_masks(module_name: str) -> bool:
  """Whether a PreTrainedModel of Python module `module_name` sets _supports_sdpa or
  _supports_flash_attn (cached per module)."""
  return _family_takes_reduced_masks_cached(module_name)


@functools.cache
def _family_takes_reduced_masks_cached(module_name: str) -> bool:
  import sys

  from transformers import PreTrainedModel

  models = [v for v in vars(sys.modules[module_name]).values()
            if isinstance(v, type) and issubclass(v, PreTrainedModel)
            and v.__module__ == module_name]
  return any(getattr(m, "_supports_sdpa", False) or getattr(m, "_supports_flash_attn", False)
             for m in models)


def _check_family_takes_reduced_masks(op: str, module: torch.nn.Module) -> None:
  """Raises NotImplementedError for a Transformers attention class whose family declares
  neither SDPA nor FlashAttention support (no PreTrainedModel of its modeling module sets
  _supports_sdpa or _supports_flash_attn). Like those backends, this kernel takes the
  causal pattern from the module (is_causal) and only padding from the mask; such
  families rely on the materialized mask instead (BigBird-Pegasus's decoder self-attention
  is not marked causal: the kernel would let it see the future)."""
  name = type(module).__module__
  if name.startswith("transformers.") and not _family_takes_reduced_masks(name):
    raise NotImplementedError(
        f"{op}: {type(module).__name__}'s family ({name}) declares neither SDPA nor "
        f"FlashAttention support: its attention layers rely on the materialized mask (for "
        f"example decoder layers whose module is not marked causal), while this kernel, like "
        f"those backends, takes the causal pattern from the module and only padding from "
        f"the mask. Use attn_implementation='eager' for this model")


# Transformers' continuous batching (a paged cache) reaches the attention call only through
# cu_seq_lens (the model has already written the cache and passes no cache argument; the
# mask function is not called), so it is refused here with them.
# Models that pass `sinks` (Inkling 2: per-token sinks; gpt-oss-style per-head sinks come as
# s_aux), or sparse-attention selections (`indices`: DeepSeek-V3.2-style DSA; `block_indices`:
# MiniMax-M3-VL) would otherwise have them ignored: dense attention, a silent wrong result.
_UNSUPPORTED_KWARGS = {
    "position_bias": "a position bias (T5-style additive logits)",
    "sinks": "per-token attention sinks (a `sinks` tensor; per-head sinks as s_aux are "
             "supported)",
    "indices": "sparse attention (the indexer's selected keys)",
    "block_indices": "block-sparse attention (the indexer's selected key blocks)",
    "cu_seq_lens_q": "varlen cu_seq_lens, as continuous batching passes (pass position_ids "
                     "that restart per sequence instead)",
    "cu_seq_lens_k": "varlen cu_seq_lens, as continuous batching passes (pass position_ids "
                     "that restart per sequence instead)",
}


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      dropout: float = 0.0, scaling: float | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, is_causal: bool | None = None,
                      **kwargs) -> tuple[torch.Tensor, None]:
  """Transformers attention function (AttentionInterface) on the flash-attention kernel.

  query [B, Hq, Sq, D], key / value [B, Hkv, Skv, D] (GQA without repeat_kv);
  `attention_mask` is what `make_attention_mask` (the mask function above) made: None, or
  the 6-D view transformers_masks.encode_mask makes of a bool [B, Skv] padding mask or of
  int32 [B, Skv] segment ids of the keys (packed sequences or chunks), whose shape gives
  the model's sliding window and causality (these override the sliding_window and
  is_causal arguments). Raises RuntimeError if the mask function registered under
  module.config._attn_implementation is not that one (see register_attention). Queries are
  the last Sq keys' positions (q_offset = Skv - Sq, as with no cache or a DynamicCache).
  is_causal (else module.is_causal), sliding_window, softcap (Gemma 2) and s_aux (gpt-oss
  sinks) go to the kernel. Returns (attn_output [B, Sq, Hq, D], None): no attention weights.
  """
  op = "attention_forward"
  transformers_masks.check_mask_function(op, module, "register_attention(name)")
  _check_family_takes_reduced_masks(op, module)
  if dropout:
    raise NotImplementedError(
        f"{op}: attention dropout ({dropout}) is not implemented by the kernel; set the "
        f"config's attention_dropout to 0.0 (or train without it)")
  for name, what in _UNSUPPORTED_KWARGS.items():
    if kwargs.get(name) is not None:
      raise NotImplementedError(f"{op}: {what} is not supported by this kernel")
  if kwargs.get("output_attentions", False):
    warnings.warn(f"{op}: the kernel returns no attention weights (output_attentions); use "
                  f"attn_implementation='eager' to get them", stacklevel=2)
  if attention_mask is not None:
    decoded = None
    if isinstance(attention_mask, torch.Tensor):
      decoded = transformers_masks.decode_mask(attention_mask)
    if decoded is None:
      shape = tuple(getattr(attention_mask, "shape", ()))
      raise NotImplementedError(
          f"{op}: got an attention_mask of shape {shape} ({type(attention_mask).__name__}): "
          f"the kernel takes no arbitrary mask, only what its mask function makes (None, or "
          f"a [B, Skv] padding mask or segment ids carrying the model's mask pattern in a "
          f"6-D shape). Register the attention with register_attention() (it registers the "
          f"mask function too) and do not pass a ready-made 4-D mask; use "
          f"attn_implementation='eager' for custom masks")
    # The mask's pattern is the model's (what eager and SDPA with a mask apply); a layer's
    # sliding_window or is_causal may be missing (Phi-MoE passes no window) or disagree.
    attention_mask, sliding_window, is_causal, has_padding = decoded
    if not has_padding:
      attention_mask = None
  if is_causal is None:
    is_causal = bool(getattr(module, "is_causal", True))
  batch, _, q_len, _ = query.shape
  kv_len = key.shape[2]
  q_offset = 0
  if is_causal:
    if kv_len < q_len:
      raise ValueError(f"{op}: causal attention with {q_len} queries and only {kv_len} keys: "
                       f"the queries must be the last Sq of the keys")
    q_offset = kv_len - q_len
  elif sliding_window is not None:
    raise NotImplementedError(f"{op}: a sliding window without causal masking (bidirectional "
                              f"window) is not supported by this kernel")

  segment_ids = None
  if attention_mask is not None:
    if attention_mask.dtype == torch.bool:
      validation.check_shape(op, "attention_mask", attention_mask, (batch, kv_len),
                             "the valid keys, [batch, kv_len]")
      kv_seg = attention_mask.to(torch.int32)
      # Every query in segment 1 sees the valid keys (1), never padding (0). A query that is
      # itself padding sees only what its causal window holds: nothing, under left padding
      # (it gives 0), or valid keys (a finite value no one reads).
      q_seg = kv_seg.new_ones((batch, q_len))
      segment_ids = (q_seg, kv_seg)
    elif attention_mask.dtype == torch.int32:
      # Packed-sequence ids (Sq == Skv) or chunk ids: one segment id per key; the queries
      # are the last Sq keys and take theirs.
      validation.check_shape(op, "attention_mask", attention_mask, (batch, kv_len),
                             "segment ids of the keys (packed sequences or chunks), "
                             "[batch, kv_len]")
      if not is_causal and q_len != kv_len:
        raise NotImplementedError(f"{op}: int32 segment ids without causal masking need Sq "
                                  f"== Skv, got {q_len} queries and {kv_len} keys")
      segment_ids = (attention_mask[:, kv_len - q_len:], attention_mask)
    else:
      raise NotImplementedError(f"{op}: got a {dtype_name(attention_mask.dtype)} 2-D "
                                f"attention_mask; expected bool padding or int32 segment ids "
                                f"from register_attention()'s mask function")

  sinks = s_aux
  if sinks is not None and sinks.dtype not in (torch.float32, query.dtype):
    sinks = sinks.float()
  out = flash_attention(query, key, value, causal=is_causal, sm_scale=scaling,
                        sliding_window=sliding_window, soft_cap=softcap,
                        segment_ids=segment_ids, sinks=sinks, q_offset=q_offset)
  return out.transpose(1, 2).contiguous(), None


def register_attention(name: str = DEFAULT_ATTENTION_NAME) -> str:
  """Registers `attention_forward` and its mask function with Transformers under `name`,
  so that `attn_implementation=name` runs attention on this kernel. Returns `name`.

  The name may not contain "flash", "sdpa", "flex_attention", "eager", "paged", "|", "/"
  or ":": Transformers gives such names special treatment (a name with "flash" is taken
  for a FlashAttention install and imported as one, "/" for a Hub kernel repo).
  """
  validation.check_attention_name("register_attention", name, DEFAULT_ATTENTION_NAME)
  from transformers import AttentionInterface, AttentionMaskInterface

  AttentionInterface.register(name, attention_forward)
  AttentionMaskInterface.register(name, make_attention_mask)
  return name


# Diffusers' attention backend (imported last: it uses flash_attention, defined above).
from .diffusers_backend import (DEFAULT_DIFFUSERS_BACKEND, JointAttnProcessor,  # noqa: E402
                                diffusers_attention, register_diffusers_backend,
                                set_diffusers_backend)
