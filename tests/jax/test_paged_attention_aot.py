"""Every default paged-attention configuration compiles ahead of time for v5e and v6e.

The matrix (scripts/paged_attention_cases.py): decode at batch {1, 64, 256} x context
{2k, 32k, 128k} x heads {32/8, 64/8, 16/1} x head_dim {64, 128, 256}, page size 16, bf16;
plus feature programs (mixed prefill + decode with window / soft-cap / sinks, prefill
only, int8 and fp8 caches, page size 256, f32), and one decode program per entry of the
tuning table (kernels/tpu_kernels/tuned/paged_attention.<chip>.json). Each program is compiled by libtpu
(Mosaic, then LLO), which rejects illegal blocks and VMEM or SMEM overflow. Checked per
program: it compiles; it holds exactly one Mosaic kernel, `ragged_paged_attention`
(the SMEM-chunked cases run that one kernel in a loop); it compiled under the scoped-VMEM
limit `paged_tiling` asked for, within the chip's allowance; the tiling's VMEM plan and
SMEM tables fit their budgets. Each tiling is written to the test report.

Of the 9 (batch, context) programs of a (heads, head_dim, chip), those that run the same
kernel (the same blocks, VMEM limit and sequences per call: they differ only in the
length of the page table and in how many calls the SMEM-chunked path makes) are
compiled once, at the one with the largest SMEM tables (`aot_pool.largest_per_kernel`):
5 of the 9. `TPU_KERNELS_AOT_FULL_MATRIX=1` compiles all 9. One test per (heads,
head_dim, chip), 1-15 s of compile per program; all compiles are queued at once on the
shared two-worker pool.

Depth: the CI profile compiles a cross of the (heads, head_dim) matrix: every head layout
at head_dim 128 and every head_dim at 32 / 8 heads (5 of the 9 pairs per chip). The other
four (64 / 8 and 16 / 1 heads at head_dim 64 and 256: about 240 s of CI's longest runs on
2026-12-07) compile under HYPOTHESIS_PROFILE=thorough.
"""

import functools
import re

import pytest

import aot_pool
from aot_pool import check_compiled, largest_per_kernel, module_compiles
from paged_attention_cases import (AOT_CHIPS, BATCHES, CONTEXTS, FEATURE_CONFIGS, HEAD_DIMS,
                                   HEADS, Config, Program, compile_case, default_programs,
                                   feature_programs)
from tpu_kernels import chips, paged_attention as PA, vmem

pytestmark = pytest.mark.aot


def _check(program, report, chip):
  what = f"{program.label} on {chip}"
  assert report.ok, f"{what}: {report.error}"
  assert report.num_kernels == 1 and PA.KERNEL_NAME in report.kernel_names[0], (
      f"{what}: Mosaic kernels {report.kernel_names}")
  t = program.tiling(chip)
  assert report.scoped_vmem_bytes == t.vmem_limit_bytes, (
      f"{what}: compiled under {report.scoped_vmem_bytes} bytes of scoped VMEM, "
      f"paged_tiling asked for {t.vmem_limit_bytes}")
  chip_ = chips.get_chip(chip)
  assert report.scoped_vmem_bytes <= chip_.max_vmem_limit_bytes, what
  assert t.vmem_plan_bytes <= t.vmem_limit_bytes, f"{what}: {t}"
  assert t.smem_plan_words <= vmem.smem_budget_words(chip_), f"{what}: {t}"


def _tuned_program(entry) -> Program:
  """A decode batch in the tuning-table entry's bucket (G = 4, 8192 tokens of context)."""
  chip, kv_dtype, page_size, head_dim, kv_heads = entry
  return Program(Config("tuned", 64, 8192, 4 * kv_heads, kv_heads, head_dim, page_size,
                        kv_dtype=kv_dtype))


def _group(item):
  params = getattr(getattr(item, "callspec", None), "params", {})
  if "entry" in params:
    return ("tuned", params["entry"], None, params["entry"][0])
  if "chip" not in params:
    return None
  if "head_dim" in params:
    return ("default", params["heads"], params["head_dim"], params["chip"])
  return ("features", None, None, params["chip"])


def _kernel(program, chip):
  """What shapes the Mosaic kernel: the tiling but for the sizes of its SMEM tables."""
  t = program.tiling(chip)
  return (t.block_q, t.rows, t.block_kv, t.pages_per_block, t.items_per_call,
          t.vmem_limit_bytes)


def _programs(kind, heads, head_dim, chip):
  if kind == "tuned":
    return [_tuned_program(heads)]
  if kind == "default":
    return largest_per_kernel(default_programs(heads, head_dim), lambda p: _kernel(p, chip),
                              lambda p: p.tiling(chip).smem_plan_words)
  return feature_programs()


