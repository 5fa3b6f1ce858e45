"""flash-attention-tpu as a Diffusers attention backend (diffusers 0.42).

    flash = get_kernel("<org>/flash-attention-tpu", version=1)
    flash.register_diffusers_backend()                    # adds the backend "flash_tpu"
    pipe.transformer.set_attention_backend("flash_tpu")   # Flux, Wan, Qwen-Image, ...
    # or, for any transformer (SD3 included), registration, processors and a check in one:
    flash.set_diffusers_backend(pipe.transformer)

How Diffusers chooses attention (diffusers.models.attention_dispatch): every attention
processor that supports backends calls `dispatch_attention_fn(q, k, v, attn_mask=...,
is_causal=..., scale=..., enable_gqa=..., backend=self._attention_backend)` with q, k, v
in [B, S, H, D]; the dispatcher looks the backend up in `_AttentionBackendRegistry`
(keyed by the `AttentionBackendName` enum) and passes it the arguments its signature
names. `ModelMixin.set_attention_backend(name)` and the `attention_backend(name)` context
manager only accept names that are members of that enum, and the enum has no TPU entry
that works on TorchTPU (`_native_xla` needs torch_xla). So `register_diffusers_backend`
adds one member, `AttentionBackendName("flash_tpu")` (attribute `FLASH_TPU`), and
registers `diffusers_attention` under it with the same constraints as Diffusers' native
backend (`_check_device`, `_check_shape`) and no context parallelism. Nothing of
Diffusers' is replaced. It adds no `_HUB_KERNELS_REGISTRY` entry: that table tells
`set_attention_backend` which Hub repo to `get_kernel` on first use, and here the kernel
is already loaded (it registered itself); an entry would download it a second time.

SD3 (and SD3.5) is the exception among the four models this was written for: its
`JointAttnProcessor2_0` calls `F.scaled_dot_product_attention` itself, not the
dispatcher, and has no `_attention_backend`, so `set_attention_backend` leaves it on
SDPA without a word. `set_diffusers_backend(model)` swaps each `JointAttnProcessor2_0`
for `JointAttnProcessor` (the same projections, norms and split, attention through the
dispatcher), sets the backend, and refuses, before changing anything, a model with any
other attention processor that bypasses the dispatcher.

Masks: the kernel takes no [Sq, Skv] mask; it has segment ids (key j visible from query i
only if their ids are equal) and a causal mask at an offset (key j visible from query i
only if j <= q_offset + i). A boolean mask (True = attend) becomes those:

  * a key mask, the same for every query and head ([Skv], [B, Skv] as Diffusers' native
    backend reads it, or [B, 1, 1, Skv]): segment ids, keys 1 where True and 0 where
    False, every query 1. That is Qwen-Image's mask (padded text tokens,
    `encoder_hidden_states_mask`) and Qwen-Image-2.1's for its image blocks and cached
    steps. Taken as it is: no look at its values, nothing to sync.
  * a per-query mask [B or 1, 1, Sq, Skv] that is a key mask over the union of the keys
    any query sees, optionally AND a causal mask aligned bottom-right (q_offset = Skv - Sq:
    the last query sees the last key, as in chunked prefill) or top-left (q_offset = 0,
    SDPA's is_causal). That is Qwen-Image-2.1's block-causal prefill, which its default
    processor (`QwenImage21AttnProcessor`) sends as one call per prefix segment: a text
    segment's queries over every key up to the segment's end, causal over its own keys,
    padded text keys masked. The mask is checked against those three patterns on the
    device (one comparison of the mask with each, one device-to-host sync of three
    booleans per call, and a graph break under torch.compile) before the kernel runs, so
    a mask of any other pattern raises instead of being computed as one of them.

Anything else (an additive float mask, a mask that varies per head, a 3-D mask, which SDPA
would read as [H, Sq, Skv], a per-query mask of another pattern, a flex_attention
BlockMask) raises NotImplementedError. A query row whose keys are all masked gives 0
(SDPA gives NaN).

Qwen-Image-2.1's other processor, `QwenImage21FlexAttnProcessor`, sends its prefill (one
call with a flex `BlockMask`) to the "flex" backend by name, whatever backend is set, and
only its cached steps to the set backend; a BlockMask's block-causal pattern (causal text
and whole image blocks in one call) is not one causal mask at one offset, so no single
kernel call computes it. `set_diffusers_backend` therefore swaps it for
`QwenImage21AttnProcessor`, Diffusers' exact per-segment form of the same attention.
"""

