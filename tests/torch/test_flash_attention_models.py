"""flash-attention-tpu inside Transformers: tiny randomly initialised Llama (GQA), Qwen3,
Gemma 2 (logit soft-cap, sliding window) and gpt-oss (sinks, sliding window) built from
configs (scripts/transformers_integration.py), with attn_implementation="tpu_attention"
against the same model with Transformers' own "eager" attention: logits and the
gradients of every parameter.

Registered as users do: kernel = get_kernel(..., version=1); kernel.register_attention().
Every test counts the kernel's op calls, so a model that silently fell back to another
attention would fail.

float32: logits and every gradient within 1e-4 of eager (|got - ref| <= atol * max|ref|
  + rtol * |ref|, per tensor): both sides compute in f32; only the order of the sums and
  the kernel's online softmax differ.
bfloat16: not an elementwise bound between the two bf16 models. Eager rounds the scores
  to bf16 before the softmax, then the probabilities and P @ V; with these models' logits
  (up to ~20: weights of std 0.2, Qwen3's q/k norms) a bf16 score is off by up to 0.06,
  6% in probability. Measured against the same weights run in f32, eager bf16 is 0.7-3%
  off in logits (relative L2) and up to 23% in single gradients (max-norm, gpt-oss's
  router bias), so an elementwise bound between the bf16 models would have to be that
  loose. Instead the f32 model (the bf16 weights upcast, eager) is the reference, and the
  kernel's bf16 model must be about as accurate as eager's, per tensor, in relative L2
  error: logits <= 1.25x eager's + 2e-3, each gradient <= 2x eager's + 2e-3. Measured:
  the kernel's logits error is below eager's in every model (it keeps scores and
  probabilities in f32); single gradients reach 1.14x eager's (Qwen3 q_norm) and 1.49x
  (gpt-oss sinks: 4 numbers per layer, whose gradient sums D = rowsum(dO * O) computed
  from the bf16-rounded output, the error `reference.attention_grad_scales` describes);
  both models round the rest of the network to bf16 at different points. A masking,
  cap or sink mistake moves logits by far more (test_tiny_models_exercise_the_features).
The tiny gpt-oss routes every token to both of its 2 experts, so that a bf16 difference
cannot flip a top-k choice (a routing flip is not an attention error).
"""

import copy

import pytest
import torch

import reference as ref
import transformers_integration as ti

IMPL = "tpu_attention"
TOL = dict(rtol=1e-4, atol=1e-4)                      # float32, logits and gradients
# bfloat16: relative L2 error to the f32 model <= ratio * eager bf16's + floor.
BF16_LOGITS_RATIO, BF16_GRAD_RATIO, BF16_FLOOR = 1.25, 2.0, 2e-3
BATCH, SEQ, PAD = 2, 32, 7      # PAD: left padding of the second row in padded batches
VOCAB = ti._TINY["vocab_size"]


@pytest.fixture(scope="module")
def registered(flash):
  assert flash.register_attention() == IMPL
  return flash


@pytest.fixture
def op_calls(registered, flash_ops, monkeypatch):
  """Records every call of the kernel's forward and backward ops (args, then runs them)."""
  calls = {"forward": [], "backward": []}
  forward, backward = flash_ops.flash_attention_op, flash_ops.flash_attention_backward_op

  def counting_forward(*args):
    calls["forward"].append(args)
    return forward(*args)

  def counting_backward(*args):
    calls["backward"].append(args)
    return backward(*args)

  monkeypatch.setattr(registered, "flash_attention_op", counting_forward)
  monkeypatch.setattr(flash_ops, "flash_attention_backward_op", counting_backward)
  return calls


def _model(family, dtype, layers=2):
  return ti.tiny_attention_model(family, dtype, num_hidden_layers=layers)


def _inputs(padded, seed=1):
  gen = torch.Generator().manual_seed(seed)
  ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=gen)
  mask = torch.ones(BATCH, SEQ, dtype=torch.long)
  if padded:
    mask[1, :PAD] = 0
    ids[1, :PAD] = 0
  direction = torch.randn(BATCH, SEQ, VOCAB, generator=gen) * mask[..., None]
  return ids, (mask if padded else None), direction


