"""experts_forward of ragged-dot-tpu inside Transformers, against Transformers' own "eager"
experts (the modules' per-expert loops) on tiny randomly initialised models, and against
the float64 per-token NumPy reference (tests/reference_moe.py) on experts modules built
directly.

Registered as users do: ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", kernel.experts_forward),
then model.set_experts_implementation(...). The kernel is loaded with get_kernel(version=1).

Tolerances (|got - ref| <= atol * max|ref| + rtol * |ref|, per tensor):
  float32: 1e-4 for logits and every gradient (observed ~3e-7 for logits: only the
    summation order differs).
  bfloat16: both sides round every intermediate to bf16 (2^-8 relative), at different
    points (the kernel keeps the gate/up product and the down projection in f32, eager
    rounds each), so they differ by a few bf16 ulps of each layer's output: 3e-2 for
    logits, 6e-2 for gradients (the backward adds a bf16 rounding of each gradient).
    bf16 models have ONE decoder layer: a second layer's router would see the first
    layer's (legitimately) different bf16 output and may pick another expert for a
    token, which is a routing flip, not a kernel error.
"""

import importlib

import pytest
import torch

import reference_moe as ref

TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
GRAD_TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4),
            torch.bfloat16: dict(rtol=6e-2, atol=6e-2)}
IMPL = "tpu_ragged_dot"

_COMMON = dict(vocab_size=128, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, max_position_embeddings=64, pad_token_id=0, bos_token_id=1,
               eos_token_id=2)


def _config(family: str, layers: int):
  import transformers as tr

  common = dict(_COMMON, num_hidden_layers=layers)
  if family == "qwen3_moe":
    return tr.Qwen3MoeConfig(**common, intermediate_size=64, moe_intermediate_size=32,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)
  if family == "mixtral":
    return tr.MixtralConfig(**common, intermediate_size=32, num_local_experts=4,
                            num_experts_per_tok=2)
  if family == "olmoe":
    return tr.OlmoeConfig(**common, intermediate_size=32, num_experts=8, num_experts_per_tok=2)
  if family == "gpt_oss":
    return tr.GptOssConfig(**common, intermediate_size=32, num_local_experts=4,
                           num_experts_per_tok=2)
  if family == "deepseek_v2":
    common["head_dim"] = None
    return tr.DeepseekV2Config(**common, intermediate_size=64, moe_intermediate_size=32,
                               n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                               first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
                               qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                               n_group=1, topk_group=1)
  raise ValueError(family)


@pytest.fixture(scope="module")
def registered(ragged):
  from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

  ALL_EXPERTS_FUNCTIONS.register(IMPL, ragged.experts_forward)
  return ragged


def _tiny(family: str, dtype: torch.dtype, seed: int = 0):
  from transformers import AutoModelForCausalLM

  torch.manual_seed(seed)
  model = AutoModelForCausalLM.from_config(_config(family, 2 if dtype == torch.float32 else 1),
                                           dtype=dtype)
  with torch.no_grad():  # random (not zero / one) biases and router biases: exercise them
    for name, p in model.named_parameters():
      if name.endswith("bias") or "norm" in name:
        p.add_(torch.randn_like(p) * 0.1)
  return model.eval()


def _experts_modules(model):
  return [m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "num_experts")]


