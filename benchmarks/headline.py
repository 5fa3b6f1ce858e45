"""The headline cases: the shapes every performance number in this project is quoted at.

One home for them, so that the static estimator (`estimate.py`), the anchors measured
beside our kernels (`anchors.py`) and the wall-clock benchmark for a real TPU
(`wallclock.py`) all rate the same thing under the same name. Pure data and arithmetic:
no jax import, no side effects.

    flops      multiply-adds counted as 2 (attention: QK^T and PV; causal halves them)
    min_bytes  every operand read once and every result written once (the roofline's bytes)
    bound      "memory" or "compute": which target of issue 6 applies (0.85 / 0.75)
"""

from __future__ import annotations

import dataclasses

ITEMSIZE = {"bfloat16": 2, "float32": 4, "int8": 1, "float8_e4m3fn": 1}
TARGET_EFFICIENCY = {"memory": 0.85, "compute": 0.75}


def roofline_us(case, chip) -> float:
  """max(flops / bf16 peak, min_bytes / HBM bandwidth) in µs: the fastest `case` (anything
  with flops() and min_bytes()) could run on `chip` (a chips.Chip)."""
  return max(case.flops() / chip.bf16_flops_per_s, case.min_bytes() / chip.hbm_bytes_per_s) * 1e6


@dataclasses.dataclass(frozen=True)
class RmsNorm:
  rows: int
  hidden: int
  dtype: str = "bfloat16"
  kernel = "rms-norm-tpu"

  @property
  def name(self) -> str:
    return f"rms_norm bf16[{self.rows},{self.hidden}]"

  bound = "memory"

  def flops(self) -> int:
    return 4 * self.rows * self.hidden

  def min_bytes(self) -> int:
    return (2 * self.rows * self.hidden + self.hidden) * ITEMSIZE[self.dtype]


# MoE expert shapes: (experts, hidden, expert width). gpt-oss-20b: 32 experts (its Hub
# config.json; Transformers 5.23's GptOssConfig defaults, 128 experts, are gpt-oss-120b's),
# hidden = width = 2880 in both.
MOE_MODELS = {"Qwen3-30B-A3B": (128, 2048, 768), "Mixtral-8x7B": (8, 4096, 14336),
              "gpt-oss-20b": (32, 2880, 2880)}
WEIGHT_TAG = {"bfloat16": "bf16", "int8": "int8", "float8_e4m3fn": "fp8"}


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  """One projection of a MoE layer's experts: lhs [m, k] routed to the experts (balanced:
  m / groups rows each; with fewer rows than experts, m experts of one row each and the
  rest empty), weights [groups, k, n] (gate_up: n = 2 * width, the gated unit in the
  epilogue, output [m, width]). Weights in `weight_dtype`: bf16, or int8 / float8_e4m3fn
  with a per-output-channel `scale_dtype` scale [groups, n]; activations in `dtype`."""

  m: int
  part: str                 # "gate_up+silu", "gate_up+gpt_oss" or "down"
  groups: int = 128         # Qwen3-30B-A3B: 128 experts, hidden 2048, expert width 768
  hidden: int = 2048
  width: int = 768
  dtype: str = "bfloat16"
  model: str = "Qwen3-30B-A3B"
  weight_dtype: str = "bfloat16"
  scale_dtype: str = "float32"
  kernel = "ragged-dot-tpu"

  @classmethod
  def of(cls, model: str, m: int, part: str, weight_dtype: str = "bfloat16"):
    """The case of one of MOE_MODELS."""
    groups, hidden, width = MOE_MODELS[model]
    return cls(m, part, groups=groups, hidden=hidden, width=width, model=model,
               weight_dtype=weight_dtype)

  @property
  def name(self) -> str:
    return f"ragged_dot {self.model} {self.part} {WEIGHT_TAG[self.weight_dtype]} m={self.m}"

  @property
  def bound(self) -> str:
    # Decode-size batches read every expert's weights for a few rows each.
    return "memory" if self.m <= 1024 else "compute"

  @property
  def gated(self) -> bool:
    return self.part.startswith("gate_up")

  @property
  def quantized(self) -> bool:
    return ITEMSIZE[self.weight_dtype] == 1

  @property
  def active_groups(self) -> int:
    """Experts with rows: the weights a step reads (empty experts are not visited)."""
    return min(self.groups, self.m)

  @property
  def k(self) -> int:
    return self.hidden if self.gated else self.width

  @property
  def n_weight(self) -> int:
    return 2 * self.width if self.gated else self.hidden

  @property
  def n_out(self) -> int:
    return self.width if self.gated else self.hidden

  def flops(self) -> int:
    return 2 * self.m * self.k * self.n_weight

  def min_bytes(self) -> int:
    s = ITEMSIZE[self.dtype]
    weights = self.active_groups * self.k * self.n_weight * ITEMSIZE[self.weight_dtype]
    scales = self.active_groups * self.n_weight * ITEMSIZE[self.scale_dtype] \
        if self.quantized else 0
    return (self.m * self.k + self.m * self.n_out) * s + weights + scales