def _run(model, impl, ids, mask, direction, **kwargs):
  """Logits, and gradients of <logits, direction> w.r.t. every parameter."""
  model.set_attn_implementation(impl)
  model.zero_grad(set_to_none=True)
  logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits
  (logits.float() * direction).sum().backward()
  grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
  return logits.detach(), grads


def _tensors(run, valid=None):
  """{"logits": ..., "grad <name>": ...} of one run, padding positions dropped."""
  logits, grads = run
  out = {"logits": logits if valid is None else logits[valid]}   # padding: garbage, unread
  out.update({f"grad {name}": g for name, g in grads.items()})
  return out


def _compare_f32(got, want, valid=None):
  got, want = _tensors(got, valid), _tensors(want, valid)
  assert set(got) == set(want)
  for name, w in want.items():
    assert got[name].dtype == torch.float32, name
    ref.assert_close(got[name], w, TOL, what=name)


def _rel_l2(a, b) -> float:
  a, b = a.double(), b.double()
  return float((a - b).norm() / b.norm())


def _compare_bf16(got, want, truth, valid=None):
  """The kernel's bf16 model is no further from the f32 model than eager's bf16 model."""
  got, want, truth = _tensors(got, valid), _tensors(want, valid), _tensors(truth, valid)
  assert set(got) == set(want) == set(truth)
  for name, t in truth.items():
    assert got[name].dtype == torch.bfloat16 and torch.isfinite(got[name]).all(), name
    err, eager_err = _rel_l2(got[name], t), _rel_l2(want[name], t)
    ratio = BF16_LOGITS_RATIO if name == "logits" else BF16_GRAD_RATIO
    assert err <= ratio * eager_err + BF16_FLOOR, (
        f"{name}: relative L2 error to the f32 model {err:.3g}, eager bf16's {eager_err:.3g}")


VARIANTS = {"f32_padded": (torch.float32, True), "bf16": (torch.bfloat16, False),
            "f32": (torch.float32, False)}
# Every family in f32 with a left-padded batch and in bf16 without a mask; Llama and Qwen3
# (whose kernel calls compile to the same kernels) also in f32 without a mask. Each new
# kernel configuration compiles (seconds in interpret mode): this keeps the file short.
CASES = ([(family, "f32_padded") for family in ti.ATTENTION_FAMILIES]
         + [(family, "bf16") for family in ti.ATTENTION_FAMILIES]
         + [("llama", "f32"), ("qwen3", "f32")])


@pytest.mark.parametrize("family, variant", CASES, ids=[f"{f}-{v}" for f, v in CASES])
def test_model_matches_eager_forward_and_backward(registered, op_calls, family, variant):
  dtype, padded = VARIANTS[variant]
  model = _model(family, dtype)
  ids, mask, direction = _inputs(padded)
  valid = None if mask is None else mask.bool()
  want = _run(model, "eager", ids, mask, direction)
  assert not op_calls["forward"]
  got = _run(model, IMPL, ids, mask, direction)
  assert any("self_attn" in name for name in got[1]), "no attention weight got a gradient"
  if dtype == torch.float32:
    _compare_f32(got, want, valid)
  else:
    truth = _run(copy.deepcopy(model).float(), "eager", ids, mask, direction)
    _compare_bf16(got, want, truth, valid)

  # Routed through the kernel: one forward and one backward op call per layer, with the
  # layer's features.
  layers = model.config.num_hidden_layers
  assert len(op_calls["forward"]) == layers and len(op_calls["backward"]) == layers
  config = model.config
  for layer, args in enumerate(op_calls["forward"]):
    _, _, _, sinks, q_seg, kv_seg, q_offset, causal, _, window, cap, zero_offset = args
    # No cache: the int offset 0, static, so that the kernel may fold its causal grid.
    assert causal and q_offset.tolist() == [0] and zero_offset is True
    sliding = getattr(config, "layer_types", ["full_attention"] * layers)[layer]
    assert window == (ti.ATTENTION_WINDOW if sliding == "sliding_attention" else 0)
    assert cap == (2.0 if family == "gemma2" else 0.0)
    assert (sinks is not None) == (family == "gpt_oss")
    assert (kv_seg is not None) == padded
    if padded:
      assert torch.equal(kv_seg, mask.to(torch.int32)) and bool((q_seg == 1).all())


