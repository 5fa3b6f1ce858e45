"""The attention column of the coverage table (scripts/coverage.py): a cell is a function
(kernels, family) -> str, "matches", "refused: <reason>" or "not applicable" (anything
else names what went wrong before the kernel could be judged).

attention: the family's first *ForCausalLM class (a config-only family: the borrowed
  family's, see coverage.Family) built small from its config class (tiny_config:
  ATTENTION_TINY where the config has the attribute: 2 layers, 4 query / 2 KV heads of
  16, vocab 128, weights std 0.2, a sliding window of 8 and an attention chunk of 6 where
  the config has them; MLA_TINY for latent attention; per-layer lists cut to 2 layers
  that keep an attention layer; sub-configs likewise; FAMILY_TINY where a family's
  default does not build small; "not built: ..." when that fails), float32, on a
  left-padded batch [2, 12] (3 padding tokens): flash-attention-tpu (registered with its
  mask function) against Transformers' "eager", logits at the valid positions within
  rtol = atol = 1e-4 of max |eager| (the bound of tests/torch/test_flash_attention_models.py).
  A family whose modeling code has no attention through the AttentionInterface, or whose
  attention never reached the kernel (its calls are counted), is "not applicable".
  NotImplementedError (from the kernel or its mask function) is a refusal with the
  kernel's reason; any other error is reported as "crash: ...".
"""

from __future__ import annotations

ATTENTION_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                      attention_dropout=0.0, sliding_window=8, attention_chunk_size=6,
                      num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, n_group=1, topk_group=1, n_shared_experts=1,
                      tie_word_embeddings=False,
                      # encoder-decoder and GPT-2-style names of the same sizes
                      d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                      n_layer=2, n_head=4, n_embd=64, n_positions=128,
                      # partial rotary (GPT-J, CodeGen): within the head_dim
                      rotary_dim=8,
                      # hybrid layouts given by period / indices / block pattern: the
                      # attention layer within the first two (Jamba, Zamba, Bamba,
                      # RecurrentGemma)
                      attn_layer_period=2, attn_layer_offset=1, attn_layer_indices=[1],
                      block_types=["recurrent", "attention"],
                      # Gemma 3n / 4: per-layer inputs and KV sharing sized for 2 layers
                      num_kv_shared_layers=0, vocab_size_per_layer_input=128,
                      hidden_size_per_layer_input=16,
                      # sparse-attention indexers (Kolibri, DSA): 2 heads of 16
                      index_num_heads=2, index_n_heads=2, index_head_dim=16,
                      # BLT's hashed byte-group embeddings and its local models' view of
                      # the global one
                      encoder_hash_byte_group_vocab=128, hidden_size_global=64)
# Multi-head latent attention (configs with kv_lora_rank: DeepSeek-V2/V3 and their kin):
# its keys have as many heads as the queries, head_dim is the rope part, and query / key
# head_dim 24 (16 + 8) against value head_dim 16 exercises the kernel's padding; the
# indexers (DSA) as ATTENTION_TINY says.
MLA_TINY = dict(num_key_value_heads=4, qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8,
                qk_head_dim=24, v_head_dim=16, kv_lora_rank=16, q_lora_rank=32)
# Families whose default config does not build small by the rules above, or not at all
# (merged into the tiny keyword arguments, dicts into dicts; also used to build the
# default where the family's own default config does not validate):
#   granitemoehybrid  its per-layer kinds name no attention layer (the default is all
#                     Mamba; any kind but "linear_attention" is attention)
#   lfm2_moe          its layer kinds are unset ("conv" or attention)
#   qwen4_exp         its attention layers all need the QSA indexer the default leaves unset
#   dory              layers split into input / looped / output blocks: one each
#   cohere_compass    rope parameters per layer kind, which the default does not give
#   dbrx              the attention reads attn_config.rope_theta, which the default lacks,
#                     and clamps q/k/v to attn_config.clip_qkv, which it leaves None
#   zaya              top-1 routing only
#   musicgen(_melody) one codebook, so that input_ids are [batch, tokens]
#   gemma4_assistant  its default text config has per-layer inputs, which it refuses
FAMILY_TINY = {
    "granitemoehybrid": dict(layer_types=["linear_attention", "attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"]),
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16,
                      indexer_budget=8, indexer_compress_ratio=4),
    "dory": dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1,
                 layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "cohere_compass": dict(
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    "dbrx": dict(attn_config=dict(rope_theta=10000.0, kv_n_heads=2, clip_qkv=8.0)),
    "zaya": dict(num_experts_per_tok=1),
    "musicgen": dict(num_codebooks=1),
    "musicgen_melody": dict(num_codebooks=1),
    "gemma4_assistant": dict(text_config=dict(model_type="gemma4_text",
                                              hidden_size_per_layer_input=0,
                                              vocab_size_per_layer_input=0)),
}
ATTENTION_TOLERANCE = dict(rtol=1e-4, atol=1e-4)
MAX_PARAMETERS = 50_000_000   # a tiny model has ~0.1M; far more means the shrink missed a size
COVERAGE_ATTENTION = "tpu_attention_coverage"   # registered with a call counter
_PAD, _SEQ = 3, 12


