"""paged-attention-tpu: ragged paged attention (mixed prefill and decode over a paged KV
cache) and KV-cache writes as Pallas TPU kernels, for PyTorch tensors on TPU (TorchTPU)
or CPU. Forward only: for serving.

    ragged_paged_attention(q, k_cache, v_cache, kv_lens, page_indices, cu_q_lens, *,
                           sm_scale=None, soft_cap=None, sliding_window=None, sinks=None,
                           k_scale=None, v_scale=None) -> out [T, Hq, D]
    write_kv_cache_(k_cache, v_cache, new_k, new_v, slot_mapping, *, k_scale=None,
                    v_scale=None)                       (in place; returns None)
    write_kv_pages_(cache, new_rows, slot_mapping, *, scale=None)
                              (the same write into ONE cache tensor: K and V pages of a
                               shared pool, e.g. Transformers' continuous batching)
    PagedKVCache, PagedBatch                            (page allocation, step metadata)
    register_attention(name="tpu_serving")              (Transformers serving loop)
    set_continuous_batching_attention(model)            (Transformers' generate_batch)

Layout, per layer: k_cache and v_cache are each [num_pages, Hkv, page_size, D] (page-major:
one page of every KV head is one contiguous run, one DMA); token j of sequence s lives at
[page_indices[s, j // page_size], :, j % page_size, :]. q packs
the new tokens of every sequence: sequence s owns q[cu_q_lens[s]:cu_q_lens[s + 1]],
and they are the LAST q_len of its kv_lens[s] tokens (decode: q_len 1; prefill chunk:
q_len > 1 after a cached prefix). Query i of sequence s (position p = kv_lens[s] -
q_len + i) sees key j iff j <= p (and p - j < sliding_window). Query head h reads KV
head h // (Hq / Hkv). Tokens past cu_q_lens[-1] (padding) give 0.

On "tpu" tensors the compiled kernel runs through TorchTPU; on "cpu" tensors the same
kernel runs in Pallas interpret mode (slow; for development and tests), and every index
input is checked against the shapes first. jax must be installed.
"""

from __future__ import annotations

import math

import torch

from . import _shim
from ._custom_ops import (QUANTIZED_DTYPES, ragged_paged_attention_op, write_kv_cache_op,
                          write_kv_pages_op)
from ._shim import validation
from ._shim.validation import check_int32, check_ndim, dtype_name
from .cache import PagedBatch, PagedKVCache
from .continuous_batching import (CONTINUOUS_BATCHING_ATTENTION_NAME,
                                  continuous_batching_attention, register_continuous_batching,
                                  set_continuous_batching_attention)
from .serving import (DEFAULT_ATTENTION_NAME, ServingStep, attention_forward,
                      make_attention_mask, register_attention)

__all__ = ["CONTINUOUS_BATCHING_ATTENTION_NAME", "DEFAULT_ATTENTION_NAME", "PagedBatch",
           "PagedKVCache", "ServingStep", "attention_forward", "continuous_batching_attention",
           "make_attention_mask", "ragged_paged_attention", "register_attention",
           "register_continuous_batching", "set_continuous_batching_attention",
           "write_kv_cache_", "write_kv_pages_"]

COMPUTE_DTYPES = (torch.float32, torch.bfloat16)


def _check_cache(op: str, name: str, cache) -> tuple[int, int, int, int]:
  """(num_pages, Hkv, page_size, D) of a valid cache `name`."""
  validation.check_tensor(op, name, cache)
  check_ndim(op, name, cache, 4, "[num_pages, kv_heads, page_size, head_dim]")
  if cache.dtype not in COMPUTE_DTYPES + QUANTIZED_DTYPES:
    raise TypeError(f"{op}: {name} has dtype {dtype_name(cache.dtype)}; a cache is "
                    f"float32 / bfloat16 (q's dtype) or int8 / float8_e4m3fn (with scales)")
  num_pages, num_kv_heads, page_size, head_dim = cache.shape
  if min(cache.shape) == 0:
    raise ValueError(f"{op}: {name} must have no empty dimension, got {tuple(cache.shape)}")
  if page_size % 16 or not 16 <= page_size <= 256:
    raise ValueError(f"{op}: page_size ({name}.shape[2]) must be a multiple of 16 in "
                     f"[16, 256], got {page_size}")
  return num_pages, num_kv_heads, page_size, head_dim


