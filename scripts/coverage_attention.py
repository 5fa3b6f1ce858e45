"""The attention column of the coverage table (scripts/coverage.py): a cell is a function
(kernels, family) -> str, "matches", "refused: <reason>" or "not applicable" (anything
else names what went wrong before the kernel could be judged).

attention: the family's first *ForCausalLM class built small from its own config class
  (ATTENTION_TINY where the config has the attribute: 2 layers, 4 query / 2 KV heads of
  16, vocab 128, weights std 0.2, a sliding window of 8 and an attention chunk of 6 where
  the config has them; "not built: ..." when that fails), float32, on a left-padded batch [2, 12] (3 padding tokens):
  flash-attention-tpu (registered with its mask function) against Transformers' "eager",
  logits at the valid positions within rtol = atol = 1e-4 of max |eager| (the bound of
  tests/torch/test_flash_attention_models.py). The kernel's calls are counted: a model
  whose attention never reached it is "not applicable". NotImplementedError (from the
  kernel or its mask function) is a refusal with the kernel's reason; any other error is
  reported as "crash: ...".
"""

from __future__ import annotations

ATTENTION_TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=128, pad_token_id=0,
                      bos_token_id=1, eos_token_id=2, initializer_range=0.2,
                      attention_dropout=0.0, sliding_window=8, attention_chunk_size=6,
                      num_local_experts=4, num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, tie_word_embeddings=False,
                      # encoder-decoder and GPT-2-style names of the same sizes
                      d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
                      n_layer=2, n_head=4, n_embd=64, n_positions=128)
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


def tiny_causal_lm(cls: type):
  """cls built small in float32 from its config class (ATTENTION_TINY), eager attention."""
  import torch

  config_class = cls.config_class
  defaults = config_class().to_dict()
  kwargs = {k: v for k, v in ATTENTION_TINY.items() if k in defaults}
  # Hybrid models (Qwen3.5, Qwen3-Next): one linear and one full attention layer of two.
  kwargs["full_attention_interval"] = 2
  config = config_class(**kwargs)
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

  classes = [c for c in fam.classes(lambda c: c.__name__.endswith("ForCausalLM"))
             if hasattr(c, "config_class") and hasattr(c, "_from_config")]
  if not classes:
    return "not applicable"
  cls = classes[0]
  try:
    model = tiny_causal_lm(cls)
  except Exception as e:  # noqa: BLE001  (reported in the cell)
    return f"not built: {cls.__name__}: {type(e).__name__}: {str(e)[:200]}"
  calls = _register_counting_attention(kernels["flash-attention-tpu"])
  gen = torch.Generator().manual_seed(1)
  ids = torch.randint(3, ATTENTION_TINY["vocab_size"], (2, _SEQ), generator=gen)
  mask = torch.ones(2, _SEQ, dtype=torch.long)
  mask[1, :_PAD], ids[1, :_PAD] = 0, 0
  valid = mask.bool()
  try:
    with torch.no_grad():
      want = model(input_ids=ids, attention_mask=mask).logits
  except Exception as e:  # noqa: BLE001
    return f"not built: {cls.__name__} eager: {type(e).__name__}: {str(e)[:200]}"
  try:
    model.set_attn_implementation(COVERAGE_ATTENTION)
  except Exception as e:  # noqa: BLE001  (the model takes no registered attention)
    return f"not applicable ({cls.__name__}: {str(e)[:120]})"
  try:
    with torch.no_grad():
      got = model(input_ids=ids, attention_mask=mask).logits
  except NotImplementedError as e:
    return f"refused: {e}"
  except Exception as e:  # noqa: BLE001
    return f"crash: {cls.__name__}: {type(e).__name__}: {str(e)[:300]}"
  if not calls:
    return f"not applicable ({cls.__name__}'s attention does not go through the interface)"
  if tuple(want.shape[:2]) != tuple(valid.shape):
    return f"not built: {cls.__name__}'s logits {tuple(want.shape)} are not per input token"
  want, got = want[valid].double(), got[valid].double()
  bound = (ATTENTION_TOLERANCE["atol"] * want.abs().max()
           + ATTENTION_TOLERANCE["rtol"] * want.abs())
  if not bool(((got - want).abs() <= bound).all()):
    error = float((got - want).abs().max() / want.abs().max())
    return f"differs: {cls.__name__} logits off by {error:.2e} of max |eager|"
  return "matches"
