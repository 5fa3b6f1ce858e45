"""Transformers' continuous batching (`model.generate_batch`, `ContinuousBatchingManager`,
what `transformers serve` builds on) with paged-attention-tpu as its attention.

    paged = get_kernel("<org>/paged-attention-tpu", version=1)
    paged.set_continuous_batching_attention(model)      # -> "paged_attention_tpu_flash"
    outputs = model.generate_batch(prompts, generation_config,
                                   continuous_batching_config=ContinuousBatchingConfig(
                                       page_size=64, num_blocks=512, max_batch_tokens=512))

Each forward of the engine packs every scheduled request's new tokens (prefill chunks and
decode tokens mixed) into one row; every attention layer then makes ONE
write_kv_pages_ call and ONE ragged_paged_attention call over the engine's own
PagedAttentionCache.

The name. Transformers 5.23's engine accepts only "paged|eager", "sdpa" or a name that
contains "flash" (and hands only the latter its paged cache, `cache=`, without building
masks). So the attention is registered as "paged_attention_tpu_flash". Such a name cannot
be set through `from_pretrained(attn_implementation=...)` or `set_attn_implementation`:
for a "flash" name those try to load a FlashAttention build from the Hub. Hence
`set_continuous_batching_attention(model)`, which registers the function and sets the
name on the model's config (and its sub-configs) directly. Switch back with
`model.set_attn_implementation("sdpa")` (or "eager") before calling `generate()`: outside
the engine the function refuses to run (it has no paged cache).

The cache, read and written in place. The engine keeps one flat uint8 tensor
(`cache.cache_tensor`). A block holds `page_size` tokens of every layer of an attention
group as 2 * num_layers "half-pages" of page_size * kv_heads * head_dim elements in the
model's dtype, K of layer 0, V of layer 0, K of layer 1, ...; block b starts at half-page
b * 2 * num_layers. The engine interprets those bytes only in `cache.update()` (which
this attention never calls; the engine's own copies move whole blocks as bytes), so the
bytes of a half-page are ours to lay out: here each is a kernel page,
[kv_heads, page_size, head_dim]. Then, with the whole buffer viewed as
pages = [num_half_pages, kv_heads, page_size, head_dim] (no copy):
  - layer i's (i-th of its group) K cache is pages[2i:], its V cache pages[2i + 1:], both
    contiguous views (a storage offset) truncated to the same length; page id
    b * 2 * num_layers is block b in both. This is the engine's own page numbering
    (`fill_block_table`), so
  - the engine's `write_index` (token rows of the shifted K view) is already the slot
    mapping, page = slot // page_size, and a request's page table is every page_size-th
    entry of its run of `read_index` (or of `write_index` when the step reads no cache:
    all its requests are first prefill chunks);
  - the write goes through write_kv_pages_ (the one-tensor cache write) once per layer
    over the whole buffer: K and V of a layer are different pages of the same tensor, and
    the step's K and V tokens are packed into one list of 2T rows, V's slot K's plus
    page_size. Not write_kv_cache_ with the layer's K and V views: they overlap, so each
    view's result would overwrite the other's new tokens; nor with the buffer as both of
    its caches: on a TPU it donates both to XLA, which refuses to donate one buffer
    twice. write_kv_pages_ donates the one buffer (see docs/serving.md for what only a
    TPU can confirm).

Sliding-window layers (gpt-oss, Gemma 2...). The engine keeps their cache as a ring of
`sliding_window` tokens, written before it is read, and a prefill chunk that crosses the
window overwrites keys that its own earlier queries still see: the engine reads the
window out first; an attention that reads the cache in place cannot. So, for models on
this attention, every layer's cache is a full-attention cache (`group_layers_by_attn_type`
of the engine reports one full-attention group while the model's config names this
attention; other models are untouched), and the window is applied by the kernel
(`sliding_window=`, which the model passes per layer). Exact; the cost is memory: a
sliding layer keeps the whole sequence, not its last `sliding_window` tokens (gpt-oss,
half its layers sliding: up to 2x the cache of the engine's own layout for long
sequences).

The cache dtype is the model's dtype (the engine allocates its cache in `model.dtype`:
float32 or bfloat16 here); the kernel's int8 / float8 pages are not reachable through this
engine. Use PagedKVCache (dtype=torch.int8 / torch.float8_e4m3fn, k_scale, v_scale) for
those.
"""

