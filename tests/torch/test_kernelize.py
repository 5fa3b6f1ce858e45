"""rms-norm-tpu under the RMSNorms of tiny Transformers models (built from configs, random
weights, no downloads), through kernels' kernelize and Transformers 5.25's own kernelize
(from_pretrained on load, set_use_kernels, the re-kernelize of train() / eval()); the
kernelized model must match the stock one."""

import pytest
import torch
from kernels import KernelizeFallback, Mode, kernelize, use_kernel_mapping

import transformers_integration as ti

# Logit tolerance relative to the largest logit. bfloat16: the stock norm rounds twice
# (normalised x to bf16, then times weight), the kernel once, and the difference runs
# through two decoder layers (measured: about 0.008 for Llama and Qwen3; 0 for Gemma, whose
# stock norm also rounds once).
LOGIT_TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 2e-2}


@pytest.fixture(autouse=True)
def _own_kernel_mapping():
  """Each test's mappings and class marks end with it (use_rms_norm_tpu's are process-wide)."""
  with ti.kernel_mapping_scope():
    yield


def _pair(family, dtype, repo_id, mode):
  stock = ti.tiny_model(family, dtype)
  kernelized = ti.tiny_model(family, dtype)
  kernelized.load_state_dict(stock.state_dict())
  ti.kernelize_rms_norm(kernelized, repo_id("rms-norm-tpu"), mode=mode)
  return stock, kernelized


def _assert_all_norms_use_kernel(model, rms):
  norms = ti.rms_norm_modules(model)
  assert norms, "model has no RMSNorm modules"
  for module in norms:
    layer = getattr(rms.layers, ti.rms_norm_layer(type(module)))
    assert module.forward.__func__ is layer.forward, type(module).__name__


def _assert_logits_match(stock, kernelized, dtype=torch.float32, seed=1):
  ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(seed))
  with torch.no_grad():
    expected = stock(ids).logits.float()
    got = kernelized(ids).logits.float()
  scale = expected.abs().max().item()
  assert torch.isfinite(got).all()
  assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE[dtype] * scale


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernelized_logits_match_stock(rms, repo_id, family, dtype):
  stock, kernelized = _pair(family, dtype, repo_id, Mode.INFERENCE)
  _assert_all_norms_use_kernel(kernelized, rms)
  _assert_logits_match(stock, kernelized, dtype)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_kernelized_generate_matches_stock(rms, repo_id, family):
  stock, kernelized = _pair(family, torch.float32, repo_id, Mode.INFERENCE)
  ids = torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(2))
  expected = stock.generate(ids, max_new_tokens=6, do_sample=False)
  got = kernelized.generate(ids, max_new_tokens=6, do_sample=False)
  assert torch.equal(got, expected)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
def test_kernelized_training_gradients_match_stock(rms, repo_id, family):
  stock, kernelized = _pair(family, torch.float32, repo_id, Mode.TRAINING)
  _assert_all_norms_use_kernel(kernelized, rms)
  ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(3))
  for model in (stock, kernelized):
    model.train()
    model(ids, labels=ids).loss.backward()
  _assert_all_norms_use_kernel(kernelized, rms)
  stock_grads = dict(stock.named_parameters())
  for name, p in kernelized.named_parameters():
    expected = stock_grads[name].grad
    assert p.grad is not None, name
    scale = max(expected.abs().max().item(), 1e-12)
    assert (p.grad - expected).abs().max().item() <= 1e-4 * scale, name


# ----------------------------------------------------- from_pretrained, train(), eval() (5.25)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
  """Tiny Qwen3 (decorated norms) and Gemma (undecorated GemmaRMSNorm) checkpoints."""
  paths = {}
  for family in ("qwen3", "gemma"):
    paths[family] = tmp_path_factory.mktemp(family)
    ti.tiny_model(family).save_pretrained(paths[family])
  return paths


def _load(path, **kwargs):
  from transformers import AutoModelForCausalLM

  return AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _norm_classes(model):
  return {type(m) for m in ti.rms_norm_modules(model)}