@dataclasses.dataclass(frozen=True)
class Attention:
  """Causal self-attention, q [B, S, Hq, D], k / v [B, S, Hkv, D], one forward pass."""

  seq: int
  batch: int = 1
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  dtype: str = "bfloat16"
  kernel = "flash-attention-tpu"
  bound = "compute"

  @property
  def name(self) -> str:
    return (f"flash_attention causal B={self.batch} H={self.q_heads}/{self.kv_heads} "
            f"S={self.seq} D={self.head_dim} bf16")

  def flops(self) -> int:
    # QK^T and PV, 2 flops per multiply-add each, over the causal half (plus the diagonal).
    visible = self.seq * (self.seq + 1) // 2
    return 4 * self.batch * self.q_heads * visible * self.head_dim

  def min_bytes(self) -> int:
    tokens = self.batch * self.seq * self.head_dim
    return (2 * tokens * self.q_heads + 2 * tokens * self.kv_heads) * ITEMSIZE[self.dtype]


@dataclasses.dataclass(frozen=True)
class PagedDecode:
  """One decode step: `batch` sequences of `context` cached tokens, one new query token
  each; caches in pages of `page_size` tokens."""

  context: int
  batch: int = 64
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  page_size: int = 64
  kv_dtype: str = "bfloat16"
  q_dtype: str = "bfloat16"
  kernel = "paged-attention-tpu"
  bound = "memory"

  @property
  def name(self) -> str:
    return (f"paged_attention decode B={self.batch} H={self.q_heads}/{self.kv_heads} "
            f"D={self.head_dim} ctx={self.context} page={self.page_size} "
            + ("bf16" if self.kv_dtype == "bfloat16" else f"cache {self.kv_dtype}"))

  def flops(self) -> int:
    return 4 * self.batch * self.q_heads * self.context * self.head_dim

  def min_bytes(self) -> int:
    kv = 2 * self.batch * self.kv_heads * self.context * self.head_dim * ITEMSIZE[self.kv_dtype]
    q_out = 2 * self.batch * self.q_heads * self.head_dim * ITEMSIZE[self.q_dtype]
    return kv + q_out


HEADLINE = (
    RmsNorm(8192, 4096), RmsNorm(8, 4096),
    GroupedMatmul(512, "gate_up+silu"), GroupedMatmul(512, "down"),
    GroupedMatmul(8192, "gate_up+silu"), GroupedMatmul(8192, "down"),
    Attention(4096), Attention(32768),
    PagedDecode(2048), PagedDecode(32768),
)


# Cases rated beside the headline (estimate.py rates every one of ALL_CASES; the front page
# and wallclock.py quote HEADLINE). One tuple per question, each with its own case class:
DIFFUSION_ATTENTION: tuple = ()   # non-causal joint text+image attention (Diffusers, issue 30)
QUANTIZED_DECODE: tuple = tuple(   # int8 / fp8 expert weights at decode (issue 28)
    GroupedMatmul.of(model, m, part, weight_dtype)
    for model, gate_up in (("Qwen3-30B-A3B", "gate_up+silu"), ("Mixtral-8x7B", "gate_up+silu"),
                           ("gpt-oss-20b", "gate_up+gpt_oss"))
    for m in (64, 512)
    for part in (gate_up, "down")
    for weight_dtype in ("bfloat16", "int8", "float8_e4m3fn")
    # the bf16 rows every quantized row is compared with (Qwen3 m=512 is in HEADLINE)
    if not (weight_dtype == "bfloat16" and model == "Qwen3-30B-A3B" and m == 512))
EXPERTS_LAYER: tuple = ()         # the whole experts op as one program (issue 28)
SERVING_PAGED: tuple = ()         # paged attention at serving page sizes and batches (issue 28)

ALL_CASES = HEADLINE + DIFFUSION_ATTENTION + QUANTIZED_DECODE + EXPERTS_LAYER + SERVING_PAGED


def by_name(name: str):
  """The case of ALL_CASES called `name` (KeyError naming the known ones otherwise)."""
  for case in ALL_CASES:
    if case.name == name:
      return case
  raise KeyError(f"no case {name!r}; known: {[c.name for c in ALL_CASES]}")