from __future__ import annotations

import re

import torch

from . import flash_attention  # the package's function (__init__ imports this module last)

__all__ = ["DEFAULT_DIFFUSERS_BACKEND", "JointAttnProcessor", "diffusers_attention",
           "register_diffusers_backend", "set_diffusers_backend"]

DEFAULT_DIFFUSERS_BACKEND = "flash_tpu"
_OP = "diffusers_attention"


def _check_mask_type(attn_mask) -> None:
  if type(attn_mask).__name__ == "BlockMask":
    raise NotImplementedError(
        f"{_OP}: got a flex_attention BlockMask; this backend takes boolean tensor masks. For "
        f"Qwen-Image-2.1 use QwenImage21AttnProcessor (its per-segment prefill; "
        f"set_diffusers_backend swaps QwenImage21FlexAttnProcessor for it), or the 'flex' "
        f"backend for BlockMasks")
  if not isinstance(attn_mask, torch.Tensor):
    raise TypeError(f"{_OP}: attn_mask must be None or a torch.Tensor, got "
                    f"{type(attn_mask).__name__}")
  if attn_mask.dtype != torch.bool:
    raise NotImplementedError(
        f"{_OP}: got a {str(attn_mask.dtype).removeprefix('torch.')} attn_mask "
        f"{tuple(attn_mask.shape)}; the kernel takes boolean masks only (True = attend), as "
        f"segment ids and a causal offset. An additive float mask is not supported: pass the "
        f"boolean mask it was made from")


