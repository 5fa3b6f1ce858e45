"""Every default flash-attention configuration compiles ahead of time for v5e and v6e.

The matrix (scripts/flash_attention_cases.py), bf16, B = 1, torch layout [B, H, S, D]:

  * defaults: Hq / Hkv = 32 / 8, causal, S in {2048, 8192, 32768}, head_dim 128, 256
    and 80;
  * features at S = 8192, one program each: everything on (D 128, 32 / 8, causal,
    sliding_window=4096, soft_cap=50.0, sinks, a (q, kv) segment-id pair); gpt-oss-like
    (D 64, 64 / 8, causal, sliding_window=128, sinks); MQA (16 / 1); the default in f32;
    DeepSeek-V3's MLA (128 / 128 heads of 192: its value head_dim 128 zero-padded to the
    query's, as flash-attention-tpu runs it).

Every program is the backward: jax.grad of 0.5 * sum(out^2) w.r.t. q, k, v (and sinks).
The loss needs the output, so each program holds the forward kernel, the very
pallas_call (same tiling) that inference runs, plus the dq and dkv kernels: one compile
covers forward and backward (`test_backward_program_holds_the_forward_kernel` checks
that claim; forward-only programs are left to `python scripts/aot_summary.py`).
Each program is compiled by libtpu (Mosaic, then LLO), which rejects illegal blocks and
scoped-VMEM overflow. Checked per program: it compiles; it holds exactly the expected
Mosaic kernels by name (forward, dq, dkv: one each); the scoped-VMEM limit it compiled
under is the one `attention_tiling` asked for and within the chip's allowance. The
tiling of every case (block_q, block_k, limit and plan) is written to the test report
(`record_property`) and printed by `python scripts/aot_summary.py`.

A default length is compiled when it is the longest that uses its tiling (block_q,
block_k, VMEM limit) on that chip (`aot_pool.largest_per_kernel`): the lengths that share
a tiling compile the same three kernels over a longer or shorter grid, and the longest
has the largest SMEM tables of the causal grid. With today's tuning table that is one
length per head_dim on each chip. `TPU_KERNELS_AOT_FULL_MATRIX=1`
compiles every length. One test per (head_dim or the feature set, chip) checks its
programs (2-70 s of compile each: head_dim 80, MQA, the feature programs and the
1024-block ones are the slowest). The compiles of all selected tests are queued at once on
up to two worker processes (libtpu's compile is single-threaded; the test run itself is
serial). A tuning-table entry that a default shape uses is checked on that very program,
compiled once (`tuned_programs` picks 32 / 8 heads at the longest default length of the
entry's tiling).

Depth: the CI profile compiles, of each chip's tuning table, one entry per (head_dim,
blocks): the one with the most query heads per KV head, whose VMEM plan and limit are
the largest of those blocks (6 of 18 programs per chip; all 18 were about 400 s of CI's
longest run on 2026-12-07). The entries of 1 and 4 query heads per KV head compile under
HYPOTHESIS_PROFILE=thorough, as does head_dim 80 on v5e (an odd size no seed model has;
v6e's compiles in CI).
"""

import re

import jax
import pytest

import aot_pool
from aot_pool import check_compiled, largest_per_kernel, module_compiles

from flash_attention_cases import (AOT_CHIPS, FEATURE_CONFIGS, HEAD_DIMS, Program,
                                   compile_case, default_config, default_programs,
                                   feature_programs, tuned_programs)
from profiles import THOROUGH
from tpu_kernels import aot, chips, flash_attention

pytestmark = pytest.mark.aot


def _check(program, report, chip):
  what = f"{program.label} on {chip}"
  assert report.ok, f"{what}: {report.error}"
  names = report.kernel_names
  assert len(names) == report.num_kernels and "?" not in names, report
  # Exactly the expected kernels, one each ("flash_attention_dq" is no substring of
  # "flash_attention_dkv", nor the other way round).
  matched = {want: [n for n in names if want in n] for want in program.kernels}
  assert len(names) == len(program.kernels) and all(
      len(found) == 1 for found in matched.values()), (
      f"{what}: Mosaic kernels {names}, expected one each of {program.kernels}")
  t = program.tiling(chip)
  assert report.scoped_vmem_bytes == t.vmem_limit_bytes, (
      f"{what}: compiled under {report.scoped_vmem_bytes} bytes of scoped VMEM, "
      f"attention_tiling asked for {t.vmem_limit_bytes}")
  assert report.scoped_vmem_bytes <= chips.get_chip(chip).max_vmem_limit_bytes, what
  assert t.vmem_plan_bytes <= t.vmem_limit_bytes, f"{what}: {t}"


def _group(item):
  """(kind, head_dim, chip) of the programs a test item of this module compiles, or None."""
  params = getattr(getattr(item, "callspec", None), "params", {})
  if "chip" not in params:
    return None
  if "head_dim" in params:
    return ("default", params["head_dim"], params["chip"])
  if item.originalname == "test_tuning_table_entries_compile":
    return ("tuned", None, params["chip"])
  return ("features", None, params["chip"])