def _run(model, impl, embeds, direction):
  """Logits, and gradients of <logits, direction> w.r.t. the inputs and every parameter."""
  model.set_experts_implementation(impl)
  model.zero_grad(set_to_none=True)
  embeds = embeds.detach().clone().requires_grad_()
  logits = model(inputs_embeds=embeds).logits
  (logits.float() * direction).sum().backward()
  grads = {"inputs_embeds": embeds.grad}
  grads.update({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
  return logits.detach(), grads


FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "gpt_oss", "deepseek_v2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_model_matches_eager_forward_and_backward(registered, family, dtype):
  model = _tiny(family, dtype)
  experts = _experts_modules(model)
  assert experts, "no experts module found"
  gen = torch.Generator().manual_seed(1)
  embeds = (torch.randn(2, 5, _COMMON["hidden_size"], generator=gen)).to(dtype)
  direction = torch.randn(2, 5, _COMMON["vocab_size"], generator=gen)
  want_logits, want_grads = _run(model, "eager", embeds, direction)
  got_logits, got_grads = _run(model, IMPL, embeds, direction)
  assert got_logits.dtype == dtype
  ref.assert_close(got_logits, want_logits, what="logits", **TOL[dtype])
  expert_params = [n for n in want_grads if ".experts." in n]
  assert expert_params, "no expert weight received a gradient"
  assert set(got_grads) == set(want_grads)
  for name, want in want_grads.items():
    ref.assert_close(got_grads[name], want, what=f"grad {name}", **GRAD_TOL[dtype])


def test_from_pretrained_with_experts_implementation(registered, tmp_path, monkeypatch):
  """The card's line: from_pretrained(path, experts_implementation="tpu_ragged_dot").
  Transformers 5.25 kernelizes on load by default and again on train() / eval(); the
  experts still run on the kernel (its calls counted) and equal eager's logits."""
  from transformers import AutoModelForCausalLM
  from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

  calls = []

  def counting(*args, **kwargs):
    calls.append(1)
    return registered.experts_forward(*args, **kwargs)

  monkeypatch.setitem(ALL_EXPERTS_FUNCTIONS._global_mapping, IMPL, counting)
  _tiny("qwen3_moe", torch.float32).save_pretrained(tmp_path)
  eager = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="eager")
  model = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation=IMPL)
  model.train()
  model.eval()
  assert model.config._experts_implementation == IMPL
  ids = torch.randint(3, _COMMON["vocab_size"], (2, 6), generator=torch.Generator().manual_seed(2))
  with torch.no_grad():
    want, got = eager(input_ids=ids).logits, model(input_ids=ids).logits
  assert len(calls) == model.config.num_hidden_layers
  ref.assert_close(got, want, what="logits", **TOL[torch.float32])


# ---------------------------------------------------------------- directly built experts


def _direct_experts(kind: str, dtype=torch.float32, seed=0):
  """A Transformers experts module with random weights: 'no_gate' (Nemotron-H style),
  'qwen' (default layout), 'gemma4' (GELU-tanh gate), 'gpt_oss' (transposed, interleaved,
  biased)."""
  import transformers as tr
  from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
  from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

  torch.manual_seed(seed)
  if kind == "no_gate":
    config = tr.NemotronHConfig(hidden_size=48, moe_intermediate_size=24, n_routed_experts=6,
                                mlp_hidden_act="relu2")
    module = NemotronHExperts(config)
  elif kind == "gemma4":
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextExperts

    module = Gemma4TextExperts(tr.Gemma4TextConfig(hidden_size=48, moe_intermediate_size=24,
                                                   num_experts=6,
                                                   hidden_activation="gelu_pytorch_tanh"))
  elif kind == "qwen":
    module = Qwen3MoeExperts(tr.Qwen3MoeConfig(hidden_size=48, moe_intermediate_size=24,
                                               num_experts=6))
  else:
    module = GptOssExperts(tr.GptOssConfig(hidden_size=48, intermediate_size=24,
                                           num_local_experts=6))
  with torch.no_grad():
    for p in module.parameters():
      p.copy_(torch.randn_like(p) * (0.1 if p.dim() == 2 else p.shape[-1] ** -0.5 * 2))
  module.config._experts_implementation = IMPL
  return module.to(dtype)


def _numpy_reference(module, hidden, index, weights, lhs_quant=None):
  activation = {"GptOssExperts": "gpt_oss", "NemotronHExperts": "relu2",
                "Gemma4TextExperts": "gelu_tanh"}.get(type(module).__name__, "silu")
  up = "gate_up_proj" if module.has_gate else "up_proj"
  gu_scale, dn_scale = getattr(module, f"{up}_scale", None), getattr(module, "down_proj_scale",
                                                                    None)
  return ref.moe_experts(
      hidden, index, weights, getattr(module, up), module.down_proj,
      gate_up_bias=getattr(module, f"{up}_bias") if module.has_bias else None,
      down_bias=module.down_proj_bias if module.has_bias else None,
      gate_up_scale=gu_scale, down_scale=dn_scale,
      num_experts=module.num_experts, has_gate=module.has_gate,
      is_transposed=module.is_transposed, is_concatenated=module.is_concatenated,
      activation_name=activation, alpha=getattr(module, "alpha", 1.702),
      limit=getattr(module, "limit", 7.0), lhs_quant=lhs_quant)


