"""tpu-inference 0.32.0 (vLLM's TPU kernels, `tpu_inference/kernels/`) as a peer, rated by the
same driver as the other Pallas peers (peers/protocol.py: children compiled ahead of time
with libtpu's static profile), each child in `.venv-tpu-inference` (common.py).

    python benchmarks/estimate.py --implementations tpu-inference --out DIR   (these rows alone)

`specs_for(case)` maps a case (by its class) to the specs rated on it:
  * megablox `gmm` (`GmmSpec`, grouped-matmul cases; gmm.py);
  * `flash_attention` (`FlashSpec`, causal attention cases; attention.py);
  * ragged paged attention v3 (`RpaV3Spec`, paged decode cases and the decode-only serving
    batches; attention.py); the other serving batches say why not (`not_rated_why`);
  * fused_moe v1 (`FusedMoeSpec`, experts-layer cases; fused_moe.py);
  * gdn v3, conv + Gated DeltaNet fused (`GdnV3Spec`, the gated delta rule's prefill forward
    and decode cases; gdn.py).
quantized_matmul does not apply (`NOT_RATED`). Where the estimator aborts or a compile runs
out of time, the row says so (docs/performance/tpu-inference.md: RPA v3 and fused_moe).
"""

from __future__ import annotations

from benchmarks.cases.headline import Attention, GroupedMatmul, PagedDecode
from benchmarks.cases.serving import PagedBatch
from benchmarks.peers import fused_gdn, protocol
from benchmarks.peers.tpu_inference_ops.attention import FlashSpec, RpaV3Spec
from benchmarks.peers.tpu_inference_ops.fused_moe import FusedMoeSpec
from benchmarks.peers.tpu_inference_ops.gdn import GdnV3Spec
from benchmarks.peers.tpu_inference_ops.gmm import GmmSpec


NOT_RATED = {
    "quantized_matmul": "a dense [m, k] x [n, k] int8/fp8 matmul with per-channel scales: it "
                        "has no expert (group) dimension, so it does not apply to the grouped "
                        "expert projections; tpu-inference's quantized experts go through "
                        "gmm's rhs_scale or fused_moe",
}


def not_rated_why(case) -> str | None:
  """Why a case of a kind tpu-inference has a kernel for gets no row (None: it gets one)."""
  if isinstance(case, PagedBatch):
    if case.kv_dtype == "int8":
      return ("RPA v3 refuses an int8 cache (static_validate_inputs: 'Expected "
              "kv_cache.dtype=int8 to be a floating point'); its 1-byte cache is fp8")
    if case.prefill:
      return ("mixed batch (decode + chunked prefill): not expressed yet (its mixed kernel "
              "loops over q blocks of SMEM-dependent length)")
    if case.sliding_window is not None:
      return ("sliding window: not expressed yet (its first kv block per sequence is "
              "(kv_len - q_len - window) // bkv_sz, a run-time signed division, the pattern "
              "the estimator is known to read as 0: it would rate the whole context)")
  return None


def specs_for(case) -> list:
  """The tpu-inference specs rated on `case` (by its class; [] if none applies)."""
  if isinstance(case, GroupedMatmul):
    # its gmm takes bf16 activations only (no activation quantization): the int8 row's
    # anchor is the comparison for a w8a8 row
    return [] if case.lhs_quant else [GmmSpec(case)]
  if isinstance(case, Attention):
    return [FlashSpec(case)]
  if isinstance(case, PagedDecode):
    return [RpaV3Spec(case)]
  if isinstance(case, PagedBatch):
    return [] if not_rated_why(case) else [RpaV3Spec(case)]
  if fused_gdn.applies(case):
    return [GdnV3Spec(case)]
  if all(hasattr(case, a) for a in EXPERTS_LAYER_FIELDS):   # the whole experts layer
    return [FusedMoeSpec(case)]
  return []


# What an experts-layer case (cases/experts_layer.py's ExpertsLayer) offers fused_moe.
EXPERTS_LAYER_FIELDS = ("tokens", "experts", "top_k", "hidden", "width")


def implementations(case) -> list[protocol.Implementation]:
  return [protocol.implementation(s) for s in specs_for(case)]
