"""The linear-attention column of the coverage table (scripts/coverage.py): a cell is a
function (kernels, family) -> str, "matches", "refused: <reason>" or "not applicable"
(anything else names what went wrong: "not built", "crash", "differs").

linear attention: the families whose modeling code defines a function or class under one
  of the hub names the linear-attention recipe maps (transformers_integration.
  LINEAR_ATTENTION_LAYERS: chunk_gated_delta_rule, fused_recurrent_gated_delta_rule,
  causal_conv1d_fn, causal_conv1d_update, causal_conv1d_forward, RMSNormGated), found by
  code (the objects of its modeling modules carrying that `kernel_layer_name`), no hand
  list. The family's first *ForCausalLM class (else *ForConditionalGeneration, on text
  only) is built small (coverage_attention's
  tiny_config: 2 layers keeping one of each kind, hidden 64, weights std 0.2; plus
  LINEAR_TINY where the config has the attribute: 2 key / 4 value heads of 16 for the
  linear attention), float32, CPU, and run on a batch [2, 12]: its stock code, then with
  the recipe (use_linear_attention_tpu, Transformers' set_use_kernels; every call checked
  to run the kernels, the kernels' ops seen running): logits within 1e-4 of max |stock|
  (tests/torch/test_linear_attention_models.py's bound) and the same tokens from a cached
  greedy generate of 3 (prefill, then the decode-side kernels; a family whose own generate
  fails on the tiny model, Inkling 2's, is judged on its logits and the cell says
  "eager broken: ..."). NotImplementedError from a kernel is a refusal with its reason; a
  hub name the tiny model never calls is said in the cell.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import coverage_attention  # noqa: E402
import transformers_integration as ti  # noqa: E402

# Linear-attention sizes (where the config has them): as the model tests'.
LINEAR_TINY = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                   linear_value_head_dim=16, linear_conv_kernel_dim=4)
# Families whose tiny config needs more than the attention column's to build, or to keep a
# layer that calls the hub names (each with why):
#   mamba2  its heads must tile hidden_size * expand (128): 8 heads of 16
#   lfm2       its default layers are all attention: one short-conv layer and one attention
#   glm5_next  its sparse (DSA) attention takes no rotary part (the attention column's MLA
#              sizes give it 8)
LINEAR_FAMILY_TINY = {
    "mamba2": dict(num_heads=8, head_dim=16),
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "glm5_next": dict(text_config=dict(qk_rope_head_dim=0)),
}
LINEAR_ATTENTION_BOUND = 1e-4
NEW_TOKENS = 3
# The op of the kernels that a hub name's call runs, in a prefill and in decode steps.
PREFILL_OPS = {"chunk_gated_delta_rule": "chunk_gated_delta_rule",
               "causal_conv1d_forward": "causal_conv1d_forward",
               "causal_conv1d_fn": "causal_conv1d_forward", "RMSNormGated": "rms_norm_gated"}
DECODE_OPS = {"fused_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
              "causal_conv1d_update": "causal_conv1d_update"}
_REPOS = ("gated-delta-rule-tpu", "causal-conv1d-tpu", "rms-norm-tpu")


def hub_names(fam) -> set[str]:
  """The hub names of LINEAR_ATTENTION_LAYERS that the family's modeling modules define a
  function (a kernels function layer) or a class under."""
  found = set()
  for module in fam.modules:
    for value in vars(module).values():
      owner = value if isinstance(value, type) else type(value)
      if owner.__module__ != module.__name__:
        continue
      name = owner.__dict__.get("kernel_layer_name")
      if name in ti.LINEAR_ATTENTION_LAYERS:
        found.add(name)
  return found


def tiny_model(cls, fam):
  """cls built as the attention column builds it (coverage_attention's tiny keyword
  arguments), with LINEAR_TINY's sizes where its config has them and
  LINEAR_FAMILY_TINY[family]."""
  import torch

  config_class = fam.config_class or cls.config_class
  kwargs = coverage_attention._tiny_kwargs(config_class, fam.name)
  names = set(config_class().to_dict()) if fam.name not in LINEAR_FAMILY_TINY else set()
  kwargs.update({k: v for k, v in LINEAR_TINY.items() if k in names or k in kwargs})
  for key, value in LINEAR_FAMILY_TINY.get(fam.name, {}).items():
    if isinstance(value, dict) and isinstance(kwargs.get(key), dict):
      kwargs[key] = {**kwargs[key], **value}
    else:
      kwargs[key] = value
  config = config_class(**kwargs, full_attention_interval=2)
  torch.manual_seed(0)
  return cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def _org() -> str:
  import build

  return build.load_manifest()["collection"]["hub-org"]


def linear_attention_cell(kernels, fam) -> str:
  """The linear-attention column (module docstring)."""
  import torch

  names = hub_names(fam)
  broken = [f"{name} does not import ({error})" for name, error in fam.import_errors.items()
            if any(f'"{hub}"' in Path(importlib.util.find_spec(name).origin).read_text()
                   for hub in ti.LINEAR_ATTENTION_LAYERS)]
  if broken:
    return "refused: " + "; ".join(broken)
  if not names:
    return "not applicable"
  classes = [c for suffix in ("ForCausalLM", "ForConditionalGeneration")
             for c in fam.model_classes(lambda c, s=suffix: c.__name__.endswith(s))
             if hasattr(c, "config_class") and hasattr(c, "_from_config")]
  if not classes:
    return f"not applicable (calls {sorted(names)}, but no generative class to run)"
  cls = classes[0]
  try:
    model = tiny_model(cls, fam)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, coverage_attention.ATTENTION_TINY["vocab_size"], (2, 12),
                        generator=gen)
    with torch.no_grad():
      want = model(input_ids=ids).logits
  except Exception as e:  # noqa: BLE001  (reported in the cell)
    return f"not built: {cls.__name__}: {type(e).__name__}: {str(e)[:200]}"
  try:
    want_tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    generate_broken = None
  except Exception as e:  # noqa: BLE001  (the family's own generate: judged without it)
    want_tokens = None
    generate_broken = f"{cls.__name__} generate: {type(e).__name__}: {str(e)[:120]}"
  org = _org()
  loaded = [kernels[name] for name in _REPOS]
  with ti.kernel_mapping_scope():
    try:
      ti.kernelize_linear_attention(model, org)
    except ValueError as e:
      return f"not applicable ({cls.__name__} built small: {e})"
    calls = {name for _, name, _ in ti.linear_attention_calls(model)}
    try:
      with torch.no_grad(), ti.RecordKernelOps(loaded) as prefill:
        got = model(input_ids=ids).logits
      with ti.RecordKernelOps(loaded) as decode:
        if generate_broken is None:
          got_tokens = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)
    except NotImplementedError as e:
      return f"refused: {cls.__name__}: {e}"
    except Exception as e:  # noqa: BLE001
      return f"crash: {cls.__name__}: {type(e).__name__}: {str(e)[:300]}"
  error = float((got.double() - want.double()).abs().max() / want.double().abs().max())
  if error > LINEAR_ATTENTION_BOUND:
    return f"differs: {cls.__name__} logits off by {error:.2e} of max |stock|"
  if generate_broken is None and not torch.equal(got_tokens, want_tokens):
    return f"differs: {cls.__name__} cached greedy generate's tokens"
  unreached = sorted(name for name in calls
                     if PREFILL_OPS.get(name, "") not in prefill.called
                     and DECODE_OPS.get(name, "") not in decode.called)
  note = f" ({', '.join(unreached)} not called by the tiny model)" if unreached else ""
  if generate_broken is not None:
    return (f"eager broken: {generate_broken}; kernel matches its logits "
            f"({', '.join(sorted(calls))})" + note + fam.borrowed())
  return f"matches ({', '.join(sorted(calls))})" + note + fam.borrowed()
