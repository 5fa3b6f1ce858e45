"""kernels.kernelize swaps rms-norm-tpu into tiny Transformers models (built from configs,
random weights, no downloads); the kernelized model must match the stock one."""

import pytest
import torch
from kernels import Mode

import transformers_integration as ti

# Logit tolerance relative to the largest logit. bfloat16: the stock norm rounds twice
# (normalised x to bf16, then times weight), the kernel once, and the difference runs
# through two decoder layers (measured: about 0.008 for Llama and Qwen3; 0 for Gemma, whose
# stock norm also rounds once).
LOGIT_TOLERANCE = {torch.float32: 5e-6, torch.bfloat16: 2e-2}


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


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_kernelized_logits_match_stock(rms, repo_id, family, dtype):
  stock, kernelized = _pair(family, dtype, repo_id, Mode.INFERENCE)
  _assert_all_norms_use_kernel(kernelized, rms)
  ids = torch.randint(3, 128, (2, 11), generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    expected = stock(ids).logits.float()
    got = kernelized(ids).logits.float()
  scale = expected.abs().max().item()
  assert torch.isfinite(got).all()
  assert (got - expected).abs().max().item() <= LOGIT_TOLERANCE[dtype] * scale


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
  stock_grads = dict(stock.named_parameters())
  for name, p in kernelized.named_parameters():
    expected = stock_grads[name].grad
    assert p.grad is not None, name
    scale = max(expected.abs().max().item(), 1e-12)
    assert (p.grad - expected).abs().max().item() <= 1e-4 * scale, name
