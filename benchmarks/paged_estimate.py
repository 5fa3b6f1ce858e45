"""Static estimate of a paged-attention decode step (uniform batch), for tuning and the card.

    python benchmarks/paged_estimate.py [--chip v6e] [--batch 64] [--context 2048]
                                        [--heads 32 8] [--head-dim 128] [--page-size 16]
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
linearly to the real batch. These are static estimates, not measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))

if "--xla_jf_dump_static_llo_profile_to" not in os.environ.get("LIBTPU_INIT_ARGS", ""):
  os.environ["LIBTPU_INIT_ARGS"] = (
      os.environ.get("LIBTPU_INIT_ARGS", "") + " --xla_jf_dump_static_llo_profile_to="
      + tempfile.mkdtemp(prefix="static_llo_profile_"))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, paged_attention as PA  # noqa: E402

S = jax.ShapeDtypeStruct
TRUNCATED_BATCHES = (2, 4)


@dataclasses.dataclass(frozen=True)
class DecodeCase:
  batch: int
  context: int
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  page_size: int = 16
  kv_dtype: str = "bfloat16"
  q_dtype: str = "bfloat16"

  @property
  def label(self) -> str:
    return (f"paged decode S={self.batch} ctx={self.context} {self.q_heads}/{self.kv_heads} "
            f"D={self.head_dim} page={self.page_size} cache {self.kv_dtype}")

  def hbm_bytes(self) -> int:
    kv = 2 * self.batch * self.kv_heads * self.context * self.head_dim * \
        jnp.dtype(self.kv_dtype).itemsize
    q_out = 2 * self.batch * self.q_heads * self.head_dim * jnp.dtype(self.q_dtype).itemsize
    return kv + q_out

  def flops(self) -> int:
    return 4 * self.batch * self.q_heads * self.context * self.head_dim


def kernel_program(case: DecodeCase, chip: str, batch: int, block_kv: int | None):
  """(fn, specs, tiling) of the kernel alone for `batch` sequences of the case."""
  group = case.q_heads // case.kv_heads
  pages_per_seq = -(-case.context // case.page_size)
  t = PA.paged_tiling(case.batch, case.batch, pages_per_seq, case.page_size, case.head_dim,
                      num_kv_heads=case.kv_heads, group=group, q_dtype=jnp.dtype(case.q_dtype),
                      kv_dtype=jnp.dtype(case.kv_dtype), chip=chip, block_kv=block_kv)
  last_key = case.context - 1
  floors = dict(seq=0, rows=1, q_pos=last_key, kv_len=case.context, first_block=0,
                last_block=last_key // t.block_kv, first_page=0,
                last_page=last_key // case.page_size)
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
           S((batch * pages_per_seq,), jnp.int32), S((2, case.kv_heads), jnp.float32),
           S((batch, case.kv_heads * t.rows, case.head_dim), jnp.dtype(case.q_dtype)), cache,
           cache]

  def fn(*args):
    items = dict(zip(PA._ITEM_FIELDS, args[:len(PA._ITEM_FIELDS)]))
    table, scales, q_items, k_pages, v_pages = args[len(PA._ITEM_FIELDS):]
    return PA._call(items, table, scales, q_items, None, k_pages, v_pages, st)

  return fn, specs, t


def estimate(case: DecodeCase, chip: str, block_kv: int | None = None) -> dict:
  chip_ = chips.get_chip(chip)
  cycles = []
  for batch in TRUNCATED_BATCHES:
    fn, specs, t = kernel_program(case, chip, batch, block_kv)
    report = aot.compile_for_chip(fn, specs, chip)
    if not report.ok:
      raise RuntimeError(f"{case.label} on {chip}: {report.error}")
    cycles.append(report.estimated_cycles)
  (b0, c0), (b1, c1) = zip(TRUNCATED_BATCHES, cycles)
  per_seq = (c1 - c0) / (b1 - b0)
  total = c0 + per_seq * (case.batch - b0)
  compute_us = total / chip_.clock_hz * 1e6
  hbm_us = case.hbm_bytes() / chip_.hbm_bytes_per_s * 1e6
  roofline_us = max(case.flops() / chip_.bf16_flops_per_s * 1e6, hbm_us)
  predicted_us = max(compute_us, hbm_us)
  return dict(kernel="paged-attention-tpu", name=case.label, chip=chip,
              block_kv=t.block_kv, pages_per_block=t.pages_per_block,
              truncated_cycles=dict(zip(map(str, TRUNCATED_BATCHES), cycles)),
              estimated_cycles=int(total), compute_us=compute_us, hbm_bytes=case.hbm_bytes(),
              hbm_us=hbm_us, predicted_us=predicted_us, roofline_us=roofline_us,
              efficiency=roofline_us / predicted_us)


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--chip", default="v6e")
  p.add_argument("--batch", type=int, default=64)
  p.add_argument("--context", type=int, default=2048)
  p.add_argument("--heads", type=int, nargs=2, default=(32, 8))
  p.add_argument("--head-dim", type=int, default=128)
  p.add_argument("--page-size", type=int, default=16)
  p.add_argument("--kv-dtype", default="bfloat16")
  p.add_argument("--block-kv", type=int, nargs="*", default=[None])
  a = p.parse_args(argv)
  case = DecodeCase(a.batch, a.context, a.heads[0], a.heads[1], a.head_dim, a.page_size,
                    a.kv_dtype)
  for block_kv in a.block_kv:
    print(json.dumps(estimate(case, a.chip, block_kv)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
