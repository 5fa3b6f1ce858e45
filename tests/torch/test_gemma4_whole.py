"""Gemma 4, whole, on the kernels (issue 60, item 3): a tiny Gemma 4 text causal LM of the
pinned Transformers (5.25, models/gemma4) built from its own config, float32, CPU (Pallas
interpret mode), with every kernel under it, against the same model's stock code.

The tiny model keeps what makes Gemma 4 Gemma 4 (`Gemma4TextConfig`):
  * one sliding layer (head_dim 16, 4 / 2 heads, window 8, its own v_proj) and one
    full-attention layer at a wider head_dim (`global_head_dim` 32, twice the sliding one,
    as 512 is to 256) with `attention_k_eq_v` (no v_proj: v = v_norm(k_proj(x)), k =
    rope(k_norm(k_proj(x)))) and 1 KV head (`num_global_key_value_heads`); both with
    `scaling = 1.0` after the q / k norms, the full layer with its proportional RoPE;
  * the MoE block next to the dense MLP in every layer (`enable_moe_block`: 4 experts,
    top 2, GELU-tanh), as 26B-A4B has it;
  * `Gemma4RMSNorm` everywhere: `weight * x` norms (with_scale=True) and weightless ones
    (with_scale=False: every attention's v_norm and every router's norm);
  * the final logit soft-cap 30 (26B-A4B's).
Per-layer inputs (`hidden_size_per_layer_input`, the small Gemma 4 models') are off:
26B-A4B has none.

Kernels, each registered as a user does: attention "tpu_attention" (flash-attention-tpu's
`register_attention`), experts "tpu_ragged_dot" (ragged-dot-tpu's `experts_forward`), and
every Gemma4RMSNorm on rms-norm-tpu's layers.RMSNorm, reached by class: the card's recipe
for a class Transformers leaves undecorated, `replace_kernel_forward_from_hub(Gemma4RMSNorm,
"Gemma4RMSNorm")` with that name mapped (kernels' `kernelize`), so the weightless norms
too run the kernel (with a weight of ones). Each test checks the kernels' ops ran
(`RecordKernelOps`) and every norm's forward is the layer's.

  * logits within 1e-4 of the largest stock logit (both sides f32: the order of sums and
    the online softmax differ);
  * cached greedy `generate` gives the stock model's tokens (prefill, then decode steps
    on the cache; the sliding layer's window is shorter than the sequence);
  * `Gemma4RMSNorm` with and without scale against its own forward, in float32 (values and
    the gradients of x and the weight) and bfloat16, at the walk's tolerances.
"""

import contextlib

import pytest
import torch

import transformers_integration as ti

BOUND = 1e-4
PROMPT = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(0))
NEW_TOKENS = 3


def _tiny_gemma4_config():
  import transformers as tr

  return tr.Gemma4TextConfig(
      vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
      num_global_key_value_heads=1, attention_k_eq_v=True,
      layer_types=["sliding_attention", "full_attention"],
      sliding_window=ti.ATTENTION_WINDOW, hidden_size_per_layer_input=0,
      enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
      final_logit_softcapping=30.0, max_position_embeddings=128, initializer_range=0.2,
      pad_token_id=0, bos_token_id=1, eos_token_id=2)


def _tiny_gemma4(attn_implementation="eager"):
  """The tiny Gemma 4 (module docstring), weights drawn with std 0.2 (the attention
  models' of transformers_integration: attention far from uniform), the norms' weights
  around 1 and the routers' scales drawn too, eval mode."""
  from transformers import AutoModelForCausalLM

  torch.manual_seed(0)
  model = AutoModelForCausalLM.from_config(_tiny_gemma4_config(), dtype=torch.float32,
                                           attn_implementation=attn_implementation)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
        p.normal_(1.0, 0.1)
      elif "experts" in name:
        p.normal_(0.0, 0.2)
  return model.eval()


@contextlib.contextmanager
def gemma4_norms_marked():
  """Gemma4RMSNorm marked for kernelize under its own name, with no condition (every
  instance, weightless ones included), undone at exit (with the mappings registered
  inside)."""
  from kernels import replace_kernel_forward_from_hub
  from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

  assert "kernel_layer_name" not in vars(Gemma4RMSNorm)   # Transformers leaves it undecorated
  with ti.kernel_mapping_scope():
    replace_kernel_forward_from_hub(Gemma4RMSNorm, "Gemma4RMSNorm")
    try:
      yield Gemma4RMSNorm
    finally:
      del Gemma4RMSNorm.kernel_layer_name, Gemma4RMSNorm.kernel_condition


def _kernelize_norms(model, rms_repo: str):
  from kernels import KernelizeFallback, Mode, kernelize, register_kernel_mapping

  register_kernel_mapping({"Gemma4RMSNorm": {
      device: ti.rms_norm_layer_repository(rms_repo, "RMSNorm") for device in ti.DEVICES}})
  kernelize(model, mode=Mode.INFERENCE, device="cpu",
            use_fallback=KernelizeFallback.DEFAULT)