def _routing(tokens, num_experts, top_k, gen, placeholders=0):
  index = torch.stack([torch.randperm(num_experts + placeholders, generator=gen)[:top_k]
                       for _ in range(tokens)])
  weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
  return index, weights   # index int64, as Transformers routers produce


def _check_against_reference_and_stock(module, hidden, index, weights, out, gen):
  """out (the kernel's, float32) against the float64 reference and Transformers'
  grouped_mm path; the gradients w.r.t. hidden, weights and every parameter against
  grouped_mm's along a random direction."""
  from transformers.integrations.moe import grouped_mm_experts_forward

  ref.assert_close(out.detach(), _numpy_reference(module, hidden, index, weights),
                   **TOL[torch.float32])
  stock = grouped_mm_experts_forward(module, hidden, index, weights)
  ref.assert_close(out.detach(), stock.detach(), **TOL[torch.float32])
  direction = torch.randn(out.shape, generator=gen)
  params = [hidden, weights, *module.parameters()]
  got = torch.autograd.grad((out * direction).sum(), params)
  want = torch.autograd.grad((stock * direction).sum(), params)
  for i, (a, b) in enumerate(zip(got, want)):
    ref.assert_close(a, b, what=f"grad {i}", **GRAD_TOL[torch.float32])


@pytest.mark.parametrize("kind", ["no_gate", "qwen", "gemma4", "gpt_oss"])
def test_direct_experts_with_placeholder_ids(registered, kind):
  """Expert-parallel placeholders (ids >= num_experts) contribute nothing; the rest matches
  the float64 reference and Transformers' grouped_mm path (both handle placeholders)."""
  module = _direct_experts(kind)
  module._is_expert_parallel = True
  gen = torch.Generator().manual_seed(3)
  hidden = torch.randn(7, 48, generator=gen, requires_grad=True)
  index, weights = _routing(7, 6, 2, gen, placeholders=3)
  index[0] = torch.tensor([6, 8])     # token 0: all its experts live on other shards
  weights.requires_grad_()
  out = registered.experts_forward(module, hidden, index, weights)
  assert torch.all(out[0] == 0)
  _check_against_reference_and_stock(module, hidden, index, weights, out, gen)


def test_gpt_oss_experts_at_prefill_size(registered):
  """80 tokens x top-2 on the small gpt-oss module: the float32 [160, 2I] intermediate
  outweighs the weights, so the gated kernel de-interleaves gate / up itself (ragged_dot's
  "lanes" route; the other tests here are small enough for "gate_pass"). Forward against
  the float64 reference and Transformers' grouped_mm path, gradients against the latter."""
  ragged_dot = importlib.import_module(f"{registered.__name__}.tpu_kernels.ragged_dot")
  module = _direct_experts("gpt_oss")
  weight_bytes = module.gate_up_proj.numel() * module.gate_up_proj.element_size()
  assert ragged_dot.gate_up_route(160, 48, "interleaved", weight_bytes) == "lanes"
  gen = torch.Generator().manual_seed(5)
  hidden = torch.randn(80, 48, generator=gen, requires_grad=True)
  index, weights = _routing(80, 6, 2, gen)
  weights.requires_grad_()
  out = registered.experts_forward(module, hidden, index, weights)
  _check_against_reference_and_stock(module, hidden, index, weights, out, gen)


# Quantized experts: error of int8 / fp8 against the unquantized bf16 result, relative to
# max|bf16 output| (both outputs are bf16, so each carries its own 2^-9 output rounding).
# Per-output-channel symmetric quantization moves each weight by at most amax/254 (int8)
# or 2^-4 of itself (fp8 e4m3, 3 mantissa bits); through two projections of random-signed
# terms the output error is far below the worst case. Measured on these modules (seeded):
# int8 <= 1.2e-2, fp8 <= 4.0e-2. The bounds are those measurements with a ~2.5x margin,
# an empirical bound for weights of this kind (Gaussian), not a guarantee for any model.
QUANT_BOUND = {"int8": 3e-2, "float8_e4m3fn": 1e-1}


