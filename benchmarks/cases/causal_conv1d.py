"""The causal depthwise conv (causal-conv1d-tpu, issue 59) of a Gated DeltaNet layer: the
prefill conv (forward, and training forward + backward) and the decode update, at the
layer's shapes (cases/gated_delta_rule.py's GDN_LAYERS: Qwen3.5-9B's, which Qwen3-Next-80B
shares): 8192 channels, width 4, SiLU, bf16, no bias (the layer's conv1d has none).

x is channels-last [B, T, D], as the op hands Transformers' transposed [B, D, T] view to
the kernel (torch-ext/causal_conv1d_tpu: no copy). The decode update writes the conv state
[B, D, 4] in place (donated). Both memory bound by far (8 flops per element moved).
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE
from benchmarks.cases.gated_delta_rule import (CONV_STATE_LEN, DECODE_BATCH, PREFILL_TOKENS,
                                               QWEN3_5_9B, GdnLayer)

BF16 = ITEMSIZE["bfloat16"]


@dataclasses.dataclass(frozen=True)
class ConvPrefill:
  """`causal_conv1d_fn(x [1, T, D] channels-last, weight [D, W], activation="silu")`:
  "fwd", or "fwd+bwd" (training: out, then dx and dweight from out's cotangent)."""

  tokens: int = PREFILL_TOKENS
  direction: str = "fwd"
  layer: GdnLayer = QWEN3_5_9B
  kernel = "causal-conv1d-tpu"
  bound = "memory"

  @property
  def name(self) -> str:
    L = self.layer
    return (f"causal_conv1d {self.direction} T={self.tokens} D={L.conv_dim} "
            f"W={L.conv_width} silu bf16 ({L.model})")

  @property
  def training(self) -> bool:
    return self.direction == "fwd+bwd"

  def flops(self) -> int:
    L = self.layer
    return 2 * self.tokens * L.conv_dim * L.conv_width * (3 if self.training else 1)

  def min_bytes(self) -> int:
    L = self.layer
    x = self.tokens * L.conv_dim * BF16
    weight = L.conv_dim * L.conv_width * BF16
    if self.training:   # x and dout in, out and dx out; weight in, dweight out
      return 4 * x + 2 * weight
    return 2 * x + weight

  def program(self, chip: str):
    """(fn, specs): our kernel on this case, one whole program (rating/ours.py)."""
    import functools
    import jax
    import jax.numpy as jnp
    from tpu_kernels import causal_conv1d as C
    L = self.layer
    conv = functools.partial(C.causal_conv1d_fn, activation="silu", channels_last=True,
                             chip=chip)
    x = jax.ShapeDtypeStruct((1, self.tokens, L.conv_dim), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((L.conv_dim, L.conv_width), jnp.bfloat16)
    if not self.training:
      return conv, [x, w]

    def train(x_, w_, dout):
      out, vjp = jax.vjp(conv, x_, w_)
      return out, vjp(dout)

    return train, [x, w, x]


@dataclasses.dataclass(frozen=True)
class ConvUpdate:
  """`causal_conv1d_update(x [B, D, 1], conv_state [B, D, S], weight, activation="silu")`:
  one decode token per sequence; the state (argument 1) donated, updated in place."""

  batch: int = DECODE_BATCH
  state_len: int = CONV_STATE_LEN
  layer: GdnLayer = QWEN3_5_9B
  kernel = "causal-conv1d-tpu"
  bound = "memory"
  donated = (1,)   # the conv state (rating/linear_attention.py compiles it donated)

  @property
  def name(self) -> str:
    L = self.layer
    return (f"causal_conv1d update B={self.batch} D={L.conv_dim} W={L.conv_width} "
            f"state {self.state_len} silu bf16 ({L.model})")

  def flops(self) -> int:
    return 2 * self.batch * self.layer.conv_dim * self.layer.conv_width

  def min_bytes(self) -> int:
    L = self.layer
    tokens = 2 * self.batch * L.conv_dim * BF16              # x in, out
    state = 2 * self.batch * L.conv_dim * self.state_len * BF16
    return tokens + state + L.conv_dim * L.conv_width * BF16

  def specs(self) -> list:
    import jax
    import jax.numpy as jnp
    S, L = jax.ShapeDtypeStruct, self.layer
    return [S((self.batch, L.conv_dim, 1), jnp.bfloat16),
            S((self.batch, L.conv_dim, self.state_len), jnp.bfloat16),
            S((L.conv_dim, L.conv_width), jnp.bfloat16)]

  def program(self, chip: str):
    """(fn, specs): our update kernel (the state is donated by the rating)."""
    import functools
    from tpu_kernels import causal_conv1d as C
    return (functools.partial(C.causal_conv1d_update, activation="silu", chip=chip),
            self.specs())


CASES = (ConvPrefill(), ConvPrefill(direction="fwd+bwd"), ConvUpdate())
