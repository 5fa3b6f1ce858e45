"""The attention column of `python scripts/coverage.py` (scripts/coverage_attention.py) on
a fast subset of families, one per kind of cell (the whole table is the script's thorough
mode; the norm column's subset is tests/torch/test_coverage_norm.py):

  llama            matches
  llama4           matches (chunked attention layers)
  qwen3_5          matches (hybrid: one linear, one full layer)
  doge             refused: it asks for its causal mask materialized
  bigbird_pegasus  refused: its family declares neither SDPA nor FlashAttention (its
                   decoder self-attention is not marked causal: the kernel would see the
                   future; before this refusal the cell read "differs", logits 0.73 off)
  falcon           refused: it asks for its causal mask materialized (since Transformers
                   5.24 its attention goes through the AttentionInterface, and its model
                   always passes allow_is_causal_skip=False so that ALiBi can be added to
                   the mask; the cell read "not applicable" on 5.23)
  phimoe           matches: its sliding window comes from the mask (the layers pass none;
                   before, the cell read "differs", logits 0.9 off)
  deepseek_v3      matches (multi-head latent attention built small by MLA_TINY: key
                   head_dim 24, value 16; "not built" before)
  exaone           matches, on Llama's classes from its own ExaoneConfig (a config-only
                   family, Transformers 5.24+)
  mamba2           not applicable: no attention of its own through the interface (its
                   default config did not even build small: "not built" before)

The cells judge the kernel against Transformers' eager attention (tolerances in the
module's docstring).
"""

import pytest

import coverage_attention as columns
from coverage_walk import coverage

EXPECTED = {
    "llama": "matches",
    "llama4": "matches",
    "qwen3_5": "matches",
    "doge": "refused: flash-attention-tpu: the model asks for its causal mask materialized",
    "bigbird_pegasus": "refused: attention_forward: BigBirdPegasusDecoderAttention's family",
    "falcon": "refused: flash-attention-tpu: the model asks for its causal mask materialized",
    "phimoe": "matches",
    "deepseek_v3": "matches",
    "exaone": "matches (llama's classes from its own ExaoneConfig)",
    "mamba2": "not applicable (mamba2's modeling code has no attention of its own",
}


def test_column_is_registered():
  assert coverage.COLUMNS["attention"] is columns.attention_cell


@pytest.mark.parametrize("family", list(EXPECTED))
def test_cells(flash, family):
  fam = coverage.family(family)
  assert columns.attention_cell({"flash-attention-tpu": flash}, fam).startswith(EXPECTED[family])
