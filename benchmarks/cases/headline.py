"""The headline cases: the shapes every performance number in this project is quoted at,
and the four case kinds they are made of (RMSNorm, one grouped-matmul projection of a MoE
layer, causal GQA attention, a paged decode step), with the gated RMSNorm kind beside its
sibling (the seed models' calls use it; no headline case does).

One home for them, so that the static estimator (`benchmarks/estimate.py`), the peers rated
beside our kernels (`benchmarks/peers/`) and the wall-clock benchmark for a real TPU
(`benchmarks/wallclock.py`) all rate the same thing under the same name. Pure data and
arithmetic: no jax import at import time, no side effects.

    flops      multiply-adds counted as 2 (attention: QK^T and PV; causal halves them)
    min_bytes  every operand read once and every result written once (the roofline's bytes)
    bound      "memory" or "compute": which target of issue 6 applies (0.85 / 0.75)
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE


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

  def program(self, chip: str):
    """(fn, specs): our kernel on this case, rated as one whole program (rating/ours.py)."""
    import functools
    import jax
    from tpu_kernels import rms_norm
    x = jax.ShapeDtypeStruct((self.rows, self.hidden), self.dtype)
    w = jax.ShapeDtypeStruct((self.hidden,), self.dtype)
    return functools.partial(rms_norm.rms_norm, chip=chip), [x, w]


@dataclasses.dataclass(frozen=True)
class RmsNormGated:
  """Gated RMSNorm (Transformers' RMSNormGated: weight * norm(x) * silu(gate)) over rows
  of one head's values, as Gated DeltaNet layers call it after the recurrence: x and gate
  [rows, hidden], weight [hidden]. Not a headline case: the kind of the seed models' calls."""
  rows: int
  hidden: int
  dtype: str = "bfloat16"
  kernel = "rms-norm-tpu"

  @property
  def name(self) -> str:
    return f"rms_norm_gated silu bf16[{self.rows},{self.hidden}]"

  bound = "memory"

  def flops(self) -> int:
    return 8 * self.rows * self.hidden

  def min_bytes(self) -> int:
    return (3 * self.rows * self.hidden + self.hidden) * ITEMSIZE[self.dtype]

  def specs(self):
    import jax
    x = jax.ShapeDtypeStruct((self.rows, self.hidden), self.dtype)
    return [x, x, jax.ShapeDtypeStruct((self.hidden,), self.dtype)]

  def program(self, chip: str):
    """(fn, specs): our kernel on this case, rated as one whole program (rating/ours.py)."""
    import functools
    from tpu_kernels import rms_norm
    return functools.partial(rms_norm.rms_norm_gated, chip=chip), self.specs()


# MoE expert shapes: (experts, hidden, expert width). gpt-oss-20b: 32 experts (its Hub
# config.json; Transformers 5.23's GptOssConfig defaults, 128 experts, are gpt-oss-120b's),
# hidden = width = 2880 in both.
MOE_MODELS = {"Qwen3-30B-A3B": (128, 2048, 768), "Mixtral-8x7B": (8, 4096, 14336),
              "gpt-oss-20b": (32, 2880, 2880)}
WEIGHT_TAG = {"bfloat16": "bf16", "int8": "int8", "float8_e4m3fn": "fp8"}
# How each model stores its gate/up weights (scripts/ragged_dot_cases.py's MODELS): gpt-oss
# interleaves the gate and up columns in one weight; the others concatenate the two halves.
INTERLEAVED_GATE_UP = ("gpt-oss-20b",)


@dataclasses.dataclass(frozen=True)
class GroupedMatmul:
  """One projection of a MoE layer's experts: lhs [m, k] routed to the experts (balanced:
  m / groups rows each; with fewer rows than experts, m experts of one row each and the
  rest empty), weights [groups, k, n] (gate_up: n = 2 * width, the gated unit in the
  epilogue, output [m, width]). Weights in `weight_dtype`: bf16, or int8 / float8_e4m3fn
  with a per-output-channel `scale_dtype` scale [groups, n]; activations in `dtype`.
  `lhs_quant` "int8" (int8 weights): the activations quantized per row and multiplied as
  int8 (ragged_dot's lhs_quant, "w8a8" in the name); the roofline is the same as the int8
  row's (bf16 activations in, the op's input)."""

  m: int
  part: str                 # "gate_up+silu", "gate_up+gpt_oss" or "down"
  groups: int = 128         # Qwen3-30B-A3B: 128 experts, hidden 2048, expert width 768
  hidden: int = 2048
  width: int = 768
  dtype: str = "bfloat16"
  model: str = "Qwen3-30B-A3B"
  weight_dtype: str = "bfloat16"
  scale_dtype: str = "float32"
  lhs_quant: str | None = None
  kernel = "ragged-dot-tpu"

  @classmethod
  def of(cls, model: str, m: int, part: str, weight_dtype: str = "bfloat16",
         lhs_quant: str | None = None):
    """The case of one of MOE_MODELS."""
    groups, hidden, width = MOE_MODELS[model]
    return cls(m, part, groups=groups, hidden=hidden, width=width, model=model,
               weight_dtype=weight_dtype, lhs_quant=lhs_quant)

  @property
  def name(self) -> str:
    tag = "w8a8" if self.lhs_quant else WEIGHT_TAG[self.weight_dtype]
    return f"ragged_dot {self.model} {self.part} {tag} m={self.m}"

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
  def layout(self) -> str:
    """The gate/up columns of the model's weights: "interleaved" or "concatenated"."""
    return "interleaved" if self.model in INTERLEAVED_GATE_UP else "concatenated"

  @property
  def weight_bytes(self) -> int:
    """Every expert's weights of this projection (what ragged_dot.gate_up_route weighs)."""
    return self.groups * self.k * self.n_weight * ITEMSIZE[self.weight_dtype]

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
  causal = True

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


# The front page and benchmarks/wallclock.py quote these rows; benchmarks/estimate.py rates
# them beside every other family's (cases.all_cases()).
HEADLINE = (
    RmsNorm(8192, 4096), RmsNorm(8, 4096),
    GroupedMatmul(512, "gate_up+silu"), GroupedMatmul(512, "down"),
    GroupedMatmul(8192, "gate_up+silu"), GroupedMatmul(8192, "down"),
    Attention(4096), Attention(32768),
    PagedDecode(2048), PagedDecode(32768),
)
CASES = HEADLINE
