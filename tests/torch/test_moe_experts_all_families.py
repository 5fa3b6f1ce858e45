"""Every `@use_experts_implementation` class of the installed Transformers on ragged-dot-tpu's
experts_forward, against the module's own "eager" forward (its per-expert loop).

The classes are found by code, by the family walk of scripts/coverage.py (the same walk
`python scripts/coverage.py` prints its table from): a class is an experts class iff its
forward is the wrapper the decorator installs. Each is built tiny from its own config class
(coverage.build_experts: sizes shrunk by name, the config annotation or the family's config
classes tried in turn) with random weights. A class that cannot be built fails with the
reason, for every config class tried; a modeling module that uses the decorator but does not
import fails the walk test.

The module is called directly (hidden [T, H], top_k_index, top_k_weights), as its MoE block
calls it. Gradients: of <out, direction> w.r.t. hidden, the routing weights and every
parameter of the module (expert weights, biases, post-expert norm weights).

Tolerances, per tensor, max |got - want| / max |want|:
  float32: 1e-4 (coverage.F32_BOUND) for the output and every gradient: only the summation
    order differs (observed below 1e-6).
  bfloat16: 3e-2 for the output, 6e-2 for gradients (as tests/torch/test_moe_experts.py
    argues: both sides round every intermediate to bf16 at different points; the kernel keeps
    the gate/up product and the down projection in f32, eager rounds each; the backward adds
    a bf16 rounding of each gradient).

A class whose own eager forward raises on these inputs (ergo's, Transformers 5.25) is judged
without it (coverage.judge_without_eager: the float64 reference of tests/reference_moe.py,
and eager on one route per row of unit weight), and that must pass.

Cost: in the default (`ci`) hypothesis profile, every class in f32 forward + backward and
bf16 on one class per distinct kind (activation, gate function, layout flags, post-norm);
HYPOTHESIS_PROFILE=thorough runs bf16 on every class.
"""


import pytest
import torch

import reference_moe as ref
from coverage_walk import coverage
from profiles import THOROUGH

BF16_BOUND = {"out": 3e-2, "grad": 6e-2}

CLASSES = coverage.all_experts_classes()
IDS = [f"{family}-{cls.__name__}" for family, cls in CLASSES]


def _kind(cls):
  """What decides the kernel's route and layout for a class: its gate function, act_fn,
  and the decorator's flags (read from a tiny instance). BuildError -> its own kind."""
  try:
    module = coverage.build_experts(cls, torch.float32)
  except coverage.BuildError:
    return ("unbuildable", cls)
  act = module.act_fn if hasattr(module, "act_fn") else None
  act_key = act if not isinstance(act, torch.nn.Module) else type(act)
  return (getattr(type(module)._apply_gate, "__qualname__", None) if
          type(module)._apply_gate.__name__ != "_default_apply_gate" else "default",
          act_key, module.has_gate, module.has_bias, module.is_transposed,
          module.is_concatenated, module.has_post_expert_norm)


def _bf16_classes():
  if THOROUGH:
    return CLASSES
  seen, chosen = set(), []
  for family, cls in CLASSES:
    kind = _kind(cls)
    if kind not in seen:
      seen.add(kind)
      chosen.append((family, cls))
  return chosen


BF16_CLASSES = _bf16_classes()


def _build(cls, dtype):
  try:
    return coverage.build_experts(cls, dtype)
  except coverage.BuildError as e:
    pytest.fail(str(e))


