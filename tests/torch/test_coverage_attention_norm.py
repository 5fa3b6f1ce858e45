"""The attention and norm columns of `python scripts/coverage.py` (scripts/
coverage_attention_norm.py) on a fast subset of families, one per kind of cell (the whole
table is the script's thorough mode):

  llama            attention matches, norm matches
  llama4           attention matches (chunked attention layers), norm not applicable
  qwen3_5          attention matches (hybrid: one linear, one full layer), norm matches
                   (the zero-centred (1 + w) norm)
  doge             attention refused: it asks for its causal mask materialized
  bigbird_pegasus  attention refused: its family declares neither SDPA nor FlashAttention
                   (its decoder self-attention is not marked causal: the kernel would see
                   the future; before this refusal the cell read "differs", logits 0.73 off)
  falcon           attention not applicable: not through Transformers' AttentionInterface
  phimoe           attention matches: its sliding window comes from the mask (the layers
                   pass none; before, the cell read "differs", logits 0.9 off)

The cells judge the kernel against Transformers' eager attention and each norm class's
own forward (tolerances in the module's docstring).
"""

import importlib.util
import sys
from pathlib import Path

import pytest

import coverage_attention_norm as columns

ROOT = Path(__file__).resolve().parents[2]
# Loaded by path under its own name: `coverage` is also the name of a PyPI package.
if "transformers_coverage" not in sys.modules:
  _spec = importlib.util.spec_from_file_location("transformers_coverage",
                                                 ROOT / "scripts" / "coverage.py")
  sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(sys.modules[_spec.name])
coverage = sys.modules["transformers_coverage"]

EXPECTED = {
    "llama": ("matches", "matches"),
    "llama4": ("matches", "not applicable"),
    "qwen3_5": ("matches", "matches"),
    "doge": ("refused: flash-attention-tpu: the model asks for its causal mask materialized",
             "matches"),
    "bigbird_pegasus": ("refused: attention_forward: BigBirdPegasusDecoderAttention's family",
                        "not applicable"),
    "falcon": ("not applicable (FalconForCausalLM's attention does not go through",
               "not applicable"),
    "phimoe": ("matches", "not applicable"),
}


def test_columns_are_registered():
  assert coverage.COLUMNS["attention"] is columns.attention_cell
  assert coverage.COLUMNS["norm"] is columns.norm_cell


@pytest.mark.parametrize("family", list(EXPECTED))
def test_cells(flash, rms, family):
  fam = coverage.family(family)
  kernels = {"flash-attention-tpu": flash, "rms-norm-tpu": rms}
  attention, norm = EXPECTED[family]
  assert columns.attention_cell(kernels, fam).startswith(attention)
  assert columns.norm_cell(kernels, fam).startswith(norm)
