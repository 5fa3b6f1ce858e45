"""No silent wrong attention in Transformers (issue 26, item 2), on tiny models built from
their own configs (random weights, float32, CPU).

* Registered the way Transformers documents for custom attention,
  `AttentionInterface.register(name, kernel.attention_forward)`, without the kernel's mask
  function, Transformers passes attention_mask=None: a left-padded batch then attended to
  its padding (logits 1.07 relative off on this Llama, no error). Now every route into
  the attention (forward with and without padding, training forward, generate with and
  without padding, Gemma 2's sliding and full layers, a name whose mask function is
  another one) raises a RuntimeError naming register_attention(); register_attention()
  itself equals eager on the same left-padded batch. The same for paged-attention-tpu's
  serving attention, whose mask function refuses the patterns it does not compute.
* Llama 4's chunked attention (causal within chunks counted from each row's first valid
  token) runs on the kernel as segment ids (one chunk index per key): forward on a
  left-padded batch and greedy generation across chunk boundaries equal eager.
* Doge builds its own dynamic mask on top of the causal one and needs that materialized:
  the kernel's mask function refuses it (NotImplementedError raised in the kernel package)
  before Doge's code could fail on the reduced mask (it raised IndexError inside
  modeling_doge.py).

* Under torch.compile the mask's pattern still reaches the attention: it travels in the
  mask's shape (transformers_masks.encode_mask), not in Python attributes, which
  torch.compile dropped (the attention then fell back on its own arguments: Phi-MoE
  attended with no window, StableLM with config.is_causal=False causally, logits 0.9 off
  eager, no error). Compiled Phi-MoE, StableLM (is_causal=False), Gemma 2 and a
  left-padded Llama equal eager attention; Doge (packed sequences, and every compiled
  call: Transformers then counts any batch with position_ids as packed) is refused by the
  mask function before Doge's own code runs, and BigBird-Pegasus (no SDPA support
  declared) by the attention call, compiled as in eager.

float32 tolerance: rtol = atol = 1e-4 of eager, as in test_flash_attention_models.py.
"""

import traceback

import pytest
import torch

import reference as ref
import transformers_integration as ti
from profiles import THOROUGH

TOL = dict(rtol=1e-4, atol=1e-4)
BARE = "bare_tpu_attention"        # attention function only, no mask function
OTHER_MASK = "tpu_attention_other_mask"   # attention function + Transformers' sdpa mask
SEQ, PAD = 16, 5
VOCAB = ti._TINY["vocab_size"]


@pytest.fixture(scope="module")
def registered(flash):
  from transformers import AttentionInterface, AttentionMaskInterface
  from transformers.masking_utils import sdpa_mask

  flash.register_attention()
  AttentionInterface.register(BARE, flash.attention_forward)
  AttentionInterface.register(OTHER_MASK, flash.attention_forward)
  AttentionMaskInterface.register(OTHER_MASK, sdpa_mask)
  return flash


def _batch(seed=1, seq=SEQ):
  gen = torch.Generator().manual_seed(seed)
  ids = torch.randint(3, VOCAB, (2, seq), generator=gen)
  mask = torch.ones(2, seq, dtype=torch.long)
  mask[1, :PAD] = 0
  ids[1, :PAD] = 0
  return ids, mask


def _routes(model, ids, mask):
  """Every way the tests drive a model into its attention."""
  gen = dict(max_new_tokens=2, do_sample=False, pad_token_id=0)
  return {
      "forward": lambda: model(input_ids=ids),
      "forward, left padding": lambda: model(input_ids=ids, attention_mask=mask),
      "training forward": lambda: model.train()(input_ids=ids, labels=ids).loss.backward(),
      "generate": lambda: model.eval().generate(ids[:1], **gen),
      "generate, left padding": lambda: model.eval().generate(ids, attention_mask=mask, **gen),
  }