def _kernel(program, chip):
  t = program.tiling(chip)
  return (t.block_q, t.block_k, t.vmem_limit_bytes)


def _tuned(chip):
  """The tuning-table programs compiled for `chip`: every entry under the thorough profile
  (or TPU_KERNELS_AOT_FULL_MATRIX=1), else the widest group of each (head_dim, blocks)."""
  programs = tuned_programs(chip)
  if THOROUGH or aot_pool.FULL_MATRIX:
    return programs
  widest = {}
  for p in programs:
    key = (p.config.head_dim, _kernel(p, chip)[:2])
    if key not in widest or p.config.group > widest[key].config.group:
      widest[key] = p
  return [p for p in programs if p in widest.values()]


def _programs(kind, head_dim, chip):
  if kind == "tuned":
    return _tuned(chip)
  if kind == "default":
    return largest_per_kernel(default_programs(head_dim), lambda p: _kernel(p, chip),
                              lambda p: p.config.seq)
  return feature_programs()


@pytest.fixture(scope="module")
def compiles(request):
  """Every compile of the selected tests, queued at once -> {group: [(program, future)]}."""
  with module_compiles(request, _group, lambda g: _programs(*g), compile_case,
                       chip_of=lambda g: g[2]) as futures:
    yield futures


@pytest.mark.parametrize("head_dim, chip", [
    pytest.param(d, chip, marks=pytest.mark.thorough if (d, chip) == (80, "v5e") else ())
    for d in HEAD_DIMS for chip in AOT_CHIPS])
def test_default_shapes_compile_bf16(compiles, head_dim, chip, record_property):
  """32 / 8 heads, causal, S in {2048, 8192, 32768}: every tiling those lengths use, each
  at the longest length that uses it."""
  group = ("default", head_dim, chip)
  every = default_programs(head_dim)
  compiled = [p for p, _ in compiles[group]]
  assert {_kernel(p, chip) for p in compiled} == {_kernel(p, chip) for p in every}
  for p in compiled:
    assert aot_pool.FULL_MATRIX or p.config.seq == max(
        q.config.seq for q in every if _kernel(q, chip) == _kernel(p, chip)), p.label
  assert len(compiled) == len(every) or not aot_pool.FULL_MATRIX
  check_compiled(compiles[group], group[2], _check, record_property)


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_feature_programs_compile(compiles, chip, record_property):
  """All features at once, gpt-oss-like, MQA, f32."""
  group = ("features", None, chip)
  assert [p.config.name for p, _ in compiles[group]] == list(FEATURE_CONFIGS)
  check_compiled(compiles[group], group[2], _check, record_property)


@pytest.mark.parametrize("chip", sorted({key[0] for key in flash_attention.TUNED_BLOCKS}))
def test_tuning_table_entries_compile(compiles, chip, record_property):
  """Every (head_dim, group, blocks, VMEM limit) of the chip's tuning table (in CI, the
  widest group of each (head_dim, blocks)), backward (fwd + dq + dkv), compiles under the
  scoped-VMEM limit of its entry."""
  group = ("tuned", None, chip)
  programs = [p for p, _ in compiles[group]]
  table = {(k[2], k[3], entry) for k, entry in flash_attention.TUNED_BLOCKS.items()
           if k[0] == chip}
  if not (THOROUGH or aot_pool.FULL_MATRIX):
    widest = {}
    for head_dim, g, entry in table:
      widest[head_dim, entry[:2]] = max(g, widest.get((head_dim, entry[:2]), 0))
    table = {(d, g, e) for d, g, e in table if g == widest[d, e[:2]]}
  tilings = {p: p.tiling(chip) for p in programs}
  assert {(p.config.head_dim, p.config.group, (t.block_q, t.block_k, t.vmem_limit_bytes))
          for p, t in tilings.items()} == table
  check_compiled(compiles[group], group[2], _check, record_property)


@pytest.mark.parametrize("config", [default_config(8192, 128), FEATURE_CONFIGS["all features"]],
                         ids=["default", "all features"])
def test_backward_program_holds_the_forward_kernel(config):
  """What lets the matrix skip forward-only compiles: the Mosaic kernel of the forward
  program (its serialized body, grid, blocks and compiler params, i.e. the backend
  config of the tpu_custom_call) appears verbatim in the backward program, next to two
  other kernels. Lowering only (no libtpu compile)."""
  device = aot.topology_device("v6e")
  configs = []
  for program in (Program(config, "fwd"), Program(config, "bwd")):
    fn, specs = program.build("v6e")
    text = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower().as_text()
    configs.append([re.search(r'backend_config = "([^"]*)"', line).group(1)
                    for line in text.splitlines() if "@tpu_custom_call" in line])
  assert len(configs[0]) == 1 and len(configs[1]) == 3, [len(c) for c in configs]
  assert configs[0][0] in configs[1], f"{config.name}: forward kernel not in the backward"