def _check_caches(op: str, k_cache, v_cache) -> tuple[int, int, int, int]:
  """(num_pages, Hkv, page_size, D) of a valid pair of caches."""
  validation.check_tensor(op, "k_cache", k_cache)
  validation.check_tensor(op, "v_cache", v_cache)
  check_ndim(op, "k_cache", k_cache, 4, "[num_pages, kv_heads, page_size, head_dim]")
  validation.check_same_dtype(op, "v_cache", v_cache, "k_cache", k_cache)
  validation.check_shape(op, "v_cache", v_cache, tuple(k_cache.shape), "the shape of k_cache")
  return _check_cache(op, "k_cache", k_cache)


def _scale(op: str, name: str, cache: torch.Tensor, s, num_kv_heads: int):
  """Scale `name` as a float32 [Hkv] tensor for a quantized cache, else None."""
  if cache.dtype not in QUANTIZED_DTYPES:
    if s is not None:
      raise ValueError(f"{op}: {name} is only for int8 / float8_e4m3fn caches; this cache "
                       f"is {dtype_name(cache.dtype)}")
    return None
  if s is None:
    raise ValueError(f"{op}: the cache is {dtype_name(cache.dtype)} (quantized) and needs "
                     f"{name}: a Python float, or a float32 tensor of shape () or "
                     f"({num_kv_heads},) (one per KV head)")
  if isinstance(s, torch.Tensor):
    validation.check_float_dtype(op, name, s, (torch.float32,))
    if s.dim() == 0:
      s = s.reshape(1).expand(num_kv_heads)
    validation.check_shape(op, name, s, (num_kv_heads,), "one scale per KV head")
    return s.contiguous()
  value = validation.check_finite_number(op, name, s)
  if value <= 0:
    raise ValueError(f"{op}: {name} must be > 0, got {value}")
  return torch.full((num_kv_heads,), value, dtype=torch.float32, device=cache.device)


def _scales(op: str, cache: torch.Tensor, k_scale, v_scale, num_kv_heads: int):
  """(k_scale, v_scale) as float32 [Hkv] tensors for a quantized cache, else (None, None)."""
  return tuple(_scale(op, name, cache, s, num_kv_heads)
               for name, s in (("k_scale", k_scale), ("v_scale", v_scale)))


def _optional_int(op: str, name: str, value, minimum: int) -> int:
  if value is None:
    return 0
  if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
    raise TypeError(f"{op}: {name} must be None or an int, got {type(value).__name__}")
  if value < minimum:
    raise ValueError(f"{op}: {name} must be None or >= {minimum}, got {value}")
  return int(value)


def _cpu_checks(device_type: str) -> bool:
  """Data-dependent checks: on CPU only (cheap there; on TPU they would force a device sync),
  and not while torch.compile traces (the values are not known then)."""
  return device_type == "cpu" and not torch.compiler.is_compiling()