@pytest.mark.parametrize("family", ["qwen3", "gemma"])
def test_recipe_after_load_survives_train_and_eval(rms, repo_id, saved, family):
  """A from_pretrained model (use_kernels on by default: kernelized on load, with no
  mapping for its norms on CPU, so stock), then the recipe (use_rms_norm_tpu, then
  Transformers' set_use_kernels): every norm runs the layer, and still after train() and
  eval(), which kernelize again against the process's mapping; logits match stock."""
  repo = repo_id("rms-norm-tpu")
  stock = _load(saved[family], use_kernels=False)
  model = _load(saved[family])
  assert model.use_kernels and not stock.use_kernels
  assert all(m.forward.__func__ is type(m).forward for m in ti.rms_norm_modules(model))
  ti.use_rms_norm_tpu(repo, _norm_classes(model))
  model.set_use_kernels(True)
  _assert_all_norms_use_kernel(model, rms)
  model.train()
  assert model.kernels_mode == Mode.TRAINING
  _assert_all_norms_use_kernel(model, rms)
  stock.train()
  _assert_logits_match(stock, model)
  model.eval()
  stock.eval()
  assert model.kernels_mode == Mode.INFERENCE
  _assert_all_norms_use_kernel(model, rms)
  _assert_logits_match(stock, model, seed=2)
  assert ti.assert_rms_norms_kernelized(model, repo) == len(ti.rms_norm_modules(model))


def test_recipe_before_load_kernelizes_on_load(rms, repo_id, saved):
  """The card's order: the mapping first, then from_pretrained kernelizes on load."""
  ti.use_rms_norm_tpu(repo_id("rms-norm-tpu"))
  model = _load(saved["qwen3"])
  _assert_all_norms_use_kernel(model, rms)
  model.train()
  _assert_all_norms_use_kernel(model, rms)


def test_a_scoped_mapping_does_not_survive_train(rms, repo_id, saved):
  """Why the recipe registers the mapping for the process: kernels.kernelize with a
  mapping given only for the call puts the layer in, but the next train() kernelizes again
  without it and the stock forward comes back, silently."""
  model = _load(saved["qwen3"])
  names = {"RMSNorm": {"cpu": ti.rms_norm_layer_repository(repo_id("rms-norm-tpu"), "RMSNorm")}}
  with use_kernel_mapping(names):
    kernelize(model, mode=Mode.INFERENCE, use_fallback=KernelizeFallback.DEFAULT)
  _assert_all_norms_use_kernel(model, rms)
  model.train()
  assert all(m.forward.__func__ is type(m).forward for m in ti.rms_norm_modules(model))


def test_other_hub_layers_keep_their_forward(rms, repo_id):
  """Qwen3 carries hub layers with no cpu / tpu mapping (rotary embeddings, SiLU): with
  kernels 0.19 kernelize(use_fallback=False) raises on them; kernelize_rms_norm leaves them
  their own forward and replaces every norm."""
  model = ti.tiny_model("qwen3")
  others = [m for m in model.modules() if getattr(type(m), "kernel_layer_name", "RMSNorm")
            != "RMSNorm"] + [f for m in model.modules()
                             for f in getattr(m, "_kernel_funcs", {}).values()]
  assert others
  ti.kernelize_rms_norm(model, repo_id("rms-norm-tpu"))
  _assert_all_norms_use_kernel(model, rms)
  assert all("forward" not in vars(m) for m in others)


def test_a_norm_left_stock_raises(repo_id, saved):
  """No silent fallback: a mapping that does not cover the model's device (here "tpu"
  only, the model on CPU) leaves the norms stock, and the check names them;
  kernelize_rms_norm on such a model raises (a model on the meta device)."""
  repo = repo_id("rms-norm-tpu")
  ti.use_rms_norm_tpu(repo, devices=("tpu",))
  model = _load(saved["qwen3"])
  with pytest.raises(RuntimeError, match=r"9 of 9 RMSNorm modules do not run .*input_layernorm"):
    ti.assert_rms_norms_kernelized(model, repo)
  with pytest.raises(RuntimeError, match="RMSNorm modules do not run"):
    ti.kernelize_rms_norm(ti.tiny_model("qwen3").to("meta"), repo)
  with pytest.raises(ValueError, match="has no RMSNorm"):
    ti.kernelize_rms_norm(torch.nn.Linear(4, 4), repo)
