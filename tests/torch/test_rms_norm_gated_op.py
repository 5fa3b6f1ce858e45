"""rms-norm-tpu's gated norm (Transformers' "RMSNormGated"), loaded with get_kernel as a user
loads it, on the CPU path (DLPack + Pallas interpret mode).

`rms_norm_gated` against the float64 reference of tests/reference_linear.py (its roundings
modelled; tolerances `reference.TOLERANCE` / `GRAD_TOLERANCE`, documented there): forward
and torch autograd's gradients of x, gate and weight, SiLU and sigmoid gates, both
roundings, float32 / bfloat16 inputs and weights.

`layers.RMSNormGated` on every class Transformers decorates
`use_kernel_forward_from_hub("RMSNormGated")` (found by code: the modeling modules whose
source names the hub layer, imported, their classes with that layer name; 9 in 5.25),
kernelized with the real kernels loader and compared with the class's own forward on the
same module: float32 (also the gradients of x, gate and weight), bfloat16, and bfloat16
with a float32 weight; and which rounding each class was found to use.
"""

import importlib
import pkgutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings, strategies as st
from kernels import Mode, kernelize

import reference as ref
import reference_linear as rl
import transformers_integration as ti

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@settings(max_examples=max(2, settings.default.max_examples // 2))
@given(rows=st.sampled_from([1, 7, 40]), hidden=st.sampled_from([16, 100, 128]),
       x_dtype=st.sampled_from(list(DTYPES)), w_dtype=st.sampled_from(list(DTYPES)),
       activation=st.sampled_from(["silu", "sigmoid"]), in_input_dtype=st.booleans(),
       seed=st.integers(0, 2**16))
def test_rms_norm_gated_forward_and_backward(rms, rows, hidden, x_dtype, w_dtype, activation,
                                             in_input_dtype, seed):
  gen = torch.Generator().manual_seed(seed)
  x = (torch.randn(rows, hidden, generator=gen) * 2).to(DTYPES[x_dtype]).requires_grad_()
  gate = torch.randn(rows, hidden, generator=gen).to(DTYPES[x_dtype]).requires_grad_()
  weight = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DTYPES[w_dtype]).requires_grad_()
  out = rms.rms_norm_gated(x, gate, weight, 1e-5, activation=activation,
                           norm_in_input_dtype=in_input_dtype)
  assert out.dtype == x.dtype and out.shape == x.shape
  want, scale = rl.rms_norm_gated(x.detach().float().numpy(), gate.detach().float().numpy(),
                                  weight.detach().float().numpy(), 1e-5, activation,
                                  in_input_dtype)
  coarsest = rl.coarsest(x_dtype, w_dtype)
  ref.assert_close(out.detach().float(), want, ref.TOLERANCE[coarsest], "out", scale)
  grad_out = torch.randn(rows, hidden, generator=gen).to(x.dtype)
  grads = torch.autograd.grad(out, (x, gate, weight), grad_out)
  assert [g.dtype for g in grads] == [x.dtype, gate.dtype, weight.dtype]
  rdx, rdg, rdw, scales = rl.rms_norm_gated_grads(
      x.detach().float().numpy(), gate.detach().float().numpy(),
      weight.detach().float().numpy(), grad_out.float().numpy(), 1e-5, activation)
  tol = ref.GRAD_TOLERANCE[coarsest]
  for name, got, want_grad in (("dx", grads[0], rdx), ("dgate", grads[1], rdg),
                               ("dweight", grads[2], rdw)):
    ref.assert_close(got.float(), want_grad, tol, name, scales[name])


def test_errors(rms):
  x, w = torch.randn(4, 16), torch.ones(16)
  with pytest.raises(TypeError, match="x has dtype float16"):
    rms.rms_norm_gated(x.half(), x.half(), w)
  with pytest.raises(ValueError, match="gate must have shape"):
    rms.rms_norm_gated(x, x[:, :8], w)
  with pytest.raises(NotImplementedError, match="gate activation 'gelu'"):
    rms.rms_norm_gated(x, x, w, activation="gelu")


# ----------------------------------------------------------------------------- the classes


def gated_norm_classes() -> list[type]:
  """Every class of transformers.models whose hub layer name is "RMSNormGated": the modeling
  modules whose source names it, imported, and their own classes that carry it."""
  import transformers.models

  root = Path(transformers.models.__path__[0])
  found = []
  for package in sorted(pkgutil.iter_modules([str(root)]), key=lambda p: p.name):
    for module in sorted(pkgutil.iter_modules([str(root / package.name)]), key=lambda m: m.name):
      path = root / package.name / f"{module.name}.py"
      if not module.name.startswith("modeling_") or '"RMSNormGated"' not in path.read_text():
        continue
      mod = importlib.import_module(f"transformers.models.{package.name}.{module.name}")
      found += [v for v in vars(mod).values()
                if isinstance(v, type) and v.__module__ == mod.__name__
                and ti.hub_layer_name(v) == "RMSNormGated"]
  return found


CLASSES = gated_norm_classes()
# Which rounding each family's forward has (read from their code): the normalised x rounded
# to x's dtype before the weight, or all of it in float32.
ROUNDS_TO_INPUT_DTYPE = {"Qwen3_5", "Qwen3_5Moe", "Qwen3Next", "OlmoHybrid", "Qwen4ExpText"}


def test_the_walk_finds_the_families():
  names = {cls.__name__.removesuffix("RMSNormGated") for cls in CLASSES}
  assert names == ROUNDS_TO_INPUT_DTYPE | {"KimiLinear", "BailingHybrid", "Glm5NextText",
                                           "LaraMini"}


def _norm(cls, weight_dtype, seed=0):
  torch.manual_seed(seed)
  norm = cls(48, eps=1e-5)
  with torch.no_grad():
    norm.weight.add_(0.1 * torch.randn(48))
  return norm.to(weight_dtype)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_layer_matches_each_class(rms, cls):
  """The class's own forward against the kernel through kernelize (its `activation`
  attribute: SiLU or sigmoid), in each dtype case; the rounding the layer picked is the
  family's."""
  repo = ti.linear_attention_layer_repository("tpu-kernels", "RMSNormGated")
  gen = torch.Generator().manual_seed(1)
  for x_dtype, weight_dtype in ti.RMS_NORM_CASES:
    norm = _norm(cls, weight_dtype)
    x = (torch.randn(2, 5, 48, generator=gen) * 3).to(x_dtype)
    gate = torch.randn(2, 5, 48, generator=gen).to(x_dtype)
    with ti.kernel_mapping_scope():
      ti.use_linear_attention_tpu("tpu-kernels")
      kernelize(torch.nn.ModuleList([norm]), mode=Mode.TRAINING, device="cpu")
    assert norm.__dict__.get("_kernel_repo") == repo
    want = cls.forward(norm, x, gate)
    got = norm(x, gate)
    assert got.dtype == want.dtype
    scale = want.double().abs().max().item()
    error = (got.double() - want.double()).abs().max().item()
    assert error <= ti.RMS_NORM_TOLERANCE[x_dtype] * scale, (x_dtype, weight_dtype, error)
    if x_dtype == torch.float32:
      leaves = [x.requires_grad_(), gate.requires_grad_(), norm.weight]
      direction = torch.randn_like(want)
      grads = [torch.autograd.grad((f(x, gate) * direction).sum(), leaves)
               for f in (lambda a, b: cls.forward(norm, a, b), norm)]
      for name, w, g in zip(("x", "gate", "weight"), *grads):
        assert (g - w).abs().max() <= 1e-4 * w.abs().max(), name
  layers = rms.layers
  picked = {k[1:4]: v for k, v in vars(layers)["_GATED_CHECKED"].items() if k[0] is cls}
  bf16 = picked[(torch.bfloat16, torch.bfloat16, torch.bfloat16)]
  assert bf16 == (cls.__name__.removesuffix("RMSNormGated") in ROUNDS_TO_INPUT_DTYPE)


def test_torch_compile_fullgraph(rms):
  gen = torch.Generator().manual_seed(0)
  x, gate, w = (torch.randn(7, 16, generator=gen), torch.randn(7, 16, generator=gen),
                torch.randn(16, generator=gen))

  def block(x, gate, w):
    return rms.rms_norm_gated(x, gate, w, 1e-5, activation="sigmoid")

  torch.testing.assert_close(torch.compile(block, fullgraph=True)(x, gate, w), block(x, gate, w),
                             rtol=0, atol=0)
