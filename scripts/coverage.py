"""Which model families of the installed Transformers the kernels run, found by walking its
modeling modules (no hand-kept list), each family built small from its own config classes
with random weights.

    python scripts/coverage.py [--family NAME ...] [--column experts|attention|norm ...]
                               [--dist DIR] [--all]

prints one row per family: family | <column>..., each cell "matches", "refused: <reason>",
"not applicable", or (experts) "eager broken: <what>; kernel matches <what it was judged
against>", anything else naming what went wrong (crash, differs, not built); and a summary
line with the Transformers version. Exit status 1 if any cell is of that last kind.

Layout (so that more columns can be added): `families()` is the one family walk; a column
is a function `<column>_cell(kernels, family) -> Cell` listed in COLUMNS. The experts
column builds every `@use_experts_implementation` class of the family (found by code: its
forward is the decorator's wrapper) and compares ragged-dot-tpu's `experts_forward`
against the module's own "eager" forward, forward and backward, in float32.
tests/torch/test_moe_experts_all_families.py imports this walk and these builders.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import inspect
import os
import pkgutil
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

# float32: kernel vs eager, max |got - want| / max |want| per tensor (output and every
# gradient). Only the summation order differs, so 1e-4 leaves a wide margin (observed <1e-6).
F32_BOUND = 1e-4


# ------------------------------------------------------------------------------ family walk


@dataclasses.dataclass
class Family:
  """One `transformers.models.<name>` package: its imported modeling modules, and the ones
  that failed to import (module name -> error) with whether their source mentions experts.

  A package with a configuration module and no modeling module (5.24+: exaone,
  internlm3, iquestcoder, param2moe, sarvam_mla, sarvam_moe, ...) runs another family's
  model classes (Transformers' auto mappings) built from its own config: `borrows` is that
  family and `config_class` its own config class. The columns that build from a config
  (attention, experts) take `model_classes`, the borrowed family's classes, and build them
  from `config_class`; `classes` and `mentions` answer for the family's own modules only."""

  name: str
  modules: list = dataclasses.field(default_factory=list)
  import_errors: dict = dataclasses.field(default_factory=dict)
  borrows: Family | None = None
  config_class: type | None = None

  def borrowed(self) -> str:
    """What a config-only family's cell adds: whose classes ran, from which config."""
    if self.borrows is None:
      return ""
    return f" ({self.borrows.name}'s classes from its own {self.config_class.__name__})"

  def mentions(self, text: str) -> bool:
    """Whether the source of one of the family's imported modeling modules contains text."""
    return any(_source_mentions(module.__name__, text) for module in self.modules)

  def model_classes(self, predicate) -> list[type]:
    """`classes`, or for a config-only family the classes of the family it borrows."""
    return (self.borrows or self).classes(predicate)

  def classes(self, predicate) -> list[type]:
    """Classes defined (not merely imported) in the family's modeling modules."""
    found = []
    for module in self.modules:
      for value in vars(module).values():
        if isinstance(value, type) and value.__module__ == module.__name__ and predicate(value):
          found.append(value)
    return found


def _source_mentions(module_name: str, text: str) -> bool:
  spec = importlib.util.find_spec(module_name)
  return bool(spec and spec.origin and text in Path(spec.origin).read_text())


@functools.cache
def families() -> tuple[Family, ...]:
  """Every package of transformers.models with its modeling_* modules, imported (and the
  config-only packages that borrow another family's models, see Family)."""
  import transformers.models

  out, config_only = [], []
  for package in sorted(pkgutil.iter_modules(transformers.models.__path__),
                        key=lambda p: p.name):
    if not package.ispkg:
      continue
    family = Family(package.name)
    prefix = f"transformers.models.{package.name}"
    path = Path(transformers.models.__path__[0]) / package.name
    for module in sorted(pkgutil.iter_modules([str(path)]), key=lambda m: m.name):
      if not module.name.startswith("modeling_"):
        continue
      name = f"{prefix}.{module.name}"
      try:
        family.modules.append(importlib.import_module(name))
      except Exception as e:  # noqa: BLE001  (recorded, reported by every column)
        family.import_errors[name] = f"{type(e).__name__}: {e}"
    if family.modules or family.import_errors:
      out.append(family)
    else:
      config_only.append(family)
  for family in config_only:
    _borrow(family, out)
  return tuple(sorted(out, key=lambda f: f.name))


def _borrow(family: Family, walked: list) -> None:
  """Appends a config-only `family` to `walked` with the family whose base model class
  Transformers maps its config to (MODEL_MAPPING_NAMES), if there is one."""
  from transformers import PretrainedConfig
  from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

  package = importlib.import_module(f"transformers.models.{family.name}")
  for info in pkgutil.iter_modules(package.__path__):
    if not info.name.startswith("configuration_"):
      continue
    module = importlib.import_module(f"{package.__name__}.{info.name}")
    configs = [v for v in vars(module).values() if isinstance(v, type)
               and issubclass(v, PretrainedConfig) and v.__module__ == module.__name__
               and MODEL_MAPPING_NAMES.get(getattr(v, "model_type", None))]
    for config_class in configs:
      model_name = MODEL_MAPPING_NAMES[config_class.model_type]
      for other in walked:
        if any(isinstance(vars(m).get(model_name), type) for m in other.modules):
          walked.append(dataclasses.replace(family, borrows=other, config_class=config_class))
          return


def family(name: str) -> Family:
  for f in families():
    if f.name == name:
      return f
  raise KeyError(f"no family {name!r} in transformers.models")


# ------------------------------------------------------------------------------ tiny configs

# The sizes a family is shrunk to: small enough for Pallas interpret mode on a CPU core.
TINY = dict(hidden=32, intermediate=16, experts=4, top_k=2)


def _tiny_value(key: str):
  """The small value for a config attribute (or __init__ argument) named `key`, or None to
  leave it: sizes of the hidden and intermediate dimensions, the expert count and top-k."""
  k = key.lower()
  if "expert" in k and ("per_tok" in k or "top" in k):
    return TINY["top_k"]
  if re.search(r"intermediate|ffn", k):
    return TINY["intermediate"]
  if re.search(r"hidden_size|d_model|hidden_dim", k):
    return TINY["hidden"]
  if re.search(r"^(num_|n_)(local_|routed_)?experts$|^num_experts|moe_num_experts", k):
    return TINY["experts"]
  return None


def shrink_config(config):
  """`config` with its hidden / intermediate sizes and expert counts made tiny (in place)."""
  for key, value in config.to_dict().items():
    small = _tiny_value(key)
    if small is None or isinstance(value, bool):
      continue
    if value is None or isinstance(value, int):
      setattr(config, key, small)
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
      setattr(config, key, type(value)(small for _ in value))
  return config


def config_classes(cls: type) -> list[type]:
  """The config classes `cls` may be built from: its __init__'s `config` annotation first,
  then every config class of its family's configuration module."""
  from transformers import PretrainedConfig

  candidates = []
  try:
    hint = typing.get_type_hints(inspect.unwrap(cls.__init__)).get("config")
    if isinstance(hint, type) and issubclass(hint, PretrainedConfig):
      candidates.append(hint)
  except Exception:  # noqa: BLE001  (an unresolvable annotation: fall back to the family's)
    pass
  package = cls.__module__.rsplit(".", 1)[0]
  for module_info in pkgutil.iter_modules(importlib.import_module(package).__path__):
    if module_info.name.startswith("configuration_"):
      module = importlib.import_module(f"{package}.{module_info.name}")
      candidates += [v for v in vars(module).values()
                     if isinstance(v, type) and issubclass(v, PretrainedConfig)
                     and v.__module__ == module.__name__ and v not in candidates]
  return candidates


class BuildError(RuntimeError):
  """A class could not be built small (the message says why, for every config tried)."""


def build_small(cls: type, check=lambda module: None, config_class: type | None = None):
  """An instance of `cls` from the first of its config classes that builds once shrunk,
  (module, config). Extra __init__ arguments named like sizes get the tiny sizes, a
  `layer_idx` gets 0. `config_class` (a config-only family's own) is the only candidate
  when given. `check`
  raises on an instance that is not usable (e.g. still large). Raises BuildError."""
  import torch

  errors = []
  params = list(inspect.signature(inspect.unwrap(cls.__init__)).parameters)[2:]
  extra = {p: _tiny_value(p) for p in params if _tiny_value(p) is not None}
  if "layer_idx" in params:   # per-layer settings (Step3p7's swiglu_limits): the first layer's
    extra["layer_idx"] = 0
  for config_class in [config_class] if config_class else config_classes(cls):
    try:
      config = shrink_config(config_class())
      with torch.device("meta"):   # sizes first: a shrink that missed a size costs nothing
        check(cls(config, **extra))
      module = cls(config, **extra)
      return module, config
    except Exception as e:  # noqa: BLE001  (collected into the BuildError)
      errors.append(f"{config_class.__name__}: {type(e).__name__}: {e}")
  raise BuildError(f"{cls.__module__}.{cls.__qualname__} could not be built small: "
                   + ("; ".join(errors) or "no config class found"))


# ------------------------------------------------------------------------------ experts


@functools.cache
def _experts_wrapper_code():
  """The code object of the forward `@use_experts_implementation` installs on a class."""
  import torch
  from transformers.integrations.moe import use_experts_implementation

  class Probe(torch.nn.Module):
    def forward(self, x):
      return x

  return use_experts_implementation(Probe).forward.__code__


def is_experts_class(cls: type) -> bool:
  """True iff `cls` is decorated with Transformers' @use_experts_implementation."""
  return getattr(getattr(cls, "forward", None), "__code__", None) is _experts_wrapper_code()


def experts_classes(fam: Family) -> list[type]:
  return fam.model_classes(is_experts_class)


def all_experts_classes() -> list[tuple[str, type]]:
  """(family name, class) of every @use_experts_implementation class, once each (not again
  for the config-only families that borrow it), in family order."""
  return [(f.name, cls) for f in families() if f.borrows is None for cls in experts_classes(f)]


def unimportable_experts_modules() -> dict[str, str]:
  """Modeling modules that failed to import although their source uses the decorator."""
  return {name: error for f in families() for name, error in f.import_errors.items()
          if _source_mentions(name, "use_experts_implementation")}


def _check_tiny_experts(module) -> None:
  limit = 4 * TINY["hidden"] * TINY["intermediate"] * TINY["experts"]
  for name, p in module.named_parameters():
    if p.numel() > limit:
      raise BuildError(f"parameter {name} {tuple(p.shape)} was not shrunk")


def build_experts(cls: type, dtype, seed: int = 0, config_class: type | None = None):
  """A tiny instance of experts class `cls` with random weights, set to "eager" (from
  `config_class` if given, see build_small).

  3-D expert weights ~ N(0, (2 / sqrt(fan_in))^2), 2-D (biases) ~ N(0, 0.01), 1-D (norm
  weights) ~ 1 + N(0, 0.01). Raises BuildError.
  """
  import torch

  torch.manual_seed(seed)
  module, config = build_small(cls, _check_tiny_experts, config_class)
  with torch.no_grad():
    for p in module.parameters():
      if p.dim() == 3:
        fan_in = p.shape[1] if module.is_transposed else p.shape[2]
        p.copy_(torch.randn_like(p) * 2 * fan_in ** -0.5)
      elif p.dim() == 2:
        p.copy_(torch.randn_like(p) * 0.1)
      else:
        p.copy_(1 + torch.randn_like(p) * 0.1)
  config._experts_implementation = "eager"
  return module.to(dtype)


def experts_inputs(module, dtype, seed: int = 1, tokens: int = 12, placeholders: int = 0,
                   scale: float | None = None):
  """(hidden [T, H], top_k_index [T, K] int64, top_k_weights [T, K], direction [T, H]).

  Hidden ~ N(0, scale^2). float32's default scale 3 puts the gate/up values (std ~6) past
  the clamp limits (7-10) of the clamped gates often, so the clamps are exercised. bfloat16's
  default is 1 (std ~2, the limits > 3 sigma away): there a bf16 rounding of a value near a
  limit would move it across the clamp on one side only, turning that element's gradient
  from its full value to 0, a difference of the clamp, not of the kernel.
  Ids >= num_experts (`placeholders` of them) are expert-parallel placeholders."""
  import torch

  if scale is None:
    scale = 3.0 if dtype == torch.float32 else 1.0
  gen = torch.Generator().manual_seed(seed)
  hidden_size = module.down_proj.shape[2 if module.is_transposed else 1]
  num_experts, top_k = module.num_experts, min(TINY["top_k"], module.num_experts)
  hidden = torch.randn(tokens, hidden_size, generator=gen) * scale
  index = torch.stack([torch.randperm(num_experts + placeholders, generator=gen)[:top_k]
                       for _ in range(tokens)])
  weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), dim=-1)
  direction = torch.randn(tokens, hidden_size, generator=gen)
  return hidden.to(dtype), index, weights.to(dtype), direction


