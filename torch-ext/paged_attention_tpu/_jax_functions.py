"""The typed JAX entry points behind the torch ops (imported on first use: it imports jax).

Each is fully annotated, as TorchTPU's `jax_op` requires: jax.Array for tensors,
plain Python types for static values. `chip` and `interpret` are filled in by the
shim (the host's TPU generation on TPU; interpret mode on CPU).

Optional tensors (sinks, k_scale, v_scale) travel as arrays of shape (0,) when absent:
a jax_op signature is fixed, and a (0,) array is free. Optional statics use a
sentinel: soft_cap 0.0, sliding_window 0, block_q / block_kv / items_per_call /
vmem_limit_bytes 0 and chip_name "" mean "none / the kernel's default".

The index tensors (kv_lens, page_indices, cu_q_lens, slot_mapping) are runtime values
of the kernels: one compiled program serves every step of a serving loop whose shapes
(padded token count, number of sequences, pages per sequence) stay the same.

KV-cache writes and buffer aliasing: the shim builds `write_kv_cache`'s TPU op with
TorchTPU's `jax_op(..., donate_argnums=(0, 1))` and `write_kv_pages`'s with
`donate_argnums=(0,)` (each op's JaxKernel declares it), so the exported program aliases
the cache(s) to the output(s) (`tf.aliasing_output`) and XLA may write the updated caches
into the buffers it was given instead of allocating new ones. XLA refuses to donate one
buffer twice, so `write_kv_cache` needs two distinct caches; a pool holding K and V pages
in one buffer (Transformers' continuous batching) is written with `write_kv_pages`, which
takes and donates that one buffer. TorchTPU's op declares no mutation (marking it mutable
would make torch copy back and defeat the donation); the torch ops do: they declare the
caches mutated and, if an output does not come back in its cache's own buffer (same
data_ptr), copy it in. On CPU the shim calls the function inside its own jax.jit
with nothing donated (the inputs are torch's memory, seen through DLPack, and must never
be handed to XLA to reuse), and the torch op copies the result into the caches.
"""

from __future__ import annotations

import jax

from .tpu_kernels import paged_attention as kernel


def _opt(a: jax.Array):
  return None if a.ndim == 1 and a.shape[0] == 0 else a


def ragged_paged_attention_forward(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                                   kv_lens: jax.Array, page_indices: jax.Array,
                                   cu_q_lens: jax.Array, sinks: jax.Array, k_scale: jax.Array,
                                   v_scale: jax.Array, sm_scale: float, soft_cap: float,
                                   sliding_window: int, block_q: int, block_kv: int,
                                   items_per_call: int, vmem_limit_bytes: int, chip_name: str,
                                   chip: str,
                                   interpret: bool) -> jax.Array:
  """out [T, Hq, D] in q's dtype (tokens past cu_q_lens[-1] are 0)."""
  return kernel.ragged_paged_attention(
      q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, sm_scale=sm_scale,
      soft_cap=soft_cap or None, sliding_window=sliding_window or None, sinks=_opt(sinks),
      k_scale=_opt(k_scale), v_scale=_opt(v_scale), chip=chip_name or chip,
      block_q=block_q or None, block_kv=block_kv or None,
      items_per_call=items_per_call or None, vmem_limit_bytes=vmem_limit_bytes or None,
      interpret=interpret)


def write_kv_cache(k_cache: jax.Array, v_cache: jax.Array, new_k: jax.Array,
                   new_v: jax.Array, slot_mapping: jax.Array, k_scale: jax.Array,
                   v_scale: jax.Array, chip: str,
                   interpret: bool) -> tuple[jax.Array, jax.Array]:
  """(k_cache, v_cache) with token t's K/V written to slot slot_mapping[t] (< 0: skipped).

  On TPU the caches are donated (the shim's donate_argnums=(0, 1)): see the module
  docstring. An XLA scatter: the same program on every chip.
  """
  del chip, interpret
  return kernel.write_kv_cache(k_cache, v_cache, new_k, new_v, slot_mapping,
                               k_scale=_opt(k_scale), v_scale=_opt(v_scale))


def write_kv_pages(cache: jax.Array, new_rows: jax.Array, slot_mapping: jax.Array,
                   scale: jax.Array, chip: str, interpret: bool) -> jax.Array:
  """cache with row t of new_rows written to slot slot_mapping[t] (< 0: skipped).

  One cache (K and V pages may share it); on TPU it is donated (the shim's
  donate_argnums=(0,)). The same XLA scatter as write_kv_cache's.
  """
  del chip, interpret
  return kernel.write_kv_pages(cache, new_rows, slot_mapping, scale=_opt(scale))
