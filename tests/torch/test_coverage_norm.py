"""The norm column of `python scripts/coverage.py` (scripts/coverage_norm.py) on a fast
subset of families, one per kind of cell (the whole table is the script's thorough mode):

  llama       matches (decorated "RMSNorm": weight * norm(x))
  qwen3_5     matches (decorated "RMSNormZeroCentered": (1 + w) * norm(x))
  gpt_oss     matches (its norm lost the decorator in 5.24: reached by class)
  gemma       matches (never decorated: (1 + w) * norm(x), reached by class)
  muse_spark  refused: MuseSparkTextInputScaledRMSNorm (it scales before it normalises)
  bert        not applicable (LayerNorm, no RMSNorm)

Each cell judges the norm classes' own forward against rms-norm-tpu's layer (tolerances in
the module's docstring).
"""

import pytest

import coverage_norm
from coverage_walk import coverage

EXPECTED = {
    "llama": "matches",
    "qwen3_5": "matches",
    "gpt_oss": "matches",
    "gemma": "matches",
    "muse_spark": "refused: MuseSparkTextInputScaledRMSNorm (float32 x, float32 weight): "
                  "rms-norm-tpu layers.GemmaRMSNorm: MuseSparkTextInputScaledRMSNorm's own "
                  "forward is not (1 + weight) * x",
    "bert": "not applicable",
}


def test_column_is_registered():
  assert coverage.COLUMNS["norm"] is coverage_norm.norm_cell


@pytest.mark.parametrize("family", list(EXPECTED))
def test_cells(rms, family):
  cell = coverage_norm.norm_cell({"rms-norm-tpu": rms}, coverage.family(family))
  assert cell.startswith(EXPECTED[family]), cell
  if family == "muse_spark":   # its other norm classes match: one refusal in the cell
    assert cell.count("refused") == 1 and cell.count("MuseSpark") == 2, cell