def run_experts(forward, module, hidden, index, weights, direction, *, weights_grad=True):
  """forward(module, hidden, index, weights) and the gradients of <out, direction> w.r.t.
  hidden, the routing weights (unless weights_grad is False: constant weights, as a MoE
  block that passes ones has) and every parameter: {name: tensor} (out under "out")."""
  import torch

  module.zero_grad(set_to_none=True)
  hidden = hidden.detach().clone().requires_grad_()
  weights = weights.detach().clone().requires_grad_(weights_grad)
  out = forward(module, hidden, index, weights)
  (out.float() * direction).sum().backward()
  result = {"out": out.detach(), "grad hidden": hidden.grad}
  if weights_grad:
    result["grad top_k_weights"] = weights.grad
  result.update({f"grad {n}": p.grad for n, p in module.named_parameters()})
  return result


def eager_forward(module, hidden, index, weights):
  module.config._experts_implementation = "eager"
  return module(hidden, index, weights)


def relative_errors(got: dict, want: dict) -> dict[str, float]:
  """max |got - want| / max |want| per entry (inf where one side is missing)."""
  errors = {}
  for name, w in want.items():
    g = got.get(name)
    if g is None or w is None:
      errors[name] = 0.0 if g is None and w is None else float("inf")
      continue
    scale = float(w.float().abs().max()) or 1.0
    errors[name] = float((g.float() - w.float()).abs().max()) / scale
  return errors


