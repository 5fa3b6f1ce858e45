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

Masks: the kernel takes no [Sq, Skv] mask, only segment ids. A boolean key mask (True =
attend) that is the same for every query and head ([Skv], [B, Skv] as Diffusers' native
backend reads it, or [B, 1, 1, Skv]) becomes segment ids: keys 1 where True and 0
where False, every query 1. That is Qwen-Image's mask (padded text tokens,
`encoder_hidden_states_mask`); Flux, Wan and SD3 pass none. Anything else (an additive
float mask, a mask that varies per query or head, a 3-D mask, which SDPA would read as
[H, Sq, Skv]) raises NotImplementedError. A query row whose keys are all masked gives 0
(SDPA gives NaN).
"""

from __future__ import annotations

import re

import torch

from . import flash_attention  # the package's function (__init__ imports this module last)

__all__ = ["DEFAULT_DIFFUSERS_BACKEND", "JointAttnProcessor", "diffusers_attention",
           "register_diffusers_backend", "set_diffusers_backend"]

DEFAULT_DIFFUSERS_BACKEND = "flash_tpu"
_OP = "diffusers_attention"


def _key_segment_ids(attn_mask: torch.Tensor, batch: int, q_len: int, kv_len: int):
  """(q_segment_ids [B, Sq], kv_segment_ids [B, Skv]) int32 for a boolean key mask."""
  if not isinstance(attn_mask, torch.Tensor):
    raise TypeError(f"{_OP}: attn_mask must be None or a torch.Tensor, got "
                    f"{type(attn_mask).__name__}")
  shape = tuple(attn_mask.shape)
  if attn_mask.dtype != torch.bool:
    raise NotImplementedError(
        f"{_OP}: got a {str(attn_mask.dtype).removeprefix('torch.')} attn_mask {shape}; the "
        f"kernel takes boolean key masks only (True = attend), as segment ids. An additive "
        f"float mask is not supported: pass the boolean mask it was made from")
  # [Skv], [B or 1, Skv] (Diffusers' native backend reads a 2-D mask as [B, Skv]) or
  # [B or 1, 1, 1, Skv]: the same keys for every query and head.
  key_only = (len(shape) in (1, 2) or (len(shape) == 4 and shape[1:3] == (1, 1)))
  if not key_only or shape[-1] != kv_len or (len(shape) > 1 and shape[0] not in (1, batch)):
    raise NotImplementedError(
        f"{_OP}: attn_mask of shape {shape} for batch {batch}, {q_len} queries, {kv_len} "
        f"keys: the kernel masks keys per batch row (segment ids), so it takes a boolean "
        f"key mask of shape [{kv_len}], [{batch}, {kv_len}] or [{batch}, 1, 1, {kv_len}] "
        f"(the same keys for every query and head). Masks that differ per query or per "
        f"head, and 3-D masks, are not supported: use the 'native' backend for them")
  kv_seg = attn_mask.reshape(-1, kv_len).expand(batch, kv_len).to(torch.int32)
  q_seg = kv_seg.new_ones((batch, q_len))
  return q_seg, kv_seg


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
    attn_mask: None or a boolean key mask, True = attend: [Skv], [B, Skv] or
      [B, 1, 1, Skv] (see the module docstring); anything else raises.
    dropout_p: must be 0.0 (the kernel has no dropout).
    is_causal: key j visible from query i only if j <= i (SDPA's top-left alignment).
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
  segment_ids = None
  if attn_mask is not None:
    segment_ids = _key_segment_ids(attn_mask, batch, q_len, kv_len)
  soft_cap = softcap if softcap else None
  result = flash_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                           causal=bool(is_causal), sm_scale=scale, soft_cap=soft_cap,
                           segment_ids=segment_ids, return_lse=return_lse)
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


def set_diffusers_backend(model: torch.nn.Module, name: str = DEFAULT_DIFFUSERS_BACKEND) -> str:
  """Runs every attention of a Diffusers model (e.g. `pipe.transformer`) on this kernel:
  registers the backend `name`, swaps SD3's `JointAttnProcessor2_0` (which calls SDPA
  itself) for `JointAttnProcessor`, calls `model.set_attention_backend(name)`, and
  checks that every attention module now dispatches to it. A model with another
  processor that bypasses the dispatcher raises NotImplementedError before anything is
  changed. Returns `name`.
  """
  op = "set_diffusers_backend"
  from diffusers.models.attention_processor import JointAttnProcessor2_0

  modules = _attention_modules(model)
  if not modules:
    raise ValueError(f"{op}: {type(model).__name__} has no Diffusers attention modules")
  bypassing = sorted({type(m.processor).__name__ for _, m in modules
                      if type(m.processor) is not JointAttnProcessor2_0
                      and not hasattr(m.processor, "_attention_backend")})
  if bypassing:
    raise NotImplementedError(
        f"{op}: {type(model).__name__} has attention processors that call attention "
        f"themselves instead of Diffusers' dispatcher ({', '.join(bypassing)}); "
        f"set_attention_backend cannot reach them")
  register_diffusers_backend(name)
  for _, module in modules:
    if type(module.processor) is JointAttnProcessor2_0:
      module.set_processor(JointAttnProcessor())
  model.set_attention_backend(name)
  wrong = [n for n, m in modules if getattr(m.processor, "_attention_backend", None) != name]
  if wrong:
    raise RuntimeError(f"{op}: after set_attention_backend({name!r}) these attention modules "
                       f"still use another backend: {wrong}")
  return name
