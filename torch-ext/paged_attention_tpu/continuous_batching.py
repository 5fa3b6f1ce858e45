"""Transformers' continuous batching (`model.generate_batch`, `ContinuousBatchingManager`,
what `transformers serve` builds on) with paged-attention-tpu as its attention
(Transformers 5.25).

    paged = get_kernel("<org>/paged-attention-tpu", version=1)
    paged.set_continuous_batching_attention(model)      # -> "paged_attention_tpu_flash"
    outputs = model.generate_batch(prompts, generation_config,
                                   continuous_batching_config=ContinuousBatchingConfig(
                                       page_size=64, num_blocks=512, max_batch_tokens=512))

Each forward of the engine packs every scheduled request's new tokens (prefill chunks and
decode tokens mixed) into one row; every attention layer then makes ONE
write_kv_pages_ call and ONE ragged_paged_attention call over the engine's own
PagedAttentionCache buffer, in place: the engine neither writes nor gathers K/V for it.

The name. The engine accepts only "paged|eager", "sdpa" or a name that contains "flash",
and builds no attention masks only for the latter. So the attention is registered as
"paged_attention_tpu_flash". Such a name cannot be set through
`from_pretrained(attn_implementation=...)` or `set_attn_implementation`: for a "flash"
name those try to load a FlashAttention build from the Hub. Hence
`set_continuous_batching_attention(model)`, which registers the function and sets the
name on the model's config (and its sub-configs) directly. Switch back with
`model.set_attn_implementation("sdpa")` (or "eager") before calling `generate()`: outside
the engine the function refuses to run (nothing wrote its K/V into a paged cache).

Where the write happens. In Transformers 5.25 the model itself calls
`cache.update(key, value, layer_idx, kwargs=kwargs)` before the attention function, and
the attention gets no cache. PagedAttentionCache.update selects `cu_seq_lens_k` /
`max_length_k` for the layer's cache group (in kwargs, in place) and hands the K/V to the
group's allocator, whose `update` the engine's FullAttentionCacheAllocator implements as
an index_copy_ of the new K/V into its token-major rows and an index_select of the whole
sequence back, which the attention would then receive. That allocator is the engine's
extension point, and this module takes it: for a model whose config names this attention,
`PagedAttentionCache._create_allocator` (wrapped, idempotently; every other model keeps the
engine's own allocators) creates a KernelPagesAllocator, a FullAttentionCacheAllocator
whose `update` writes the step's K/V with write_kv_pages_, in the kernel's page layout,
and returns them unchanged (no engine write, no gather). It also records what it wrote
(per thread, per layer: the K/V tensors, read_index, write_index). The attention takes
that record for its layer, and raises if there is none or if its K/V are not the ones
written (a model that does not call cache.update, an engine created before
set_continuous_batching_attention, plain generate()): never attention over a cache that
this step's tokens did not reach. It then builds the page tables and calls
ragged_paged_attention over the buffer in place. The engine's block-table decode path is
off for this allocator (supports_block_table = False; the engine takes it only for
FlashAttention on CUDA / XPU anyway).

The cache, in the kernel's layout. The engine keeps one flat uint8 tensor
(`cache.cache_tensor`; two trash sectors first, never given to a request). A block holds
`page_size` tokens of every layer of an attention group as 2 * num_layers "half-pages" of
page_size * kv_heads * head_dim elements in the model's dtype, K of layer 0, V of layer 0,
K of layer 1, ...; block b starts at half-page b * 2 * num_layers. The engine interprets
the bytes inside a half-page only in its allocator's `update` (replaced here) and its
block-table views (unused here); everything else it does to the buffer (forking, prefix
sharing, CPU offloading and restoring) moves whole blocks as bytes. So the bytes of a
half-page are ours to lay out: here each is a kernel page, [kv_heads, page_size,
head_dim]. With the whole buffer viewed as pages = [num_half_pages, kv_heads, page_size,
head_dim] (no copy):
  - layer i's (i-th of its group) K cache is pages[2i:], its V cache pages[2i + 1:], both
    contiguous views (a storage offset) truncated to the same length; page id
    b * 2 * num_layers is block b in both (the engine's own page numbering), so
  - the engine's `write_index` (token rows of the layer's shifted K view) is already the
    slot mapping, page = slot // page_size, and a request's page table is every
    page_size-th entry of its run of `read_index` (or of `write_index` when the step reads
    no cache: all its requests are first prefill chunks);
  - the write goes through write_kv_pages_ (the one-tensor cache write) once per layer
    over the whole buffer: K and V of a layer are different pages of the same tensor, and
    the step's K and V tokens are packed into one list of 2T rows, V's slot K's plus
    page_size. Not write_kv_cache_ with the layer's K and V views: they overlap, so each
    view's result would overwrite the other's new tokens; nor with the buffer as both of
    its caches: on a TPU it donates both to XLA, which refuses to donate one buffer
    twice. write_kv_pages_ donates the one buffer (see docs/serving.md for what only a
    TPU can confirm). Padding tokens (past write_index, or at the engine's write-trash
    row) are skipped.

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
those. MLA models (compressed-latent caches) are refused when the engine creates its cache.
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from ._shim.validation import dtype_name

CONTINUOUS_BATCHING_ATTENTION_NAME = "paged_attention_tpu_flash"
_FULL_ATTENTION = "full_attention"   # transformers' cache_allocators.FULL_ATTENTION
_OP = "paged-attention-tpu continuous_batching_attention"
_CACHE_DTYPES = (torch.float32, torch.bfloat16)
# The smallest padded sizes of a step (tokens, sequences, pages per sequence): padding
# rows cost next to nothing in the kernel (q_len 0, kv_len 0) and spare compiles.
TOKEN_BUCKET_MIN, SEQ_BUCKET_MIN, PAGES_BUCKET_MIN = 16, 4, 4
# The engine functions wrapped here carry this attribute, set to _THIS_COPY: a unique
# object per loaded copy of this module (see _wrap_once).
_WRAPPED, _THIS_COPY = "_paged_attention_tpu", object()


def _bucket(n: int, minimum: int) -> int:
  """n rounded up to a power of two (at least `minimum`): the padded sizes of a step, so
  that the kernel compiles a handful of programs instead of one per step shape."""
  return max(minimum, 1 << max(n - 1, 0).bit_length())


@dataclasses.dataclass(frozen=True)
class _LayerWrite:
  """What KernelPagesAllocator.update wrote for one layer in this step: the K/V it was
  given ([T, Hkv, D], returned unchanged to the model), and the engine's int64 indices
  for the layer's group (write_index [<= T], read_index [cached + new tokens, or 0])."""

  allocator: object
  key: torch.Tensor
  value: torch.Tensor
  write_index: torch.Tensor
  read_index: torch.Tensor


