"""Transformers' own continuous batching on paged-attention-tpu (issue 27): tiny randomly
initialised Llama (GQA: 4 query heads, 2 KV heads), Qwen3 (q/k norms) and gpt-oss
(attention sinks; sliding window 8 on every other layer), 2 layers, float32
(scripts/transformers_integration.py), served by `model.generate_batch` after
`set_continuous_batching_attention(model)`, give the same greedy tokens as
`model.generate(do_sample=False)` run on each prompt alone with eager attention. Exact
token equality: float32 on both sides, the attention sums differ only in order.

The workload makes the engine do what a server does: five prompts of 5 to 44 tokens, a
step budget of 32 tokens (a 44-token prompt is prefilled in two chunks, the second after
its cached prefix) and at most 4 requests per step, and a cache too small for all
requests at once, so that requests wait for pages other requests free. Each case checks
that this happened: a page (block) held by two different requests in turn, a kernel call
that mixes a decode token with a prefill chunk, one write_kv_pages_ and one
ragged_paged_attention call per layer per step, and the kernel reading and the write
writing the engine's own cache tensor (same storage, no copy; the write given it once, as
its one cache). In place, proven rather than assumed: the cache's allocator is the
package's KernelPagesAllocator, and the engine's own write and gather (index_copy_ into,
index_select from, its K/V rows of the cache tensor) never ran, counted at torch's entry
points (the counters do count the engine's own update on the same cache). A corrupted page
must change the tokens. K/V that did not go through the package's allocator in the step
(no cache.update, or changed after it) make the attention raise.

Default cases: (llama, page 16), (qwen3, page 64), (gpt_oss, page 16). With
HYPOTHESIS_PROFILE=thorough: every family with both page sizes.
"""

import itertools
import re

import pytest
import torch

import transformers_integration as ti
from profiles import THOROUGH

NEW_TOKENS = 6
PROMPT_LENGTHS = (5, 21, 37, 12, 44)
MAX_BATCH_TOKENS = 32
MAX_REQUESTS_PER_BATCH = 4
# Blocks (pages of every layer) in the cache: fewer than all requests together need
# (12 at page 16, 5 at page 64) and enough for the longest one alone.
NUM_BLOCKS = {16: 6, 64: 3}
FAMILIES = ("llama", "qwen3", "gpt_oss")
PAGE_SIZES = (16, 64)
CASES = (list(itertools.product(FAMILIES, PAGE_SIZES)) if THOROUGH
         else [("llama", 16), ("qwen3", 64), ("gpt_oss", 16)])


def _prompts(vocab_size: int) -> list[list[int]]:
  gen = torch.Generator().manual_seed(13)
  return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def _generation_config(model):
  """Greedy, NEW_TOKENS at most, stopping at the model's EOS (generate and the engine
  both honour it; with None, generate would still take it from the model's defaults and
  the engine would not)."""
  from transformers import GenerationConfig

  return GenerationConfig(do_sample=False, max_new_tokens=NEW_TOKENS,
                          eos_token_id=model.config.eos_token_id, pad_token_id=0)


def _expected(model, prompts) -> list[list[int]]:
  """Transformers' greedy generate, one prompt at a time, with its own attention."""
  out = []
  with torch.no_grad():
    for prompt in prompts:
      ids = model.generate(torch.tensor([prompt]), generation_config=_generation_config(model))
      out.append(ids[0, len(prompt):].tolist())
  return out