@pytest.mark.parametrize("family", ["llama", "gemma2"])   # gemma2: sliding + full layers
def test_attention_without_its_mask_function_raises(registered, family):
  model = ti.tiny_attention_model(family, torch.float32)
  ids, mask = _batch()
  for name, expected in ((BARE, f"no mask function is registered as '{BARE}'"),
                         (OTHER_MASK, "is sdpa_mask")):
    model.set_attn_implementation(name)
    for route, run in _routes(model, ids, mask).items():
      with pytest.raises(RuntimeError, match="register_attention") as err:
        run()
      assert expected in str(err.value), (name, route)


def test_register_attention_matches_eager_on_left_padding(registered):
  model = ti.tiny_attention_model("llama", torch.float32)
  ids, mask = _batch()
  valid = mask.bool()
  with torch.no_grad():
    model.set_attn_implementation("eager")
    want = model(input_ids=ids, attention_mask=mask).logits
    model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
    got = model(input_ids=ids, attention_mask=mask).logits
  ref.assert_close(got[valid], want[valid], TOL, what="logits")


CHUNK = 6


def _tiny_llama4():
  """Two layers: 0 chunked (chunk 6, no RoPE), 1 full; dense MLPs (no MoE layer)."""
  import transformers as tr

  config = tr.Llama4TextConfig(**dict(ti._TINY_ATTENTION, num_hidden_layers=2),
                               intermediate_size_mlp=128, num_local_experts=2,
                               attention_chunk_size=CHUNK, no_rope_layers=[1, 0], moe_layers=[])
  assert config.layer_types == ["chunked_attention", "full_attention"]
  torch.manual_seed(0)
  return tr.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()


def test_llama4_chunked_attention_matches_eager(registered):
  model = _tiny_llama4()
  ids, mask = _batch(seq=20)           # row 1: 5 padding tokens, then 15 in chunks of 6
  valid = mask.bool()
  with torch.no_grad():
    want = model(input_ids=ids, attention_mask=mask).logits
    model.config.attention_chunk_size = 4 * SEQ   # the chunks matter in this model
    unchunked = model(input_ids=ids, attention_mask=mask).logits
    model.config.attention_chunk_size = CHUNK
    assert (unchunked - want)[valid].abs().max() > 0.1 * want.abs().max()
    model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
    got = model(input_ids=ids, attention_mask=mask).logits
  ref.assert_close(got[valid], want[valid], TOL, what="logits")
  # Greedy generation with a DynamicCache: prompt 10 (row 1: 5 padding), 7 new tokens,
  # crossing chunk boundaries during decode.
  kwargs = dict(attention_mask=mask[:, :10], max_new_tokens=7, do_sample=False,
                output_scores=True, return_dict_in_generate=True, pad_token_id=0)
  model.set_attn_implementation("eager")
  want = model.generate(ids[:, :10], **kwargs)
  model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
  got = model.generate(ids[:, :10], **kwargs)
  assert torch.equal(got.sequences, want.sequences)
  for a, b in zip(got.scores, want.scores):
    ref.assert_close(a, b, TOL, what="scores")


def test_chunk_ids_of_the_mask_function(registered):
  from transformers import masking_utils as mu

  left_padding = torch.tensor([0, 2])
  chunked = mu.chunked_causal_mask_function(3, left_padding)
  padding = torch.tensor([[1] * 8, [0, 0] + [1] * 6], dtype=torch.bool)
  got = registered.make_attention_mask(2, 8, 8, mask_function=chunked, attention_mask=padding)
  assert got.dtype == torch.int32
  assert got[..., 0, 0, 0, 0].tolist() == [[0, 0, 0, 1, 1, 1, 2, 2], [-1, -1, 0, 0, 0, 1, 1, 1]]
  # Decode through a cache holding positions 3..8: the keys' absolute positions count.
  got = registered.make_attention_mask(2, 1, 6, q_offset=8, kv_offset=3, mask_function=chunked,
                                       attention_mask=torch.ones(2, 9, dtype=torch.bool))
  assert got[..., 0, 0, 0, 0].tolist() == [[1, 1, 1, 2, 2, 2], [0, 0, 1, 1, 1, 2]]


