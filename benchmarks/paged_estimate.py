"""Static estimate of a paged-attention decode step (uniform batch), for tuning and the card.

    python benchmarks/paged_estimate.py [--chip v6e] [--batch 64] [--context 2048]
                                        [--heads 32 8] [--head-dim 128] [--page-size 64]
                                        [--kv-dtype bfloat16] [--block-kv N ...]

libtpu's estimator reads every SMEM value as 0: lengths and page ids of a paged kernel
would all look empty. So the kernel is built through its internal `_call` with
`item_floors`: every per-item value is read as max(value, floor), the floors being the
batch's own values (all sequences at the same length, one new token each), so the
estimator sees the real trip counts. The page ids stay 0: every page slot keeps the
same block index, so the estimator sees no DMA, and its cycles are the kernel's compute
and step overhead. HBM is then counted by hand (each item reads each of its pages once
per KV head: exact for this kernel, whose page slots never re-read a page) and

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth)

The estimator's time grows faster than linearly with grid steps, so each case is rated
at two truncated batch sizes (identical per-sequence work) and the cycles extrapolated
linearly to the real batch; contexts past MAX_RATED_CONTEXT are rated at two shorter
contexts with the same tiling and extrapolated linearly in kv steps. These are static
estimates, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))
import tuning  # noqa: E402  (no jax)

if __name__ == "__main__":   # run as a script: the profile flag must be set before jax loads
  tuning.enable_static_profile()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, paged_attention as PA  # noqa: E402

from headline import PagedDecode  # noqa: E402

S = jax.ShapeDtypeStruct
TRUNCATED_BATCHES = (2, 4)
MAX_RATED_CONTEXT = 4096   # longer contexts: extrapolated per kv step (the estimator is slow)


def kernel_program(case: PagedDecode, chip: str, batch: int, block_kv: int | None):
  """(fn, specs, tiling) of the kernel alone for `batch` sequences of the case."""
  group = case.q_heads // case.kv_heads
  pages_per_seq = -(-case.context // case.page_size)
  t = PA.paged_tiling(case.batch, case.batch, pages_per_seq, case.page_size, case.head_dim,
                      num_kv_heads=case.kv_heads, group=group, q_dtype=jnp.dtype(case.q_dtype),
                      kv_dtype=jnp.dtype(case.kv_dtype), chip=chip, block_kv=block_kv)
  last_key = case.context - 1
  floors = dict(rows=1, q_pos=last_key, kv_len=case.context, first_block=0,
                last_block=last_key // t.block_kv)
  quantized = jnp.dtype(case.kv_dtype) in PA.QUANTIZED_DTYPES
  st = PA._Static(sm_scale=1.0 / case.head_dim ** 0.5, soft_cap=None, sliding_window=None,
                  has_sinks=False, quantized=quantized, block_q=1, block_kv=t.block_kv,
                  page_size=case.page_size, pages_per_block=t.pages_per_block,
                  pages_per_seq=pages_per_seq, num_kv_heads=case.kv_heads, rows=t.rows,
                  vmem_limit_bytes=t.vmem_limit_bytes, interpret=False,
                  item_floors=tuple(floors[f] for f in PA._ITEM_FIELDS))
  num_pages = batch * pages_per_seq
  cache = S((num_pages, case.kv_heads, case.page_size, case.head_dim),
            jnp.dtype(case.kv_dtype))
  specs = [*(S((batch,), jnp.int32) for _ in PA._ITEM_FIELDS),
           S((batch * PA._kv_steps(pages_per_seq, t.pages_per_block) * t.pages_per_block,),
             jnp.int32),
           S((2, case.kv_heads), jnp.float32),
           S((batch, case.kv_heads * t.rows, case.head_dim), jnp.dtype(case.q_dtype)), cache,
           cache]

  def fn(*args):
    items = dict(zip(PA._ITEM_FIELDS, args[:len(PA._ITEM_FIELDS)]))
    slot_pages, scales, q_items, k_pages, v_pages = args[len(PA._ITEM_FIELDS):]
    return PA._call(items, slot_pages, scales, q_items, None, k_pages, v_pages, st)

  return fn, specs, t


def _rated_cycles(case: PagedDecode, chip: str, block_kv: int | None):
  """Kernel cycles of the case, from truncated batches (and contexts): (cycles, tiling, how)."""
  def rate(c: PagedDecode, batch: int):
    fn, specs, t = kernel_program(c, chip, batch, block_kv)
    report = aot.compile_for_chip(fn, specs, chip)
    if not report.ok:
      raise RuntimeError(f"{c.name} (batch {batch}) on {chip}: {report.error}")
    return report.estimated_cycles, t

  def per_sequence(c: PagedDecode):
    (c0, t), (c1, _) = (rate(c, b) for b in TRUNCATED_BATCHES)
    (b0, b1) = TRUNCATED_BATCHES
    per_seq = (c1 - c0) / (b1 - b0)
    return c0 - per_seq * b0, per_seq, t, {str(b0): c0, str(b1): c1}

  if case.context <= MAX_RATED_CONTEXT:
    fixed, per_seq, t, rated = per_sequence(case)
    how = f"rated at batch {TRUNCATED_BATCHES}, extrapolated to {case.batch}"
    return fixed + per_seq * case.batch, t, how, rated
  # Long contexts: the per-sequence cycles at two shorter contexts with the same tiling,
  # extrapolated linearly in kv steps (each kv step of a decode item is the same work).
  t = kernel_program(case, chip, 1, block_kv)[2]
  contexts = (MAX_RATED_CONTEXT // 2, MAX_RATED_CONTEXT)
  points = [per_sequence(dataclasses.replace(case, context=ctx)) for ctx in contexts]
  steps = [-(-ctx // pt[2].block_kv) for ctx, pt in zip(contexts, points)]
  if any(pt[2].block_kv != t.block_kv for pt in points):
    raise RuntimeError(f"{case.name}: the shorter contexts tile differently "
                       f"({[pt[2].block_kv for pt in points]} vs {t.block_kv})")
  per_step = (points[1][1] - points[0][1]) / (steps[1] - steps[0])
  per_seq = points[1][1] + per_step * (-(-case.context // t.block_kv) - steps[1])
  how = (f"rated at contexts {contexts} x batch {TRUNCATED_BATCHES}, extrapolated per kv "
         f"step ({per_step:,.0f} cycles) to {case.context} and batch {case.batch}")
  rated = {f"{ctx}/{b}": v for ctx, pt in zip(contexts, points) for b, v in pt[3].items()}
  return points[1][0] + per_seq * case.batch, t, how, rated


def estimate(case: PagedDecode, chip: str, block_kv: int | None = None) -> dict:
  chip_ = chips.get_chip(chip)
  total, t, how, rated = _rated_cycles(case, chip, block_kv)
  compute_us = total / chip_.clock_hz * 1e6
  # Each item reads each of its pages once per KV head: the roofline's own bytes.
  hbm_bytes = case.min_bytes()
  hbm_us = hbm_bytes / chip_.hbm_bytes_per_s * 1e6
  roofline_us = max(case.flops() / chip_.bf16_flops_per_s * 1e6, hbm_us)
  predicted_us = max(compute_us, hbm_us)
  return dict(kernel="paged-attention-tpu", name=case.name, chip=chip,
              block_kv=t.block_kv, pages_per_block=t.pages_per_block,
              truncated_cycles=rated, method="static estimate, " + how,
              estimated_cycles=int(total), compute_us=compute_us, hbm_bytes=hbm_bytes,
              hbm_us=hbm_us, predicted_us=predicted_us, roofline_us=roofline_us,
              efficiency=roofline_us / predicted_us)


def xla_program(case: PagedDecode):
  """(fn, specs): paged_attention_xla (gathers each sequence's pages) on the decode batch."""
  pages_per_seq = -(-case.context // case.page_size)
  num_pages = case.batch * pages_per_seq
  cache = S((num_pages, case.kv_heads, case.page_size, case.head_dim), jnp.dtype(case.kv_dtype))
  specs = [S((case.batch, case.q_heads, case.head_dim), jnp.dtype(case.q_dtype)), cache, cache,
           S((case.batch,), jnp.int32), S((case.batch, pages_per_seq), jnp.int32),
           S((case.batch + 1,), jnp.int32)]
  return PA.paged_attention_xla, specs


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--chip", default="v6e")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--heads", type=int, nargs=2, default=(32, 8))
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--page-size", type=int, default=64)
  p.add_argument("--kv-dtype", default="bfloat16")
  p.add_argument("--block-kv", type=int, nargs="*", default=[None])
  a = p.parse_args(argv)
  case = PagedDecode(a.context, a.batch, a.heads[0], a.heads[1], a.head_dim, a.page_size,
                     a.kv_dtype)
  for block_kv in a.block_kv:
    print(json.dumps(estimate(case, a.chip, block_kv)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
