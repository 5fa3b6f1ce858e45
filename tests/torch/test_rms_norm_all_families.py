"""rms-norm-tpu on every RMSNorm class of the installed Transformers (issue 26 item 3, issue 57
items 1 and 4), found by class over the coverage walk's modeling modules
(coverage.families(), the list the norm column of scripts/coverage.py walks) with
transformers_integration.rms_norm_layer, no hand list: in Transformers 5.25, 190 classes.
135 carry Transformers' hub decorator (133 "RMSNorm", 2 "RMSNormZeroCentered"); 55 do not:
the 13 families whose norm lost it in 5.24 / 5.25 (gpt-oss, OLMo 2 / 3, ...), Gemma's and
other `(1 + weight)` norms, and older undecorated ones. Their formulas: the rounding
variants of `weight * x * rsqrt(mean(x^2) + eps)` (Llama: x rounded to its dtype before the
weight; OLMo 2 / gpt-oss: weight times the float32 x, rounded once; Nemotron-H: the weight
cast to float32 first) and the zero-centred `(1 + weight) * ...`.

Each class is built small (hidden 48, eps 1e-5, weights drawn around their initial value
with std 0.1), kernelized with the real `kernels` loader (kernelize_rms_norm: the mapping to
the built rms-norm-tpu repo, as test_kernelize.py) and compared with its own forward on the
same module, kernelized for training: float32, bfloat16, and a bfloat16 input with a
float32 weight (gpt-oss keeps its norms in float32); in float32 also the gradients of x
and the weight (within 1e-4 of the stock's, relative to the largest). Output dtype exactly
the class's; values within test_kernelize.py's documented tolerances relative to the
largest stock output: 5e-6 in float32, 2e-2 in bfloat16.

A class whose forward is another formula is refused by the layer with NotImplementedError:
one in 5.25, MuseSparkTextInputScaledRMSNorm (it scales x by (1 + weight) before it
normalises), in every dtype; every other class matches.
"""

import itertools
from pathlib import Path

import pytest
import torch
from kernels import Mode, kernelize, use_kernel_mapping

import transformers_integration as ti
from coverage_walk import coverage

# The families whose RMSNorm lost @use_kernel_forward_from_hub("RMSNorm") in 5.24 / 5.25.
UNDECORATED_SINCE_5_24 = ("gpt_oss", "olmo2", "olmo3", "afmoe", "flex_olmo", "deepseek_v4",
                          "nemotron_h", "nemotron_h_omni", "olmo_hybrid", "inkling2", "beam",
                          "flint", "openai_privacy_filter")
# The one class whose own forward is not the layer's formula (refused, not computed).
REFUSED = {"MuseSparkTextInputScaledRMSNorm"}


@pytest.fixture(autouse=True)
def _own_kernel_mapping():
  with ti.kernel_mapping_scope():
    yield


@pytest.fixture(scope="module")
def rms_norm_classes():
  """(family, class) for every RMSNorm class of the coverage walk."""
  return [(fam.name, cls) for fam in coverage.families()
          for cls in fam.classes(lambda c: ti.rms_norm_layer(c) is not None)]


def test_the_walk_finds_every_rms_norm_class(rms_norm_classes):
  import transformers.models

  sources = list(Path(transformers.models.__path__[0]).glob("*/modeling_*.py"))
  broken = [name for fam in coverage.families() for name in fam.import_errors
            if coverage._source_mentions(name, "RMSNorm")]
  assert not broken   # no module that defines a norm is missing from the walk
  decorated = [cls for _, cls in rms_norm_classes if ti.hub_layer_name(cls) is not None]
  # Every decorated class: as many as the decorator calls in the sources.
  calls = sum(path.read_text().count(f'use_kernel_forward_from_hub("{name}")')
              for path in sources for name in ti.LAYER_FOR_HUB_NAME)
  assert len(decorated) == calls >= 100
  by_family = {}
  for family, cls in rms_norm_classes:
    by_family.setdefault(family, []).append(cls)
  for family in UNDECORATED_SINCE_5_24:   # reached by class, not by decorator
    assert any(ti.hub_layer_name(cls) is None and ti.rms_norm_layer(cls) == "RMSNorm"
               for cls in by_family[family]), family
  assert [ti.rms_norm_layer(cls) for cls in by_family["gemma"]] == ["GemmaRMSNorm"]
  # Not plain RMS norms: the gated ones, and those without a weight.
  names = {cls.__name__ for _, cls in rms_norm_classes}
  assert not [name for name in names if "Gated" in name or "Weightless" in name
              or "Unweighted" in name]
  gated = [cls for fam in coverage.families()
           for cls in fam.classes(lambda c: c.__name__.endswith("RMSNormGated"))]
  assert len(gated) >= 10 and all(ti.rms_norm_layer(cls) is None for cls in gated)