# ------------------------------------------------------------------ when eager is broken
#
# A family's own eager forward may fail on the walk's inputs: Transformers 5.25's
# ErgoExpertProjections (gate-less, transposed, relu²) takes one route per row of unit
# weight, which is how its MoE block (ErgoExperts) calls it, and raises IndexError on 2
# routes per row (it also ignores the routing weights). Such a class is judged without its
# eager forward on those inputs, and the cell says so: the kernel against the float64
# reference of tests/reference_moe.py (written from the definition, no kernel code) on the
# same inputs, forward; and against eager on one route per row of unit weight, forward and
# backward, where eager runs there.


def _reference_activation(act_fn) -> str | None:
  """tests/reference_moe.py's name for an experts module's act_fn (by exact class, or the
  function itself), or None when it has none."""
  import torch
  from transformers import activations as acts

  names = {acts.SiLUActivation: "silu", torch.nn.SiLU: "silu", torch.nn.ReLU: "relu",
           acts.ReLUSquaredActivation: "relu2", acts.GELUActivation: "gelu",
           acts.GELUTanh: "gelu_tanh", acts.LinearActivation: "identity"}
  functions = {torch.nn.functional.silu: "silu", torch.nn.functional.relu: "relu",
               torch.relu: "relu", torch.nn.functional.gelu: "gelu"}
  if isinstance(act_fn, torch.nn.Module):
    return names.get(type(act_fn))
  return functions.get(act_fn)