def _register_counting_attention(kernel) -> list:
  """Registers kernel.attention_forward (behind a call counter) and its mask function as
  COVERAGE_ATTENTION; returns the counter (a list the calls append to)."""
  from transformers import AttentionInterface, AttentionMaskInterface

  calls = []

  def counting_attention(*args, **kwargs):
    calls.append(1)
    return kernel.attention_forward(*args, **kwargs)

  AttentionInterface.register(COVERAGE_ATTENTION, counting_attention)
  AttentionMaskInterface.register(COVERAGE_ATTENTION, kernel.make_attention_mask)
  return calls


def _is_attention_layer(kind) -> bool:
  """Whether a per-layer kind names an attention layer ("full_attention",
  "sliding_attention", "attention", Zamba's "hybrid"), not a linear-attention, SSM or
  convolution one."""
  return isinstance(kind, str) and (kind in ("attention", "hybrid") or (
      kind.endswith("attention") and "linear" not in kind))


def _two_layers(defaults: dict) -> dict:
  """The per-layer lists of a config (its lists as long as its default num_hidden_layers),
  cut to 2 layers: the full model's first attention layer and, before it, its first layer
  of another kind (a hybrid keeps both kinds), else its first two layers."""
  layers = defaults.get("num_hidden_layers")
  if not isinstance(layers, int) or layers <= 2:
    return {}
  lists = {k: v for k, v in defaults.items() if isinstance(v, list) and len(v) == layers}
  picked = [0, 1]
  for values in lists.values():
    attention = [i for i, kind in enumerate(values) if _is_attention_layer(kind)]
    if attention:
      other = [i for i, kind in enumerate(values) if not _is_attention_layer(kind)]
      picked = sorted({attention[0], other[0] if other else (attention + [1])[1]})
      break
  return {k: [v[i] for i in picked] for k, v in lists.items()}


# Sizes that 0 (or None) switches off in some families' defaults (Gemma 4's assistant has
# no per-layer input): set only where the default sets them.
_ONLY_WHERE_SET = {"hidden_size_per_layer_input", "vocab_size_per_layer_input"}


def _tiny_kwargs(config_class, family: str = "") -> dict:
  """The keyword arguments tiny_config builds config_class with (sub-configs as dicts of
  their own)."""
  family_kwargs = FAMILY_TINY.get(family, {})
  try:
    defaults = config_class().to_dict()
  except Exception:  # noqa: BLE001  (a default that does not validate: FAMILY_TINY mends it)
    if not family_kwargs:
      raise
    defaults = config_class(**family_kwargs).to_dict()
  names = set(defaults) | set(getattr(config_class, "attribute_map", {}))
  kwargs = {k: v for k, v in ATTENTION_TINY.items()
            if k in names and (k not in _ONLY_WHERE_SET or defaults.get(k))}
  if "kv_lora_rank" in defaults:
    kwargs.update({k: v for k, v in MLA_TINY.items() if k in names})
  kwargs.update(_two_layers(defaults))
  # Composite configs (a vision or audio tower beside the text model): each part small
  # (an AutoConfig part by its default's model_type).
  from transformers import AutoConfig
  from transformers.models.auto.configuration_auto import CONFIG_MAPPING

  for key, sub_class in (getattr(config_class, "sub_configs", None) or {}).items():
    sub_defaults = defaults.get(key)
    if not isinstance(sub_class, type) or not isinstance(sub_defaults, dict):
      continue
    if sub_class is AutoConfig:
      model_type = sub_defaults.get("model_type")
      if model_type not in CONFIG_MAPPING:
        continue
      kwargs[key] = dict(_tiny_kwargs(CONFIG_MAPPING[model_type]), model_type=model_type)
    else:
      kwargs[key] = _tiny_kwargs(sub_class)
  for key, value in family_kwargs.items():
    if isinstance(value, dict) and isinstance(kwargs.get(key), dict):
      kwargs[key] = {**kwargs[key], **value}
    else:
      kwargs[key] = value
  return kwargs