from __future__ import annotations

import torch

from ._shim.validation import dtype_name

CONTINUOUS_BATCHING_ATTENTION_NAME = "paged_attention_tpu_flash"
_FULL_ATTENTION = "full_attention"   # transformers' cache_allocators.FULL_ATTENTION
_OP = "paged-attention-tpu continuous_batching_attention"
_CACHE_DTYPES = (torch.float32, torch.bfloat16)
# The smallest padded sizes of a step (tokens, sequences, pages per sequence): padding
# rows cost next to nothing in the kernel (q_len 0, kv_len 0) and spare compiles.
TOKEN_BUCKET_MIN, SEQ_BUCKET_MIN, PAGES_BUCKET_MIN = 16, 4, 4


def _whole_cache_pages(allocator) -> torch.Tensor:
  """The allocator's entire cache tensor as kernel pages [num_half_pages, Hkv, page_size,
  D] in the cache dtype: a view of the engine's buffer (same storage, no copy)."""
  views = allocator.__dict__.setdefault("_paged_attention_tpu_views", {})
  if "pages" not in views:
    flat = allocator.cache_tensor.view(-1)
    page_size, heads, dim = (allocator.tokens_per_page, allocator.num_key_value_heads,
                             allocator.head_dim)
    views["pages"] = flat.view(-1, heads, page_size, dim)
  return views["pages"]