def _mask_to_kernel(attn_mask: torch.Tensor, batch: int, q_len: int, kv_len: int,
                    is_causal: bool):
  """A boolean mask (with the call's is_causal) as (causal, q_offset, (q_segment_ids [B, Sq],
  kv_segment_ids [B, Skv]) int32): the kernel's way of computing exactly that mask (module
  docstring, "Masks"). Raises NotImplementedError for a mask the kernel cannot compute."""
  _check_mask_type(attn_mask)
  shape = tuple(attn_mask.shape)
  batch_ok = len(shape) == 1 or shape[0] in (1, batch)
  # [Skv], [B or 1, Skv] (Diffusers' native backend reads a 2-D mask as [B, Skv]) or
  # [B or 1, 1, 1, Skv]: the same keys for every query and head.
  key_only = len(shape) in (1, 2) or (len(shape) == 4 and shape[1:3] == (1, 1))
  # [B or 1, 1, Sq, Skv]: one row of keys per query, the same for every head.
  per_query = len(shape) == 4 and shape[1] == 1 and shape[2] == q_len
  if not batch_ok or shape[-1] != kv_len or not (key_only or per_query):
    raise NotImplementedError(
        f"{_OP}: attn_mask of shape {shape} for batch {batch}, {q_len} queries, {kv_len} "
        f"keys: the kernel takes a boolean key mask of shape [{kv_len}], [{batch}, {kv_len}] "
        f"or [{batch}, 1, 1, {kv_len}] (the same keys for every query and head), or a "
        f"per-query mask [{batch}, 1, {q_len}, {kv_len}] of a causal pattern (see the "
        f"module docstring). Masks that differ per head, and 3-D masks, are not supported: "
        f"use the 'native' backend for them")
  causal, q_offset = is_causal, 0
  if key_only:
    keys = attn_mask.reshape(-1, kv_len)
  else:
    if is_causal:
      raise ValueError(f"{_OP}: is_causal=True with a per-query attn_mask {shape}: pass one "
                       f"or the other (SDPA refuses both too)")
    rows = attn_mask[:, 0]                                  # [B or 1, Sq, Skv]
    keys = rows.any(dim=1)                                  # keys some query sees
    query_pos = torch.arange(q_len, device=rows.device)[:, None]
    key_pos = torch.arange(kv_len, device=rows.device)[None, :]
    # (causal, q_offset) candidates, cheapest kernel call first; a bottom-right offset
    # must be >= 0 (Skv >= Sq).
    candidates = [(False, 0), (True, 0)]
    if kv_len > q_len:
      candidates.insert(1, (True, kv_len - q_len))
    patterns = [keys[:, None, :] & (key_pos <= query_pos + offset) if with_causal
                else keys[:, None, :].expand_as(rows) for with_causal, offset in candidates]
    matches = torch.stack([(rows == p).all() for p in patterns])   # one sync below
    found = [c for c, hit in zip(candidates, matches.tolist()) if hit]
    if not found:
      raise NotImplementedError(
          f"{_OP}: attn_mask {shape} differs per query in a pattern the kernel does not "
          f"compute: it computes a key mask (the same keys for every query), optionally with "
          f"a causal mask aligned bottom-right (query i sees keys j <= i + {kv_len - q_len}) "
          f"or top-left (j <= i). Use the 'native' backend for other masks")
    causal, q_offset = found[0]
  kv_seg = keys.expand(batch, kv_len).to(torch.int32)
  q_seg = kv_seg.new_ones((batch, q_len))
  return causal, q_offset, (q_seg, kv_seg)


