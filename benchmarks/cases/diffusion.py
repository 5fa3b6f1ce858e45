"""Non-causal joint text + image attention at Diffusers' shapes (issue 30; docs/diffusers.md):
the case kind `JointAttention` and its rows. SD3.5's pipeline batches classifier-free
guidance (torch.cat([latents] * 2): B=2); Flux.1-dev is guidance-distilled and Wan runs its
cond / uncond passes as separate calls (B=1)."""

from __future__ import annotations

import dataclasses

from benchmarks.cases import ITEMSIZE


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


DIFFUSION_ATTENTION: tuple = (
    JointAttention("SD3.5-medium 1024x1024", 4096 + 333, heads=24, head_dim=64, batch=2),
    JointAttention("Flux.1 1024x1024", 4096 + 512, heads=24, head_dim=128),
    # 81 frames -> 21 latent frames, 480 x 832 px -> 60 x 104 latents, 2 x 2 patches
    JointAttention("Wan2.1-14B 480x832x81", 21 * 30 * 52, heads=40, head_dim=128),
)
CASES = DIFFUSION_ATTENTION