def ragged_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           kv_lens: torch.Tensor, page_indices: torch.Tensor,
                           cu_q_lens: torch.Tensor, *, sm_scale: float | None = None,
                           soft_cap: float | None = None, sliding_window: int | None = None,
                           sinks: torch.Tensor | None = None, k_scale=None, v_scale=None,
                           chip: str | None = None, block_q: int | None = None,
                           block_kv: int | None = None, items_per_call: int | None = None,
                           vmem_limit_bytes: int | None = None) -> torch.Tensor:
  """Attention of packed new tokens over a paged KV cache (see the module docstring).

  Forward only: the op has no backward (a backward through it raises
  NotImplementedError); run it under torch.no_grad() / torch.inference_mode().

  Args:
    q: [T, Hq, D] float32 / bfloat16: the new tokens of all sequences, packed; tokens
      past cu_q_lens[-1] are padding (their output is 0), so T can be a fixed bucket.
    k_cache, v_cache: [num_pages, Hkv, page_size, D], in q's dtype, or int8 /
      float8_e4m3fn with k_scale and v_scale; page_size a multiple of 16 in [16, 256].
      They must already hold every sequence's first kv_lens[s] tokens, the new ones
      included (write them first with write_kv_cache_).
    kv_lens: [S] int32, each sequence's KV length including its new tokens.
    page_indices: [S, pages_per_seq] int32: sequence s's page ids, in order. Only the
      first ceil(kv_lens[s] / page_size) entries are read; pages may be shared.
    cu_q_lens: [S + 1] int32, 0 = cu_q_lens[0] <= ... <= cu_q_lens[S] <= T.
    sm_scale: logit scale, default 1 / sqrt(D).
    soft_cap: None or > 0: logits become soft_cap * tanh(logits / soft_cap).
    sliding_window: None or int >= 1: key j visible from position p only if
      p - j < sliding_window.
    sinks: None or [Hq] (float32 or q's dtype): one logit per query head added to the
      softmax denominator (gpt-oss).
    k_scale, v_scale: quantized caches only: a Python float or a float32 tensor of shape
      () or [Hkv]; the real value is cache.float() * scale.
    chip: the TPU generation to tile for ("v5e", "v6e", ...); default the host's.
    block_q, block_kv, items_per_call, vmem_limit_bytes: tiling overrides (default: the
      kernel's choice for the chip; see the kernel module's `paged_tiling`).
  Returns:
    out [T, Hq, D] in q's dtype.

  Raises TypeError for dtypes (a bf16 q with a float32 cache is refused: no silent
  casts), ValueError for shapes and, on CPU, for index values (page ids out of range,
  lengths beyond the pages given, cu_q_lens decreasing, more queries than KV tokens).
  """
  op = "ragged_paged_attention"
  validation.check_tensor(op, "q", q)
  validation.check_float_dtype(op, "q", q, COMPUTE_DTYPES)
  num_pages, num_kv_heads, page_size, head_dim = _check_caches(op, k_cache, v_cache)
  if k_cache.dtype not in QUANTIZED_DTYPES and k_cache.dtype != q.dtype:
    raise TypeError(f"{op}: k_cache has dtype {dtype_name(k_cache.dtype)} and q "
                    f"{dtype_name(q.dtype)}: a float cache must have q's dtype (no silent "
                    f"casts); quantized caches are int8 / float8_e4m3fn with scales")
  check_ndim(op, "q", q, 3, "[tokens, q_heads, head_dim]")
  num_tokens, num_q_heads, q_head_dim = q.shape
  if q_head_dim != head_dim:
    raise ValueError(f"{op}: q's head_dim {q_head_dim} differs from the cache's {head_dim}")
  if num_tokens == 0 or num_q_heads == 0:
    raise ValueError(f"{op}: q must have no empty dimension, got {tuple(q.shape)}")
  if num_q_heads % num_kv_heads:
    raise ValueError(f"{op}: q's {num_q_heads} heads must be a multiple of the cache's "
                     f"{num_kv_heads} KV heads (grouped-query attention)")
  for name, t in (("kv_lens", kv_lens), ("page_indices", page_indices),
                  ("cu_q_lens", cu_q_lens)):
    check_int32(op, name, t)
  check_ndim(op, "kv_lens", kv_lens, 1, "[num_seqs]")
  num_seqs = kv_lens.shape[0]
  if num_seqs == 0:
    raise ValueError(f"{op}: kv_lens must hold at least one sequence")
  check_ndim(op, "page_indices", page_indices, 2, "[num_seqs, pages_per_seq]")
  if page_indices.shape[0] != num_seqs or page_indices.shape[1] == 0:
    raise ValueError(f"{op}: page_indices must have shape ({num_seqs}, pages_per_seq >= 1) "
                     f"(one row per sequence of kv_lens), got {tuple(page_indices.shape)}")
  validation.check_shape(op, "cu_q_lens", cu_q_lens, (num_seqs + 1,),
                         "num_seqs + 1 cumulative query lengths")
  k_scale, v_scale = _scales(op, k_cache, k_scale, v_scale, num_kv_heads)
  if sm_scale is None:
    sm_scale = 1.0 / math.sqrt(head_dim)
  sm_scale = validation.check_finite_number(op, "sm_scale", sm_scale)
  cap = 0.0
  if soft_cap is not None:
    cap = validation.check_finite_number(op, "soft_cap", soft_cap)
    if cap <= 0:
      raise ValueError(f"{op}: soft_cap must be None or > 0, got {soft_cap}")
  window = _optional_int(op, "sliding_window", sliding_window, 1)
  if sinks is not None:
    validation.check_tensor(op, "sinks", sinks)
    validation.check_float_dtype(op, "sinks", sinks, (torch.float32,) if q.dtype == torch.float32
                                 else (torch.float32, q.dtype))
    validation.check_shape(op, "sinks", sinks, (num_q_heads,), "one logit per query head")
    sinks = sinks.contiguous()
  if chip is not None and not isinstance(chip, str):
    raise TypeError(f"{op}: chip must be None or a chip name (str), got {type(chip).__name__}")
  tiling = [_optional_int(op, name, value, 1) for name, value in (
      ("block_q", block_q), ("block_kv", block_kv), ("items_per_call", items_per_call),
      ("vmem_limit_bytes", vmem_limit_bytes))]
  device_type = _shim.device_type_of(op, {
      "q": q, "k_cache": k_cache, "v_cache": v_cache, "kv_lens": kv_lens,
      "page_indices": page_indices, "cu_q_lens": cu_q_lens, "sinks": sinks,
      "k_scale": k_scale, "v_scale": v_scale})
  if _cpu_checks(device_type):
    from .tpu_kernels import paged_attention as kernel

    kernel.check_indices(kv_lens.numpy(), page_indices.numpy(), cu_q_lens.numpy(),
                         num_tokens=num_tokens, num_pages=num_pages, page_size=page_size)
  return ragged_paged_attention_op(
      q.contiguous(), k_cache.contiguous(), v_cache.contiguous(), kv_lens.contiguous(),
      page_indices.contiguous(), cu_q_lens.contiguous(), sinks, k_scale, v_scale, sm_scale,
      cap, window, *tiling, chip or "")