def test_mla_value_head_dim_matches_eager(registered, op_calls):
  """DeepSeek-V3's multi-head latent attention: query / key head_dim 24 (16 no-rope + 8
  rope) and value head_dim 16, like the real 192 / 128. The kernel runs them zero-padded
  to one head_dim; logits and every gradient equal eager's on a left-padded batch."""
  import transformers as tr

  config = tr.DeepseekV3Config(
      vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
      q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
      v_head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
      first_k_dense_replace=2, max_position_embeddings=64, pad_token_id=0)
  torch.manual_seed(0)
  model = tr.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
  ids, mask, direction = _inputs(True)
  want = _run(model, "eager", ids, mask, direction)
  got = _run(model, IMPL, ids, mask, direction)
  _compare_f32(got, want, mask.bool())
  q, k, v = op_calls["forward"][0][:3]
  assert q.shape[-1] == k.shape[-1] == v.shape[-1] == 24      # v padded for the kernel
  assert len(op_calls["forward"]) == len(op_calls["backward"]) == 2


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_packed_sequences_match_eager(registered, op_calls, family):
  """position_ids restarting inside a row (packed sequences, padding-free: no mask, no
  cache, as in training): Transformers' packed-sequence detection becomes the kernel's
  segment ids, forward and backward. Gemma 2: the window (8) inside sequences of 12 and 20
  and the soft-cap, on the packed composition's sliding base."""
  model = _model(family, torch.float32)
  ids, _, direction = _inputs(False, seed=2)
  position_ids = torch.cat([torch.arange(12), torch.arange(20)])[None].expand(BATCH, -1)
  kwargs = dict(position_ids=position_ids, use_cache=False)   # a cache turns detection off
  want = _run(model, "eager", ids, None, direction, **kwargs)
  got = _run(model, IMPL, ids, None, direction, **kwargs)
  _compare_f32(got, want)
  layers = model.config.num_hidden_layers
  assert len(op_calls["forward"]) == len(op_calls["backward"]) == layers
  packed = (torch.arange(SEQ) >= 12).to(torch.int32).expand(BATCH, -1)
  for layer, args in enumerate(op_calls["forward"]):
    segment_ids, window = args[4], args[9]
    assert torch.equal(segment_ids, packed)
    sliding = getattr(model.config, "layer_types", ["full_attention"] * layers)[layer]
    assert window == (ti.ATTENTION_WINDOW if sliding == "sliding_attention" else 0)


@pytest.mark.parametrize("family", ti.ATTENTION_FAMILIES)
def test_generate_with_padding_matches_eager(registered, op_calls, family):
  """Greedy generation with a DynamicCache and a left-padded batch: prefill (14 tokens),
  then a decode step (the query is the last key, q_offset = Skv - Sq; the sliding layer's
  cache keeps only the window's last keys). The model writes the cache itself before the
  attention call (Transformers 5.24+: cache.update, then the attention function with K/V
  read back). Same tokens, scores within the f32 tolerance."""
  model = _model(family, torch.float32)
  ids, mask, _ = _inputs(True, seed=3)
  ids, mask = ids[:, :14], mask[:, :14]
  kwargs = dict(attention_mask=mask, max_new_tokens=2, do_sample=False, output_scores=True,
                return_dict_in_generate=True, pad_token_id=0)
  model.set_attn_implementation("eager")
  want = model.generate(ids, **kwargs)
  model.set_attn_implementation(IMPL)
  got = model.generate(ids, **kwargs)
  assert torch.equal(got.sequences, want.sequences)
  for a, b in zip(got.scores, want.scores):
    ref.assert_close(a, b, TOL, what="scores")
  assert len(op_calls["forward"]) == 2 * model.config.num_hidden_layers
  decode = op_calls["forward"][-1]
  assert decode[0].shape[2] == 1 and decode[6].tolist() == [decode[1].shape[2] - 1]