class _WrittenLayers(threading.local):
  """Per thread (the engine may run its loop in a thread of its own): layer index ->
  _LayerWrite, set by the allocator's update and taken by the attention right after it,
  in the same layer's forward."""

  def __init__(self):
    self.layers: dict[int, _LayerWrite] = {}


_WRITTEN = _WrittenLayers()


def _write_step(allocator, key_states: torch.Tensor, value_states: torch.Tensor,
                layer_idx: int, write_index: torch.Tensor) -> None:
  """One write_kv_pages_ call: the step's K and V rows ([T, Hkv, D] each) into the
  allocator's whole buffer at the engine's write_index (int64 [<= T], rows of the layer's
  K view), V one half-page after K. Tokens without a write index, or at the engine's
  write-trash row (padding), get slot -1 (skipped). T is padded to a bucket."""
  from . import write_kv_pages_

  num_tokens = key_states.shape[0]
  if write_index.shape[0] > num_tokens:
    raise ValueError(f"{_OP}: {write_index.shape[0]} write indices for {num_tokens} tokens")
  page_size = allocator.tokens_per_page
  padded_tokens = _bucket(num_tokens, TOKEN_BUCKET_MIN)
  rows = []
  for t in (key_states, value_states):
    if padded_tokens > num_tokens:
      t = torch.cat([t, t.new_zeros((padded_tokens - num_tokens, *t.shape[1:]))])
    rows.append(t)
  # Slots in the whole-buffer numbering: the engine's rows count from this layer's K view
  # (half-page 2i); V is the next half-page.
  shifted = write_index + allocator.first_half_page[layer_idx] * page_size
  k_slots = torch.full((padded_tokens,), -1, dtype=torch.int64, device=key_states.device)
  k_slots[:write_index.shape[0]] = torch.where(
      write_index == allocator.write_trash_index, -1, shifted)
  v_slots = torch.where(k_slots >= 0, k_slots + page_size, k_slots)
  write_kv_pages_(allocator.kernel_pages, torch.cat(rows),
                  torch.cat([k_slots, v_slots]).to(torch.int32))


