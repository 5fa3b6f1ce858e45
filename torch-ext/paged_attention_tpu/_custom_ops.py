"""The torch custom ops of paged-attention-tpu: schema, fake (shape) functions, autograd.

Ops, in the namespace of this build (`_ops.NAMESPACE`, unique per kernel and version):

  ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, sinks?,
                         k_scale?, v_scale?, sm_scale, soft_cap, sliding_window, block_q,
                         block_kv, items_per_call, vmem_limit_bytes, chip_name)
      -> out [T, Hq, D]
  write_kv_cache(k_cache!, v_cache!, new_k, new_v, slot_mapping, k_scale?, v_scale?) -> ()
  write_kv_pages(cache!, new_rows, slot_mapping, scale?) -> ()

Absent optional tensors travel to JAX as empty (0,) float32 tensors. soft_cap 0.0,
sliding_window 0, block_q / block_kv / items_per_call / vmem_limit_bytes 0 and chip_name
"" mean "none /
the kernel's default".

Forward only (serving): ragged_paged_attention registers an autograd formula whose
backward raises NotImplementedError, so a forward under autograd (a model called without
torch.no_grad) works and only an actual backward fails, with a message saying why.

write_kv_cache declares both caches as mutated (`mutates_args`), so torch.compile and
functionalization order it before the attention that reads them and never drop it. It
returns nothing: the caller's tensors are the result (same storage before and after).
write_kv_pages is the same write into ONE cache tensor (declared mutated, donated alone
on TPU): for K and V pages that share a buffer, which write_kv_cache cannot take (it
donates both of its caches, and XLA refuses to donate one buffer twice).
"""

from __future__ import annotations

import torch

from . import _shim
from ._ops import add_op_namespace_prefix
from .tpu_kernels.chips import DEFAULT_CHIP

QUANTIZED_DTYPES = (torch.int8, torch.float8_e4m3fn)

_jax_kernel = _shim.jax_kernels(__package__, add_op_namespace_prefix, cpu_chip=DEFAULT_CHIP)
_attention = _jax_kernel("ragged_paged_attention", "ragged_paged_attention_forward")
# The caches (tensors 0 and 1) are donated to the TPU program: see _jax_functions' docstring.
_write = _jax_kernel("write_kv_cache", "write_kv_cache", donate_argnums=(0, 1))
_write_pages = _jax_kernel("write_kv_pages", "write_kv_pages", donate_argnums=(0,))


def _empty(like: torch.Tensor) -> torch.Tensor:
  """An empty (0,) float32 tensor: how an absent tensor travels to JAX."""
  return like.new_empty((0,), dtype=torch.float32)


def _or_empty(t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
  return _empty(like) if t is None else t


# ------------------------------------------------------------------ ragged_paged_attention


def _attention_impl(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    kv_lens: torch.Tensor, page_indices: torch.Tensor, cu_q_lens: torch.Tensor,
                    sinks: torch.Tensor | None, k_scale: torch.Tensor | None,
                    v_scale: torch.Tensor | None, sm_scale: float, soft_cap: float,
                    sliding_window: int, block_q: int, block_kv: int, items_per_call: int,
                    vmem_limit_bytes: int, chip_name: str) -> torch.Tensor:
  tensors = {"q": q, "k_cache": k_cache, "v_cache": v_cache, "kv_lens": kv_lens,
             "page_indices": page_indices, "cu_q_lens": cu_q_lens,
             "sinks": _or_empty(sinks, q), "k_scale": _or_empty(k_scale, q),
             "v_scale": _or_empty(v_scale, q)}
  return _attention(tensors, sm_scale=sm_scale, soft_cap=soft_cap,
                    sliding_window=sliding_window, block_q=block_q, block_kv=block_kv,
                    items_per_call=items_per_call, vmem_limit_bytes=vmem_limit_bytes,
                    chip_name=chip_name)


def _attention_fake(q, *rest):
  return torch.empty_like(q)


def _attention_setup_context(ctx, inputs, output):
  pass


def _attention_backward(ctx, grad_out):
  raise NotImplementedError(
      "paged-attention-tpu: ragged_paged_attention is forward-only (serving: prefill and "
      "decode over a paged KV cache); it has no backward. Run serving under torch.no_grad() / "
      "torch.inference_mode(), and train with flash-attention-tpu instead")


def _setup_attention(op):
  op.register_fake(_attention_fake)
  op.register_autograd(_attention_backward, setup_context=_attention_setup_context)


ragged_paged_attention_op = _shim.custom_op_once(
    add_op_namespace_prefix("ragged_paged_attention"), _attention_impl,
    setup=_setup_attention)


# --------------------------------------------------------------------------- write_kv_cache


def _write_impl(k_cache: torch.Tensor, v_cache: torch.Tensor, new_k: torch.Tensor,
                new_v: torch.Tensor, slot_mapping: torch.Tensor, k_scale: torch.Tensor | None,
                v_scale: torch.Tensor | None) -> None:
  tensors = {"k_cache": k_cache, "v_cache": v_cache, "new_k": new_k, "new_v": new_v,
             "slot_mapping": slot_mapping, "k_scale": _or_empty(k_scale, new_k),
             "v_scale": _or_empty(v_scale, new_k)}
  k_out, v_out = _write(tensors)
  _copy_back(k_cache, k_out)
  _copy_back(v_cache, v_out)


def _copy_back(cache: torch.Tensor, out: torch.Tensor) -> None:
  """TPU: with the donation honoured the output already lives in the cache's buffer
  (nothing to copy); CPU: a fresh JAX buffer, copied into the caller's tensor."""
  if out.data_ptr() != cache.data_ptr():
    cache.copy_(out)


def _write_fake(k_cache, v_cache, new_k, new_v, slot_mapping, k_scale, v_scale):
  return None


write_kv_cache_op = _shim.custom_op_once(
    add_op_namespace_prefix("write_kv_cache"), _write_impl,
    mutates_args=("k_cache", "v_cache"),
    setup=lambda op: op.register_fake(_write_fake))


# --------------------------------------------------------------------------- write_kv_pages


def _write_pages_impl(cache: torch.Tensor, new_rows: torch.Tensor, slot_mapping: torch.Tensor,
                      scale: torch.Tensor | None) -> None:
  tensors = {"cache": cache, "new_rows": new_rows, "slot_mapping": slot_mapping,
             "scale": _or_empty(scale, new_rows)}
  _copy_back(cache, _write_pages(tensors))


def _write_pages_fake(cache, new_rows, slot_mapping, scale):
  return None


write_kv_pages_op = _shim.custom_op_once(
    add_op_namespace_prefix("write_kv_pages"), _write_pages_impl, mutates_args=("cache",),
    setup=lambda op: op.register_fake(_write_pages_fake))
