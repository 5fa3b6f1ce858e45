"""The whole experts op as one program (issue 28, item 3): the case kind `ExpertsLayer` and its
rows, Qwen3-30B-A3B and gpt-oss-20b at decode and prefill token counts."""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE


@dataclasses.dataclass(frozen=True)
class ExpertsLayer:
  """The whole experts op (`moe.moe_experts`, torch-ext's experts_forward): `tokens` rows of
  hidden [T, hidden], each routed to `top_k` of `experts` experts (gate/up [E, 2*width,
  hidden] with silu(gate) * up, down [E, hidden, width]), weighted and summed back to
  [T, hidden]. Also what a fused-MoE anchor needs: tokens, experts, top_k, hidden, width,
  dtype.

  Roofline: flops of both projections over the T * top_k routed rows; min_bytes = the
  weights of the experts hit + hidden in + result out + the routing (ids int32, weights).
  Experts hit: the expected number of distinct experts under uniform routing (each token
  picks top_k distinct experts at random), E * (1 - (1 - top_k / E) ** T); at prefill it is
  E. `all_experts_min_bytes` is the worst case (every expert's weights read)."""

  model: str
  tokens: int
  experts: int
  top_k: int
  hidden: int
  width: int
  dtype: str = "bfloat16"
  layout: str = "concatenated"   # gate/up columns: gpt-oss "interleaved" (even gate, odd up)
  activation: str = "silu"       # gpt-oss: "gpt_oss" (clamped)
  kernel = "ragged-dot-tpu"

  @property
  def name(self) -> str:
    return (f"ragged_dot experts layer {self.model} T={self.tokens} top-{self.top_k} "
            f"(E={self.experts} H={self.hidden} I={self.width}) bf16")

  @property
  def rows(self) -> int:
    return self.tokens * self.top_k

  @property
  def bound(self) -> str:
    return "memory" if self.rows <= 1024 else "compute"   # as GroupedMatmul's m

  @property
  def experts_hit(self) -> float:
    return self.experts * (1 - (1 - self.top_k / self.experts) ** self.tokens)

  def flops(self) -> int:
    # gate/up: [rows, H] x [H, 2I]; down: [rows, I] x [I, H].
    return 2 * self.rows * self.hidden * 3 * self.width

  def _min_bytes(self, experts_read: float) -> int:
    s = ITEMSIZE[self.dtype]
    weights = experts_read * 3 * self.hidden * self.width * s
    return round(weights + 2 * self.tokens * self.hidden * s + self.rows * (4 + s))

  def min_bytes(self) -> int:
    return self._min_bytes(self.experts_hit)

  def all_experts_min_bytes(self) -> int:
    return self._min_bytes(self.experts)


# gpt-oss-20b routes to 4 experts (experts_per_token 4 in its config.json; transformers'
# GptOssConfig num_experts_per_tok=4), not the 8 the issue names.
EXPERTS_LAYER: tuple = tuple(
    ExpertsLayer(model, tokens, experts, top_k, hidden, width, layout=layout, activation=act)
    for model, experts, top_k, hidden, width, layout, act in (
        ("Qwen3-30B-A3B", 128, 8, 2048, 768, "concatenated", "silu"),
        ("gpt-oss-20b", 32, 4, 2880, 2880, "interleaved", "gpt_oss"))
    for tokens in (1, 8, 64, 8192))
CASES = EXPERTS_LAYER