@functools.cache
def kernel_pages_allocator_class():
  """KernelPagesAllocator: Transformers' FullAttentionCacheAllocator with this kernel's
  page layout and write (the module docstring). Built on first use, so that the package
  imports without Transformers."""
  from transformers.generation.continuous_batching.cache_allocators import (
      FullAttentionCacheAllocator)

  class KernelPagesAllocator(FullAttentionCacheAllocator):
    """The engine's full-attention allocator (blocks, sectors, sharing, copies unchanged)
    whose update writes the step's K/V into the kernel's pages and returns them as given,
    for continuous_batching_attention to read the cache in place.

    Attributes set with the cache tensor:
      kernel_pages: the whole buffer as [num_half_pages, Hkv, page_size, D] in the cache
        dtype (same storage, no copy): write_kv_pages_'s one cache.
      layer_caches: layer index -> (k_cache, v_cache), views of kernel_pages from
        half-page 2i and 2i + 1, of one length: ragged_paged_attention's caches.
      first_half_page: layer index -> 2i, where the engine's row numbering starts.
    """

    supports_block_table = False   # its update is the only way in

    def register_cache_tensor(self, bytes_per_sector, non_trash_bytes, cache_tensor, pool):
      super().register_cache_tensor(bytes_per_sector, non_trash_bytes, cache_tensor, pool)
      self.kernel_pages = self.cache_tensor.view(-1, self.num_key_value_heads,
                                                 self.tokens_per_page, self.head_dim)
      # The same length for every layer (one compiled kernel for all of them), enough for
      # the last block's page (num_blocks - 1) * 2 * num_layers.
      count = self.kernel_pages.shape[0] - 2 * len(self.layer_indices) + 1
      self.first_half_page = {layer: 2 * i for i, layer in enumerate(self.layer_indices)}
      self.layer_caches = {
          layer: (self.kernel_pages[first:first + count],
                  self.kernel_pages[first + 1:first + 1 + count])
          for layer, first in self.first_half_page.items()}

    def update(self, key_states, value_states, layer_idx, read_index, write_index):
      """key_states / value_states [T, Hkv, D] in the cache dtype; read_index, write_index
      int64 (the engine's). Writes them (one write_kv_pages_) and returns them unchanged:
      the attention reads the cache in place, nothing is gathered."""
      _write_step(self, key_states, value_states, layer_idx, write_index)
      _WRITTEN.layers[layer_idx] = _LayerWrite(self, key_states, value_states, write_index,
                                               read_index)
      return key_states, value_states

  return KernelPagesAllocator


def _take_layer_write(layer: int, key: torch.Tensor, value: torch.Tensor) -> _LayerWrite:
  """The record of this step's write for `layer`, checked to be of these very K/V
  ([1, Hkv, T, D]: the allocator's tensors, transposed back by the engine); raises if the
  layer's K/V did not go through KernelPagesAllocator.update."""
  written = _WRITTEN.layers.pop(layer, None)
  if written is None:
    raise ValueError(
        f"{_OP}: runs only inside Transformers' continuous batching (model.generate_batch, "
        f"ContinuousBatchingManager) on an engine created after "
        f"set_continuous_batching_attention(model): layer {layer}'s keys and values were "
        f"not written to the engine's paged cache by this attention's allocator in this "
        f"step (the model did not call cache.update on it). For model.generate(), switch "
        f"the model back first: model.set_attn_implementation('sdpa')")
  for name, got, wrote in (("keys", key, written.key), ("values", value, written.value)):
    got = got[0].transpose(0, 1)
    if (got.data_ptr() != wrote.data_ptr() or got.shape != wrote.shape
        or got.stride() != wrote.stride()):
      raise RuntimeError(
          f"{_OP}: layer {layer} got {name} {tuple(got.shape)} other than the "
          f"{tuple(wrote.shape)} its cache.update wrote in this step (changed after the "
          f"update?); the attention reads the cache, so it would not see them")
  return written