def _norms(model, cls):
  return [m for m in model.modules() if type(m) is cls]


def _relative(got, want) -> float:
  got, want = got.detach().double(), want.detach().double()
  return float((got - want).abs().max() / want.abs().max())


@pytest.fixture(scope="module")
def kernels_registered(flash, ragged, rms, repo_id):
  """Attention and experts registered with Transformers by the recipes' helpers (their
  get_kernel returns the builds the fixtures loaded: kernels dedups by id)."""
  assert ti.register_tpu_attention(repo_id("flash-attention-tpu")) is flash
  assert ti.register_ragged_experts(repo_id("ragged-dot-tpu")) is ragged
  return flash, ragged, rms


def _assert_has_what_gemma4_has(model):
  """The config gave the layers the module docstring names (not a silent default)."""
  sliding, full = (layer.self_attn for layer in model.model.layers)
  assert (sliding.is_sliding, sliding.head_dim, sliding.v_proj is not None) == (True, 16, True)
  assert (full.is_sliding, full.head_dim, full.v_proj) == (False, 32, None)
  assert full.k_proj.out_features == 32 and sliding.scaling == full.scaling == 1.0
  assert all(layer.enable_moe_block for layer in model.model.layers)


def test_logits_and_cached_generate_match_eager(kernels_registered, repo_id):
  flash, ragged, rms = kernels_registered
  stock = _tiny_gemma4()
  _assert_has_what_gemma4_has(stock)
  model = _tiny_gemma4(attn_implementation="tpu_attention")
  model.set_experts_implementation(ti.EXPERTS_NAME)
  with gemma4_norms_marked() as norm_class:
    _kernelize_norms(model, repo_id("rms-norm-tpu"))
    norms = _norms(model, norm_class)
    assert all(not hasattr(m, "weight") for m in norms if not m.with_scale)
    # 2 layers x (4 around attention and MLP, q / k / v norms, 3 of the MoE block, the
    # router's) + the final norm; 4 of them weightless (v_norm, the router's).
    assert len(norms) == 23 and sum(not m.with_scale for m in norms) == 4
    assert all(m.forward.__func__ is rms.layers.RMSNorm.forward for m in norms)
    with torch.no_grad():
      want = stock(PROMPT).logits
      with ti.RecordKernelOps((flash, ragged, rms)) as ops:
        got = model(PROMPT).logits
    assert {"flash_attention", "rms_norm"} <= ops.called, ops.called
    assert ops.called & {"experts", "ragged_dot"}, ops.called
    assert _relative(got, want) <= BOUND
    want_tokens = stock.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    with ti.RecordKernelOps((flash, ragged, rms)) as ops:
      got_tokens = model.generate(PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert {"flash_attention", "rms_norm"} <= ops.called, ops.called
    assert ops.called & {"experts", "ragged_dot"}, ops.called
    assert torch.equal(got_tokens, want_tokens)
    assert got_tokens.shape[1] == PROMPT.shape[1] + NEW_TOKENS > ti.ATTENTION_WINDOW


@pytest.mark.parametrize("with_scale", [True, False])
def test_gemma4_rms_norm_on_the_kernel(rms, repo_id, with_scale):
  """Both variants, reached by class, against Gemma4RMSNorm's own forward: float32 (values
  and the gradients of x and, with scale, of the weight) and bfloat16 (x and weight)."""
  from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

  torch.manual_seed(0)
  norm = Gemma4RMSNorm(48, eps=1e-5, with_scale=with_scale)
  if with_scale:
    with torch.no_grad():
      norm.weight.normal_(1.0, 0.1)
  with gemma4_norms_marked():
    _kernelize_norms(torch.nn.ModuleList([norm]), repo_id("rms-norm-tpu"))
    assert norm.forward.__func__ is rms.layers.RMSNorm.forward
    for dtype in (torch.float32, torch.bfloat16):
      module = norm.to(dtype)
      x = ti.rms_norm_input(dtype).requires_grad_(dtype == torch.float32)
      direction = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).to(dtype)
      results = []
      for forward in (lambda t: Gemma4RMSNorm.forward(module, t), module):
        x.grad = None
        if with_scale:
          module.weight.grad = None
        out = forward(x)
        if dtype == torch.float32:
          (out * direction).sum().backward()
          results.append((out, x.grad.clone(), *((module.weight.grad.clone(),)
                                                 if with_scale else ())))
        else:
          results.append((out,))
      (want, *want_grads), (got, *got_grads) = results
      assert got.dtype == want.dtype == dtype
      assert _relative(got, want) <= ti.RMS_NORM_TOLERANCE[dtype]
      for got_grad, want_grad in zip(got_grads, want_grads):
        assert _relative(got_grad, want_grad) <= 1e-4
