"""The gated delta rule (gated-delta-rule-tpu, issue 59) at a Gated DeltaNet layer's shapes:
chunked prefill (forward, and training forward + backward) and a batch of decode steps.

The shapes' one home (scripts/aot_summary.py and cases/causal_conv1d.py read them here):
`GDN_LAYERS`, a Gated DeltaNet layer per model, from Transformers 5.25's config defaults.
Qwen3.5-9B's (`models/qwen3_5`, "Qwen3.5-9B style") and Qwen3-Next-80B-A3B's
(`models/qwen3_next`) linear-attention layers are the same: 16 key heads and 32 value heads
of 128, a width-4 conv over 2 * 16 * 128 + 32 * 128 = 8192 channels, an f32 state
[32, 128, 128] per sequence. So one set of rows rates both (named after Qwen3.5-9B, the
seed's model). Inputs as the layer passes them: q, k, v bf16 (l2-normalised in the kernel,
`use_qk_l2norm_in_kernel=True`), g f32, beta bf16.

    flops      multiply-adds counted as 2. Prefill: the chunked (WY / UT) algorithm's
               matmuls per chunk of C = 64 and value head, the triangular inverse at its
               forward-substitution count C^3 / 3 (`chunk_flops`); training adds twice the
               forward for the backward (the usual 1 : 2). Decode: the recurrence's
               4 K V multiply-adds per token and head (S^T k, k delta^T, S^T q, the decay).
    min_bytes  every operand read once and every result written once: decode's roofline is
               the f32 state read and written once (issue 59's goal: >= 0.85 of it).
    bound      memory, but for training: prefill's 22 GFLOP take less than its 104 MB on
               v5e and v6e (at the bf16 peak); training's 65 GFLOP against 203 MB are compute
               bound on v5e (memory bound on v6e): "compute" (target 0.75).
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE

CHUNK = 64   # the chunk of the WY form (ours, fla, tpu-inference and tokamax alike)


@dataclasses.dataclass(frozen=True)
class GdnLayer:
  """A Gated DeltaNet layer's shapes (Transformers' config: linear_num_key_heads,
  linear_num_value_heads, linear_key_head_dim = linear_value_head_dim,
  linear_conv_kernel_dim)."""

  model: str
  key_heads: int
  value_heads: int
  head_dim: int
  conv_width: int

  @property
  def conv_dim(self) -> int:
    """The conv's channels: q, k and v side by side (Transformers' conv_dim)."""
    return (2 * self.key_heads + self.value_heads) * self.head_dim


QWEN3_5_9B = GdnLayer("Qwen3.5-9B", key_heads=16, value_heads=32, head_dim=128, conv_width=4)
GDN_LAYERS = {"Qwen3.5-9B": QWEN3_5_9B,
              # Qwen3-Next-80B-A3B's config defaults: the same layer (see the docstring)
              "Qwen3-Next-80B": dataclasses.replace(QWEN3_5_9B, model="Qwen3-Next-80B")}
PREFILL_TOKENS = 4096
DECODE_BATCH = 64
# Transformers' conv state keeps conv_kernel_size (4) inputs per sequence and channel.
CONV_STATE_LEN = 4


def chunk_flops(tokens: int, layer: GdnLayer) -> int:
  """Forward flops of the chunked algorithm (docstring of kernels/tpu_kernels/
  gated_delta_rule.py) per C-token chunk and value head, with D = K = V and G = Hv / Hk:
  k k^T and q k^T once per key head (2 C^2 D / G), the inverse of (I + A) (C^3 / 3),
  W = Tinv (beta Gam K) and U0 = Tinv (beta V) (2 C^2 D), W S and Q S (2 C D^2),
  P U (C^2 D) and the state update K^T U (C D^2)."""
  c, d = CHUNK, layer.head_dim
  group = layer.value_heads // layer.key_heads
  macs = 2 * c * c * d / group + c ** 3 / 3 + 3 * c * c * d + 3 * c * d * d
  chunks = -(-tokens // CHUNK)
  return int(2 * macs * chunks * layer.value_heads)


def _gdn_specs(layer: GdnLayer, batch: int, tokens: int) -> list:
  """ShapeDtypeStructs of q, k, v, g, beta as the layer passes them."""
  import jax
  import jax.numpy as jnp
  S = jax.ShapeDtypeStruct
  q = S((batch, tokens, layer.key_heads, layer.head_dim), jnp.bfloat16)
  return [q, q, S((batch, tokens, layer.value_heads, layer.head_dim), jnp.bfloat16),
          S((batch, tokens, layer.value_heads), jnp.float32),
          S((batch, tokens, layer.value_heads), jnp.bfloat16)]


@dataclasses.dataclass(frozen=True)
class GdnChunked:
  """Prefill of one sequence of `tokens` by the chunked kernel (`chunk_gated_delta_rule`):
  "fwd" (o and the final state, as a cached prefill asks) or "fwd+bwd" (training: o, then
  the gradients of q, k, v, g and beta from o's cotangent; no initial or final state)."""

  tokens: int = PREFILL_TOKENS
  direction: str = "fwd"
  layer: GdnLayer = QWEN3_5_9B
  kernel = "gated-delta-rule-tpu"

  @property
  def bound(self) -> str:
    return "compute" if self.training else "memory"

  @property
  def name(self) -> str:
    L = self.layer
    return (f"gated_delta_rule chunked {self.direction} T={self.tokens} "
            f"H={L.key_heads}/{L.value_heads} D={L.head_dim} bf16 ({L.model})")

  @property
  def training(self) -> bool:
    return self.direction == "fwd+bwd"

  def flops(self) -> int:
    return chunk_flops(self.tokens, self.layer) * (3 if self.training else 1)

  def min_bytes(self) -> int:
    L, t = self.layer, self.tokens
    qk = 2 * t * L.key_heads * L.head_dim * 2
    v = t * L.value_heads * L.head_dim * 2
    gates = t * L.value_heads * (4 + 2)            # g f32, beta bf16
    state = L.value_heads * L.head_dim * L.head_dim * 4
    if self.training:   # q k v g beta and do in, o out, dq dk dv dg dbeta out
      return 2 * (qk + v + gates) + 2 * v
    return qk + v + gates + v + state              # q k v g beta in, o and the state out

  def program(self, chip: str, tokens: int | None = None):
    """(fn, specs): our kernel on this case, or on its first `tokens` tokens (the rating
    extrapolates from such truncations: rating/gated_delta_rule.py)."""
    import functools
    import jax
    from tpu_kernels import gated_delta_rule as G
    specs = _gdn_specs(self.layer, 1, tokens or self.tokens)
    if not self.training:
      return functools.partial(G.chunk_gated_delta_rule, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, chip=chip), specs
    forward = functools.partial(G.chunk_gated_delta_rule, use_qk_l2norm_in_kernel=True,
                                chip=chip)

    def train(q, k, v, g, beta, do):
      o, vjp = jax.vjp(lambda *a: forward(*a)[0], q, k, v, g, beta)
      return o, vjp(do)

    return train, specs + [specs[2]]


@dataclasses.dataclass(frozen=True)
class GdnDecode:
  """One decode step of `batch` sequences (`fused_recurrent_gated_delta_rule`, one token
  each): the state [batch, Hv, K, V] f32 read and written once (its buffer donated: the kernel
  aliases it to the new state, as the layer's cache update does in place)."""

  batch: int = DECODE_BATCH
  layer: GdnLayer = QWEN3_5_9B
  kernel = "gated-delta-rule-tpu"
  bound = "memory"
  donated = (5,)   # the state (rating/linear_attention.py compiles it donated)

  @property
  def name(self) -> str:
    L = self.layer
    return (f"gated_delta_rule decode B={self.batch} H={L.key_heads}/{L.value_heads} "
            f"D={L.head_dim} state f32 ({L.model})")

  @property
  def state_bytes(self) -> int:
    L = self.layer
    return self.batch * L.value_heads * L.head_dim * L.head_dim * ITEMSIZE["float32"]

  def flops(self) -> int:
    L = self.layer
    return 2 * 4 * self.batch * L.value_heads * L.head_dim * L.head_dim

  def min_bytes(self) -> int:
    L = self.layer
    tokens = self.batch * (2 * L.key_heads * L.head_dim + 2 * L.value_heads * L.head_dim) * 2
    gates = self.batch * L.value_heads * (4 + 2)
    return 2 * self.state_bytes + tokens + gates

  def program(self, chip: str):
    """(fn, specs): our recurrent kernel, the state donated (updated in place)."""
    import functools
    import jax
    import jax.numpy as jnp
    from tpu_kernels import gated_delta_rule as G
    L = self.layer
    step = functools.partial(G.fused_recurrent_gated_delta_rule, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, chip=chip)
    fn = lambda q, k, v, g, beta, h0: step(q, k, v, g, beta, initial_state=h0)
    state = jax.ShapeDtypeStruct((self.batch, L.value_heads, L.head_dim, L.head_dim),
                                 jnp.float32)
    return fn, _gdn_specs(L, self.batch, 1) + [state]


# Training (GdnChunked(direction="fwd+bwd")) is not among the rated cases yet: its truncated
# rating (2 and 4 chunks, forward and backward) did not finish within the first rating
# run's time on the 2-core machine (2026-12-07); add it here to rate it.
CASES = (GdnChunked(), GdnDecode())
