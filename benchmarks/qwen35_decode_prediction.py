"""Issue 59's prediction: one Qwen3.5-9B decode step at batch 64 on one v6e chip (24 Gated
DeltaNet + 8 attention layers), with this project's kernels against the default torch path
as XLA compiles it. Static estimates, not measurements.

The step (cases/seed.py's `Qwen35DecodeStep`): 64 sequences, one new token each, 2048
cached tokens per sequence for the 8 attention layers, the Gated DeltaNet states
(f32 [32, 128, 128] per sequence and layer) and conv states updated in place, bf16
weights, one chip (no split: it fits).

What differs between the two programs, part by part (rating/qwen35_decode.py):
  * the 65 RMSNorms: our rms_norm kernel (offset 1) | Qwen3_5RMSNorm in f32 (XLA);
  * per Gated DeltaNet layer: `causal_conv1d_update` (our kernel | Transformers'
    `torch_causal_conv1d_update`), the recurrence (our fused_recurrent kernel, the state
    donated | `torch_recurrent_gated_delta_rule`: q / k repeated to 32 heads, f32), the
    gated norm (our rms_norm_gated | Qwen3_5RMSNormGated: f32, the norm rounded to bf16
    before the weight);
  * per attention layer: our paged_attention kernel (pages of 64) | SDPA over the dense
    cache with GQA, as `sdpa_attention_forward` calls it when there is no mask.
The rest is the same XLA program in both (in / out projections, the attention's q / k
norms, RoPE and output gate, the MLPs, lm_head) and is rated once. Not rated, the same in
both: the embedding gather, the new token's KV-cache write, sampling.

A part's time is max(static cycles / clock, HBM bytes / bandwidth); the step's, the sum of
count x time. A part whose kernel the estimator cannot rate (causal_conv1d_update: libtpu
aborts on the kernel's bf16 unpack, the same abort as its row in estimates.md) takes the
default's time on our side too, so the ratio credits no gain we could not rate.

    python benchmarks/qwen35_decode_prediction.py [v5e] [v6e]   # rate (v6e by default), write
    python benchmarks/qwen35_decode_prediction.py --table       # the docs' table
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import dataclasses  # noqa: E402
import json  # noqa: E402

from benchmarks.cases.seed import QWEN3_5_STEP, Qwen35DecodeStep  # noqa: E402
from benchmarks.rating import qwen35_decode as Q  # noqa: E402
from benchmarks.reports import tables  # noqa: E402


def main(argv) -> int:
  if argv[:1] == ["--table"]:
    results = json.loads(Q.RESULTS_FILE.read_text())
    print(tables.qwen35_step_table(results))
    return 0
  chips_ = [a for a in argv if a in ("v5e", "v6e")] or ["v6e"]
  results = (json.loads(Q.RESULTS_FILE.read_text()) if Q.RESULTS_FILE.exists()
             else dict(chips={}))
  results["step"] = dataclasses.asdict(QWEN3_5_STEP)
  for chip in chips_:
    results["chips"][chip] = Q.rate_all(QWEN3_5_STEP, chip)
  step = Qwen35DecodeStep(**results["step"])
  results["summary"] = {chip: Q.step_totals(step, rated)
                        for chip, rated in results["chips"].items()}
  Q.RESULTS_FILE.write_text(json.dumps(results, indent=1, default=float) + "\n")
  print(tables.qwen35_step_table(results))
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
