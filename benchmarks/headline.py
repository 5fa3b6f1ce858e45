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


@dataclasses.dataclass(frozen=True)
class JointAttention:
  """Non-causal self-attention over one sequence (a Diffusers transformer's joint text +
  image tokens, or Wan's video tokens), q / k / v [B, S, H, D] (no GQA), one forward pass. `model`
  names the shape; S need not be a multiple of any block size (see each rating's method
  for how the tail is handled)."""

  model: str
  seq: int
  heads: int
  head_dim: int
  batch: int = 1
  dtype: str = "bfloat16"
  kernel = "flash-attention-tpu"
  bound = "compute"
  causal = False

  @property
  def q_heads(self) -> int:
    return self.heads

  @property
  def kv_heads(self) -> int:
    return self.heads

  @property
  def name(self) -> str:
    return (f"flash_attention non-causal {self.model} B={self.batch} H={self.heads} "
            f"S={self.seq} D={self.head_dim} bf16")

  def flops(self) -> int:
    # QK^T and PV over every (query, key) pair, 2 flops per multiply-add each.
    return 4 * self.batch * self.heads * self.seq * self.seq * self.head_dim

  def min_bytes(self) -> int:
    return 4 * self.batch * self.seq * self.heads * self.head_dim * ITEMSIZE[self.dtype]


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


@dataclasses.dataclass(frozen=True)
class PagedBatch:
  """One serving step of ragged paged attention (issue 28): `decode` sequences of `context`
  cached tokens with one new query token each, plus `prefill` chunks of `chunk` new tokens,
  each chunk the last `chunk` tokens of a sequence of `prefill_context` tokens (chunked
  prefill: its earlier tokens are cached). Caches in pages of `page_size` tokens, in
  `kv_dtype` (bfloat16, or int8 / float8_e4m3fn with per-KV-head scales); `sliding_window`
  keys visible per query (None: all). The new tokens' K/V are already in the cache (the
  write is a separate op). Llama-3-8B-like heads by default (32 / 8 x 128).

  Everything an RPA-style anchor needs is here: the per-sequence q and kv lengths
  (`sequences`), the page size and the dtypes. Memory bound at every serving shape rated
  here (the prefill chunks add flops, not bytes: tests check the roofline is the bytes'
  side on v5e and v6e)."""

  decode: int = 64
  context: int = 2048
  prefill: int = 0
  chunk: int = 512
  prefill_context: int = 2048
  page_size: int = 64
  kv_dtype: str = "bfloat16"
  sliding_window: int | None = None
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  q_dtype: str = "bfloat16"
  kernel = "paged-attention-tpu"
  bound = "memory"

  def __post_init__(self):
    if self.decode < 0 or self.prefill < 0 or self.decode + self.prefill == 0:
      raise ValueError(f"need decode >= 0, prefill >= 0 and some sequences, got "
                       f"{self.decode} / {self.prefill}")
    if self.prefill and not 0 < self.chunk <= self.prefill_context:
      raise ValueError(f"need 0 < chunk <= prefill_context, got {self.chunk} / "
                       f"{self.prefill_context}")
    if self.sliding_window is not None and self.sliding_window < 1:
      raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")

  @property
  def name(self) -> str:
    parts = [f"paged_attention serving H={self.q_heads}/{self.kv_heads} D={self.head_dim}"]
    if self.decode:
      parts.append(f"decode {self.decode}x{self.context}")
    if self.prefill:
      parts.append(f"prefill {self.prefill}x{self.chunk}@{self.prefill_context}")
    parts.append(f"page={self.page_size}")
    if self.sliding_window is not None:
      parts.append(f"window={self.sliding_window}")
    parts.append("bf16" if self.kv_dtype == "bfloat16" else f"cache {self.kv_dtype}")
    return " ".join(parts)

  def sequences(self) -> list[tuple[int, int]]:
    """(q_len, kv_len) of every sequence, decodes first: what cu_q_lens / kv_lens hold."""
    return [(1, self.context)] * self.decode + [(self.chunk, self.prefill_context)] * self.prefill

  @property
  def num_tokens(self) -> int:
    return self.decode + self.prefill * self.chunk

  def _visible(self, q_len: int, kv_len: int) -> tuple[int, int]:
    """(sum over the sequence's queries of their visible keys, distinct keys any of them
    sees): query i sits at position kv_len - q_len + i and sees keys in
    (position - window, position]."""
    w = self.sliding_window
    pairs = 0
    first = kv_len - q_len
    for p in range(first, kv_len):
      pairs += p + 1 if w is None else min(p + 1, w)
    keys = kv_len - (0 if w is None else max(0, first - w + 1))
    return pairs, keys

  def flops(self) -> int:
    pairs = sum(self._visible(q, kv)[0] for q, kv in self.sequences())
    return 4 * self.q_heads * self.head_dim * pairs

  def min_bytes(self) -> int:
    """K and V of every key some query sees (a window's earlier keys are never read), q
    read and out written once."""
    keys = sum(self._visible(q, kv)[1] for q, kv in self.sequences())
    kv = 2 * keys * self.kv_heads * self.head_dim * ITEMSIZE[self.kv_dtype]
    q_out = 2 * self.num_tokens * self.q_heads * self.head_dim * ITEMSIZE[self.q_dtype]
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
# non-causal joint text+image attention (Diffusers, issue 30; docs/diffusers.md): SD3.5's
# pipeline batches classifier-free guidance (torch.cat([latents] * 2): B=2); Flux.1-dev is
# guidance-distilled and Wan runs its cond / uncond passes as separate calls (B=1).
DIFFUSION_ATTENTION: tuple = (
    JointAttention("SD3.5-medium 1024x1024", 4096 + 333, heads=24, head_dim=64, batch=2),
    JointAttention("Flux.1 1024x1024", 4096 + 512, heads=24, head_dim=128),
    # 81 frames -> 21 latent frames, 480 x 832 px -> 60 x 104 latents, 2 x 2 patches
    JointAttention("Wan2.1-14B 480x832x81", 21 * 30 * 52, heads=40, head_dim=128),
)
QUANTIZED_DECODE: tuple = tuple(   # int8 / fp8 expert weights at decode (issue 28)
    GroupedMatmul.of(model, m, part, weight_dtype)
    for model, gate_up in (("Qwen3-30B-A3B", "gate_up+silu"), ("Mixtral-8x7B", "gate_up+silu"),
                           ("gpt-oss-20b", "gate_up+gpt_oss"))
    for m in (64, 512)
    for part in (gate_up, "down")
    for weight_dtype in ("bfloat16", "int8", "float8_e4m3fn")
    # the bf16 rows every quantized row is compared with (Qwen3 m=512 is in HEADLINE)
    if not (weight_dtype == "bfloat16" and model == "Qwen3-30B-A3B" and m == 512))