def reference_experts(module, hidden, index, weights):
  """The float64 reference (tests/reference_moe.py moe_experts) of an experts module with
  the default gate (act(gate) * up) or none, on hidden [T, H], index [T, K], weights
  [T, K]: a float64 [T, H] tensor. Raises NotImplementedError for what it does not describe
  (a custom gate, a post-expert norm, an activation it does not know)."""
  import torch

  sys.path.insert(0, str(ROOT / "tests"))
  import reference_moe

  act = _reference_activation(getattr(module, "act_fn", None))
  if act is None:
    raise NotImplementedError(f"its act_fn {getattr(module, 'act_fn', None)!r}")
  if module.has_gate and type(module)._apply_gate.__name__ != "_default_apply_gate":
    raise NotImplementedError("its own _apply_gate")
  if module.has_post_expert_norm:
    raise NotImplementedError("its post-expert norm")
  first = "gate_up_proj" if module.has_gate else "up_proj"
  bias = (lambda name: getattr(module, f"{name}_bias")) if module.has_bias else (lambda _: None)
  out = reference_moe.moe_experts(
      hidden, index, weights, getattr(module, first), module.down_proj,
      gate_up_bias=bias(first), down_bias=bias("down_proj"), num_experts=module.num_experts,
      has_gate=module.has_gate, is_transposed=module.is_transposed,
      is_concatenated=module.is_concatenated, activation_name=act)
  return torch.from_numpy(out)