def _for_layer_type(value, allocator):
  """A kwarg the engine keys by cache group type (cu_seq_lens_k, max_length_k) for this
  allocator: as PagedAttentionCache.update left it (selected), or still the per-type dict."""
  return value[allocator.layer_type] if isinstance(value, dict) else value


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
                                  s_aux: torch.Tensor | None = None,
                                  **kwargs) -> tuple[torch.Tensor, None]:
  """Transformers attention function (AttentionInterface) for the continuous-batching
  engine: attends over the engine's PagedAttentionCache, in place, after
  KernelPagesAllocator.update (called by the model's cache.update) wrote this step's K/V.

  query [1, Hq, T, D], key / value [1, Hkv, T, D]: the step's packed new tokens, as the
  cache's update returned them (T may include padding past cu_seq_lens_q[-1]; its output
  is 0). kwargs from the engine: cu_seq_lens_q [S + 1] int32, cu_seq_lens_k [S + 1] and
  max_length_k (selected for the layer's group by cache.update, or keyed by group type).
  Returns (attn_output [1, T, Hq, D], None).
  """
  from . import ragged_paged_attention
  from ._shim import transformers_masks

  # First, so that the record never outlives its step, whatever is refused below.
  layer = module.layer_idx
  written = _take_layer_write(layer, key, value)
  # Without this package's mask function, an unsupported mask pattern would go unnoticed.
  transformers_masks.check_mask_function(_OP, module, "set_continuous_batching_attention(model)")
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
  allocator = written.allocator
  page_size = allocator.tokens_per_page
  cu_q = kwargs["cu_seq_lens_q"].to(torch.int32)
  cu_kv = _for_layer_type(kwargs["cu_seq_lens_k"], allocator).to(torch.int32)
  max_kv = int(_for_layer_type(kwargs["max_length_k"], allocator))

  q = query[0].transpose(0, 1)            # [T, Hq, D]
  num_tokens = q.shape[0]
  # Fixed buckets: tokens past cu_q[-1] are padding (output 0), padding sequences have
  # q_len 0 and kv_len 0.
  padded_tokens = _bucket(num_tokens, TOKEN_BUCKET_MIN)
  padded_seqs = _bucket(cu_q.shape[0] - 1, SEQ_BUCKET_MIN)
  if padded_tokens > num_tokens:
    q = torch.cat([q, q.new_zeros((padded_tokens - num_tokens, *q.shape[1:]))])
  if padded_seqs > cu_q.shape[0] - 1:
    more = padded_seqs - (cu_q.shape[0] - 1)
    cu_q = torch.cat([cu_q, cu_q[-1:].expand(more)])
    cu_kv = torch.cat([cu_kv, cu_kv[-1:].expand(more)])

  # Page tables: a step that reads no cache (every request's first chunk) has no
  # read_index, and then each request's KV is exactly its new tokens (cu_kv == cu_q).
  token_rows = written.read_index if written.read_index.numel() else written.write_index
  kv_lens = cu_kv[1:] - cu_kv[:-1]
  pages_per_seq = _bucket(-(-max_kv // page_size), PAGES_BUCKET_MIN)
  page_indices = _page_table(token_rows, cu_kv, kv_lens, pages_per_seq, page_size)
  k_cache, v_cache = allocator.layer_caches[layer]
  out = ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q,
                               sm_scale=scaling, soft_cap=softcap,
                               sliding_window=sliding_window,
                               sinks=None if s_aux is None else s_aux.detach())
  return out[:num_tokens].unsqueeze(0), None


def _wrap_once(original, wrap):
  """wrap(original), marked as this copy's, unless `original` already is this copy's
  wrapper. A wrapper made by another loaded copy of this package (another version) is
  replaced, wrapping the engine's own function again: the engine's hooks then write the
  records that the attention registered last (this copy's) reads."""
  owner = getattr(original, _WRAPPED, None)
  if owner is _THIS_COPY:
    return original
  if owner is not None:
    original = original.__wrapped__
  wrapper = functools.wraps(original)(wrap(original))
  setattr(wrapper, _WRAPPED, _THIS_COPY)
  return wrapper


def _one_full_attention_group(original):
  """The engine's group_layers_by_attn_type, except that a model on this attention gets a
  single full-attention group (the sliding-window note in the module docstring)."""

  def group_layers_by_attn_type(config):
    if getattr(config, "_attn_implementation", None) == CONTINUOUS_BATCHING_ATTENTION_NAME:
      return {_FULL_ATTENTION: list(range(config.num_hidden_layers))}
    return original(config)

  return group_layers_by_attn_type


def _kernel_pages_allocator(original):
  """PagedAttentionCache._create_allocator, except that for a model on this attention the
  (single, full-attention) group gets a KernelPagesAllocator."""

  def _create_allocator(cache, continuous_batching_config, attn_type, index, layer_indices,
                        num_key_value_heads):
    config = cache.config
    if getattr(config, "_attn_implementation", None) != CONTINUOUS_BATCHING_ATTENTION_NAME:
      return original(cache, continuous_batching_config, attn_type, index, layer_indices,
                      num_key_value_heads)
    op = "set_continuous_batching_attention"
    if attn_type != _FULL_ATTENTION:
      raise RuntimeError(f"{op}: the engine made a {attn_type} cache group for layers "
                         f"{layer_indices}; this attention needs one full-attention group "
                         f"(call register_continuous_batching() before the engine is made)")
    if getattr(config, "kv_lora_rank", None) is not None:
      raise NotImplementedError(f"{op}: MLA models (kv_lora_rank set) keep a compressed-"
                                f"latent cache; the kernel's pages hold K and V heads")
    if cache.dtype not in _CACHE_DTYPES:
      raise TypeError(f"{op}: the engine's cache is {dtype_name(cache.dtype)} (the model's "
                      f"dtype); the kernel serves float32 / bfloat16 models")
    return kernel_pages_allocator_class()(
        index=index, config=config, num_key_value_heads=num_key_value_heads,
        cache_dtype=cache.dtype, page_size=continuous_batching_config.page_size,
        layer_indices=layer_indices,
        allow_block_sharing=continuous_batching_config.allow_block_sharing)

  return _create_allocator


def register_continuous_batching() -> str:
  """Registers `continuous_batching_attention` (and a mask function that builds no mask)
  with Transformers under CONTINUOUS_BATCHING_ATTENTION_NAME, and makes the engine give
  models on it one full-attention cache group with a KernelPagesAllocator. Returns the
  name. Idempotent; models on other attentions keep the engine's groups and allocators."""
  from transformers import AttentionInterface, AttentionMaskInterface
  from transformers.generation.continuous_batching import cache as cb_cache
  from transformers.generation.continuous_batching import initialization as cb_init

  from .serving import make_attention_mask

  for module in (cb_cache, cb_init):   # both look the function up by this global name
    module.group_layers_by_attn_type = _wrap_once(module.group_layers_by_attn_type,
                                                  _one_full_attention_group)
  cb_cache.PagedAttentionCache._create_allocator = _wrap_once(
      cb_cache.PagedAttentionCache._create_allocator, _kernel_pages_allocator)
  AttentionInterface.register(CONTINUOUS_BATCHING_ATTENTION_NAME, continuous_batching_attention)
  AttentionMaskInterface.register(CONTINUOUS_BATCHING_ATTENTION_NAME, make_attention_mask)
  return CONTINUOUS_BATCHING_ATTENTION_NAME


def set_continuous_batching_attention(model) -> str:
  """Makes `model`'s continuous batching (generate_batch, init_continuous_batching,
  continuous_batching_context_manager) run its attention on paged-attention-tpu.

  Registers the attention (register_continuous_batching) and sets the model's config
  (and sub-configs) to it. Call it before the engine is created (a manager kept with
  persistent_manager=True keeps the cache it was made with; its attention then raises).
  Raises TypeError for a model dtype the kernel does not serve. Returns the attention name.
  """
  if model.dtype not in _CACHE_DTYPES:
    raise TypeError(f"set_continuous_batching_attention: the model is "
                    f"{dtype_name(model.dtype)}; the engine's cache takes the model's dtype "
                    f"and the kernel serves float32 / bfloat16")
  name = register_continuous_batching()
  model.config._attn_implementation = name
  return name