def _layer_caches(allocator, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
  """(k_cache, v_cache) of one layer: contiguous views of the engine's buffer, page
  b * 2 * num_layers of both being block b (the engine's page numbering)."""
  views = allocator.__dict__.setdefault("_paged_attention_tpu_views", {})
  if layer_idx not in views:
    pages = _whole_cache_pages(allocator)
    first = 2 * allocator.layer_indices.index(layer_idx)
    # The same length for every layer (one compiled kernel for all of them), enough for
    # the last block's page (num_blocks - 1) * 2 * num_layers.
    count = pages.shape[0] - 2 * len(allocator.layer_indices) + 1
    views[layer_idx] = (pages[first:first + count], pages[first + 1:first + 1 + count])
  return views[layer_idx]


def _bucket(n: int, minimum: int) -> int:
  """n rounded up to a power of two (at least `minimum`): the padded sizes of a step, so
  that the kernel compiles a handful of programs instead of one per step shape."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


def _page_table(token_rows: torch.Tensor, cu_kv: torch.Tensor, kv_lens: torch.Tensor,
                pages_per_seq: int, page_size: int) -> torch.Tensor:
  """[S, pages_per_seq] int32 page ids: page j of sequence s is the page of its token
  j * page_size, read from its run token_rows[cu_kv[s]:cu_kv[s + 1]] of per-token cache
  rows; unused entries 0. Device ops only (no host sync)."""
  offsets = torch.arange(pages_per_seq, device=cu_kv.device, dtype=torch.int64) * page_size
  used = offsets[None, :] < kv_lens[:, None].to(torch.int64)
  where = (cu_kv[:-1, None].to(torch.int64) + offsets[None, :]).clamp(max=max(
      token_rows.shape[0] - 1, 0))
  if token_rows.shape[0] == 0:
    return torch.zeros(used.shape, dtype=torch.int32, device=cu_kv.device)
  pages = torch.div(token_rows[where], page_size, rounding_mode="floor")
  return torch.where(used, pages, torch.zeros_like(pages)).to(torch.int32)


def continuous_batching_attention(module: torch.nn.Module, query: torch.Tensor,
                                  key: torch.Tensor, value: torch.Tensor, attention_mask,
                                  dropout: float = 0.0, scaling: float | None = None,
                                  sliding_window: int | None = None,
                                  softcap: float | None = None,
                                  s_aux: torch.Tensor | None = None, cache=None,
                                  **kwargs) -> tuple[torch.Tensor, None]:
  """Transformers attention function (AttentionInterface) for the continuous-batching
  engine: writes this step's K/V into the engine's PagedAttentionCache and attends.

  query [1, Hq, T, D], key / value [1, Hkv, T, D]: the step's packed new tokens (T may
  include padding past cu_seq_lens_q[-1]; its output is 0). kwargs from the engine:
  cu_seq_lens_q [S + 1], cu_seq_lens_k / max_length_k (keyed by layer type),
  write_index / read_index (int64, one per attention group). Returns
  (attn_output [1, T, Hq, D], None).
  """
  from transformers.generation.continuous_batching import PagedAttentionCache

  from . import ragged_paged_attention, write_kv_pages_
  from ._shim import transformers_masks

  # Without this package's mask function, an unsupported mask pattern would go unnoticed.
  transformers_masks.check_mask_function(_OP, module, "set_continuous_batching_attention(model)")
  if not isinstance(cache, PagedAttentionCache):
    raise ValueError(
        f"{_OP}: runs only inside Transformers' continuous batching (model.generate_batch, "
        f"ContinuousBatchingManager), which passes its PagedAttentionCache as cache= (got "
        f"{type(cache).__name__}). For model.generate(), switch the model back first: "
        f"model.set_attn_implementation('sdpa')")
  if dropout:
    raise NotImplementedError(f"{_OP}: attention dropout ({dropout}) is not supported (serving)")
  if kwargs.get("block_table") is not None:
    raise NotImplementedError(f"{_OP}: the engine's block-table decode path (CUDA / XPU "
                              f"FlashAttention only) is not supported")
  if query.shape[0] != 1:
    raise ValueError(f"{_OP}: the engine packs every request into one row; query batch "
                     f"must be 1, got {query.shape[0]}")
  if key.shape != value.shape:
    raise NotImplementedError(f"{_OP}: keys {tuple(key.shape)} and values "
                              f"{tuple(value.shape)} differ in shape (e.g. MLA's smaller value "
                              f"head); the kernel's pages hold K and V of one head_dim")
  layer = module.layer_idx
  allocator = cache.layer_to_allocator[layer]
  if allocator.layer_type != _FULL_ATTENTION:
    raise RuntimeError(
        f"{_OP}: layer {layer} has a {allocator.layer_type} cache; this attention needs every "
        f"layer's cache to be full attention. Set the model up with "
        f"set_continuous_batching_attention(model) before creating the engine")
  if allocator.cache_dtype not in _CACHE_DTYPES:
    raise TypeError(f"{_OP}: the engine's cache is {dtype_name(allocator.cache_dtype)} (the "
                    f"model's dtype); the kernel serves float32 / bfloat16 models")
  page_size = allocator.tokens_per_page
  group = allocator.index
  write_rows = kwargs["write_index"][group]
  read_rows = kwargs["read_index"][group]
  cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
  cu_kv = kwargs["cu_seq_lens_k"][allocator.layer_type].to(torch.int32)
  max_kv = int(kwargs["max_length_k"][allocator.layer_type])

  q = query[0].transpose(0, 1)            # [T, Hq, D]
  k = key[0].transpose(0, 1)              # [T, Hkv, D]
  v = value[0].transpose(0, 1)
  num_tokens = q.shape[0]
  if write_rows.shape[0] > num_tokens:
    raise ValueError(f"{_OP}: {write_rows.shape[0]} write indices for {num_tokens} tokens")
  # Fixed buckets: tokens past cu_q[-1] are padding (output 0, no write), padding
  # sequences have q_len 0 and kv_len 0.
  padded_tokens = _bucket(num_tokens, TOKEN_BUCKET_MIN)
  padded_seqs = _bucket(cu_q.shape[0] - 1, SEQ_BUCKET_MIN)
  if padded_tokens > num_tokens:
    q = torch.cat([q, q.new_zeros((padded_tokens - num_tokens, *q.shape[1:]))])
    k = torch.cat([k, k.new_zeros((padded_tokens - num_tokens, *k.shape[1:]))])
    v = torch.cat([v, v.new_zeros((padded_tokens - num_tokens, *v.shape[1:]))])
  if padded_seqs > cu_q.shape[0] - 1:
    more = padded_seqs - (cu_q.shape[0] - 1)
    cu_q = torch.cat([cu_q, cu_q[-1:].expand(more)])
    cu_kv = torch.cat([cu_kv, cu_kv[-1:].expand(more)])

  # Slots in the whole-buffer numbering: the engine's rows count from this layer's K view
  # (half-page 2i); V is the next half-page. Tokens without an engine slot are skipped.
  first_page = 2 * allocator.layer_indices.index(layer)
  k_slots = torch.full((padded_tokens,), -1, dtype=torch.int64, device=q.device)
  k_slots[:write_rows.shape[0]] = write_rows + first_page * page_size
  v_slots = torch.where(k_slots >= 0, k_slots + page_size, k_slots)
  write_kv_pages_(_whole_cache_pages(allocator), torch.cat([k, v]),
                  torch.cat([k_slots, v_slots]).to(torch.int32))

  # Page tables: a step that reads no cache (every request's first chunk) has no
  # read_index, and then each request's KV is exactly its new tokens (cu_kv == cu_q).
  token_rows = read_rows if read_rows.numel() else write_rows
  kv_lens = cu_kv[1:] - cu_kv[:-1]
  pages_per_seq = _bucket(-(-max_kv // page_size), PAGES_BUCKET_MIN)
  page_indices = _page_table(token_rows, cu_kv, kv_lens, pages_per_seq, page_size)
  k_cache, v_cache = _layer_caches(allocator, layer)
  out = ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q,
                               sm_scale=scaling, soft_cap=softcap,
                               sliding_window=sliding_window,
                               sinks=None if s_aux is None else s_aux.detach())
  return out[:num_tokens].unsqueeze(0), None


def _one_full_attention_group(original):
  """The engine's group_layers_by_attn_type, except that a model on this attention gets a
  single full-attention group (the sliding-window note in the module docstring)."""
  if getattr(original, "_paged_attention_tpu", False):
    return original

  def group_layers_by_attn_type(config):
    if getattr(config, "_attn_implementation", None) == CONTINUOUS_BATCHING_ATTENTION_NAME:
      return {_FULL_ATTENTION: list(range(config.num_hidden_layers))}
    return original(config)

  group_layers_by_attn_type._paged_attention_tpu = True
  group_layers_by_attn_type.__wrapped__ = original
  group_layers_by_attn_type.__doc__ = original.__doc__
  return group_layers_by_attn_type


def register_continuous_batching() -> str:
  """Registers `continuous_batching_attention` (and a mask function that builds no mask)
  with Transformers under CONTINUOUS_BATCHING_ATTENTION_NAME, and makes the engine give
  models on it one full-attention cache group. Returns the name. Idempotent."""
  from transformers import AttentionInterface, AttentionMaskInterface
  from transformers.generation.continuous_batching import cache as cb_cache
  from transformers.generation.continuous_batching import initialization as cb_init

  from .serving import make_attention_mask

  for module in (cb_cache, cb_init):   # both look the function up by this global name
    module.group_layers_by_attn_type = _one_full_attention_group(
        module.group_layers_by_attn_type)
  AttentionInterface.register(CONTINUOUS_BATCHING_ATTENTION_NAME, continuous_batching_attention)
  AttentionMaskInterface.register(CONTINUOUS_BATCHING_ATTENTION_NAME, make_attention_mask)
  return CONTINUOUS_BATCHING_ATTENTION_NAME


def set_continuous_batching_attention(model) -> str:
  """Makes `model`'s continuous batching (generate_batch, init_continuous_batching,
  continuous_batching_context_manager) run its attention on paged-attention-tpu.

  Registers the attention (register_continuous_batching) and sets the model's config
  (and sub-configs) to it. Call it before the engine is created (a manager kept with
  persistent_manager=True keeps the cache layout it was made with). Raises TypeError for
  a model dtype the kernel does not serve. Returns the attention name.
  """
  if model.dtype not in _CACHE_DTYPES:
    raise TypeError(f"set_continuous_batching_attention: the model is "
                    f"{dtype_name(model.dtype)}; the engine's cache takes the model's dtype "
                    f"and the kernel serves float32 / bfloat16")
  name = register_continuous_batching()
  model.config._attn_implementation = name
  return name