def test_from_pretrained_with_attn_implementation(registered, op_calls, tmp_path):
  """The card's line: from_pretrained(path, attn_implementation="tpu_attention").
  Transformers 5.25 kernelizes on load by default and again on train() / eval(); the
  attention still runs on the kernel and equals eager's on a left-padded batch."""
  from transformers import AutoModelForCausalLM

  _model("llama", torch.float32).save_pretrained(tmp_path)
  eager = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
  model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=IMPL)
  model.train()
  model.eval()
  assert model.config._attn_implementation == IMPL
  ids, mask, _ = _inputs(True)
  with torch.no_grad():
    want = eager(input_ids=ids, attention_mask=mask).logits
    got = model(input_ids=ids, attention_mask=mask).logits
  assert len(op_calls["forward"]) == model.config.num_hidden_layers
  valid = mask.bool()
  ref.assert_close(got[valid], want[valid], TOL, what="logits")


def test_tiny_models_exercise_the_features():
  """The comparisons above mean something: in these tiny models the soft-cap, the window
  and the sinks each change the eager logits far beyond the tolerances."""
  ids, _, _ = _inputs(False)

  def change(family, edit):
    model = _model(family, torch.float32)
    with torch.no_grad():
      base = model(input_ids=ids).logits
      for module in model.modules():
        edit(module)
      edited = model(input_ids=ids).logits
    return float((edited - base).abs().max() / base.abs().max())

  def no_cap(m):
    if hasattr(m, "attn_logit_softcapping"):
      m.attn_logit_softcapping = None

  def no_sinks(m):
    if hasattr(m, "sinks"):
      m.sinks.fill_(-1e4)

  def no_window(m):    # the eager mask holds the window: widen it past the sequence
    if hasattr(m, "config") and hasattr(m.config, "sliding_window"):
      m.config.sliding_window = 4 * SEQ

  for family, edit in (("gemma2", no_cap), ("gpt_oss", no_sinks), ("gemma2", no_window),
                       ("gpt_oss", no_window)):
    assert change(family, edit) > 1e-2, (family, edit.__name__)


def test_unsupported_uses_raise(registered):
  model = _model("llama", torch.float32, layers=1)
  model.set_attn_implementation(IMPL)
  ids, _, _ = _inputs(False)
  mask4d = torch.zeros(BATCH, 1, SEQ, SEQ)
  with pytest.raises(NotImplementedError, match="takes no arbitrary mask"):
    model(input_ids=ids, attention_mask=mask4d)
  model.config.attention_dropout = 0.1
  for module in model.modules():
    if hasattr(module, "attention_dropout"):
      module.attention_dropout = 0.1
  model.train()
  with pytest.raises(NotImplementedError, match="attention dropout"):
    model(input_ids=ids)
  model.eval()
  from transformers import StaticCache

  cache = StaticCache(config=model.config, max_cache_len=64)
  with pytest.raises(NotImplementedError, match="Static caches"):
    model(input_ids=ids, cache=cache, use_cache=True)


# Two packed sequences of 3 and 5 tokens in each of 2 rows: position_ids and the packed index.
PACKED_POS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2)
PACKED_SEQ = torch.tensor([[0] * 3 + [1] * 5] * 2)


def _packed(base):
  """`base` composed as Transformers' mask creation composes it for packed sequences
  (masking_utils.create_causal_mask, 5.24+)."""
  from transformers import masking_utils as mu

  return mu.and_masks(mu.remap_positions_for_packed_sequence(base, PACKED_POS),
                      mu.packed_sequence_mask_function(PACKED_SEQ))


@pytest.mark.parametrize("kwarg, match", [
    ("sinks", "per-token attention sinks"),            # Inkling 2
    ("indices", "sparse attention"),                   # DeepSeek-V3.2-style indexers
    ("block_indices", "block-sparse attention"),       # MiniMax-M3-VL
    ("position_bias", "position bias"),
    ("cu_seq_lens_q", "continuous batching")])         # what continuous batching passes
