"""jax's own Pallas TPU kernels as a peer (`jax.experimental.pallas.ops.tpu`, nothing copied),
rated by the same static estimator as ours:

  grouped matmul   megablox `gmm` (peers/megablox.py)
  attention        `flash_attention` and splash attention (attention.py)
  paged decode     `paged_attention` and `ragged_paged_attention` (paged.py)
  RMSNorm          none: jax ships no Pallas RMSNorm (the XLA jnp version is XLA's row,
                   peers/xla_ops.py); tokamax has none for TPU either (its normalization is
                   Triton or XLA)

Which rows: the headline cases of each kind, the Diffusers attention shapes, the serving
batches, and beside the quantized-decode rows megablox at one tiling for each bf16 row (it
has no quantized path). An anchor rates only the case it can express (`spec.case == case`).
"""

from __future__ import annotations

from benchmarks.cases.diffusion import JointAttention
from benchmarks.cases.headline import HEADLINE, Attention, GroupedMatmul, PagedDecode
from benchmarks.cases.serving import PagedBatch
from benchmarks.peers import protocol
from benchmarks.peers.jax_ops.attention import AttentionAnchor
from benchmarks.peers.jax_ops.paged import PagedAnchor, RaggedPagedAnchor, RaggedPagedServingAnchor
from benchmarks.peers.megablox import QUANTIZED_TILING, GmmAnchor

NOT_RATED = {
    "rms_norm": "jax ships no Pallas RMSNorm kernel (jax.experimental.pallas.ops.tpu has none); "
                "the XLA jnp baseline is XLA's row (peers/xla_ops.py)",
}
# The headline's grouped matmuls at megablox's default tiling and at a large one.
HEADLINE_GMM_TILINGS = ("default", "512x1024x1024")
ATTENTION_BLOCKS = (128, 512)   # block_q = block_k(v): both kernels' default, and a larger one


def specs_for(case) -> list:
  if isinstance(case, GroupedMatmul) and not case.lhs_quant and not case.quantized:
    tilings = HEADLINE_GMM_TILINGS if case in HEADLINE else (QUANTIZED_TILING,)
    specs = [GmmAnchor(case.m, case.part, tiling, groups=case.groups, model=case.model,
                       weight_dtype=case.weight_dtype) for tiling in tilings]
  elif isinstance(case, Attention):
    specs = [AttentionAnchor(case.seq, kind, block) for block in ATTENTION_BLOCKS
             for kind in ("flash", "splash")]
  elif isinstance(case, JointAttention):   # non-causal, Diffusers' shapes
    specs = [AttentionAnchor(case.seq, kind, block, joint=case) for block in ATTENTION_BLOCKS
             for kind in ("flash", "splash")]
  elif isinstance(case, PagedDecode):
    specs = [PagedAnchor(case.context), RaggedPagedAnchor(case.context)]
  elif isinstance(case, PagedBatch):
    specs = [RaggedPagedServingAnchor(case)]
  else:
    specs = []
  return [s for s in specs if s.case == case]


def implementations(case) -> list[protocol.Implementation]:
  return [protocol.implementation(s) for s in specs_for(case)]
