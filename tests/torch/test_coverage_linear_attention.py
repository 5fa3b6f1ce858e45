"""The linear-attention column of `python scripts/coverage.py`
(scripts/coverage_linear_attention.py) on a fast subset of families, one per kind of cell
(the whole column is the script's: 25 families in Transformers 5.25):

  qwen3_5   matches (every hub name: the gated delta rule, the convs, the gated norm)
  inkling2  eager broken (its own generate fails on the tiny model: judged on its logits)
  llama     not applicable (no linear attention)

Each cell runs the family's tiny causal LM stock and on the kernels (logits within 1e-4,
cached greedy generate's tokens); the bounds are in the module's docstring.
"""

import pytest

import coverage_linear_attention as cla
from coverage_walk import coverage

EXPECTED = {
    "qwen3_5": "matches (RMSNormGated, causal_conv1d_fn, causal_conv1d_forward, "
               "causal_conv1d_update, chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)",
    "inkling2": "eager broken: Inkling2ForCausalLM generate: IndexError",
    "llama": "not applicable",
}


def test_column_is_registered():
  assert coverage.COLUMNS["linear_attention"] is cla.linear_attention_cell


def test_hub_names_are_found_by_code():
  assert cla.hub_names(coverage.family("qwen3_5")) == set(cla.ti.LINEAR_ATTENTION_LAYERS)
  assert cla.hub_names(coverage.family("mamba2")) == {
      "causal_conv1d_fn", "causal_conv1d_update", "causal_conv1d_forward"}
  assert cla.hub_names(coverage.family("llama")) == set()


@pytest.mark.parametrize("family", list(EXPECTED))
def test_cells(rms, gdn, conv, family):
  kernels = {"rms-norm-tpu": rms, "gated-delta-rule-tpu": gdn, "causal-conv1d-tpu": conv}
  cell = cla.linear_attention_cell(kernels, coverage.family(family))
  assert cell.startswith(EXPECTED[family]), cell