def _tiny_doge(attn_implementation):
  import transformers as tr

  config = tr.DogeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, keep_window_size=8)
  torch.manual_seed(0)
  return tr.AutoModelForCausalLM.from_config(
      config, attn_implementation=attn_implementation).eval()


def _refused_by_the_mask_function(run):
  """run() raises the kernel's "materialized" refusal from make_attention_mask, before the
  model's own code could fail on the reduced mask."""
  with pytest.raises(NotImplementedError, match="materialized") as err:
    run()
  frame = traceback.extract_tb(err.value.__traceback__)[-1]
  assert frame.name == "make_attention_mask" and "modeling_" not in frame.filename


def test_doge_is_refused_by_the_mask_function_not_inside_doge(registered):
  model = _tiny_doge(registered.DEFAULT_ATTENTION_NAME)
  ids, mask = _batch()
  # Packed sequences: position_ids restart inside a row. Transformers turns
  # allow_is_causal_skip off itself then, so only Doge's source tells that Doge asked for
  # its mask materialized too; before, this crashed with an IndexError in modeling_doge.py.
  packed = torch.cat([torch.arange(7), torch.arange(SEQ - 7)])[None].expand(2, -1)
  # (use_cache=False: Transformers looks for packing only without a cache.)
  for kwargs in ({}, {"attention_mask": mask}, {"position_ids": packed, "use_cache": False}):
    _refused_by_the_mask_function(lambda: model(input_ids=ids, **kwargs))


def test_doge_packed_crashed_inside_doge_with_a_plain_reduced_mask(registered):
  """The refusal above is what stands between Doge and an IndexError in its own code:
  given the packed-sequence ids the mask function returns for other models, Doge fails in
  prepare_dynamic_mask (a RuntimeError on the 6-D encoded ids; an IndexError on the 2-D
  ones before them). Eager attention computes it, so the case is a valid one."""
  from transformers import AttentionInterface, AttentionMaskInterface

  model = _tiny_doge("eager")
  ids, _ = _batch()
  packed = torch.cat([torch.arange(7), torch.arange(SEQ - 7)])[None].expand(2, -1)
  with torch.no_grad():
    assert torch.isfinite(model(input_ids=ids, position_ids=packed, use_cache=False).logits).all()

  def reduced_mask(*args, **kwargs):
    return registered.make_attention_mask(*args, **dict(kwargs, config=None))

  setattr(reduced_mask, "TPU_KERNELS_MASK_FUNCTION", True)
  AttentionInterface.register("tpu_attention_no_config", registered.attention_forward)
  AttentionMaskInterface.register("tpu_attention_no_config", reduced_mask)
  model.set_attn_implementation("tpu_attention_no_config")
  with pytest.raises((RuntimeError, IndexError)) as err:
    model(input_ids=ids, position_ids=packed, use_cache=False)
  assert "modeling_doge" in traceback.extract_tb(err.value.__traceback__)[-1].filename


def test_serving_attention_without_its_mask_function_raises(paged):
  from transformers import AttentionInterface
  from transformers import masking_utils as mu

  AttentionInterface.register("bare_tpu_serving", paged.attention_forward)
  model = ti.tiny_attention_model("llama", torch.float32, num_hidden_layers=1)
  model.set_attn_implementation("bare_tpu_serving")
  ids, _ = _batch()
  with pytest.raises(RuntimeError, match="register_attention"):
    model(input_ids=ids[:1], use_cache=False)
  # Its own mask function passes causal and sliding patterns (packed or not), refuses
  # the rest.
  assert paged.make_attention_mask(1, 8, 8, mask_function=mu.causal_mask_function) is None
  window = mu.sliding_window_causal_mask_function(4)
  encoded = paged.make_attention_mask(1, 8, 8, mask_function=window)
  # Empty base; code 1 + causal + 2 * no padding + 4 * window 4.
  assert encoded.shape == (1, 0, 3, 3, 1 + 1 + 0 + 16, 3)
  for pattern in (mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long)),
                  mu.bidirectional_mask_function,
                  mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q >= 0)):
    with pytest.raises(NotImplementedError, match="does not compute"):
      paged.make_attention_mask(1, 8, 8, mask_function=pattern)
  with pytest.raises(NotImplementedError, match="materialized"):
    paged.make_attention_mask(1, 8, 8, mask_function=mu.causal_mask_function,
                              allow_is_causal_skip=False)


