"""Flash attention for TPU in Pallas, forward and backward: GQA, causal, sliding window,
soft-cap, segment ids, sinks, chunked-prefill offsets.

Math. For batch b, query head h (KV head h // G, G = Hq / Hkv), query row i at
position p_i = q_offset + i and key j at position j:

    s[i, j] = sm_scale * q[i] . k[j]                (f32; sm_scale = 1/sqrt(D) by default)
    s[i, j] = soft_cap * tanh(s[i, j] / soft_cap)   if soft_cap
    visible(i, j) = (not causal or j <= p_i)
                    and (sliding_window is None or p_i - j < sliding_window)
                    and (segment_ids is None or q_seg[i] == kv_seg[j])
    lse[i] = log(exp(sinks[h]) + sum_{visible j} exp(s[i, j]))   (no sink term without sinks)
    out[i] = sum_{visible j} exp(s[i, j] - lse[i]) v[j]

A row with no visible key gives out = 0 and lse = -inf (lse = sinks[h] with sinks),
and passes no gradient: never NaN. The sliding window follows Transformers' masks:
a window of w shows the query's own position and the w - 1 before it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.float32, jnp.bfloat16)


def attention_xla(q, k, v, *, causal=False, sm_scale=None, sliding_window=None, soft_cap=None,
                  segment_ids=None, sinks=None, q_offset=0):
  """The same attention in plain XLA (f32 math, O(Sq * Skv) memory): the baseline the
  benchmarks compare against, and what `flash_attention` computes. Returns (out, lse)."""
  batch, num_q_heads, q_len, head_dim = q.shape
  num_kv_heads, kv_len = k.shape[1], k.shape[2]
  group = num_q_heads // num_kv_heads
  scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else sm_scale
  kf = jnp.repeat(k.astype(jnp.float32), group, axis=1)
  vf = jnp.repeat(v.astype(jnp.float32), group, axis=1)
  s = jnp.einsum("bhqd,bhkd->bhqk", q.astype(jnp.float32), kf,
                 precision=jax.lax.Precision.HIGHEST) * scale
  if soft_cap is not None:
    s = soft_cap * jnp.tanh(s / soft_cap)
  q_pos = q_offset + jnp.arange(q_len)[:, None]
  k_pos = jnp.arange(kv_len)[None, :]
  visible = jnp.ones((q_len, kv_len), bool)
  if causal:
    visible &= k_pos <= q_pos
  if sliding_window is not None:
    visible &= q_pos - k_pos < sliding_window
  visible = visible[None, None]
  if segment_ids is not None:
    q_seg, kv_seg = _split_segment_ids(segment_ids, q_len, kv_len)
    visible = visible & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  s = jnp.where(visible, s, -jnp.inf)
  m = jnp.max(s, axis=-1)
  if sinks is not None:
    m = jnp.maximum(m, sinks.astype(jnp.float32)[None, :, None])
  m_safe = jnp.where(jnp.isfinite(m), m, 0.0)
  p = jnp.exp(s - m_safe[..., None])
  denom = jnp.sum(p, axis=-1)
  if sinks is not None:
    denom = denom + jnp.exp(sinks.astype(jnp.float32)[None, :, None] - m_safe)
  out = jnp.einsum("bhqk,bhkd->bhqd", p, vf, precision=jax.lax.Precision.HIGHEST)
  out = jnp.where(denom[..., None] > 0, out / jnp.where(denom > 0, denom, 1.0)[..., None], 0.0)
  lse = jnp.where(denom > 0, m_safe + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
  return out.astype(q.dtype), lse


def _split_segment_ids(segment_ids, q_len, kv_len):
  if isinstance(segment_ids, (tuple, list)):
    return segment_ids
  return segment_ids, segment_ids


def flash_attention(q, k, v, *, causal: bool = False, sm_scale: float | None = None,
                    sliding_window: int | None = None, soft_cap: float | None = None,
                    segment_ids=None, sinks=None, q_offset=0, return_lse: bool = False,
                    chip: str | None = None, block_q: int | None = None,
                    block_k: int | None = None, vmem_limit_bytes: int | None = None,
                    interpret: bool = False):
  """Attention in the SDPA layout (see the module docstring for the exact math).

  Args:
    q: [B, Hq, Sq, D] float32 or bfloat16.
    k, v: [B, Hkv, Skv, D], q's dtype; Hq a multiple of Hkv (GQA / MQA).
    causal: key j visible from query i only if j <= q_offset + i.
    sm_scale: logit scale, default 1 / sqrt(D).
    sliding_window: int >= 1; key j visible only if (q_offset + i) - j < sliding_window.
    soft_cap: float > 0; logits become soft_cap * tanh(logits / soft_cap).
    segment_ids: None; int32 [B, S] when Sq == Skv (queries and keys share it); or a
      pair (q_segment_ids [B, Sq], kv_segment_ids [B, Skv]). Key j visible from query
      i only within the same segment.
    sinks: [Hq] (f32 or q's dtype): one learned logit per query head, added to the
      softmax denominator (gpt-oss).
    q_offset: int or int32 scalar (may be traced), >= 0: the position of query row 0
      in the key sequence (chunked prefill).
    return_lse: also return lse [B, Hq, Sq] float32.
    chip, block_q, block_k, vmem_limit_bytes: tiling (default from the chip's VMEM budget).
    interpret: run in Pallas interpret mode (CPU).

  Returns:
    out [B, Hq, Sq, D] in q's dtype, or (out, lse) when return_lse. Differentiable with
    respect to q, k, v and sinks (and through lse).
  """
  # TEMPORARY (contract only): the Pallas kernels replace this XLA path.
  del chip, block_q, block_k, vmem_limit_bytes, interpret
  out, lse = attention_xla(q, k, v, causal=causal, sm_scale=sm_scale,
                           sliding_window=sliding_window, soft_cap=soft_cap,
                           segment_ids=segment_ids, sinks=sinks, q_offset=q_offset)
  return (out, lse) if return_lse else out