def _compare(kernel, module, dtype, bounds, reference=coverage.eager_forward, want=None,
             inputs=None):
  inputs = coverage.experts_inputs(module, dtype) if inputs is None else inputs
  if want is None:
    want = coverage.run_experts(reference, module, *inputs)
  got = coverage.run_experts(kernel.experts_forward, module, *inputs)
  assert got["out"].dtype == dtype
  assert {n for n, g in got.items() if g is None} == {n for n, w in want.items() if w is None}
  assert any(n.startswith("grad ") and ("proj" in n) and w is not None
             for n, w in want.items()), "no expert weight received a gradient"
  errors = coverage.relative_errors(got, want)
  # A bfloat16 parameter of a float32 module (XIELU's alpha_p / alpha_n) accumulates its
  # gradient in bf16, in another order on each side (eager: expert by expert): bf16 bound.
  bf16_params = {f"grad {n}" for n, p in module.named_parameters() if p.dtype == torch.bfloat16}
  bad = {n: e for n, e in errors.items()
         if e > (bounds["out"] if n == "out" else
                 BF16_BOUND["grad"] if n in bf16_params else bounds["grad"])}
  assert not bad, f"beyond {bounds}: {bad}"
  return errors


def test_walk_finds_the_experts_classes():
  """The walk found experts classes, every one decorated, and no modeling module that uses
  the decorator failed to import."""
  assert CLASSES, "no @use_experts_implementation class found in transformers.models"
  assert coverage.unimportable_experts_modules() == {}
  # The walk is by code: the probe class decorated here is recognised, an undecorated one not.
  from transformers.integrations.moe import use_experts_implementation

  class Plain(torch.nn.Module):
    def forward(self, x):
      return x

  assert not coverage.is_experts_class(Plain)
  assert coverage.is_experts_class(use_experts_implementation(Plain))


def _compare_with_eager_or_without(kernel, module, dtype, bounds, record_property):
  """_compare against the module's eager forward; where that forward raises on the walk's
  inputs (a family's own broken code), coverage.judge_without_eager instead (the float64
  reference, and eager on one route per row), which must pass. Returns _compare's errors,
  or None when judged without eager."""
  inputs = coverage.experts_inputs(module, dtype)
  try:
    want = coverage.run_experts(coverage.eager_forward, module, *inputs)
  except Exception as e:  # noqa: BLE001  (the family's eager code; judged without it)
    verdict = coverage.judge_without_eager(kernel, module, inputs, e, bounds)
    record_property("eager", verdict.text)
    assert verdict.ok, verdict.text
    return None
  return _compare(kernel, module, dtype, bounds, want=want, inputs=inputs)


@pytest.mark.parametrize("family, cls", CLASSES, ids=IDS)
def test_float32_forward_and_backward_match_eager(ragged, family, cls, record_property):
  module = _build(cls, torch.float32)
  plan = ragged.experts_plan(module)
  errors = _compare_with_eager_or_without(
      ragged, module, torch.float32, {"out": coverage.F32_BOUND, "grad": coverage.F32_BOUND},
      record_property)
  record_property("route", plan.route if plan.route == "generic" else
                  f"fused {plan.activation}")
  if errors is not None:
    record_property("f32_out", errors["out"])
    record_property("f32_grad", max(e for n, e in errors.items() if n != "out"))


@pytest.mark.parametrize("family, cls", BF16_CLASSES,
                         ids=[f"{f}-{c.__name__}" for f, c in BF16_CLASSES])
def test_bfloat16_forward_and_backward_within_bound(ragged, family, cls, record_property):
  errors = _compare_with_eager_or_without(ragged, _build(cls, torch.bfloat16), torch.bfloat16,
                                          BF16_BOUND, record_property)
  if errors is not None:
    record_property("bf16_out", errors["out"])
    record_property("bf16_grad", max(e for n, e in errors.items() if n != "out"))


