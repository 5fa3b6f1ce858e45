"""The typed JAX entry points behind the torch ops (imported on first use: it imports jax).

Each is fully annotated, as TorchTPU's `jax_op` requires: jax.Array for tensors,
plain Python types for static values. `chip` and `interpret` are filled in by the
shim (the host's TPU generation on TPU; interpret mode on CPU).

Optional tensors travel as arrays of shape (0,) when absent: a jax_op signature is
fixed, and a (0,) array is free. That holds for sinks, the segment ids and the lse
cotangent. Optional statics use a sentinel: sliding_window 0 and soft_cap 0.0 mean
"none".

q_offset is always a (1,) int32 array: the kernel reads it at run time (scalar
prefetch), so one compiled kernel serves every offset (chunked prefill, decode steps).
The static zero_offset says it is 0 (the caller passed the int 0): the kernel then gets
the Python int 0, which lets causal self-attention take the folded grid
(flash_attention._fold_causal); at most one more compile.

The backward recomputes the forward under jax.vjp, so the kernel's own Pallas
backward (its custom_vjp) runs. The sinks gradient comes back as (0,) without sinks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .tpu_kernels import flash_attention as kernel


def _opt(a: jax.Array):
  return None if a.ndim == 1 and a.shape[0] == 0 else a


def _none_array() -> jax.Array:
  return jnp.zeros((0,), jnp.float32)


def _attention(q, k, v, sinks, q_segment_ids, kv_segment_ids, q_offset, causal, sm_scale,
               sliding_window, soft_cap, zero_offset, chip, interpret):
  """(out, lse) of the kernel, optional inputs already None or arrays."""
  segment_ids = None if q_segment_ids is None else (q_segment_ids, kv_segment_ids)
  return kernel.flash_attention(
      q, k, v, causal=causal, sm_scale=sm_scale, sliding_window=sliding_window or None,
      soft_cap=soft_cap or None, segment_ids=segment_ids, sinks=sinks,
      q_offset=0 if zero_offset else q_offset.reshape(()), return_lse=True, chip=chip,
      interpret=interpret)


def flash_attention_forward(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array,
                            q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                            q_offset: jax.Array, causal: bool, sm_scale: float,
                            sliding_window: int, soft_cap: float, zero_offset: bool,
                            chip: str, interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] float32)."""
  return _attention(q, k, v, _opt(sinks), _opt(q_segment_ids), _opt(kv_segment_ids),
                    q_offset, causal, sm_scale, sliding_window, soft_cap, zero_offset, chip,
                    interpret)


def flash_attention_backward(q: jax.Array, k: jax.Array, v: jax.Array, sinks: jax.Array,
                             q_segment_ids: jax.Array, kv_segment_ids: jax.Array,
                             q_offset: jax.Array, grad_out: jax.Array, grad_lse: jax.Array,
                             causal: bool, sm_scale: float, sliding_window: int,
                             soft_cap: float, zero_offset: bool, chip: str, interpret: bool
                             ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """(dq, dk, dv, dsinks) of <grad_out, out> + <grad_lse, lse>.

  grad_lse (0,): lse unused, only out is differentiated. dsinks is (0,) without sinks.
  """
  s = _opt(sinks)
  has_sinks = s is not None
  with_lse = _opt(grad_lse) is not None
  q_seg, kv_seg = _opt(q_segment_ids), _opt(kv_segment_ids)

  def f(q_, k_, v_, sinks_):
    out, lse = _attention(q_, k_, v_, sinks_ if has_sinks else None, q_seg, kv_seg, q_offset,
                          causal, sm_scale, sliding_window, soft_cap, zero_offset, chip,
                          interpret)
    return (out, lse) if with_lse else out

  _, vjp = jax.vjp(f, q, k, v, s if has_sinks else _none_array())
  cotangent = grad_out.astype(q.dtype)
  if with_lse:
    cotangent = (cotangent, grad_lse.astype(jnp.float32))
  dq, dk, dv, dsinks = vjp(cotangent)
  return dq, dk, dv, dsinks