def diffusers_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False, scale: float | None = None,
                        enable_gqa: bool = False, return_lse: bool = False,
                        softcap: float | None = None,
                        window_size: tuple[int, int] = (-1, -1),
                        return_attn_probs: bool = False, deterministic: bool | None = None,
                        _parallel_config=None):
  """The Diffusers backend function (what `dispatch_attention_fn` calls).

  Args:
    query: [B, Sq, Hq, D] float32 / bfloat16 (Diffusers' layout).
    key, value: [B, Skv, Hkv, D] in query's dtype; Hkv == Hq unless enable_gqa (then Hq a
      multiple of Hkv: grouped-query attention without repeating K and V).
    attn_mask: None or a boolean mask, True = attend: a key mask [Skv], [B, Skv] or
      [B, 1, 1, Skv], or a per-query mask [B, 1, Sq, Skv] that is a key mask AND a causal
      mask aligned bottom-right or top-left (see the module docstring); anything else
      raises.
    dropout_p: must be 0.0 (the kernel has no dropout).
    is_causal: key j visible from query i only if j <= i (SDPA's top-left alignment);
      with a per-query attn_mask it raises (the mask carries its own causal pattern).
    scale: logit scale, default 1 / sqrt(D).
    return_lse: also return the log-sum-exp, lse [B, Sq, Hq] float32 (model layout, as
      Diffusers' native flash ops return it); differentiable.
    softcap: None or 0.0 (none), or > 0: logits become softcap * tanh(logits / softcap).
    window_size: only (-1, -1) (no window); a two-sided window is not something the
      kernel computes, so any other value raises rather than being ignored.
    return_attn_probs: must be False. deterministic: accepted and ignored (the kernel is
      deterministic).
    _parallel_config: must be None (no context parallelism; the backend is registered
      without it, so set_attention_backend refuses it on a context-parallel model).
  Returns:
    out [B, Sq, Hq, D] in query's dtype, or (out, lse).

  The argument names are Diffusers' (the dispatcher passes only the ones a backend's
  signature names and drops the rest, so every name any Diffusers model passes is here,
  and what the kernel cannot do raises).
  """
  if _parallel_config is not None:
    raise NotImplementedError(f"{_OP}: context parallelism (a parallel_config) is not "
                              f"supported by flash-attention-tpu's Diffusers backend")
  if dropout_p:
    raise NotImplementedError(f"{_OP}: attention dropout ({dropout_p}) is not implemented "
                              f"by the kernel")
  if return_attn_probs:
    raise NotImplementedError(f"{_OP}: the kernel returns no attention probabilities "
                              f"(return_attn_probs); use return_lse for the log-sum-exp")
  if tuple(window_size) != (-1, -1):
    raise NotImplementedError(f"{_OP}: window_size {tuple(window_size)} (a window around "
                              f"each query) is not supported by this backend")
  if not isinstance(enable_gqa, bool):
    raise TypeError(f"{_OP}: enable_gqa must be a bool, got {type(enable_gqa).__name__}")
  for name, t in (("query", query), ("key", key), ("value", value)):
    if not isinstance(t, torch.Tensor) or t.dim() != 4:
      shape = tuple(getattr(t, "shape", ()))
      raise ValueError(f"{_OP}: {name} must be a 4-D tensor [batch, seq, heads, head_dim], "
                       f"got {type(t).__name__} {shape}")
  batch, q_len, num_q_heads, _ = query.shape
  kv_len, num_kv_heads = key.shape[1], key.shape[2]
  if num_q_heads != num_kv_heads and not enable_gqa:
    raise ValueError(f"{_OP}: query has {num_q_heads} heads and key {num_kv_heads}; pass "
                     f"enable_gqa=True for grouped-query attention (as SDPA requires)")
  causal, q_offset, segment_ids = bool(is_causal), 0, None
  if attn_mask is not None:
    causal, q_offset, segment_ids = _mask_to_kernel(attn_mask, batch, q_len, kv_len, causal)
  soft_cap = softcap if softcap else None
  result = flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           causal=causal, sm_scale=scale, soft_cap=soft_cap,
                           segment_ids=segment_ids, q_offset=q_offset, return_lse=return_lse)
  if return_lse:
    out, lse = result
    return out.transpose(1, 2), lse.transpose(1, 2)
  return result.transpose(1, 2)


# ---------------------------------------------------------------------------- registration