class EngineRecorder:
  """Records, through the engine's and the kernel's entry points, what a generate_batch
  run did: the engine's cache, the blocks each request was given, and the query lengths
  and K cache of every kernel call. `corrupt` zeroes (once) the first block of the
  longest prompt's request when its first decode step is prepared."""

  def __init__(self, monkeypatch, paged, corrupt: bool = False):
    from transformers.generation.continuous_batching import PagedAttentionCache
    from transformers.generation.continuous_batching.cache_allocators import (
        FullAttentionCacheAllocator)

    self.cache = None
    self.blocks = {}                  # request id -> every block id it was given
    self.q_lens = []                  # per attention call: the real sequences' q lengths
    self.q_kv_lens = []               # per attention call: (q_len, kv_len) of each of them
    self.k_cache_storages = set()
    self.write_cache_storages = set()   # the storage of every write's one cache
    self.writes = 0
    self.corrupted = None
    # index_copy_ into / index_select from the engine's cache tensor viewed in the model's
    # dtype: the engine's own K/V write and gather (FullAttentionCacheAllocator.update).
    # Its uint8 views only move whole blocks (fork, CPU offload), in any page layout.
    self.engine_kv_writes = 0
    self.engine_kv_gathers = 0
    recorder = self
    allocate = FullAttentionCacheAllocator.allocate_cache_to_request
    extend = PagedAttentionCache.extend_read_and_write_indices

    def recording_allocate(allocator, request_id, past_length, query_length):
      allocate(allocator, request_id, past_length, query_length)
      recorder.blocks.setdefault(request_id, set()).update(allocator.block_table[request_id])

    def recording_extend(cache, request_id, past_length, query_length, read_index, write_index):
      recorder.cache = cache
      if (corrupt and recorder.corrupted is None
          and past_length == max(PROMPT_LENGTHS) and query_length == 1):
        for allocator in cache.cache_allocators.values():
          allocator._copy_view[allocator.block_table[request_id][0]].zero_()
        recorder.corrupted = request_id
      return extend(cache, request_id, past_length, query_length, read_index, write_index)

    attention_op, write_op = paged.ragged_paged_attention_op, paged.write_kv_pages_op

    def recording_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, *rest):
      lens = torch.diff(cu_q_lens).tolist()
      recorder.q_lens.append([n for n in lens if n])
      recorder.q_kv_lens.append([(n, kv) for n, kv in zip(lens, kv_lens.tolist()) if n])
      recorder.k_cache_storages.add(k_cache.untyped_storage().data_ptr())
      return attention_op(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, *rest)

    def recording_write(cache, *rest):
      recorder.writes += 1
      recorder.write_cache_storages.add(cache.untyped_storage().data_ptr())
      return write_op(cache, *rest)

    index_select, index_copy_ = torch.index_select, torch.Tensor.index_copy_

    def engine_kv_rows(t):
      return (recorder.cache is not None and t.dtype != torch.uint8
              and t.untyped_storage().data_ptr()
              == recorder.cache.cache_tensor.untyped_storage().data_ptr())

    def counting_index_select(input, *args, **kwargs):
      recorder.engine_kv_gathers += engine_kv_rows(input)
      return index_select(input, *args, **kwargs)

    def counting_index_copy_(tensor, *args, **kwargs):
      recorder.engine_kv_writes += engine_kv_rows(tensor)
      return index_copy_(tensor, *args, **kwargs)

    monkeypatch.setattr(torch, "index_select", counting_index_select)
    monkeypatch.setattr(torch.Tensor, "index_copy_", counting_index_copy_)
    monkeypatch.setattr(FullAttentionCacheAllocator, "allocate_cache_to_request",
                        recording_allocate)
    monkeypatch.setattr(PagedAttentionCache, "extend_read_and_write_indices", recording_extend)
    monkeypatch.setattr(paged, "ragged_paged_attention_op", recording_attention)
    monkeypatch.setattr(paged, "write_kv_pages_op", recording_write)


def _engine_config(page_size: int):
  from transformers import ContinuousBatchingConfig

  return ContinuousBatchingConfig(page_size=page_size, num_blocks=NUM_BLOCKS[page_size],
                                  max_batch_tokens=MAX_BATCH_TOKENS,
                                  max_requests_per_batch=MAX_REQUESTS_PER_BATCH)


def _serve(paged, model, prompts, page_size: int) -> list[list[int]]:
  """generate_batch on the kernel; the model goes back to eager attention afterwards."""
  config = _engine_config(page_size)
  assert paged.set_continuous_batching_attention(model) == paged.CONTINUOUS_BATCHING_ATTENTION_NAME
  try:
    outputs = model.generate_batch(prompts, generation_config=_generation_config(model),
                                   continuous_batching_config=config, warmup=False)
  finally:
    model.set_attn_implementation("eager")
  assert len(outputs) == len(prompts)
  for output in outputs.values():
    assert output.error is None, output.error
  return [output.generated_tokens for output in outputs.values()]


