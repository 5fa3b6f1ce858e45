"""The grouped matmul beyond the headline: other MoE models' expert shapes, which
benchmarks/ragged_survey.py rates (ours and XLA's, `rating/ragged_dot.py`) and the
grouped-matmul tuner tunes (tuning/ragged_dot.py). Not a family of all_cases() (no CASES):
the survey writes its own results file.
"""

from __future__ import annotations

from benchmarks.cases.headline import GroupedMatmul

# (experts, hidden, one expert's intermediate size), from each model's config.json.
MODELS = {
    "qwen3-30b-a3b": (128, 2048, 768),
    "qwen3-235b-a22b": (128, 4096, 1536),
    "mixtral-8x7b": (8, 4096, 14336),
    "deepseek-v3": (256, 7168, 2048),
    "olmoe-1b-7b": (64, 2048, 1024),
}
PARTS = ("gate_up", "down")


def case(model: str, m: int, part: str) -> GroupedMatmul:
  """One projection of `model`'s experts at m rows, as a grouped-matmul case (bf16)."""
  groups, hidden, width = MODELS[model]
  return GroupedMatmul(m, "gate_up+silu" if part == "gate_up" else "down", groups=groups,
                       hidden=hidden, width=width, model=model)