def tiny_config(config_class, family: str = ""):
  """config_class's config shrunk for the attention column: ATTENTION_TINY (and MLA_TINY
  for latent attention) where it has the attribute (or an alias of it), its per-layer
  lists cut to 2 layers, its sub-configs likewise, then FAMILY_TINY[family]."""
  # Hybrid models (Qwen3.5, Qwen3-Next): one linear and one full attention layer of two.
  return config_class(**_tiny_kwargs(config_class, family), full_attention_interval=2)


def tiny_causal_lm(cls: type, family: str = "", config_class: type | None = None):
  """cls built small in float32 from config_class (default its own; tiny_config), eager
  attention."""
  import torch

  config = tiny_config(config_class or cls.config_class, family)
  with torch.device("meta"):    # sizes first: a size the shrink missed costs nothing here
    parameters = sum(p.numel() for p in cls._from_config(config).parameters())
  if parameters > MAX_PARAMETERS:
    raise ValueError(f"{parameters:,} parameters after shrinking (a size under a name "
                     f"ATTENTION_TINY does not know)")
  torch.manual_seed(0)
  return cls._from_config(config, attn_implementation="eager", dtype=torch.float32).eval()


def attention_cell(kernels, fam) -> str:
  """The attention column (module docstring)."""
  import torch

  classes = [c for c in fam.model_classes(lambda c: c.__name__.endswith("ForCausalLM"))
             if hasattr(c, "config_class") and hasattr(c, "_from_config")]
  if not classes:
    return "not applicable"
  cls = classes[0]
  if not (fam.borrows or fam).mentions("ALL_ATTENTION_FUNCTIONS"):
    return (f"not applicable ({fam.name}'s modeling code has no attention of its own "
            f"through the AttentionInterface)")
  try:
    model = tiny_causal_lm(cls, fam.name, fam.config_class)
  except Exception as e:  # noqa: BLE001  (reported in the cell)
    return f"not built: {cls.__name__}: {type(e).__name__}: {str(e)[:200]}"
  if hasattr(model, "set_default_language"):     # X-MOD: a language adapter per input
    model.set_default_language(model.config.languages[0])
  calls = _register_counting_attention(kernels["flash-attention-tpu"])
  gen = torch.Generator().manual_seed(1)
  ids = torch.randint(3, ATTENTION_TINY["vocab_size"], (2, _SEQ), generator=gen)
  mask = torch.ones(2, _SEQ, dtype=torch.long)
  mask[1, :_PAD], ids[1, :_PAD] = 0, 0
  valid = mask.bool()
  inputs, note = dict(input_ids=ids, attention_mask=mask), ""
  try:
    with torch.no_grad():
      want = model(**inputs).logits
  except Exception as e:  # noqa: BLE001
    # A family whose default cache fails (BLT's cache reads a num_hidden_layers its
    # config lacks) is compared without one: a prefill has nothing to read from it.
    try:
      with torch.no_grad():
        want = model(**inputs, use_cache=False).logits
    except Exception:  # noqa: BLE001
      return f"not built: {cls.__name__} eager: {type(e).__name__}: {str(e)[:200]}"
    inputs["use_cache"] = False
    note = f" (use_cache=False: with its cache, eager raises {type(e).__name__}: {str(e)[:100]})"
  try:
    model.set_attn_implementation(COVERAGE_ATTENTION)
  except Exception as e:  # noqa: BLE001  (the model takes no registered attention)
    return f"not applicable ({cls.__name__}: {str(e)[:120]})"
  try:
    with torch.no_grad():
      got = model(**inputs).logits
  except NotImplementedError as e:
    return f"refused: {e}"
  except Exception as e:  # noqa: BLE001
    return f"crash: {cls.__name__}: {type(e).__name__}: {str(e)[:300]}"
  if not calls:
    return f"not applicable ({cls.__name__}'s attention does not go through the interface)"
  if got.shape != want.shape:
    return f"differs: {cls.__name__} logits {tuple(got.shape)}, eager's {tuple(want.shape)}"
  if tuple(want.shape[:2]) == tuple(valid.shape):
    want, got = want[valid].double(), got[valid].double()
  else:   # not one logit row per input token (CSM's depth decoder): the unpadded row whole
    want, got = want[0].double(), got[0].double()
    note += f" (logits {tuple(want.shape)} not per input token: the unpadded row compared)"
  bound = (ATTENTION_TOLERANCE["atol"] * want.abs().max()
           + ATTENTION_TOLERANCE["rtol"] * want.abs())
  if not bool(((got - want).abs() <= bound).all()):
    error = float((got - want).abs().max() / want.abs().max())
    return f"differs: {cls.__name__} logits off by {error:.2e} of max |eager|"
  return "matches" + note + fam.borrowed()