def test_ergo_eager_is_broken_and_its_moe_block_matches(ragged):
  """Transformers 5.25's ErgoExpertProjections (gate-less, transposed, relu²) raises
  IndexError on 2 routes per row (it takes one route of unit weight: its MoE block,
  ErgoExperts, calls it so). If a Transformers release mends it, this test fails: the
  class is then compared with eager like every other, and this test can go. The kernel
  is judged without it (float64 reference; eager on one route per row) and equals it as
  the model uses it, through ErgoExperts (one route per row, then each expert's norm). The
  judgement without eager itself runs in the float32 and bfloat16 tests above."""
  from transformers.models.ergo.modeling_ergo import ErgoExpertProjections, ErgoExperts

  module = coverage.build_experts(ErgoExpertProjections, torch.float32)
  inputs = coverage.experts_inputs(module, torch.float32)
  assert inputs[1].shape[1] == 2
  with pytest.raises(IndexError):
    coverage.run_experts(coverage.eager_forward, module, *inputs)
  # The model's own MoE block with its per-expert norm, 2 routes per row, forward and backward.
  from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

  block = coverage.build_experts(ErgoExperts, torch.float32)
  with torch.no_grad():    # each expert's norm weight around 1 (build_experts draws 2-D ones ~0)
    block.post_expert_norm.weight.normal_(1.0, 0.1)
  assert ragged.experts_plan(block).route == "fused"
  want = coverage.run_experts(coverage.eager_forward, block, *inputs)
  ALL_EXPERTS_FUNCTIONS.register("tpu_ragged_dot", ragged.experts_forward)
  block.config._experts_implementation = "tpu_ragged_dot"
  got = coverage.run_experts(lambda m, *a: m(*a), block, *inputs)
  errors = coverage.relative_errors(got, want)
  assert max(errors.values()) <= coverage.F32_BOUND, errors


# ------------------------------------------------------------------------ activations


def _qwen_experts():
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

  return coverage.build_experts(Qwen3MoeExperts, torch.float32)


def _act2fn_entries():
  from transformers.activations import ACT2FN

  return sorted(ACT2FN)


# Functions given as act_fn (lfm2_moe: F.silu): the kernel's when the function is one of
# its activations (compared by identity), the generic route otherwise.
FUNCTIONS = {"F.silu": (torch.nn.functional.silu, "silu"),
             "F.relu": (torch.nn.functional.relu, "relu"),
             "F.gelu": (torch.nn.functional.gelu, "gelu"),
             "torch.relu": (torch.relu, "relu"),
             "torch.tanh": (torch.tanh, None),
             "lambda silu": (lambda x: torch.nn.functional.silu(x), None)}


@pytest.mark.parametrize("name", _act2fn_entries())
def test_every_act2fn_entry_matches_eager(ragged, name):
  """Every ACT2FN activation as act_fn of a default-gate module: fused when it is one of the
  kernel's epilogues, the generic route otherwise; equal to eager either way (f32)."""
  from transformers.activations import ACT2FN

  module = _qwen_experts()
  module.act_fn = ACT2FN[name]
  plan = ragged.experts_plan(module)
  assert plan.route in ("fused", "generic")
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4})


@pytest.mark.parametrize("name", list(FUNCTIONS))
def test_activation_functions_match_eager(ragged, name):
  function, fused = FUNCTIONS[name]
  module = _qwen_experts()
  del module.act_fn            # a submodule: replaced by a plain function, as lfm2_moe has
  module.act_fn = function
  plan = ragged.experts_plan(module)
  assert (plan.route, plan.activation if fused else None) == (
      ("fused", fused) if fused else ("generic", None))
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4})


def test_fused_activations_are_recognised_by_class_not_name(ragged):
  """A subclass of a fused activation class (which may compute something else) takes the
  generic route; the class itself is fused."""
  from transformers.activations import ACT2CLS

  module = _qwen_experts()
  silu = ACT2CLS["silu"]
  module.act_fn = silu()
  assert ragged.experts_plan(module) == ragged.ExpertsPlan("fused", "silu")

  class Shifted(silu):
    def forward(self, x):
      return super().forward(x) + 0.5

  module.act_fn = Shifted()
  assert ragged.experts_plan(module).route == "generic"
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4})


# ------------------------------------------------------------------------ custom gates


def _grouped_mm(module, hidden, index, weights):
  """Transformers' grouped_mm experts: unlike Qwen3MoeExperts' own eager loop, it applies
  the module's `_apply_gate`, so it is the reference for the edited gates below."""
  from transformers.integrations.moe import grouped_mm_experts_forward

  return grouped_mm_experts_forward(module, hidden, index, weights)