def test_every_rms_norm_class_kernelizes_and_matches(rms, repo_id, rms_norm_classes):
  repo = repo_id("rms-norm-tpu")
  mismatches, refused = {}, {}
  for (family, cls), (x_dtype, weight_dtype) in itertools.product(rms_norm_classes,
                                                                   ti.RMS_NORM_CASES):
    case = f"{family}.{cls.__name__} x {x_dtype} weight {weight_dtype}"
    try:
      problem = ti.rms_norm_class_mismatch(cls, repo, x_dtype, weight_dtype, mode=Mode.TRAINING)
    except NotImplementedError as e:
      refused[cls.__name__] = str(e)
      continue
    if problem is not None:
      mismatches[case] = problem
  assert not mismatches, mismatches     # never a silent wrong result
  assert set(refused) == REFUSED, refused
  assert "own forward is not (1 + weight) * x" in refused["MuseSparkTextInputScaledRMSNorm"]


def test_instances_built_otherwise_keep_their_forward(rms, repo_id):
  """An undecorated RMSNorm class kernelizes the instances built as cls(hidden, eps=eps)
  and the weightless ones (Gemma 4's with_scale=False norm: a weight of ones); Qwen4-exp's
  grouped norm, built otherwise, keeps its own forward. Each against its own forward."""
  from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm
  from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextRMSNorm

  kernelized = [Gemma4RMSNorm(48, eps=1e-5), Qwen4ExpTextRMSNorm(48, eps=1e-5),
                Gemma4RMSNorm(48, eps=1e-5, with_scale=False)]
  other = [Qwen4ExpTextRMSNorm(48, group_size=16, eps=1e-5)]
  model = torch.nn.ModuleList(kernelized + other)
  ti.kernelize_rms_norm(model, repo_id("rms-norm-tpu"))
  assert ti.rms_norm_modules(model) == kernelized
  assert [m.forward.__func__ for m in kernelized] == [
      rms.layers.RMSNorm.forward, rms.layers.GemmaRMSNorm.forward, rms.layers.RMSNorm.forward]
  assert not hasattr(kernelized[2], "weight")
  assert all("forward" not in vars(m) for m in other)
  x = ti.rms_norm_input(torch.float32)
  for module in kernelized + other:
    want = type(module).forward(module, x)
    assert (module(x) - want).abs().max().item() <= 5e-6 * want.abs().max().item()


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


def test_a_different_formula_is_refused(rms, repo_id):
  """A norm mapped to a layer of another formula is refused on its first call: a class of
  (1 + w) * normalised(x) and Qwen3.5's zero-centred class mapped by hand to layers.RMSNorm
  (weight * ...); and, mapped by the rule to layers.GemmaRMSNorm, MuseSpark's norm that
  scales before it normalises, at its initial weight 0, where its output equals
  (1 + w) * normalised(x) exactly: the probe's own weight tells them apart, so a model
  checked while fresh does not compute wrongly once trained weights are loaded."""
  from kernels import replace_kernel_forward_from_hub
  from transformers.models.muse_spark.modeling_muse_spark import MuseSparkTextInputScaledRMSNorm
  from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNorm

  repo = repo_id("rms-norm-tpu")
  x = ti.rms_norm_input(torch.float32)
  replace_kernel_forward_from_hub(_OnePlusWeightNorm, "RMSNormZeroCentered")
  mapping = {"RMSNormZeroCentered": {"cpu": ti.rms_norm_layer_repository(repo, "RMSNorm")}}
  for cls in (_OnePlusWeightNorm, Qwen3_5RMSNorm):
    norm = ti.tiny_rms_norm(cls, torch.float32)
    with use_kernel_mapping(mapping, inherit_mapping=False):
      kernelize(torch.nn.ModuleList([norm]), mode=Mode.INFERENCE, use_fallback=False)
    with pytest.raises(NotImplementedError, match=f"{cls.__name__}'s own forward is not "
                                                  r"weight \* x"):
      norm(x)
  norm = MuseSparkTextInputScaledRMSNorm(48, eps=1e-5)
  ti.kernelize_rms_norm(torch.nn.ModuleList([norm]), repo)
  assert torch.equal(norm.weight, torch.zeros(48))
  with pytest.raises(NotImplementedError, match=r"own forward is not \(1 \+ weight\) \* x"):
    norm(x)


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_compiled_mixed_dtypes_take_the_class_dtype(rms, repo_id, rms_norm_classes, family):
  """Under torch.compile (fullgraph) no probe runs, but the output dtype is still the
  class's: a bfloat16 input with a float32 weight gives float32 for Llama's norm (the
  weight multiply promotes), bfloat16 for gpt-oss's (rounded once to the input's)."""
  cls = next(c for f, c in rms_norm_classes if f == family)
  norm = ti.tiny_rms_norm(cls, torch.float32)
  ti.kernelize_rms_norm(torch.nn.ModuleList([norm]), repo_id("rms-norm-tpu"))
  x = ti.rms_norm_input(torch.bfloat16, seed=2)
  with torch.no_grad():
    got = torch.compile(norm, fullgraph=True)(x)
    want = cls.forward(norm, x)
  assert got.dtype == want.dtype == {"llama": torch.float32, "gpt_oss": torch.bfloat16}[family]
  error = (got.double() - want.double()).abs().max().item()
  assert error <= ti.RMS_NORM_TOLERANCE[torch.bfloat16] * want.double().abs().max().item()