@pytest.mark.parametrize("family,page_size", CASES)
def test_generate_batch_matches_generate(paged, family, page_size, monkeypatch):
  model = ti.tiny_attention_model(family, torch.float32)
  prompts = _prompts(model.config.vocab_size)
  expected = _expected(model, prompts)
  recorder = EngineRecorder(monkeypatch, paged)
  got = _serve(paged, model, prompts, page_size)
  assert got == expected

  # Every layer's cache is one full-attention group (gpt-oss's sliding layers included),
  # with the requested page size, kept by the package's allocator.
  (allocator,) = recorder.cache.cache_allocators.values()
  assert type(allocator) is paged.continuous_batching.kernel_pages_allocator_class()
  assert allocator.layer_type == "full_attention"
  assert allocator.layer_indices == list(range(model.config.num_hidden_layers))
  assert allocator.tokens_per_page == page_size
  # Requests waited for pages: some block served two requests in turn.
  owners = {}
  for request, blocks in recorder.blocks.items():
    for block in blocks:
      owners.setdefault(block, set()).add(request)
  assert any(len(requests) > 1 for requests in owners.values()), recorder.blocks
  # Decode tokens and prefill chunks in the same kernel call; one write and one attention
  # per layer per step.
  assert any(1 in lens and max(lens) > 1 for lens in recorder.q_lens), recorder.q_lens
  # A prefill chunk after a cached prefix (the 44-token prompt does not fit one step).
  assert any(q > 1 and kv > q for call in recorder.q_kv_lens for q, kv in call)
  layers = model.config.num_hidden_layers
  assert recorder.writes == len(recorder.q_lens) and len(recorder.q_lens) % layers == 0
  # The kernel read, and the one-cache write wrote, the engine's cache tensor itself.
  engine_storage = recorder.cache.cache_tensor.untyped_storage().data_ptr()
  assert recorder.k_cache_storages == {engine_storage}
  assert recorder.write_cache_storages == {engine_storage}
  # In place: the engine neither wrote nor gathered K/V rows of its cache.
  assert (recorder.engine_kv_writes, recorder.engine_kv_gathers) == (0, 0)
  # ... and the counters see the engine's own update on this cache: one token of layer 0,
  # written to the engine's write-trash row and read back from its read-trash row.
  from transformers.generation.continuous_batching.cache_allocators import (
      FullAttentionCacheAllocator)

  token = torch.zeros(1, allocator.num_key_value_heads, allocator.head_dim)
  FullAttentionCacheAllocator.update(allocator, token, token, 0,
                                     torch.tensor([allocator.read_trash_index]),
                                     torch.tensor([allocator.write_trash_index]))
  assert (recorder.engine_kv_writes, recorder.engine_kv_gathers) == (2, 2)


def test_a_corrupted_page_changes_the_tokens(paged, monkeypatch):
  """The comparison has teeth: the same run with the longest prompt's first block (K and V
  of every layer, in the engine's cache tensor) zeroed before its first decode step gives
  other tokens for that prompt, and the same tokens for the others."""
  family, page_size = CASES[0]
  model = ti.tiny_attention_model(family, torch.float32)
  prompts = _prompts(model.config.vocab_size)
  expected = _expected(model, prompts)
  recorder = EngineRecorder(monkeypatch, paged, corrupt=True)
  got = _serve(paged, model, prompts, page_size)
  assert recorder.corrupted is not None
  longest = PROMPT_LENGTHS.index(max(PROMPT_LENGTHS))
  assert got[longest] != expected[longest]
  assert [g for i, g in enumerate(got) if i != longest] == [
      e for i, e in enumerate(expected) if i != longest]


