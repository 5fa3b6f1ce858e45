"""The norm column of `python scripts/coverage.py` (scripts/coverage_norm.py) on a fast
subset of families, one per kind of cell (the whole table is the script's thorough mode):

  llama    matches (the plain weight * norm(x))
  qwen3_5  matches (the zero-centred (1 + w) norm)
  doge     matches
  llama4   not applicable (its norm classes carry no hub decorator)

Each cell judges the norm class's own forward against rms-norm-tpu's layer (tolerances in
the module's docstring).
"""

import pytest

import coverage_norm
from coverage_walk import coverage

EXPECTED = {
    "llama": "matches",
    "qwen3_5": "matches",
    "doge": "matches",
    "llama4": "not applicable",
}


def test_column_is_registered():
  assert coverage.COLUMNS["norm"] is coverage_norm.norm_cell


@pytest.mark.parametrize("family", list(EXPECTED))
def test_cells(rms, family):
  assert coverage_norm.norm_cell({"rms-norm-tpu": rms}, coverage.family(family)).startswith(
      EXPECTED[family])