def write_kv_cache_(k_cache: torch.Tensor, v_cache: torch.Tensor, new_k: torch.Tensor,
                    new_v: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale=None,
                    v_scale=None) -> None:
  """Writes new K/V into their cache slots, in place (the trailing underscore).

  For each token t with slot_mapping[t] >= 0: k_cache[slot // page_size, :,
  slot % page_size, :] = new_k[t] (likewise v); tokens with a negative slot (padding)
  are skipped. Quantized caches store int8: clip(round(x / scale), -127, 127); fp8:
  clip(x / scale, -448, 448) cast to e4m3fn. Which of two tokens with the same slot wins
  is undefined.

  A torch custom op that declares k_cache and v_cache mutated, so it is correct under
  torch.compile (the compiled graph keeps the write and orders reads after it). The
  caller's tensors are updated, storage unchanged. On CPU the JAX result is copied into
  them; on TPU the shim builds TorchTPU's `jax_op` with the caches donated
  (donate_argnums=(0, 1), XLA input/output aliasing), so the result can land in
  TorchTPU's own cache buffers, and the copy is skipped whenever it does (same buffer).

  Args:
    k_cache, v_cache: [num_pages, Hkv, page_size, D], contiguous; float32 / bfloat16, or
      int8 / float8_e4m3fn with k_scale and v_scale (as in ragged_paged_attention).
    new_k, new_v: [T, Hkv, D]: the cache's dtype for a float cache (no silent casts),
      float32 / bfloat16 for a quantized one.
    slot_mapping: [T] int32, slot = page_id * page_size + offset_in_page, or < 0 to skip.
  """
  op = "write_kv_cache_"
  num_pages, num_kv_heads, page_size, head_dim = _check_caches(op, k_cache, v_cache)
  _check_rows_and_slots(op, {"k_cache": k_cache, "v_cache": v_cache},
                        {"new_k": new_k, "new_v": new_v}, slot_mapping)
  k_scale, v_scale = _scales(op, k_cache, k_scale, v_scale, num_kv_heads)
  _check_slot_values(op, {
      "k_cache": k_cache, "v_cache": v_cache, "new_k": new_k, "new_v": new_v,
      "slot_mapping": slot_mapping, "k_scale": k_scale, "v_scale": v_scale},
      slot_mapping, num_pages, page_size)
  write_kv_cache_op(k_cache, v_cache, new_k.detach().contiguous(),
                    new_v.detach().contiguous(), slot_mapping.contiguous(), k_scale, v_scale)


