"""Static estimate of a paged-attention decode step (uniform batch), for tuning and the card,
and of a serving step (a PagedBatch: decodes and chunked-prefill chunks, windows).

    python benchmarks/rating/paged_attention.py [--chip v6e] [--batch 64] [--context 2048]
                                                [--heads 32 8] [--head-dim 128] [--page-size 64]
                                                [--kv-dtype bfloat16] [--block-kv N ...]

libtpu's estimator reads every SMEM value as 0: lengths and page ids of a paged kernel
would all look empty. So the kernel is built through its internal `_call` with
`item_floors`: every per-item value is read as max(value, floor), the floors being the
batch's own values (all sequences at the same length, one new token each), so the
estimator sees the real trip counts. The page ids stay 0. With one BlockSpec per page
slot every slot then keeps the same block index, so the estimator sees no DMA, and its
cycles are the kernel's compute and step overhead; with the pages fetched by hand
(`manual_fetch`, the default) it sees every page's copy issued and waited for (all from
page 0: the same bytes), so its cycles include the copies' bookkeeping and any wait it
models. Either way its DMA model does not cap HBM bandwidth, so HBM is counted by hand
(each item reads each of its pages once per KV head: exact for this kernel, whose page
slots never re-read a page) and

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth)

The estimator's time grows faster than linearly with grid steps, so each case is rated
at two truncated batch sizes (identical per-sequence work) and the cycles extrapolated
linearly to the real batch; contexts past MAX_RATED_CONTEXT are rated at two shorter
contexts with the same tiling and extrapolated linearly in kv steps. These are static
estimates, not measurements.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

if __name__ == "__main__":   # the profile flag must be set before jax loads
  children.enable_static_profile()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, masking, paged_attention as PA  # noqa: E402

from benchmarks.cases import ITEMSIZE  # noqa: E402
from benchmarks.cases.headline import PagedDecode  # noqa: E402
from benchmarks.cases.serving import PagedBatch  # noqa: E402
from benchmarks.rating.roofline import prediction, roofline_us  # noqa: E402

RATES = (PagedDecode, PagedBatch)   # the case kinds rated here (rating/ours.py)

S = jax.ShapeDtypeStruct
TRUNCATED_BATCHES = (2, 4)
MAX_RATED_CONTEXT = 4096   # longer contexts: extrapolated per kv step (the estimator is slow)


def kernel_program(case: PagedDecode, chip: str, batch: int, block_kv: int | None,
                   manual_fetch: bool | None = None):
  """(fn, specs, tiling) of the kernel alone for `batch` sequences of the case
  (manual_fetch: the kernel's page fetch, None for its default)."""
  group = case.q_heads // case.kv_heads
  pages_per_seq = -(-case.context // case.page_size)
  t = PA.paged_tiling(case.batch, case.batch, pages_per_seq, case.page_size, case.head_dim,
                      num_kv_heads=case.kv_heads, group=group, q_dtype=jnp.dtype(case.q_dtype),
                      kv_dtype=jnp.dtype(case.kv_dtype), chip=chip, block_kv=block_kv,
                      manual_fetch=manual_fetch)
  last_key = case.context - 1
  floors = dict(rows=1, q_pos=last_key, kv_len=case.context, first_block=0,
                last_block=last_key // t.block_kv, first_page=0,
                last_page=last_key // case.page_size)
  quantized = jnp.dtype(case.kv_dtype) in PA.QUANTIZED_DTYPES
  st = PA._Static(sm_scale=1.0 / case.head_dim ** 0.5, soft_cap=None, sliding_window=None,
                  has_sinks=False, quantized=quantized, block_q=1, block_kv=t.block_kv,
                  page_size=case.page_size, pages_per_block=t.pages_per_block,
                  pages_per_seq=pages_per_seq, num_kv_heads=case.kv_heads, rows=t.rows,
                  group=group, vmem_limit_bytes=t.vmem_limit_bytes, interpret=False,
                  item_floors=tuple(floors[f] for f in PA._ITEM_FIELDS),
                  manual_fetch=t.manual_fetch, mask_in_f32=masking.selects_in_f32(chip))
  fn, specs = _kernel_call(case, t, st, batch, pages_per_seq,
                           PA._kv_steps(pages_per_seq, t.pages_per_block))
  return fn, specs, t


def _kernel_call(case, t: PA.Tiling, st, batch: int, pages_per_seq: int, kv_steps: int):
  """(fn, specs): PA._call on `batch` items of `pages_per_seq` pages, each visiting
  `kv_steps` kv blocks (the slot table's length per item), caches [pages, Hkv, page, D]."""
  cache = S((batch * pages_per_seq, case.kv_heads, case.page_size, case.head_dim),
            jnp.dtype(case.kv_dtype))
  specs = [*(S((batch,), jnp.int32) for _ in PA._ITEM_FIELDS),
           S((batch * kv_steps * t.pages_per_block,), jnp.int32),
           S((2, case.kv_heads), jnp.float32),
           S((batch, case.kv_heads * t.rows, case.head_dim), jnp.dtype(case.q_dtype)), cache,
           cache]

  def fn(*args):
    items = dict(zip(PA._ITEM_FIELDS, args[:len(PA._ITEM_FIELDS)]))
    slot_pages, scales, q_items, k_pages, v_pages = args[len(PA._ITEM_FIELDS):]
    return PA._call(items, slot_pages, scales, q_items, None, k_pages, v_pages, st)

  return fn, specs


def _rated_cycles(case: PagedDecode, chip: str, block_kv: int | None,
                  manual_fetch: bool | None = None):
  """Kernel cycles of the case, from truncated batches (and contexts): (cycles, tiling, how)."""
  def rate(c: PagedDecode, batch: int):
    fn, specs, t = kernel_program(c, chip, batch, block_kv, manual_fetch)
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
  t = kernel_program(case, chip, 1, block_kv, manual_fetch)[2]
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


def estimate(case: PagedDecode, chip: str, block_kv: int | None = None,
             manual_fetch: bool | None = None) -> dict:
  chip_ = chips.get_chip(chip)
  total, t, how, rated = _rated_cycles(case, chip, block_kv, manual_fetch)
  # Each item reads each of its pages once per KV head: the roofline's own bytes.
  hbm_bytes = case.min_bytes()
  p = prediction(total, hbm_bytes, chip_)
  roofline = roofline_us(case, chip_)
  return dict(kernel="paged-attention-tpu", name=case.name, chip=chip,
              block_kv=t.block_kv, pages_per_block=t.pages_per_block,
              manual_fetch=t.manual_fetch, truncated_cycles=rated, method="static estimate, " + how,
              estimated_cycles=int(total), compute_us=p["compute_us"], hbm_bytes=hbm_bytes,
              hbm_us=p["hbm_us"], predicted_us=p["predicted_us"], roofline_us=roofline,
              efficiency=roofline / p["predicted_us"])


# ----------------------------------------------------------------------------- serving batches
#
# A PagedBatch (mixed decode + prefill chunks, windows, any page size) has work items that
# differ. Items whose runs look the same to the kernel (rows used or not, the same first
# and last kv block, the same blocks seen whole or masked) cost the same: each such class
# is rated on its own as a uniform batch (floors = one of its items' values) at the case's
# tiling and grid width, at TRUNCATED_BATCHES items, and the per-item cycles summed over
# the case's items. HBM is counted by replaying the kernel's own slot table.


def batch_tiling(case: PagedBatch, chip: str, block_kv: int | None = None,
                 block_q: int | None = None) -> PA.Tiling:
  """The tiling ragged_paged_attention picks for the case (or the given block sizes)."""
  group = case.q_heads // case.kv_heads
  return PA.paged_tiling(case.num_tokens, case.decode + case.prefill, _pages_per_seq(case),
                         case.page_size, case.head_dim, num_kv_heads=case.kv_heads,
                         group=group, q_dtype=jnp.dtype(case.q_dtype),
                         kv_dtype=jnp.dtype(case.kv_dtype), chip=chip, block_q=block_q,
                         block_kv=block_kv)


def _pages_per_seq(case: PagedBatch) -> int:
  longest = max(kv for _, kv in case.sequences())
  return -(-longest // case.page_size)


def batch_items(case: PagedBatch, t: PA.Tiling) -> dict:
  """The kernel's own work items and slot table for the case (concrete, from
  paged_attention._work_items / _slot_pages): every sequence has its own pages. Returns
  the item fields (numpy [W]) and slot_pages [W, steps * pages_per_block]."""
  import numpy as np
  seqs = case.sequences()
  pages_per_seq = _pages_per_seq(case)
  num_items = PA.num_work_items(case.num_tokens, len(seqs), t.block_q)
  if num_items > t.items_per_call:
    raise NotImplementedError(f"{case.name}: {num_items} items need more than one call")
  kv_lens = jnp.asarray([kv for _, kv in seqs], jnp.int32)
  cu_q_lens = jnp.asarray(np.concatenate([[0], np.cumsum([q for q, _ in seqs])]), jnp.int32)
  page_indices = jnp.arange(len(seqs) * pages_per_seq, dtype=jnp.int32).reshape(
      len(seqs), pages_per_seq)
  items = PA._work_items(kv_lens, cu_q_lens, case.num_tokens, num_items, t.block_q,
                         t.block_kv, case.page_size, case.sliding_window)[0]
  steps = PA._grid_steps(pages_per_seq, t.pages_per_block, case.page_size, t.block_q,
                         case.sliding_window)
  slot_pages = PA._slot_pages(page_indices, items, t.pages_per_block, int(page_indices.size),
                              steps)
  return dict(items={f: np.asarray(items[f]) for f in PA._ITEM_FIELDS},
              slot_pages=np.asarray(slot_pages))


def item_classes(case: PagedBatch, t: PA.Tiling, items: dict) -> list[tuple[tuple, int]]:
  """[(floors, count)]: items grouped by what their run looks like to the kernel (rows
  used or not, first and last block, and which of those blocks are seen whole), each
  class's floors those of its first item (_ITEM_FIELDS order)."""
  classes: dict[tuple, list] = {}
  w = case.sliding_window
  for i in range(len(items["rows"])):
    v = {f: int(items[f][i]) for f in PA._ITEM_FIELDS}
    last_key = v["q_pos"] + v["rows"] - 1
    whole = tuple(b * t.block_kv + t.block_kv - 1 <= v["q_pos"]
                  and (w is None or b * t.block_kv > last_key - w)
                  for b in range(v["first_block"], v["last_block"] + 1))
    # Hand-fetched pages: the first and last blocks copy only the item's pages in them.
    n = t.pages_per_block
    pages = (v["first_page"] - v["first_block"] * n, v["last_page"] - v["last_block"] * n)
    key = (v["rows"] > 0, v["first_block"], v["last_block"], whole,
           pages if t.manual_fetch else None)
    entry = classes.setdefault(key, [tuple(v[f] for f in PA._ITEM_FIELDS), 0])
    entry[1] += 1
  return [(floors, count) for floors, count in classes.values()]


def batch_kernel_program(case: PagedBatch, chip: str, t: PA.Tiling, floors: tuple, batch: int):
  """(fn, specs) of the kernel alone on `chip` for `batch` items that all read as `floors`."""
  pages_per_seq = _pages_per_seq(case)
  group = case.q_heads // case.kv_heads
  quantized = jnp.dtype(case.kv_dtype) in PA.QUANTIZED_DTYPES
  st = PA._Static(sm_scale=1.0 / case.head_dim ** 0.5, soft_cap=None,
                  sliding_window=case.sliding_window, has_sinks=False, quantized=quantized,
                  block_q=t.block_q, block_kv=t.block_kv, page_size=case.page_size,
                  pages_per_block=t.pages_per_block, pages_per_seq=pages_per_seq,
                  num_kv_heads=case.kv_heads, rows=t.rows, group=group,
                  vmem_limit_bytes=t.vmem_limit_bytes, interpret=False,
                  item_floors=tuple(int(f) for f in floors),
                  small_rows=PA.small_rows(t, group, jnp.dtype(case.q_dtype)),
                  manual_fetch=t.manual_fetch, mask_in_f32=masking.selects_in_f32(chip))
  return _kernel_call(case, t, st, batch, pages_per_seq,
                      PA._grid_steps(pages_per_seq, t.pages_per_block, case.page_size,
                                     t.block_q, case.sliding_window))


def batch_hbm_bytes(case: PagedBatch, t: PA.Tiling, slot_pages, items: dict) -> int:
  """Bytes the kernel moves: K and V alike, with pages fetched by hand each page of
  [first_page, last_page] of a non-empty item once; with a BlockSpec per page slot, a
  slot fetches its page whenever its page id differs from the previous grid step's
  (Pallas skips unchanged blocks). Plus every item's q block read and out block written
  once (R rows per KV head, padding included)."""
  page_bytes = case.kv_heads * case.page_size * case.head_dim * ITEMSIZE[case.kv_dtype]
  if t.manual_fetch:
    fetched = ((items["last_page"] - items["first_page"] + 1) * (items["rows"] > 0)).sum()
  else:
    per_step = slot_pages.reshape(-1, t.pages_per_block)          # grid steps in order
    fetched = (1 + (per_step[1:] != per_step[:-1]).sum(axis=0)).sum()   # over slots
  num_items = slot_pages.shape[0]
  q_block = case.kv_heads * t.rows * case.head_dim * ITEMSIZE[case.q_dtype]
  return int(2 * fetched * page_bytes + 2 * num_items * q_block)


def estimate_batch(case: PagedBatch, chip: str, block_kv: int | None = None,
                   block_q: int | None = None) -> dict:
  """The static estimate of one serving step (see the section comment)."""
  chip_ = chips.get_chip(chip)
  t = batch_tiling(case, chip, block_kv, block_q)
  tables = batch_items(case, t)
  classes = item_classes(case, t, tables["items"])
  (b0, b1) = TRUNCATED_BATCHES
  rated, fixed, total = [], [], 0.0
  for floors, count in classes:
    cycles = []
    for b in TRUNCATED_BATCHES:
      fn, specs = batch_kernel_program(case, chip, t, floors, b)
      report = aot.compile_for_chip(fn, specs, chip)
      if not report.ok:
        raise RuntimeError(f"{case.name} (class {floors}, {b} items) on {chip}: {report.error}")
      cycles.append(report.estimated_cycles)
    per_item = (cycles[1] - cycles[0]) / (b1 - b0)
    fixed.append((count, cycles[0] - per_item * b0))
    total += per_item * count
    rated.append(dict(floors=dict(zip(PA._ITEM_FIELDS, floors)), items=count,
                      cycles={str(b0): cycles[0], str(b1): cycles[1]}, per_item=per_item))
  total += max(fixed)[1]    # one launch: the fixed part of the most numerous class
  hbm_bytes = batch_hbm_bytes(case, t, tables["slot_pages"], tables["items"])
  p = prediction(total, hbm_bytes, chip_)
  roofline = roofline_us(case, chip_)
  how = (f"{len(tables['items']['rows'])} work items in {len(classes)} classes (items that "
         f"run the same blocks the same way), each class rated as a uniform batch at "
         f"{TRUNCATED_BATCHES} items and extrapolated to its count; HBM by replaying the "
         f"kernel's " + ("page fetches" if t.manual_fetch else "slot table"))
  return dict(kernel="paged-attention-tpu", name=case.name, chip=chip, block_q=t.block_q,
              block_kv=t.block_kv, pages_per_block=t.pages_per_block, classes=rated,
              method="static estimate, " + how, estimated_cycles=int(total),
              compute_us=p["compute_us"], hbm_bytes=hbm_bytes, hbm_us=p["hbm_us"],
              predicted_us=p["predicted_us"], roofline_us=roofline,
              efficiency=roofline / p["predicted_us"])


def rate(case, chip: str) -> dict:
  """Our kernel's partial row for a paged decode or serving case (rating/ours.py)."""
  if isinstance(case, PagedBatch):
    r = estimate_batch(case, chip)
    return dict(compiled=True, error=None, estimated_cycles=r["estimated_cycles"],
                hbm_bytes=r["hbm_bytes"], method=r["method"],
                tiling=dict(block_q=r["block_q"], block_kv=r["block_kv"],
                            pages_per_block=r["pages_per_block"]), classes=r["classes"])
  r = estimate(case, chip)
  return dict(compiled=True, error=None, estimated_cycles=r["estimated_cycles"],
              hbm_bytes=r["hbm_bytes"], method=r["method"],
              tiling=dict(block_kv=r["block_kv"], pages_per_block=r["pages_per_block"]))


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
  p.add_argument("--fetch", choices=("default", "manual", "blockspec"), default="default",
                 help="the kernel's page fetch: by hand, one BlockSpec per page slot, or "
                      "its default for the page size")
  a = p.parse_args(argv)
  manual_fetch = {"default": None, "manual": True, "blockspec": False}[a.fetch]
  case = PagedDecode(a.context, a.batch, a.heads[0], a.heads[1], a.head_dim, a.page_size,
                     a.kv_dtype)
  for block_kv in a.block_kv:
    print(json.dumps(estimate(case, a.chip, block_kv, manual_fetch)), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
