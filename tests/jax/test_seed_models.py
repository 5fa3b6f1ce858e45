"""The seed models' inventory (benchmarks/cases/seed_models.py) and its table: the token
counts are the pipelines' arithmetic, a call shared with another family is that family's
very case (one rating), every name is one case, and the docs' table is the module's."""

import pytest

from benchmarks import RESULTS, ROOT, read_rows
from benchmarks.cases import all_cases
from benchmarks.cases.seed_models import SEED_MODELS, TEXT_TOKENS
from benchmarks.reports import tables


def _call(model_prefix, call_prefix):
  [c] = [c for c in SEED_MODELS if c.model.startswith(model_prefix)
         and c.call.startswith(call_prefix)]
  return c


def test_token_counts_are_the_pipelines_arithmetic():
  # SD3.5-medium at 1024 px: VAE 8, patch 2 -> 64 x 64 image tokens; CLIP 77 + T5 256 text;
  # classifier-free guidance batches the two passes.
  sd = _call("SD3.5", "joint attention").case
  assert (sd.seq, sd.batch, sd.heads, sd.head_dim) == ((1024 // 8 // 2) ** 2 + 77 + 256, 2, 24, 64)
  # MiniMax-H3: 124 frames -> (124 - 5) // 17 * 5 + 2 = 37 latent frames of 768 / 16 / 2 x
  # 1344 / 16 / 2 patches; audio 2 channels x round(124 / 24 * 40) latents.
  frames = (124 - 5) // 17 * 5 + 2
  video = frames * (768 // 16 // 2) * (1344 // 16 // 2)
  audio = 2 * round(124 / 24 * 40)
  mm = _call("MiniMax", "joint attention").case
  assert (frames, video, audio) == (37, 37296, 414)
  assert (mm.seq, mm.heads, mm.head_dim) == (TEXT_TOKENS + audio + video, 56, 128)
  qi = _call("Qwen-Image 1024", "joint attention").case
  assert qi.seq == (1024 // 8 // 2) ** 2 + TEXT_TOKENS


def test_layer_counts_and_shared_cases():
  counts = {(c.model, c.call): c.per_forward for c in SEED_MODELS}
  assert counts[("Qwen3.5-9B", "gated delta rule, decode")] == 24
  assert counts[("Qwen3.5-9B", "full attention, decode")] == 8
  assert counts[("Qwen3.5-9B", "RMSNorm (1 + w), decode")] == 2 * 32 + 1
  family = {c.name: c for c in all_cases()}
  for c in SEED_MODELS:
    if c.case is None:
      assert c.why, c
    elif c.case.name in family:   # rated by its family: the same case, not a look-alike
      assert family[c.case.name] == c.case
  by_name = {}
  for c in SEED_MODELS:   # one name, one case: a table row is found by its case's name
    if c.case is not None:
      assert by_name.setdefault(c.case.name, c.case) == c.case, c.case.name


def test_gated_norm_calls_are_one_row_per_value_head():
  """Qwen3.5-9B's Gated DeltaNet normalises each value head's output: 32 value heads of
  head_dim 128 (Qwen3_5TextConfig's linear_num_value_heads / linear_value_head_dim) per
  token, so tokens x 32 rows of 128, once per Gated DeltaNet layer (24)."""
  transformers = pytest.importorskip("transformers")   # leg 1 has it, leg 2 (JAX only) not
  cfg = transformers.Qwen3_5TextConfig()
  for when, tokens in (("prefill 4096", 4096), ("decode", 64)):
    call = _call("Qwen3.5-9B", f"gated RMSNorm, {when}")
    assert (call.case.rows, call.case.hidden) == (
        tokens * cfg.linear_num_value_heads, cfg.linear_value_head_dim)
    assert call.per_forward == cfg.layer_types.count("linear_attention") == 24
    assert call.case.min_bytes() == (3 * call.case.rows * 128 + 128) * 2


def test_table_is_made_from_the_results():
  table = tables.seed_models_table(read_rows(RESULTS / "estimates.jsonl"))
  docs = (ROOT / "docs" / "performance" / "seed-models.md").read_text()
  assert table in docs, "docs/performance/seed-models.md's table is not the module's"
  assert "behind by 1.25x jax flash_attention" in table   # SD3.5 on v6e: issue 60's miss
  assert len(table.splitlines()) >= 2 + len(SEED_MODELS)   # every call has a row