def _check_backend_name(op: str, name) -> str:
  if not isinstance(name, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", name):
    raise ValueError(f"{op}: name must be lowercase letters, digits and '_', starting with a "
                     f"letter (set_attention_backend lowercases what it is given), got {name!r}")
  return name


def _is_ours(fn) -> bool:
  """A backend function registered by this module (of any loaded build of the kernel)."""
  return (getattr(fn, "__name__", None) == "diffusers_attention"
          and getattr(fn, "__module__", "").endswith(".diffusers_backend"))


def _backend_member(op: str, dispatch, name: str):
  """AttentionBackendName(name), added to the enum if it is not there yet.

  An Enum takes no new members through its API, so the member is made the way EnumType
  makes one (str.__new__ for this str-valued enum, then _name_ / _value_) and entered in
  the three tables lookups read: _member_names_ (iteration), _member_map_ (__members__,
  by name) and _value2member_map_ (AttentionBackendName(value)), plus the class
  attribute. Python 3.11-3.13 keep members in those tables.
  """
  enum_cls = dispatch.AttentionBackendName
  member = enum_cls._value2member_map_.get(name)
  if member is not None:
    registered = dispatch._AttentionBackendRegistry._backends.get(member)
    if not _is_ours(registered):
      raise ValueError(f"{op}: Diffusers already has an attention backend named {name!r} "
                       f"({getattr(registered, '__qualname__', registered)}); register this "
                       f"one under another name")
    return member
  attribute = name.upper()
  if attribute in enum_cls.__members__ or hasattr(enum_cls, attribute):
    raise ValueError(f"{op}: AttentionBackendName already has an attribute {attribute!r}; "
                     f"register under another name")
  member = str.__new__(enum_cls, name)
  member._name_ = attribute
  member._value_ = name
  member._sort_order_ = len(enum_cls._member_names_)
  setattr(enum_cls, attribute, member)   # before _member_map_: EnumType refuses to reassign
  enum_cls._member_names_.append(attribute)
  enum_cls._member_map_[attribute] = member
  enum_cls._value2member_map_[name] = member
  return member


def register_diffusers_backend(name: str = DEFAULT_DIFFUSERS_BACKEND) -> str:
  """Registers `diffusers_attention` as the Diffusers attention backend `name` (see the
  module docstring: one new AttentionBackendName member, one _AttentionBackendRegistry
  entry). Then `model.set_attention_backend(name)` or `attention_backend(name)` selects
  it. Registering again (also from another loaded build of this kernel) re-points the
  name at this build. Returns `name`.
  """
  op = "register_diffusers_backend"
  _check_backend_name(op, name)
  from diffusers.models import attention_dispatch as dispatch

  member = _backend_member(op, dispatch, name)
  dispatch._AttentionBackendRegistry.register(
      member, constraints=[dispatch._check_device, dispatch._check_shape],
      supports_context_parallel=False)(diffusers_attention)
  return name


class JointAttnProcessor:
  """SD3's joint attention (Diffusers' `JointAttnProcessor2_0`, same projections, q/k
  norms, text-token concatenation and split) with the attention itself through Diffusers'
  dispatcher, so that it follows `set_attention_backend` / `attention_backend` like the
  processors of Flux, Wan and Qwen-Image. Under the "native" backend it computes what
  `JointAttnProcessor2_0` computes (SDPA on the same tensors)."""

  _attention_backend = None
  _parallel_config = None

  def __call__(self, attn, hidden_states: torch.Tensor,
               encoder_hidden_states: torch.Tensor | None = None,
               attention_mask: torch.Tensor | None = None, *args, **kwargs) -> torch.Tensor:
    from diffusers.models.attention_dispatch import dispatch_attention_fn

    if attention_mask is not None:   # JointAttnProcessor2_0 ignores it: never silently
      raise NotImplementedError("JointAttnProcessor: SD3's joint attention takes no "
                                "attention_mask (Diffusers' JointAttnProcessor2_0 ignores it)")
    residual = hidden_states
    batch_size = hidden_states.shape[0]
    # [B, S, H, D] throughout: the dispatcher's layout (JointAttnProcessor2_0 transposes
    # to [B, H, S, D] for SDPA; the norms act on the last dim either way).
    query = attn.to_q(hidden_states)
    head_dim = query.shape[-1] // attn.heads
    query = query.view(batch_size, -1, attn.heads, head_dim)
    key = attn.to_k(hidden_states).view(batch_size, -1, attn.heads, head_dim)
    value = attn.to_v(hidden_states).view(batch_size, -1, attn.heads, head_dim)
    if attn.norm_q is not None:
      query = attn.norm_q(query)
    if attn.norm_k is not None:
      key = attn.norm_k(key)
    if encoder_hidden_states is not None:
      context_query = attn.add_q_proj(encoder_hidden_states).view(batch_size, -1, attn.heads,
                                                                  head_dim)
      context_key = attn.add_k_proj(encoder_hidden_states).view(batch_size, -1, attn.heads,
                                                                head_dim)
      context_value = attn.add_v_proj(encoder_hidden_states).view(batch_size, -1, attn.heads,
                                                                  head_dim)
      if attn.norm_added_q is not None:
        context_query = attn.norm_added_q(context_query)
      if attn.norm_added_k is not None:
        context_key = attn.norm_added_k(context_key)
      query = torch.cat([query, context_query], dim=1)
      key = torch.cat([key, context_key], dim=1)
      value = torch.cat([value, context_value], dim=1)

    hidden_states = dispatch_attention_fn(query, key, value, dropout_p=0.0, is_causal=False,
                                          backend=self._attention_backend,
                                          parallel_config=self._parallel_config)
    hidden_states = hidden_states.reshape(batch_size, -1, attn.heads * head_dim)
    hidden_states = hidden_states.to(query.dtype)

    if encoder_hidden_states is not None:
      hidden_states, encoder_hidden_states = (hidden_states[:, :residual.shape[1]],
                                              hidden_states[:, residual.shape[1]:])
      if not attn.context_pre_only:
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
    hidden_states = attn.to_out[0](hidden_states)
    hidden_states = attn.to_out[1](hidden_states)
    if encoder_hidden_states is not None:
      return hidden_states, encoder_hidden_states
    return hidden_states


def _attention_modules(model):
  """(name, module) of every attention module, as ModelMixin.set_attention_backend finds
  them."""
  from diffusers.models.attention import AttentionModuleMixin
  from diffusers.models.attention_processor import Attention, MochiAttention

  classes = (Attention, MochiAttention, AttentionModuleMixin)
  return [(n, m) for n, m in model.named_modules() if isinstance(m, classes)]


def _processor_swaps() -> dict:
  """{processor class that does not reach the set backend: factory of its replacement}.

  SD3's JointAttnProcessor2_0 calls SDPA itself; Qwen-Image-2.1's
  QwenImage21FlexAttnProcessor sends its prefill to the "flex" backend by name (module
  docstring). Each replacement computes the same attention through the dispatcher."""
  from diffusers.models.attention_processor import JointAttnProcessor2_0
  from diffusers.models.transformers.transformer_qwenimage21 import (
      QwenImage21AttnProcessor, QwenImage21FlexAttnProcessor)

  return {JointAttnProcessor2_0: JointAttnProcessor,
          QwenImage21FlexAttnProcessor: QwenImage21AttnProcessor}


def set_diffusers_backend(model: torch.nn.Module, name: str = DEFAULT_DIFFUSERS_BACKEND) -> str:
  """Runs every attention of a Diffusers model (e.g. `pipe.transformer`) on this kernel:
  registers the backend `name`, swaps the processors that do not reach the set backend
  (SD3's `JointAttnProcessor2_0`, which calls SDPA itself, for `JointAttnProcessor`;
  Qwen-Image-2.1's `QwenImage21FlexAttnProcessor`, whose prefill goes to "flex" by name,
  for Diffusers' `QwenImage21AttnProcessor`), calls `model.set_attention_backend(name)`,
  and checks that every attention module now dispatches to it. A model with another
  processor that bypasses the dispatcher raises NotImplementedError before anything is
  changed. Returns `name`.
  """
  op = "set_diffusers_backend"
  swaps = _processor_swaps()

  modules = _attention_modules(model)
  if not modules:
    raise ValueError(f"{op}: {type(model).__name__} has no Diffusers attention modules")
  bypassing = sorted({type(m.processor).__name__ for _, m in modules
                      if type(m.processor) not in swaps
                      and not hasattr(m.processor, "_attention_backend")})
  if bypassing:
    raise NotImplementedError(
        f"{op}: {type(model).__name__} has attention processors that call attention "
        f"themselves instead of Diffusers' dispatcher ({', '.join(bypassing)}); "
        f"set_attention_backend cannot reach them")
  register_diffusers_backend(name)
  for _, module in modules:
    replacement = swaps.get(type(module.processor))
    if replacement is not None:
      module.set_processor(replacement())
  model.set_attention_backend(name)
  wrong = [n for n, m in modules if getattr(m.processor, "_attention_backend", None) != name
           or type(m.processor) in swaps]
  if wrong:
    raise RuntimeError(f"{op}: after set_attention_backend({name!r}) these attention modules "
                       f"still use another backend: {wrong}")
  return name