@pytest.mark.parametrize("qdtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("kind", ["qwen", "gpt_oss", "no_gate"])
def test_quantized_experts_error_is_bounded(registered, kind, qdtype):
  module = _direct_experts(kind, torch.bfloat16)
  gen = torch.Generator().manual_seed(4)
  hidden = torch.randn(9, 48, generator=gen).to(torch.bfloat16)
  index, weights = _routing(9, 6, 2, gen)
  weights = weights.to(torch.bfloat16)
  with torch.no_grad():
    full = registered.experts_forward(module, hidden, index, weights).float()
  assert registered.quantize_experts_(module, qdtype) == 1
  up = "gate_up_proj" if module.has_gate else "up_proj"
  assert getattr(module, up).dtype == getattr(torch, qdtype)
  assert getattr(module, f"{up}_scale").dtype == torch.float32
  # Stored [experts, in, out] (the layout the kernel reads without a per-block transpose),
  # flagged through the module's own is_transposed; a second call changes nothing.
  assert module.is_transposed and getattr(module, up).shape[1] == module.down_proj.shape[2] == 48
  before = {n: t.clone() for n, t in module.named_buffers()}
  assert registered.quantize_experts_(module, qdtype) == 1
  assert all(torch.equal(t, before[n]) for n, t in module.named_buffers())
  hidden.requires_grad_()
  quant = registered.experts_forward(module, hidden, index, weights)
  # The kernel computes exactly the dequantized model (float64 reference)...
  ref.assert_close(quant.detach(), _numpy_reference(module, hidden, index, weights),
                   **TOL[torch.bfloat16])
  # ... and that model is within the documented bound of the unquantized one.
  err = float((quant.detach().float() - full).abs().max() / full.abs().max())
  assert err <= QUANT_BOUND[qdtype], err
  # Frozen weights, live activations: hidden still gets its gradient.
  (grad,) = torch.autograd.grad(quant.float().sum(), hidden)
  assert torch.isfinite(grad).all() and grad.abs().max() > 0


@pytest.mark.parametrize("kind", ["qwen", "gpt_oss", "no_gate"])
def test_int8_activations_match_the_quantized_reference(registered, kind):
  """quantize_experts_(..., activations="int8"): the fused op quantizes each projection's
  rows per row (int8 x int8), as the float64 reference does by the definition; float32,
  at float32's tolerance (the unquantized result is ~1e-2 away). No gradient: it raises."""
  module = _direct_experts(kind)
  gen = torch.Generator().manual_seed(6)
  hidden = torch.randn(9, 48, generator=gen)
  index, weights = _routing(9, 6, 2, gen)
  assert registered.quantize_experts_(module, "int8", activations="int8") == 1
  assert module.lhs_quant == "int8"
  with torch.no_grad():
    out = registered.experts_forward(module, hidden, index, weights)
  want = _numpy_reference(module, hidden, index, weights, lhs_quant="int8")
  ref.assert_close(out, want, **TOL[torch.float32])
  plain = _numpy_reference(module, hidden, index, weights)
  assert abs(want - plain).max() > 20 * TOL[torch.float32]["atol"] * abs(plain).max()
  hidden.requires_grad_()
  with pytest.raises(NotImplementedError, match="inference only"):
    registered.experts_forward(module, hidden, index, weights).sum().backward()
  # "" clears the flag; fp8 weights refuse it
  assert registered.quantize_experts_(module, "int8", activations="") == 1
  assert not module.lhs_quant
  fp8 = _direct_experts(kind)
  with pytest.raises(ValueError, match="activations"):
    registered.quantize_experts_(fp8, "float8_e4m3fn", activations="int8")


def test_half_quantized_module_is_refused(registered):
  """One layout flag (is_transposed) covers both expert weights, so a module with one
  quantized and one float weight is refused, not converted halfway."""
  module = _direct_experts("qwen", torch.bfloat16)
  down = module.down_proj.detach()
  del module._parameters["down_proj"]
  module.register_buffer("down_proj", down.to(torch.int8))
  with pytest.raises(ValueError, match="one quantized and one float"):
    registered.quantize_experts_(module, "int8")
  assert module.gate_up_proj.dtype == torch.bfloat16 and not module.is_transposed


def test_quantized_model_generates_like_bf16(registered):
  """int8 experts in a tiny Qwen3-MoE: logits stay within the int8 bound of bf16's."""
  model = _tiny("qwen3_moe", torch.bfloat16)
  model.set_experts_implementation(IMPL)
  ids = torch.tensor([[5, 17, 42, 99, 7, 64]])
  with torch.no_grad():
    full = model(ids).logits.float()
    assert registered.quantize_experts_(model, "int8") == len(_experts_modules(model))
    quant = model(ids).logits.float()
  assert float((quant - full).abs().max() / full.abs().max()) <= QUANT_BOUND["int8"]


def test_int32_and_int64_index_agree(registered):
  module = _direct_experts("qwen")
  gen = torch.Generator().manual_seed(5)
  hidden = torch.randn(4, 48, generator=gen)
  index, weights = _routing(4, 6, 2, gen)
  a = registered.experts_forward(module, hidden, index, weights)
  b = registered.experts_forward(module, hidden, index.to(torch.int32), weights)
  torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_torch_compile_fullgraph(registered):
  module = _direct_experts("gpt_oss")
  gen = torch.Generator().manual_seed(6)
  hidden = torch.randn(5, 48, generator=gen, requires_grad=True)
  index, weights = _routing(5, 6, 2, gen)
  compiled = torch.compile(lambda h, i, w: registered.experts_forward(module, h, i, w),
                           fullgraph=True)
  eager = registered.experts_forward(module, hidden, index, weights)
  got = compiled(hidden, index, weights)
  torch.testing.assert_close(got, eager, rtol=0, atol=0)
  torch.testing.assert_close(torch.autograd.grad(got.sum(), hidden)[0],
                             torch.autograd.grad(eager.sum(), hidden)[0], rtol=0, atol=0)


def test_opcheck(registered, ragged_ops):
  from torch.library import opcheck

  module = _direct_experts("gpt_oss")
  gen = torch.Generator().manual_seed(7)
  hidden = torch.randn(5, 48, generator=gen, requires_grad=True)
  index, weights = _routing(5, 6, 2, gen, placeholders=1)
  weights.requires_grad_()
  args = (hidden, index.to(torch.int32), weights, module.gate_up_proj, module.down_proj,
          module.gate_up_proj_bias, module.down_proj_bias, None, None, 6, True, True, False,
          "gpt_oss", float(module.alpha), float(module.limit), "")
  opcheck(ragged_ops.experts_op, args)


def test_bad_inputs_raise(registered):
  """(Modules the epilogue cannot compute take the generic route instead of raising:
  tests/torch/test_moe_experts_all_families.py.)"""
  hidden, (index, weights) = torch.randn(3, 48), _routing(3, 6, 2, torch.Generator())
  with pytest.raises(TypeError, match="hidden_states has dtype float64"):
    registered.experts_forward(_direct_experts("qwen"), hidden.double(), index, weights)
  with pytest.raises(TypeError, match="top_k_index must be int32 or int64"):
    registered.experts_forward(_direct_experts("qwen"), hidden, index.float(), weights)


def test_tpu_branch_passes_int32_ids_and_statics(registered, monkeypatch):
  """On "tpu" tensors the experts op goes to TorchTPU's jax_op (a stand-in here: no TPU)
  with int32 ids, (0,) placeholders for absent tensors, the statics, chip and
  interpret=False."""
  import sys

  from torch_tpu_stand_in import install_fake_torch_tpu

  calls, dispatch = install_fake_torch_tpu(monkeypatch, registered)
  ops = sys.modules[f"{registered.__name__}._custom_ops"]
  monkeypatch.setattr(ops, "_experts_forward", dispatch.JaxKernel(
      ops._experts_forward.qualname + "_probe", ops._experts_forward.module,
      ops._experts_forward.function, cpu_chip="v6e"))
  try:
    module = _direct_experts("qwen")
    hidden = torch.randn(3, 48)
    index, weights = _routing(3, 6, 2, torch.Generator().manual_seed(8))
    with torch.no_grad():
      registered.experts_forward(module, hidden, index, weights)
  finally:
    dispatch.tpu_chip_name.cache_clear()
  (qualname, tensors, kwargs), = calls["op"]
  assert qualname.endswith("::experts_probe_tpu_jax")
  assert tensors[1].dtype == torch.int32 and torch.equal(tensors[1], index.to(torch.int32))
  assert [tuple(t.shape) for t in tensors[5:]] == [(0,)] * 4   # no biases, no scales
  assert kwargs == dict(num_experts=6, has_gate=True, is_transposed=False,
                        is_concatenated=True, activation="silu", alpha=1.702, limit=7.0,
                        lhs_quant="", chip="v6e", interpret=False)