def test_attention_arguments_the_kernel_would_ignore_raise(registered, kwarg, match):
  """Tensors a model passes to the attention call that change its result, which the kernel
  does not compute, raise instead of being dropped into **kwargs."""
  model = _model("llama", torch.float32, layers=1)
  model.set_attn_implementation(IMPL)
  module = model.model.layers[0].self_attn
  q, kv = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
  with pytest.raises(NotImplementedError, match=match):
    registered.attention_forward(module, q, kv, kv, None, **{kwarg: torch.zeros(2, 4, 6, 1)})


def test_mask_function_reads_the_packed_composition(registered):
  """Causal, sliding and bidirectional bases under the packed composition come back as
  the packed index (int32 segment ids) with the base's window and causality."""
  from transformers import masking_utils as mu

  for base, window, causal in ((mu.causal_mask_function, None, True),
                               (mu.sliding_window_causal_mask_function(3), 3, True),
                               (mu.bidirectional_mask_function, None, False)):
    got = registered.make_attention_mask(2, 8, 8, mask_function=_packed(base))
    segment_ids, got_window, got_causal, padding = registered.transformers_masks.decode_mask(got)
    assert segment_ids.dtype == torch.int32 and torch.equal(segment_ids, PACKED_SEQ.int())
    assert (got_window, got_causal, padding) == (window, causal, True)


def test_mask_function_rejects_other_patterns(registered):
  from transformers import masking_utils as mu

  image_overlay = mu.or_masks(mu.causal_mask_function, lambda b, h, q, k: q >= 0)
  with pytest.raises(NotImplementedError, match="mask pattern this kernel cannot compute"):
    registered.make_attention_mask(2, 8, 8, mask_function=image_overlay)
  bidirectional_window = mu.and_masks(mu.sliding_window_overlay(3),
                                      mu.bidirectional_mask_function)
  with pytest.raises(NotImplementedError, match="cannot compute"):
    registered.make_attention_mask(2, 8, 8, mask_function=bidirectional_window)
  # Chunked attention is computed (as chunk ids: test_attention_mask_safety.py), but not
  # over packed sequences.
  chunked = mu.chunked_causal_mask_function(4, torch.zeros(2, dtype=torch.long))
  with pytest.raises(NotImplementedError, match="chunked attention over packed sequences"):
    registered.make_attention_mask(2, 8, 8, mask_function=_packed(chunked))
  # A blockwise overlay between the position remap and the packed index (masking_utils'
  # block_sequence_ids) is not the plain packed pattern.
  blockwise = mu.and_masks(
      mu.or_masks(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, PACKED_POS),
                  mu.blockwise_overlay(torch.zeros(2, 8, dtype=torch.long))),
      mu.packed_sequence_mask_function(PACKED_SEQ))
  with pytest.raises(NotImplementedError, match="cannot compute"):
    registered.make_attention_mask(2, 8, 8, mask_function=blockwise)
  # Accepted patterns: the padding mask of the keys comes back (sliced to kv_length).
  padding = torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]], dtype=torch.bool)
  window = mu.sliding_window_causal_mask_function(3)
  got = registered.make_attention_mask(2, 2, 4, q_offset=4, kv_offset=2,
                                       mask_function=window, attention_mask=padding)
  assert torch.equal(got[..., 0, 0, 0, 0], padding[:, -4:])   # the base of the encoded view
  assert registered.make_attention_mask(2, 8, 8, mask_function=mu.causal_mask_function) is None
  # Cross-attention (bidirectional, 3 queries over 6 encoder keys): no position rule.
  got = registered.make_attention_mask(2, 3, 6, mask_function=mu.bidirectional_mask_function,
                                       attention_mask=padding)
  assert torch.equal(got[..., 0, 0, 0, 0], padding)
  with pytest.raises(NotImplementedError, match="last 3 of the 6 keys"):
    registered.make_attention_mask(2, 3, 6, mask_function=mu.causal_mask_function)


@pytest.mark.parametrize("name", ["tpu_flash_attention", "my_sdpa", "org/repo", ""])
def test_register_attention_refuses_names_transformers_treats_specially(registered, name):
  with pytest.raises((ValueError, TypeError), match="name"):
    registered.register_attention(name)