@pytest.fixture(scope="module")
def compiles(request):
  """Every compile of the selected tests, queued at once -> {group: [(program, future)]}."""
  with module_compiles(request, _group, lambda g: _programs(*g), compile_case,
                       chip_of=lambda g: g[3]) as futures:
    yield futures


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("heads, head_dim", [
    pytest.param(h, d, id=f"{h[0]}-{h[1]}-{d}",
                 marks=() if h == (32, 8) or d == 128 else pytest.mark.thorough)
    for h in HEADS for d in HEAD_DIMS])
def test_decode_defaults_compile(compiles, heads, head_dim, chip, record_property):
  """Batch {1, 64, 256} x context {2k, 32k, 128k}, page size 16, bf16: every kernel those
  use, each at the program with its largest SMEM tables."""
  group = ("default", heads, head_dim, chip)
  every = default_programs(heads, head_dim)
  assert [(p.config.batch, p.config.context) for p in every] == [
      (b, c) for b in BATCHES for c in CONTEXTS]
  compiled = [p for p, _ in compiles[group]]
  assert {_kernel(p, chip) for p in compiled} == {_kernel(p, chip) for p in every}
  for p in compiled:
    assert aot_pool.FULL_MATRIX or p.tiling(chip).smem_plan_words == max(
        q.tiling(chip).smem_plan_words for q in every if _kernel(q, chip) == _kernel(p, chip))
  assert len(compiled) == len(every) or not aot_pool.FULL_MATRIX
  check_compiled(compiles[group], group[3], _check, record_property)


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_feature_programs_compile(compiles, chip, record_property):
  """Mixed batch with window / soft-cap / sinks, prefill, int8, fp8, page 256, f32."""
  group = ("features", None, None, chip)
  assert [p.config.name for p, _ in compiles[group]] == list(FEATURE_CONFIGS)
  check_compiled(compiles[group], group[3], _check, record_property)


@pytest.mark.parametrize("entry", sorted(PA.TUNED_BLOCK_KV),
                         ids=lambda e: "-".join(map(str, e)))
def test_tuning_table_entries_compile(compiles, entry, record_property):
  """Every entry of the tuning table compiles for its chip, and the tiling uses it."""
  group = ("tuned", entry, None, entry[0])
  program = compiles[group][0][0]
  assert program.tiling(entry[0]).block_kv == PA.TUNED_BLOCK_KV[entry]
  check_compiled(compiles[group], group[3], _check, record_property)


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_big_batches_take_the_smem_chunked_path(chip):
  """The page table of 256 sequences x 128k tokens in pages of 16 (2 Mi words) is 8x
  SMEM: the tiling splits the items into chunks whose page-table rows fit the budget,
  while a small batch stays one chunk. (The compile of both is in the matrix above.)"""
  big, small = (default_programs((32, 8), 128)[i] for i in (-1, 0))
  assert (big.config.batch, big.config.context) == (256, 131072)
  t = big.tiling(chip)
  items = PA.num_work_items(big.config.num_tokens, big.config.batch, t.block_q)
  assert big.config.batch * big.config.pages_per_seq * 4 > chips.get_chip(chip).smem_bytes
  assert t.items_per_call < items
  assert t.smem_plan_words <= vmem.smem_budget_words(chips.get_chip(chip))
  ts = small.tiling(chip)
  assert ts.items_per_call == PA.num_work_items(small.config.num_tokens, small.config.batch,
                                                ts.block_q)


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_donated_cache_write_aliases_the_caches(chip, kv_dtype):
  """write_kv_cache under jax.jit with the caches donated (as the torch op's TPU path
  runs it) compiles for the chip with both caches aliased to the outputs: the update is
  in place in HBM, no copy of the cache. Read from the compiled program's
  input_output_alias table."""
  import jax
  import jax.numpy as jnp

  from tpu_kernels import aot

  cache = jax.ShapeDtypeStruct((4096, 8, 16, 128), jnp.dtype(kv_dtype))
  new = jax.ShapeDtypeStruct((64, 8, 128), jnp.bfloat16)
  slots = jax.ShapeDtypeStruct((64,), jnp.int32)
  scales = {} if kv_dtype == "bfloat16" else dict(k_scale=0.5, v_scale=0.25)
  write = functools.partial(PA.write_kv_cache, **scales)
  device = aot.topology_device(chip)
  specs = [aot._on_device(s, device) for s in (cache, cache, new, new, slots)]
  text = jax.jit(write, donate_argnums=(0, 1)).trace(*specs).lower().compile().as_text()
  alias = re.search(r"input_output_alias=\{(.*?)\}, entry_computation_layout", text)
  assert alias, "no input/output aliasing in the compiled program"
  assert re.search(r"\{0\}: \(0, \{\}", alias.group(1)) and re.search(
      r"\{1\}: \(1, \{\}", alias.group(1)), alias.group(1)
