"""The seed's decoder layer (the project's original claim: 21.5x faster Qwen3-30B-A3B decode at
batch 64 on v6e-8 against Transformers' default experts implementation), one chip's share:
the cases benchmarks/seed_prediction.py rates.

The per-chip program (one decoder layer, one v6e chip, its share of a v6e-8 step):
  * batch 64 decode (64 new tokens), KV context 2048 tokens per sequence (the paged
    headline's context; pages of 64), bf16.
  * experts: 8-way expert parallel as AllReduceEP runs it: 16 experts per chip, all 64 x
    top-8 = 512 routed rows per chip, about 64 of them to local experts (expected experts
    hit per chip: 16 (1 - (1 - 8/128)^64) = 15.7), the rest placeholders.
  * attention: head-split tensor parallel (AllReduceEP needs every rank of the EP group to
    hold the same batch, so attention cannot be data-parallel over sequences): 4 of the
    32 query heads per chip; the 4 KV heads cannot be split 8 ways, so each KV head is on
    2 chips (the 4 query heads of a chip share one). q/k/v projections column-split,
    o_proj row-split (then an all-reduce), norms and router replicated on the 64 tokens.
  * the two all-reduces of [64, 2048] bf16 (after o_proj, after the experts) and the new
    tokens' KV-cache write are not rated (ICI / a 64-row scatter; the same in both programs).
Not a family of all_cases() (no CASES): estimate.py does not rate it. Also here: Qwen3.5-9B's
whole decode step (`Qwen35DecodeStep`, benchmarks/qwen35_decode_prediction.py).
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE
from benchmarks.cases.causal_conv1d import ConvUpdate
from benchmarks.cases.experts_layer import ExpertsLayer
from benchmarks.cases.gated_delta_rule import QWEN3_5_9B, GdnDecode
from benchmarks.cases.headline import PagedDecode

# The seed's claims: speed-ups of decode at batch 64 on v6e-8 against Transformers' default
# experts implementation, the numbers the prediction is set against.
SEED_SPEEDUP = {"Qwen3-30B-A3B": 21.5, "Gemma 4 26B-A4B": 12.8}


@dataclasses.dataclass(frozen=True)
class Layer:
  """One MoE decoder layer at a decode step, and its per-chip split (this module's docstring)."""

  model: str = "Qwen3-30B-A3B"
  batch: int = 64             # sequences, one new token each
  context: int = 2048         # cached tokens per sequence
  page_size: int = 64
  experts: int = 128
  top_k: int = 8
  hidden: int = 2048
  width: int = 768            # moe_intermediate_size
  q_heads: int = 32
  kv_heads: int = 4
  head_dim: int = 128
  chips: int = 8              # expert parallel and head split over this many chips
  eps: float = 1e-6
  dtype: str = "bfloat16"

  @property
  def local_experts(self) -> int:
    return self.experts // self.chips

  @property
  def local_q_heads(self) -> int:
    return self.q_heads // self.chips

  @property
  def local_kv_heads(self) -> int:   # a KV head on chips/kv_heads chips when kv_heads < chips
    return max(self.kv_heads // self.chips, 1)

  @property
  def rows(self) -> int:
    return self.batch * self.top_k

  @property
  def local_experts_hit(self) -> float:
    """Expected distinct local experts hit (each token picks top_k distinct of E)."""
    return self.local_experts * (1 - (1 - self.top_k / self.experts) ** self.batch)

  def experts_case(self) -> ExpertsLayer:
    """The local experts call as rating/experts_layer.py rates it: all rows over E/ep experts."""
    return ExpertsLayer(self.model, self.batch, self.local_experts, self.top_k,
                        self.hidden, self.width, self.dtype)

  def paged_case(self) -> PagedDecode:
    return PagedDecode(self.context, batch=self.batch, q_heads=self.local_q_heads,
                       kv_heads=self.local_kv_heads, head_dim=self.head_dim,
                       page_size=self.page_size)

  def experts_min_bytes(self) -> int:
    """Per-chip experts roofline bytes: weights of the local experts hit, hidden in, out."""
    s = ITEMSIZE[self.dtype]
    return round(self.local_experts_hit * 3 * self.hidden * self.width * s
                 + 2 * self.batch * self.hidden * s + self.rows * (4 + s))


QWEN3 = Layer()


@dataclasses.dataclass(frozen=True)
class Qwen35DecodeStep:
  """One Qwen3.5-9B decode step at batch 64 on one v6e chip (issue 59's prediction,
  benchmarks/qwen35_decode_prediction.py): the whole model, one chip, no split.

  Shapes: Transformers 5.25's `Qwen3_5TextConfig` defaults ("Qwen3.5-9B style", checked by
  tests/jax/test_qwen35_decode_prediction.py): 32 layers, every 4th full attention (8),
  the rest Gated DeltaNet (24, cases/gated_delta_rule.py's QWEN3_5_9B); hidden 4096, MLP
  12288, vocabulary 248,320 (untied lm_head); attention 16 query / 4 KV heads of 256 with
  a sigmoid output gate (q_proj is twice as wide) and RoPE on a quarter of head_dim; norms
  zero-centred, (1 + w) * x. The KV context is 2048 cached tokens per sequence (the paged
  headline's), in pages of 64 for our paged kernel, a dense cache for the default.

  It fits one v6e chip (32 GiB): bf16 weights ~16.3 GB, the Gated DeltaNet states
  24 x 64 x 2 MiB = 3.2 GB, the KV cache 8 x 2 x 64 x 4 x 2048 x 256 x 2 B = 2.1 GB.
  """

  model: str = "Qwen3.5-9B"
  batch: int = 64
  context: int = 2048
  page_size: int = 64
  layers: int = 32
  full_attention_interval: int = 4
  hidden: int = 4096
  intermediate: int = 12288
  vocab: int = 248320
  q_heads: int = 16
  kv_heads: int = 4
  head_dim: int = 256
  rotary_dim: int = 64          # partial_rotary_factor 0.25 of head_dim
  eps: float = 1e-6
  dtype: str = "bfloat16"

  @property
  def attention_layers(self) -> int:
    return self.layers // self.full_attention_interval

  @property
  def gdn_layers(self) -> int:
    return self.layers - self.attention_layers

  gdn = QWEN3_5_9B               # the Gated DeltaNet layer's shapes

  def gdn_decode_case(self) -> GdnDecode:
    return GdnDecode(batch=self.batch, layer=self.gdn)

  def conv_update_case(self) -> ConvUpdate:
    return ConvUpdate(batch=self.batch, layer=self.gdn)

  def paged_case(self) -> PagedDecode:
    return PagedDecode(self.context, batch=self.batch, q_heads=self.q_heads,
                       kv_heads=self.kv_heads, head_dim=self.head_dim,
                       page_size=self.page_size)


QWEN3_5_STEP = Qwen35DecodeStep()