def one_route_inputs(module, dtype, seed: int = 3, tokens: int = 12):
  """experts_inputs with one route per row of weight 1: (hidden, index [T, 1], ones, direction)."""
  import torch

  hidden, _, _, direction = experts_inputs(module, dtype, seed=seed, tokens=tokens)
  gen = torch.Generator().manual_seed(seed)
  index = torch.randint(0, module.num_experts, (tokens, 1), generator=gen)
  return hidden, index, torch.ones(tokens, 1, dtype=dtype), direction


@dataclasses.dataclass
class EagerBrokenVerdict:
  """How the kernel was judged without a class's broken eager forward. ok: every judgement
  made passed and at least one was made; text: what was judged (or what differs)."""

  ok: bool
  text: str


def judge_without_eager(kernel, module, inputs, eager_error: Exception,
                        bounds: dict | None = None) -> EagerBrokenVerdict:
  """The kernel on an experts module whose eager forward raised `eager_error` on `inputs`
  (experts_inputs): against reference_experts on `inputs` (output) and against eager on
  one_route_inputs (output and gradients), each within `bounds` ({"out": .., "grad": ..},
  default F32_BOUND), max |got - want| / max |want| per tensor."""
  import torch

  bounds = bounds or {"out": F32_BOUND, "grad": F32_BOUND}
  hidden, index, weights, _ = inputs
  judged, problems = [], []
  try:
    want = reference_experts(module, hidden, index, weights)
  except NotImplementedError as e:
    judged_reference = f"no float64 reference for {e}"
  else:
    with torch.no_grad():
      got = kernel.experts_forward(module, hidden, index, weights)
    error = relative_errors({"out": got.double()}, {"out": want})["out"]
    if error > bounds["out"]:
      problems.append(f"output differs from the float64 reference by {error:.1e}")
    judged_reference = (f"the float64 reference (tests/reference_moe.py) on {index.shape[1]} "
                        f"routes per row (forward)")
    judged.append(judged_reference)
  one = one_route_inputs(module, hidden.dtype)
  try:
    want = run_experts(eager_forward, module, *one, weights_grad=False)
  except Exception as e:  # noqa: BLE001  (eager broken there too: said in the verdict)
    judged_one = f"eager fails on one route per row too ({type(e).__name__})"
  else:
    got = run_experts(kernel.experts_forward, module, *one, weights_grad=False)
    bad = {n: f"{err:.1e}" for n, err in relative_errors(got, want).items()
           if err > (bounds["out"] if n == "out" else bounds["grad"])}
    if bad:
      problems.append(f"on one route per row of unit weight, differs from eager: {bad}")
    judged_one = "eager on one route per row of unit weight (forward and backward)"
    judged.append(judged_one)
  name = type(module).__name__
  broken = f"eager broken: {name}: {type(eager_error).__name__}: {str(eager_error)[:160]}"
  if problems:
    return EagerBrokenVerdict(False, f"differs: {name} ({broken}): " + "; ".join(problems))
  if not judged:
    return EagerBrokenVerdict(False, f"not judged: {broken}; {judged_reference}; {judged_one}")
  return EagerBrokenVerdict(True, f"{broken}; kernel matches " + " and ".join(judged))


def experts_cell(kernels, fam: Family) -> str:
  """"matches" when every experts class of the family equals eager in float32 (forward and
  backward within F32_BOUND), else "refused: <reason>"; "not applicable" without one."""
  import torch

  classes = experts_classes(fam)
  broken = {n: e for n, e in fam.import_errors.items()
            if _source_mentions(n, "use_experts_implementation")}
  if broken:
    return "refused: " + "; ".join(f"{n} does not import ({e})" for n, e in broken.items())
  if not classes:
    return "not applicable"
  kernel = kernels["ragged-dot-tpu"]
  problems, eager_broken = [], []
  for cls in classes:
    try:
      module = build_experts(cls, torch.float32, config_class=fam.config_class)
      inputs = experts_inputs(module, torch.float32)
    except Exception as e:  # noqa: BLE001
      problems.append(f"not built: {cls.__name__}: {type(e).__name__}: {e}")
      continue
    try:
      want = run_experts(eager_forward, module, *inputs)
    except Exception as e:  # noqa: BLE001  (the family's own code: judged without it)
      verdict = judge_without_eager(kernel, module, inputs, e)
      (eager_broken if verdict.ok else problems).append(verdict.text)
      continue
    try:
      got = run_experts(kernel.experts_forward, module, *inputs)
    except NotImplementedError as e:
      problems.append(f"refused: {cls.__name__}: {e}")
      continue
    except Exception as e:  # noqa: BLE001  (a crash is what this cell reports)
      problems.append(f"crash: {cls.__name__}: {type(e).__name__}: {e}")
      continue
    worst = max(relative_errors(got, want).items(), key=lambda kv: kv[1])
    if worst[1] > F32_BOUND:
      problems.append(f"differs: {cls.__name__}: {worst[0]} off by {worst[1]:.1e}")
  if problems:
    return "; ".join(problems + eager_broken)
  if eager_broken:
    return "; ".join(eager_broken)
  cell = "matches" if len(classes) == 1 else f"matches ({len(classes)} classes)"
  return cell + fam.borrowed()