def test_sliding_window_from_the_mask_when_the_layer_passes_none(registered):
  """Phi-MoE builds sliding-window masks (window 8 < 12 tokens here) but passes no
  sliding_window to the attention call: the window travels with the mask function's
  tensor (also without padding, where it carries no padding). It was computed as full
  causal attention before (logits 0.6 off eager, no error)."""
  import coverage_attention as columns
  from transformers.models.phimoe.modeling_phimoe import PhimoeForCausalLM

  model = columns.tiny_causal_lm(PhimoeForCausalLM)
  assert model.config.sliding_window == 8
  ids, mask = _batch(seq=12)
  _equals_eager_with_and_without_padding(model, ids, mask, registered)


def _tiny_bidirectional_stablelm():
  """StableLM with config.is_causal = False: Transformers builds bidirectional masks, its
  attention modules stay is_causal = True and (unlike Llama's) get no is_causal argument."""
  import coverage_attention as columns
  from transformers import StableLmForCausalLM

  model = columns.tiny_causal_lm(StableLmForCausalLM)
  model.config.is_causal = False
  return model


def test_bidirectional_from_the_mask_when_the_module_says_causal(registered):
  """A decoder-only model with config.is_causal = False: the kernel follows the mask (as
  eager does), with and without padding. It attended causally before (logits 1.2 off
  eager, no error)."""
  model = _tiny_bidirectional_stablelm()
  ids, mask = _batch()
  _equals_eager_with_and_without_padding(model, ids, mask, registered)


def _equals_eager_with_and_without_padding(model, ids, mask, registered):
  """The kernel's logits equal eager's on every valid token, unpadded and left-padded."""
  for kwargs, valid in (({}, torch.ones_like(mask, dtype=torch.bool)),
                        ({"attention_mask": mask}, mask.bool())):
    with torch.no_grad():
      model.set_attn_implementation("eager")
      want = model(input_ids=ids, **kwargs).logits
      model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
      got = model(input_ids=ids, **kwargs).logits
    ref.assert_close(got[valid], want[valid], TOL, what=f"logits {list(kwargs)}")


# ---------------------------------------------------------------------------- torch.compile
# backend "eager" (Dynamo's trace, run without a compiler) in the default profile: what
# dropped the mask's attributes was Dynamo's tracing. HYPOTHESIS_PROFILE=thorough adds
# "aot_eager" (AOTAutograd's functionalized graph) and Inductor.
BACKENDS = ["eager"] + (["aot_eager", "inductor"] if THOROUGH else [])


def _tiny_phimoe():
  import coverage_attention as columns
  from transformers.models.phimoe.modeling_phimoe import PhimoeForCausalLM

  model = columns.tiny_causal_lm(PhimoeForCausalLM)
  assert model.config.sliding_window == 8        # < the 12 tokens of the batch
  return model


def _without_window(model):
  model.config.sliding_window = None


def _causal(model):
  model.config.is_causal = True


# name -> (tiny model, padded?, what the old compiled path computed instead: a config
# change under which eager attention gives that result, or None where it was right).
COMPILED = {
    "phimoe": (_tiny_phimoe, False, _without_window),
    "phimoe, left padding": (_tiny_phimoe, True, _without_window),
    "stablelm is_causal=False": (_tiny_bidirectional_stablelm, False, _causal),
    "stablelm is_causal=False, left padding": (_tiny_bidirectional_stablelm, True, _causal),
    "gemma2 (sliding + full layers), left padding":
        (lambda: ti.tiny_attention_model("gemma2", torch.float32), True, None),
    "llama, left padding": (lambda: ti.tiny_attention_model("llama", torch.float32), True,
                            None),
}


