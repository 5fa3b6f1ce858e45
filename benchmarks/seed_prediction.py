"""The seed's headline (21.5x faster Qwen3-30B-A3B decode at batch 64 on v6e-8 against
Transformers' default experts implementation) as a prediction: static estimates, not
measurements.

What Transformers 5.25.0 runs by default (read from the installed package):
  * `PreTrainedModel.get_correct_experts_implementation` (modeling_utils.py:1893-1915)
    picks "grouped_mm" when none is requested; it falls back to eager only if the model
    class lacks `@use_experts_implementation` (`_grouped_mm_can_dispatch`, :1674;
    Qwen3MoeExperts has it: models/qwen3_moe/modeling_qwen3_moe.py:210).
  * `grouped_mm_experts_forward` (integrations/moe.py:424-537): sort the T*K (token,
    expert) pairs, gather the token rows, histc + cumsum offsets, `_grouped_linear` with
    `weight.transpose(-2, -1)` (Qwen3 stores gate_up (E, 2I, H), down (E, H, I)), gate,
    routing weights, unsort, sum over K.
  * On a "tpu" tensor `_can_use_grouped_mm` returns True whenever torch has
    `nn.functional.grouped_mm` (moe.py:318-319; torch 2.13 has it), so the call is
    `torch.nn.functional.grouped_mm`, which TorchTPU 0.2.0 lowers itself
    (`AtenGroupedMm` / `BuildGroupedMmShlo` in csrc/ops/grouped_mm/grouped_mm_aten_kernels.cc;
    the same library carries `chlo::RaggedDot`): here it is written as XLA's
    `jax.lax.ragged_dot`, which XLA compiles for TPU to its own "ragged-dot" Mosaic custom call.
  * Expert parallelism: `base_model_ep_plan` (configuration_qwen3_moe.py:66) marks the
    experts "ep_dispatch_experts"; at inference with ep_size == tp_size the default
    `AutoEP` takes `AllReduceEP` (distributed/expert_parallel.py:262-323): every rank runs
    its own E/ep experts on the whole batch, routes to other ranks' experts get the local
    placeholder id E/ep and weight 0, and an all-reduce sums the outputs.

The per-chip program (one decoder layer, one v6e chip, its share of a v6e-8 step) is
cases/seed.py's `Layer` (its docstring: the batch, the expert-parallel and head split, what
is not rated).

Both programs share everything but the experts (rms_norm kernels, XLA projections with
Qwen3's q/k norms and RoPE, our paged attention kernel, the XLA router), so the layer ratio
isolates the experts:
  (a) ours:    `moe.moe_experts` (route, gated grouped-matmul kernel, grouped-matmul kernel,
               combine) on the 16 local experts, placeholders past the groups;
  (b) default: `grouped_mm_experts` below, Transformers' grouped_mm forward written in JAX,
               each grouped_mm a `jax.lax.ragged_dot` on the transposed weights
               ("as written": XLA materialises the transpose, a copy of every local
               expert's weights per call, which is what the compiled HLO shows) and, as
               a lower bound for it, on weights already stored (E, in, out) ("no copy").

Rating (rating/seed_prediction.py): each part in its own child process, time = max(static
cycles / clock, HBM bytes / bandwidth), parts summed (rating/experts_layer.py's method, whose
functions are imported):
  * our kernels: rms_norm by the static estimate of the compiled kernel; paged attention by
    `rating/paged_attention.estimate`; the experts layer by `experts_layer.rate_part` on
    an ExpertsLayer of 64 tokens x top-8 over the 16 local experts (every routed row local,
    32 per expert: the same op shapes as the real call, which has ~64 local rows and ~448
    placeholder rows; the kernels' extra rows cost MXU time only, and the placeholder tiles'
    zero visits are not counted);
  * XLA glue (projections, router, the default's sort / gather / gate / combine): static
    estimate of the compiled XLA ops, bytes from cost_analysis (`xla_cost.glue_part`);
  * XLA's ragged_dot: the static estimator crashes on it (as noted in docs/performance.md),
    so the two grouped_mm calls are rated by XLA's cost_analysis (optimal_seconds, bytes
    accessed), as the existing XLA baselines are: a lower bound for XLA.

    python benchmarks/seed_prediction.py            # rate every part (v6e), write the results
    python benchmarks/seed_prediction.py --table    # the docs' table from the results file
(reports/tables.py's `seed_table` and `seed_parts_table`).
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import dataclasses  # noqa: E402
import json  # noqa: E402

from benchmarks.cases.seed import QWEN3, SEED_SPEEDUP  # noqa: E402
from benchmarks.rating import seed_prediction as S  # noqa: E402
from benchmarks.reports import tables  # noqa: E402

RESULTS = S.RESULTS_FILE


def main(argv) -> int:
  if argv[:1] == ["--table"]:
    results = json.loads(RESULTS.read_text())
    print(tables.seed_table(results) + "\n\n" + tables.seed_parts_table(results))
    return 0
  chips_ = [a for a in argv if a in ("v5e", "v6e")] or ["v6e"]
  only = [a for a in argv if a not in ("v5e", "v6e")]
  results = json.loads(RESULTS.read_text()) if RESULTS.exists() else dict(chips={})
  results["layer"] = dataclasses.asdict(QWEN3)
  for chip in chips_:
    rated = S.rate_all(QWEN3, chip, only)
    for group, ps in rated.items():
      results["chips"].setdefault(chip, {}).setdefault(group, {}).update(ps)
  results["summary"] = S.summary(results)
  results["seed_speedup"] = SEED_SPEEDUP   # the claims the prediction is set against
  RESULTS.write_text(json.dumps(results, indent=1, default=float) + "\n")
  print(tables.seed_table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