# ------------------------------------------------------------------------------ the table

# column name -> cell function (kernels, family) -> str, one module per column.
from coverage_attention import attention_cell  # noqa: E402
from coverage_norm import norm_cell  # noqa: E402

COLUMNS = {"experts": experts_cell, "attention": attention_cell, "norm": norm_cell}
from coverage_linear_attention import linear_attention_cell  # noqa: E402
COLUMNS["linear_attention"] = linear_attention_cell


def load_kernels(dist: Path) -> dict:
  """The ready kernel repos built into `dist` and loaded with get_kernel (LOCAL_KERNELS)."""
  import build

  manifest = build.load_manifest()
  org = manifest["collection"]["hub-org"]
  ready = build.ready_kernels(manifest)
  for name in ready:
    build.build_kernel(name, manifest, dist)
  os.environ["LOCAL_KERNELS"] = ":".join(f"{org}/{n}={dist / n}" for n in ready)
  from kernels import get_kernel

  return {name: get_kernel(f"{org}/{name}", version=1) for name in ready}


def table(kernels, names=None, columns=None, on_row=None) -> list[tuple[str, dict]]:
  """(family, {column: cell}) for every family (or those in `names`), the `columns` of
  COLUMNS (default all); on_row(name, cells) is called as each row is done."""
  rows = []
  for fam in families():
    if names and fam.name not in names:
      continue
    cells = {column: COLUMNS[column](kernels, fam) for column in columns or COLUMNS}
    rows.append((fam.name, cells))
    if on_row is not None:
      on_row(fam.name, cells)
  return rows


# What a cell says, by its first words; "other" (crash, differs, not built, not judged) is
# what the walk must not show.
CELL_KINDS = ("matches", "refused", "eager broken", "not applicable")


def cell_kind(cell: str) -> str:
  """"matches", "refused", "eager broken" (judged without the family's eager code, and
  matching there), "not applicable" or "other"."""
  for kind in CELL_KINDS:
    if cell.startswith(kind):
      return kind
  return "other"


def summary(rows) -> str:
  import transformers

  parts = []
  for column in rows[0][1] if rows else COLUMNS:
    kinds = [cell_kind(cells[column]) for _, cells in rows]
    applicable = [k for k in kinds if k != "not applicable"]
    part = f"{column}: {kinds.count('matches')}/{len(applicable)} families match"
    for kind in ("eager broken", "refused", "other"):
      if kinds.count(kind):
        part += f", {kinds.count(kind)} {'crash / differ / not built' if kind == 'other' else kind}"
    parts.append(part)
  return f"Transformers {transformers.__version__}: " + "; ".join(parts)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--family", action="append", help="only these families (repeatable)")
  parser.add_argument("--column", action="append", choices=list(COLUMNS),
                      help="only these columns (repeatable; default all)")
  parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where to build")
  parser.add_argument("--all", action="store_true",
                      help="also print families where every column is not applicable")
  args = parser.parse_args(argv)
  kernels = load_kernels(args.dist.resolve())
  columns = args.column or list(COLUMNS)
  width = 24
  print(f"{'family':<{width}} | " + " | ".join(columns), flush=True)

  def print_row(name, cells):   # as each row is done: the whole walk takes long
    if args.all or any(c != "not applicable" for c in cells.values()):
      print(f"{name:<{width}} | " + " | ".join(cells[c] for c in columns), flush=True)

  rows = table(kernels, set(args.family or ()), columns, print_row)
  print(summary(rows))
  return 0 if all(cell_kind(c) != "other" for _, cells in rows for c in cells.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