# The default profile runs one case per path (no padding, padding, a plain causal model);
# thorough runs them all.
CI_COMPILED = ("phimoe", "stablelm is_causal=False, left padding", "llama, left padding")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", [c for c in COMPILED if THOROUGH or c in CI_COMPILED])
def test_compiled_model_equals_eager_attention(registered, case, backend):
  build, padded, old_fallback = COMPILED[case]
  model = build()
  ids, mask = _batch(seq=12)
  kwargs = {"attention_mask": mask} if padded else {}
  valid = mask.bool() if padded else torch.ones_like(mask, dtype=torch.bool)
  torch._dynamo.reset()
  with torch.no_grad():
    want = model(input_ids=ids, **kwargs).logits          # eager attention
    model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
    got = torch.compile(model, backend=backend)(input_ids=ids, **kwargs).logits
    ref.assert_close(got[valid], want[valid], TOL, what=f"compiled ({backend}) logits")
    if old_fallback is not None:
      # The case tells: what the compiled call computed before (the layer's own window /
      # causality) is far from eager.
      old_fallback(model)
      model.set_attn_implementation("eager")
      old = model(input_ids=ids, **kwargs).logits
      assert (old - want)[valid].abs().max() > 0.1 * want[valid].abs().max()


def test_compiled_doge_is_refused_by_the_mask_function(registered):
  """Compiled, every batch with position_ids (Doge makes them) counts as packed: before,
  this reached Doge's own code and failed there."""
  model = _tiny_doge(registered.DEFAULT_ATTENTION_NAME)
  ids, _ = _batch()
  torch._dynamo.reset()
  _refused_by_the_mask_function(lambda: torch.compile(model, backend="eager")(input_ids=ids))


def test_compiled_family_without_sdpa_support_is_refused(registered):
  """BigBird-Pegasus's decoder self-attention is not marked causal: the family check
  refuses it compiled too (it was skipped under torch.compile, and the kernel let the
  decoder see the future)."""
  import coverage_attention as columns
  from transformers import BigBirdPegasusForCausalLM

  model = columns.tiny_causal_lm(BigBirdPegasusForCausalLM)
  model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
  ids, _ = _batch()
  torch._dynamo.reset()
  with pytest.raises(NotImplementedError, match="declares neither SDPA nor FlashAttention"):
    torch.compile(model, backend="eager")(input_ids=ids)


def test_the_pattern_travels_in_the_mask_shape(registered):
  """[B, S, 3, 3, code, 3], code = 1 + causal + 2 * has_padding + 4 * window: a view."""
  from transformers import masking_utils as mu

  padding = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
  window = mu.sliding_window_causal_mask_function(3)
  got = registered.make_attention_mask(2, 6, 6, mask_function=window, attention_mask=padding)
  assert got.shape == (2, 6, 3, 3, 1 + 1 + 2 + 12, 3) and got.stride()[2:] == (0,) * 4
  assert torch.equal(got[..., 0, 0, 0, 0], padding)
  got = registered.make_attention_mask(2, 6, 6, mask_function=mu.bidirectional_mask_function)
  assert got.shape == (2, 6, 3, 3, 1, 3) and bool(got.all())    # carries the pattern only
  # A mask the model sliced as a 4-D one on its way (keeping fewer than 3 queries or keys)
  # is refused, not read as another pattern; a tensor of another rank is no mask of the
  # kernel's.
  model = ti.tiny_attention_model("llama", torch.float32, num_hidden_layers=1)
  model.set_attn_implementation(registered.DEFAULT_ATTENTION_NAME)
  module = model.model.layers[0].self_attn
  q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
  encoded = registered.make_attention_mask(2, 6, 6, mask_function=window,
                                           attention_mask=padding)
  for sliced in (encoded[:, :, :2], encoded[:, :, :, :1], encoded[..., :2]):
    with pytest.raises(ValueError, match="changed it on its way"):
      registered.attention_forward(module, q, k, k, sliced)
  with pytest.raises(NotImplementedError, match="takes no arbitrary mask"):
    registered.attention_forward(module, q, k, k, padding)