def write_kv_pages_(cache: torch.Tensor, new_rows: torch.Tensor, slot_mapping: torch.Tensor,
                    *, scale=None) -> None:
  """write_kv_cache_ for ONE cache tensor, in place: K and V pages that share a buffer.

  For each row t with slot_mapping[t] >= 0: cache[slot // page_size, :, slot % page_size,
  :] = new_rows[t]; rows with a negative slot (padding) are skipped. Quantized caches
  store int8: clip(round(x / scale), -127, 127); fp8: clip(x / scale, -448, 448) cast to
  e4m3fn. Which of two rows with the same slot wins is undefined.

  Why a second write: write_kv_cache_ donates both of its caches to XLA on a TPU, and XLA
  refuses to donate one buffer twice, so it cannot take one buffer as both caches. A pool
  that keeps K and V pages in one tensor (Transformers' continuous batching: every layer's
  K and V pages in one flat buffer) passes the whole pool here once, with the step's K rows
  and V rows concatenated and each slot pointing at a K or a V page. On a TPU only this
  one cache is donated (donate_argnums=(0,)); as with write_kv_cache_, the op declares it
  mutated (correct under torch.compile), and the result is copied into it unless it
  already came back in its buffer (same storage before and after).

  Args:
    cache: [num_pages, Hkv, page_size, D], contiguous; float32 / bfloat16, or int8 /
      float8_e4m3fn with `scale`; page_size a multiple of 16 in [16, 256].
    new_rows: [T, Hkv, D]: the cache's dtype for a float cache (no silent casts),
      float32 / bfloat16 for a quantized one.
    slot_mapping: [T] int32, slot = page_id * page_size + offset_in_page, or < 0 to skip.
    scale: quantized caches only: a Python float or a float32 tensor of shape () or [Hkv],
      one for every row of the call (K and V pages with different scales: two calls).
  """
  op = "write_kv_pages_"
  num_pages, num_kv_heads, page_size, head_dim = _check_cache(op, "cache", cache)
  _check_rows_and_slots(op, {"cache": cache}, {"new_rows": new_rows}, slot_mapping)
  scale = _scale(op, "scale", cache, scale, num_kv_heads)
  _check_slot_values(op, {"cache": cache, "new_rows": new_rows, "slot_mapping": slot_mapping,
                          "scale": scale}, slot_mapping, num_pages, page_size)
  write_kv_pages_op(cache, new_rows.detach().contiguous(), slot_mapping.contiguous(), scale)


def _check_rows_and_slots(op: str, caches: dict, rows: dict, slot_mapping) -> None:
  """The caches (checked) are contiguous; the rows [T, Hkv, D] fit them (dtype, shape);
  slot_mapping is [T] int32."""
  cache = next(iter(caches.values()))
  _, num_kv_heads, _, head_dim = cache.shape
  for name, t in caches.items():
    if not t.is_contiguous():
      raise ValueError(f"{op}: {name} must be contiguous (it is updated in place)")
  for name, t in rows.items():
    validation.check_tensor(op, name, t)
    if cache.dtype in QUANTIZED_DTYPES:
      validation.check_float_dtype(op, name, t, COMPUTE_DTYPES)
    elif t.dtype != cache.dtype:
      raise TypeError(f"{op}: {name} has dtype {dtype_name(t.dtype)}, the cache "
                      f"{dtype_name(cache.dtype)}: new K/V must have the cache's dtype "
                      f"(no silent casts)")
  (first_name, first), *others = rows.items()
  check_ndim(op, first_name, first, 3, "[tokens, kv_heads, head_dim]")
  num_tokens = first.shape[0]
  validation.check_shape(op, first_name, first, (num_tokens, num_kv_heads, head_dim),
                         "[tokens, the cache's kv_heads, head_dim]")
  for name, t in others:
    validation.check_shape(op, name, t, tuple(first.shape), f"the shape of {first_name}")
  check_int32(op, "slot_mapping", slot_mapping)
  validation.check_shape(op, "slot_mapping", slot_mapping, (num_tokens,), "one slot per token")


def _check_slot_values(op: str, tensors: dict, slot_mapping, num_pages: int,
                       page_size: int) -> None:
  """All tensors on one device; on CPU, every slot is < 0 (skipped) or in the cache."""
  if _cpu_checks(_shim.device_type_of(op, tensors)):
    from .tpu_kernels import paged_attention as kernel

    try:
      kernel.check_slots(slot_mapping.numpy(), num_pages=num_pages, page_size=page_size)
    except ValueError as e:
      raise ValueError(f"{op}: {e}") from None