def _clamped_module(limit=7.0, alpha=1.702):
  """A default-layout experts module whose own gate is gpt-oss's clamped gate on
  concatenated halves (MiniMax-M3-VL's formula), with the given parameters."""
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

  class ClampedExperts(Qwen3MoeExperts):
    def _apply_gate(self, gate_up):
      gate, up = gate_up.chunk(2, dim=-1)
      gate = gate.clamp(max=self.limit)
      up = up.clamp(min=-self.limit, max=self.limit)
      return (up + 1) * gate * torch.sigmoid(gate * self.alpha)

  module = _qwen_experts()
  module.__class__ = ClampedExperts
  module.limit, module.alpha = limit, alpha
  return module


def test_custom_gate_parameters_are_read_from_what_it_computes(ragged):
  module = _clamped_module(limit=3.0, alpha=1.5)
  assert ragged.experts_plan(module) == ragged.ExpertsPlan("fused", "gpt_oss", True, 1.5, 3.0)
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4}, _grouped_mm)
  module.limit = 2.5       # an edit after the first call is seen (a new probe)
  assert ragged.experts_plan(module).limit == 2.5
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4}, _grouped_mm)


def test_a_gate_near_a_known_one_is_not_mistaken_for_it(ragged):
  """Clamping up only from above differs from gpt-oss's gate only for up < -limit: the probe
  must notice and take the generic route (which still matches eager)."""
  module = _clamped_module(limit=2.0)

  def one_sided(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=module.limit), up.clamp(max=module.limit)
    return (up + 1) * gate * torch.sigmoid(gate * module.alpha)

  module._apply_gate = one_sided
  assert ragged.experts_plan(module).route == "generic"
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4}, _grouped_mm)


def test_a_gate_reading_a_tensor_is_not_fused(ragged):
  """A limit held as a tensor (it may be trained, and the probe only sees today's value)
  keeps the gate on the generic route, which follows the tensor."""
  module = _clamped_module(limit=2.0)
  module.limit = torch.nn.Parameter(torch.tensor(2.0))
  assert ragged.experts_plan(module).route == "generic"
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4}, _grouped_mm)
  with torch.no_grad():
    module.limit.fill_(0.5)
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4}, _grouped_mm)


# ------------------------------------------------------------------------ generic route


@pytest.mark.parametrize("route", ["fused", "generic"])
def test_negative_ids_are_placeholders(ragged, route):
  """A negative id (a dropped pair) gives exactly what an expert-parallel placeholder id
  gives (those are checked against Transformers above and below), on both routes: it
  sorts past the groups, it is counted in none, and a token with only such ids is zero."""
  from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts
  from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

  cls = MuseSparkExperts if route == "generic" else Qwen3MoeExperts
  module = coverage.build_experts(cls, torch.float32)
  assert ragged.experts_plan(module).route == route
  hidden, index, weights, _ = coverage.experts_inputs(module, torch.float32)
  placeholder = index.clone()
  placeholder[0] = module.num_experts
  placeholder[1, 0] = module.num_experts
  negative = index.clone()
  negative[0] = torch.tensor([-1, -module.num_experts - 3] + [-2] * (index.shape[1] - 2))
  negative[1, 0] = -1
  with torch.no_grad():
    want = ragged.experts_forward(module, hidden, placeholder, weights)
    got = ragged.experts_forward(module, hidden, negative, weights)
  assert torch.all(got[0] == 0)
  assert torch.equal(got, want)


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int8"])
def test_generic_route_with_placeholders_and_quantized_weights(ragged, quantized):
  """The generic route (a post-expert norm here) with expert-parallel placeholder ids
  (>= num_experts, contributing nothing), against Transformers' grouped_mm path; with int8
  weights, against the float64 reference of the dequantized experts plus the norm."""
  from transformers.integrations.moe import grouped_mm_experts_forward
  from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

  module = coverage.build_experts(MuseSparkExperts, torch.float32)
  assert ragged.experts_plan(module).route == "generic"
  module._is_expert_parallel = True
  hidden, index, weights, direction = coverage.experts_inputs(module, torch.float32,
                                                              placeholders=3)
  index[0] = torch.tensor([module.num_experts, module.num_experts + 2])
  if quantized:
    assert ragged.quantize_experts_(module, "int8") == 1
    with torch.no_grad():
      out = ragged.experts_forward(module, hidden, index, weights)
    assert torch.all(out[0] == 0)
    # Reference: the dequantized weights as float parameters through grouped_mm.
    for name in ("gate_up_proj", "down_proj"):
      q, scale = getattr(module, name), getattr(module, f"{name}_scale")
      deq = q.float() * (scale[:, None, :] if module.is_transposed else scale[:, :, None])
      delattr(module, name)
      module.register_parameter(name, torch.nn.Parameter(deq))
      delattr(module, f"{name}_scale")
    want = grouped_mm_experts_forward(module, hidden, index, weights).detach()
    ref.assert_close(out, want, rtol=1e-4, atol=1e-4)
    return
  got = coverage.run_experts(ragged.experts_forward, module, hidden, index, weights, direction)
  want = coverage.run_experts(grouped_mm_experts_forward, module, hidden, index, weights,
                              direction)
  assert torch.all(got["out"][0] == 0)
  errors = coverage.relative_errors(got, want)
  assert max(errors.values()) <= coverage.F32_BOUND, errors