# int8 weights with int8 activations (ragged_dot's lhs_quant="int8": tpu-inference's dynamic
# per-token activation quantization), beside the int8 rows: the same models, parts and m.
W8A8_DECODE: tuple = tuple(GroupedMatmul.of(c.model, c.m, c.part, "int8", lhs_quant="int8")
                           for c in QUANTIZED_DECODE if c.weight_dtype == "int8")
# the whole experts op as one program (issue 28). gpt-oss-20b routes to 4 experts
# (experts_per_token 4 in its config.json; transformers' GptOssConfig num_experts_per_tok=4),
# not the 8 the issue names.
EXPERTS_LAYER: tuple = tuple(
    ExpertsLayer(model, tokens, experts, top_k, hidden, width, layout=layout, activation=act)
    for model, experts, top_k, hidden, width, layout, act in (
        ("Qwen3-30B-A3B", 128, 8, 2048, 768, "concatenated", "silu"),
        ("gpt-oss-20b", 32, 4, 2880, 2880, "interleaved", "gpt_oss"))
    for tokens in (1, 8, 64, 8192))
SERVING_PAGED: tuple = (           # paged attention at serving page sizes and batches (issue 28)
    # Decode 64 x 2k at the page sizes serving engines use (page 64 is HEADLINE's row).
    PagedBatch(page_size=16), PagedBatch(page_size=32), PagedBatch(page_size=256),
    # A vLLM-like mixed step: 60 decodes + 4 chunked-prefill chunks of 512.
    PagedBatch(decode=60, prefill=4),
    # Quantized caches (1 byte per element).
    PagedBatch(kv_dtype="int8"), PagedBatch(kv_dtype="float8_e4m3fn"),
    # A sliding window on a long context (gpt-oss / Mistral-like): only 4k of 32k is read.
    PagedBatch(context=32768, sliding_window=4096),
)

ALL_CASES = (HEADLINE + DIFFUSION_ATTENTION + QUANTIZED_DECODE + W8A8_DECODE + EXPERTS_LAYER
             + SERVING_PAGED)


def by_name(name: str):
  """The case of ALL_CASES called `name` (KeyError naming the known ones otherwise)."""
  for case in ALL_CASES:
    if case.name == name:
      return case
  raise KeyError(f"no case {name!r}; known: {[c.name for c in ALL_CASES]}")
