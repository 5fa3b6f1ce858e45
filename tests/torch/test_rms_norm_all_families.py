"""rms-norm-tpu on every norm class of the installed Transformers that is decorated
`@use_kernel_forward_from_hub("RMSNorm")` or `("RMSNormZeroCentered")` (issue 26, item 3),
found by walking the modeling sources (transformers_integration.hub_rms_norm_classes; no
hand list): 144 classes in Transformers 5.23, in three rounding variants of
`weight * x * rsqrt(mean(x^2) + eps)` (Llama: x rounded to its dtype before the weight;
OLMoE / gpt-oss: weight times the float32 x, rounded once; Nemotron-H: the weight cast to
float32 first) and the zero-centred `(1 + weight) * ...` (Qwen3.5).

Each class is built small (hidden 48, eps 1e-5, weights drawn around their initial value
with std 0.1), kernelized with the real `kernels` loader (kernelize with a mapping to the
built rms-norm-tpu repo, as test_kernelize.py does) and compared with its own forward on
the same module, kernelized for training: float32, bfloat16, and a bfloat16 input with a
float32 weight (gpt-oss keeps its norms in float32); in float32 also the gradients of x
and the weight (within 1e-4 of the stock's, relative to the largest). Output dtype exactly
the class's; values within test_kernelize.py's documented tolerances relative to the
largest stock output: 5e-6 in float32, 2e-2 in bfloat16. Measured over all 144 classes:
float32 1.3e-7; bfloat16 4.1e-3 (one bf16 ulp: the Llama variant's extra rounding; 0 for
the zero-centred classes); bfloat16 input with float32 weight 2.5e-3.

A class whose forward were another formula is refused by the layer with
NotImplementedError (test_a_different_formula_is_refused); the walk asserts every class
either matches or is refused that way, and that none is refused in this version.
"""

import itertools
from pathlib import Path

import pytest
import torch
from kernels import Mode

import transformers_integration as ti

def test_every_hub_rms_norm_class_kernelizes_and_matches(rms, repo_id):
  import transformers.models

  classes = ti.hub_rms_norm_classes()
  # The walk misses no decorated class: as many as the decorator calls in the sources.
  sources = Path(transformers.models.__path__[0]).glob("*/modeling_*.py")
  calls = sum(path.read_text().count(f'use_kernel_forward_from_hub("{name}")')
              for path in sources for name in ti.LAYER_FOR_HUB_NAME)
  assert len(classes) == calls >= 100
  assert {ti.hub_layer_name(cls) for _, cls in classes} == set(ti.LAYER_FOR_HUB_NAME)
  repo = repo_id("rms-norm-tpu")
  mismatches, refused = {}, {}
  for (family, cls), (x_dtype, weight_dtype) in itertools.product(classes, ti.RMS_NORM_CASES):
    case = f"{family}.{cls.__name__} x {x_dtype} weight {weight_dtype}"
    try:
      problem = ti.rms_norm_class_mismatch(cls, repo, x_dtype, weight_dtype, mode=Mode.TRAINING)
    except NotImplementedError as e:
      refused[case] = str(e)
      continue
    if problem is not None:
      mismatches[case] = problem
  assert not mismatches, mismatches     # never a silent wrong result
  assert not refused, refused           # and in this Transformers, every class runs


class _OnePlusWeightNorm(torch.nn.Module):
  """A norm with Llama's attributes whose forward is (1 + w) * normalised(x): mapped to
  layers.RMSNorm (weight * ...), it must be refused, not computed."""

  def __init__(self, hidden_size, eps=1e-6):
    super().__init__()
    self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
    self.variance_epsilon = eps

  def forward(self, hidden_states):
    x = hidden_states.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return ((1.0 + self.weight.float()) * x).to(hidden_states.dtype)


def test_a_different_formula_is_refused(rms, repo_id, monkeypatch):
  monkeypatch.setitem(ti.LAYER_FOR_CLASS, _OnePlusWeightNorm.__name__, "RMSNorm")
  with pytest.raises(NotImplementedError, match="_OnePlusWeightNorm's own forward is not "
                                                r"weight \* x"):
    ti.rms_norm_class_mismatch(_OnePlusWeightNorm, repo_id("rms-norm-tpu"), torch.float32,
                               torch.float32)
  # A zero-centred class (epsilon in `eps`) mapped to the Llama layer: refused by name.
  qwen35 = next(cls for _, cls in ti.hub_rms_norm_classes()
                if ti.hub_layer_name(cls) == "RMSNormZeroCentered")
  monkeypatch.setitem(ti.LAYER_FOR_HUB_NAME, "RMSNormZeroCentered", "RMSNorm")
  with pytest.raises(NotImplementedError, match="has no `variance_epsilon`"):
    ti.rms_norm_class_mismatch(qwen35, repo_id("rms-norm-tpu"), torch.float32, torch.float32)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_compiled_mixed_dtypes_take_the_class_dtype(rms, repo_id, family):
  """Under torch.compile (fullgraph) no probe runs, but the output dtype is still the
  class's: a bfloat16 input with a float32 weight gives float32 for Llama's norm (the
  weight multiply promotes), bfloat16 for gpt-oss's (rounded once to the input's)."""
  cls = next(c for f, c in ti.hub_rms_norm_classes() if f == family)
  norm = ti.tiny_rms_norm(cls, torch.float32)
  ti.kernelize_rms_norm(torch.nn.ModuleList([norm]), repo_id("rms-norm-tpu"))
  x = ti.rms_norm_input(torch.bfloat16, seed=2)
  with torch.no_grad():
    got = torch.compile(norm, fullgraph=True)(x)
    want = cls.forward(norm, x)
  assert got.dtype == want.dtype == {"llama": torch.float32, "gpt_oss": torch.bfloat16}[family]
  error = (got.double() - want.double()).abs().max().item()
  assert error <= ti.RMS_NORM_TOLERANCE[torch.bfloat16] * want.double().abs().max().item()