def test_generic_route_compiles_fullgraph(ragged):
  from transformers.models.muse_spark.modeling_muse_spark import MuseSparkExperts

  module = coverage.build_experts(MuseSparkExperts, torch.float32)
  hidden, index, weights, _ = coverage.experts_inputs(module, torch.float32)
  hidden.requires_grad_()
  eager = ragged.experts_forward(module, hidden, index, weights)
  compiled = torch.compile(lambda h, i, w: ragged.experts_forward(module, h, i, w),
                           fullgraph=True)
  got = compiled(hidden, index, weights)
  torch.testing.assert_close(got, eager, rtol=1e-6, atol=1e-6)
  torch.testing.assert_close(torch.autograd.grad(got.sum(), hidden)[0],
                             torch.autograd.grad(eager.sum(), hidden)[0], rtol=1e-6, atol=1e-6)


def test_recognised_gates_are_the_kernels(ragged):
  """The gates the package recognises (listed there so that importing it does not import
  jax) are exactly the kernel's gated epilogues."""
  from tpu_kernels import ragged_dot as kernel

  assert ragged.SUPPORTED_ACTIVATIONS + ragged.PARAMETRIC_GATES == kernel.GATED_ACTIVATIONS


def test_post_activation_clamp_is_not_the_clamped_silu(ragged):
  """Step3p7's (and BailingHybrid's) gate with a per-layer swiglu limit clamps after the
  activation, min(silu(gate), limit) * clip(up, -limit, limit), which differs from the
  kernel's clamped SwiGLU silu(min(gate, limit)) * clip(up) wherever gate > limit (silu(7)
  = 6.9936 against 7). The walk builds these classes with the default config, which sets
  no limit; with one, the gate must not be taken for the fused one (and still equals eager
  on inputs that reach the limit)."""
  from transformers.models.step3p7.modeling_step3p7 import Step3p7Experts

  module = coverage.build_experts(Step3p7Experts, torch.float32)
  module.limit = 7.0           # what config.swiglu_limits[layer_idx] = 7 gives
  assert module.limit_after_act
  plan = ragged.experts_plan(module)
  assert plan.route == "generic", plan
  hidden = coverage.experts_inputs(module, torch.float32)[0]
  gate = (hidden @ module.gate_up_proj[0].T)[:, :module.intermediate_dim]
  assert bool((gate > module.limit).any())         # the inputs reach the limit
  _compare(ragged, module, torch.float32, {"out": 1e-4, "grad": 1e-4})