def test_outside_the_engine_it_refuses(paged):
  """generate() with the engine's attention still set is an error, not a silent fallback."""
  model = ti.tiny_attention_model("llama", torch.float32)
  paged.set_continuous_batching_attention(model)
  with pytest.raises(ValueError, match="runs only inside Transformers. continuous batching"):
    model.generate(torch.tensor([[5, 6, 7]]), generation_config=_generation_config(model))


@pytest.mark.parametrize("update,error", [
    ("skipped", "not written to the engine's paged cache by this attention's allocator"),
    ("copied", "other than the .* its cache.update wrote"),
])
def test_kv_the_allocator_did_not_write_are_refused(paged, monkeypatch, update, error):
  """Inside the engine, the attention refuses K/V that did not reach the cache through the
  package's allocator in this step: a cache.update that does not call the allocator (as
  for a model that writes no cache), or K/V changed after the write. Every request then
  fails with that error (the engine reports it per request); nothing is generated."""
  from transformers.generation.continuous_batching import PagedAttentionCache

  engine_update = PagedAttentionCache.update

  def skipped(cache, key_states, value_states, layer_idx, kwargs):
    allocator = cache.layer_to_allocator[layer_idx]
    kwargs["cu_seq_lens_k"] = kwargs["cu_seq_lens_k"][allocator.layer_type]
    kwargs["max_length_k"] = kwargs["max_length_k"][allocator.layer_type]
    return key_states, value_states

  def copied(cache, key_states, value_states, layer_idx, kwargs):
    k, v = engine_update(cache, key_states, value_states, layer_idx, kwargs)
    return k.clone(), v

  monkeypatch.setattr(PagedAttentionCache, "update", {"skipped": skipped, "copied": copied}[update])
  model = ti.tiny_attention_model("llama", torch.float32)
  paged.set_continuous_batching_attention(model)
  try:
    outputs = model.generate_batch(_prompts(model.config.vocab_size)[:2],
                                   generation_config=_generation_config(model), warmup=False,
                                   continuous_batching_config=_engine_config(16))
  finally:
    model.set_attn_implementation("eager")
  assert len(outputs) == 2
  for output in outputs.values():
    assert output.error is not None and re.search(error, output.error), output.error
    assert output.generated_tokens == []


def test_other_models_keep_the_engines_cache_groups(paged):
  """The one-group cache and the package's allocator are only for models on this
  attention: the engine still gives an sdpa gpt-oss its sliding-window group and its own
  allocators. Registering twice wraps the engine's functions once."""
  from transformers.generation.continuous_batching import PagedAttentionCache
  from transformers.generation.continuous_batching import cache as cb_cache
  from transformers.generation.continuous_batching.distributed import DistributedHelper

  paged.register_continuous_batching()
  wrapped = (cb_cache.group_layers_by_attn_type, PagedAttentionCache._create_allocator)
  paged.register_continuous_batching()
  assert (cb_cache.group_layers_by_attn_type, PagedAttentionCache._create_allocator) == wrapped

  def allocators(config):
    engine_config = _engine_config(16)
    engine_config.max_memory_percent = 0.5   # the engine resolves it; num_blocks sizes
    cache = PagedAttentionCache(config, engine_config, device="cpu",
                                distributed_helper=DistributedHelper(None, None),
                                dtype=torch.float32)
    return {kind: type(allocator) for kind, allocator in cache.cache_allocators.items()}

  config = ti.tiny_attention_config("gpt_oss")
  config._attn_implementation = "sdpa"
  assert allocators(config) == cb_cache.ATTN_TYPE_TO_ALLOCATOR
  config._attn_implementation = paged.CONTINUOUS_BATCHING_ATTENTION_NAME
  assert cb_cache.group_layers_by_attn_type(config) == {"full_attention": [0, 1]}
  assert allocators(config) == {
      "full_attention": paged.continuous_batching.kernel_pages_allocator_class()}


def test_a_float16_model_is_refused(paged):
  model = ti.tiny_attention_model("llama", torch.float16)
  with pytest.raises(TypeError, match="float16"):
    paged.set_continuous_batching_attention(model)
