"""Every default grouped-matmul configuration compiles ahead of time for v5e and v6e.

Real shapes of three MoE models, with Transformers' expert weight layouts:

  * Qwen3-30B-A3B: 128 experts, hidden 2048, expert width 768; gate_up (G, 2I, H),
    down (G, H, I) -> transpose_rhs=True, silu, concatenated gate/up.
  * Mixtral-8x7B: 8 experts, hidden 4096, expert width 14336 (same layout).
  * gpt-oss-20b: 32 experts, hidden 2880, expert width 2880; gate_up (G, H, 2I) with
    interleaved gate/up columns and bias, down (G, I, H) with bias -> transpose_rhs=False,
    gpt-oss's clamped gate.

for m (token-expert rows) in {8, 64, 512, 4096, 65536}, bf16: the backward of gate/up and
of down (jax.grad of 0.5 * sum(out^2) w.r.t. lhs, the weight and the bias). The loss
needs the output, so each backward program also holds the forward kernel, the very
pallas_call (same tiling) that inference runs: one compile covers forward and backward
(the forward-only programs add no Mosaic kernel and are left to
`python scripts/aot_summary.py`, which compiles them too). Plus int8 and float8_e4m3fn
weights (forward) at one m per model.
Each program is compiled by libtpu (Mosaic, then LLO), which rejects illegal blocks and
scoped-VMEM overflow. Checked per program: it compiles, it holds the expected number of
Mosaic kernels, and the scoped-VMEM limit it compiled under is the one the kernel's own
tiling asked for and within the chip's allowance. The tiling of every case is written
to the test report (`record_property`) and printed by `python scripts/aot_summary.py`.

Plus one forward program per entry of the tuning table
(kernels/tpu_kernels/tuned/ragged_dot.<chip>.json), at its key's shape.
One test per (model, chip) compiles the 10 programs of that model (1-13 s each; gpt-oss's
interleaved gate/up is the slowest), spread over up to two worker processes (libtpu's
compile is single-threaded; the test run itself is serial).

Depth: the CI profile compiles the backward matrix of Qwen3-30B-A3B, the seed's MoE model;
Mixtral's and gpt-oss's (about 250 s of CI's longest run on 2026-12-07) are marked
`thorough` (HYPOTHESIS_PROFILE=thorough). Their forward tilings still compile in CI: the
tuning table holds entries at both models' shapes, and the quantized and int8 programs
below are theirs too.
"""

import re

import jax
import jax.numpy as jnp
import pytest

from aot_pool import check_compiled, compile_pool

from ragged_dot_cases import (AOT_CHIPS, MODELS, QUANT_M, ROWS, Model, Program, compile_case,
                              model_programs, quantized_programs)
from tpu_kernels import aot, chips, ragged_dot as R

pytestmark = pytest.mark.aot


def _check(program, report, chip):
  what = f"{program.label} on {chip}"
  assert report.ok, f"{what}: {report.error}"
  # Each grouped matmul also runs a small kernel that builds its visit table (XLA may
  # merge identical ones): count the matmul kernels.
  matmuls = [n for n in report.kernel_names if R.VISIT_TABLE_KERNEL not in n]
  assert len(report.kernel_names) == report.num_kernels and "?" not in matmuls, report
  assert len(matmuls) == program.num_kernels(chip), (
      f"{what}: {len(matmuls)} grouped-matmul kernels {matmuls}, expected "
      f"{program.num_kernels(chip)}")
  limit = max(t.vmem_limit_bytes for _, t in program.tilings(chip))
  assert report.scoped_vmem_bytes == limit, (
      f"{what}: compiled under {report.scoped_vmem_bytes} bytes of scoped VMEM, "
      f"the tiling asked for {limit}")
  assert report.scoped_vmem_bytes <= chips.get_chip(chip).max_vmem_limit_bytes, what
  for name, t in program.tilings(chip):
    assert t.vmem_plan_bytes <= t.vmem_limit_bytes, f"{what} {name}: {t}"


@pytest.fixture(scope="module")
def pool():
  """Compiles in spawned workers (tests/jax/aot_pool.py)."""
  with compile_pool() as executor:
    yield executor


def _compile_and_check(pool, programs, chip, record_property):
  check_compiled([(p, pool.submit(compile_case, p, chip)) for p in programs], chip, _check,
                 record_property)


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("model", [
    pytest.param(m, marks=() if m == "qwen3-30b-a3b" else pytest.mark.thorough)
    for m in MODELS])
def test_model_shapes_compile_bf16(pool, model, chip, record_property):
  programs = [p for m in ROWS for p in model_programs(model, m, directions=("bwd",))]
  _compile_and_check(pool, programs, chip, record_property)


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("model", list(MODELS))
def test_quantized_weights_compile(pool, model, chip, record_property):
  _compile_and_check(pool, quantized_programs(model, QUANT_M), chip, record_property)


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("weight_dtype", ["int8", "float8_e4m3fn"])
def test_quantized_weights_with_a_k_tail_compile(weight_dtype, chip):
  """A masked last k block of 1-byte weights: the select runs in the weights' own dtype
  (`_gmm_kernel`). The matrix above never has one (the tiling prefers a block_k that
  divides k for 1-byte weights), so one is forced: gpt-oss down at m=64, block_k 1536
  over k = 2880 (a 1344-wide tail)."""
  experts, k, n = 32, 2880, 2880
  specs = [jax.ShapeDtypeStruct((64, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((experts, k, n), jnp.dtype(weight_dtype)),
           jax.ShapeDtypeStruct((experts,), jnp.int32),
           jax.ShapeDtypeStruct((experts, n), jnp.float32)]

  def fn(x, w, group_sizes, scale):
    return R.ragged_dot(x, w, group_sizes, rhs_scale=scale, chip=chip, block_m=16,
                        block_k=1536, block_n=1024)

  report = aot.compile_for_chip(fn, specs, chip)
  assert report.ok, report.error
  matmuls = [n for n in report.kernel_names if R.VISIT_TABLE_KERNEL not in n]
  assert len(matmuls) == 1, report


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("label, m, k, n, experts, gated, blocks", [
    ("Qwen3 down, one k block", 64, 768, 2048, 128, False, None),
    ("Qwen3 gate/up", 64, 2048, 768, 128, True, None),
    ("Qwen3 gate/up at prefill", 8192, 2048, 768, 128, True, None),
    ("gpt-oss down, k tail", 64, 2880, 2880, 32, False, (32, 1536, 1024)),
    ("gpt-oss gate/up, interleaved: the gate pass", 64, 2880, 2880, 32, "interleaved", None),
    ("gpt-oss gate/up, interleaved: lanes", 32768, 2880, 2880, 32, "interleaved", None),
])
def test_int8_activations_compile(label, m, k, n, experts, gated, blocks, chip):
  """lhs_quant="int8" (int8 x int8 on the MXU, int32 products): one block of all k,
  the gated epilogue at decode and prefill tiles, split k with a masked int8 tail into
  the int32 accumulator (forced: gpt-oss down, block_k 1536 over k = 2880), and gpt-oss's
  interleaved gate/up by both of its routes (`gate_up_route`)."""
  if gated == "interleaved":
    route = R.gate_up_route(m, 2 * n, "interleaved", experts * k * 2 * n)
    assert route == ("gate_pass" if m == 64 else "lanes"), route
  width = 2 * n if gated else n
  specs = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((experts, k, width), jnp.int8),
           jax.ShapeDtypeStruct((experts,), jnp.int32),
           jax.ShapeDtypeStruct((experts, width), jnp.float32)]
  block_m, block_k, block_n = blocks or (None, None, None)
  call = R.gated_ragged_dot if gated else R.ragged_dot

  layout = dict(layout="interleaved") if gated == "interleaved" else {}

  def fn(x, w, group_sizes, scale):
    return call(x, w, group_sizes, rhs_scale=scale, chip=chip, lhs_quant="int8",
                block_m=block_m, block_k=block_k, block_n=block_n, **layout)

  report = aot.compile_for_chip(fn, specs, chip)
  assert report.ok, f"{label} on {chip}: {report.error}"
  # the rows are quantized by a kernel of their own before the matmul
  assert sum(R.QUANTIZE_ROWS_KERNEL in n for n in report.kernel_names) == 1, report
  matmuls = [n for n in report.kernel_names
             if R.VISIT_TABLE_KERNEL not in n and R.QUANTIZE_ROWS_KERNEL not in n]
  # the gate pass is a small kernel of its own after the plain matmul
  assert len(matmuls) == (2 if gated == "interleaved" and m == 64 else 1), report


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("m, k, n, gated, weight_dtype", [
    (64, 768, 2048, False, "int8"),                # Qwen3 down
    (512, 768, 2048, False, "float8_e4m3fn"),
    (8, 2048, 768, True, "int8"),                  # Qwen3 gate/up, one token
    (512, 2048, 768, True, "float8_e4m3fn"),
])
def test_two_visits_per_step_compile(m, k, n, gated, weight_dtype, chip):
  """Decode with 1-byte weights (`_paired_tiling`): two weight slots per grid step, each
  with its scale, compile under the limit the tiling asks for."""
  experts, width = 128, 2 * n if gated else n
  t = R.gmm_tiling(m, k, n, num_groups=experts, lhs_dtype=jnp.bfloat16,
                   rhs_dtype=jnp.dtype(weight_dtype), out_dtype=jnp.bfloat16,
                   num_rhs=2 if gated else 1, n_must_divide=n if gated else None, chip=chip)
  assert t.visits_per_step == 2, t
  specs = [jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
           jax.ShapeDtypeStruct((experts, k, width), jnp.dtype(weight_dtype)),
           jax.ShapeDtypeStruct((experts,), jnp.int32),
           jax.ShapeDtypeStruct((experts, width), jnp.float32)]
  call = R.gated_ragged_dot if gated else R.ragged_dot
  report = aot.compile_for_chip(
      lambda x, w, group_sizes, scale: call(x, w, group_sizes, rhs_scale=scale, chip=chip),
      specs, chip)
  assert report.ok, report.error
  matmuls = [n for n in report.kernel_names if R.VISIT_TABLE_KERNEL not in n]
  assert len(matmuls) == 1, report
  assert report.scoped_vmem_bytes == t.vmem_limit_bytes, (report.scoped_vmem_bytes, t)


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("m, k, dtype", [
    (64, 768, jnp.bfloat16),      # Qwen3 down at decode: one block of all rows
    (512, 14336, jnp.bfloat16),   # Mixtral down: 32-row blocks
    (300, 2880, jnp.float32),     # a partial last block, k off the lanes
    (64, 49152, jnp.bfloat16),    # under a raised scoped-VMEM limit
])
def test_quantize_rows_kernel_compiles(m, k, dtype, chip):
  """`quantize_rows`' kernel alone, under the limit its plan asks for."""
  rows, limit = R.quantize_rows_plan(m, k, jnp.dtype(dtype), chip)
  report = aot.compile_for_chip(lambda x: R.quantize_rows(x, chip=chip),
                                [jax.ShapeDtypeStruct((m, k), dtype)], chip)
  assert report.ok, f"{m}x{k} on {chip}: {report.error}"
  assert report.kernel_names == (R.QUANTIZE_ROWS_KERNEL,), report
  # 0: no limit asked for, so the chip's default scoped limit holds
  assert report.scoped_vmem_bytes == (limit or 0), report
  assert (limit is not None) == (k == 49152), limit


def _tuned_program(entry) -> Program:
  """The forward program of the entry's key: its model's projection (bf16 weights
  (G, out, in), 1-byte ones (G, in, out) with a scale, as quantize_experts_ stores them;
  gate/up concatenated or, for an interleaved key, interleaved (the "lanes" route at
  the key's rows), silu; down in float32 for an f32_out key) at the bucket's rows."""
  key = R.TuningKey(*entry)
  gated = key.num_rhs == 2
  hidden, width = (key.k, key.n) if gated else (key.n, key.k)
  model = Model(f"tuned G={key.num_groups} H={hidden} I={width}", key.num_groups, hidden,
                width, True, "interleaved" if key.interleaved else "concatenated", "silu",
                False)
  program = Program(model, key.m_bucket, "gate_up" if gated else "down", "fwd",
                    weight_dtype=key.weight_dtype, dtype=key.dtype,
                    out_dtype="float32" if key.f32_out else None)
  assert not key.interleaved or program.gate_up_route == "lanes", program.label
  return program


@pytest.mark.parametrize("entry", sorted(R.TUNED_BLOCKS),
                         ids=lambda e: "-".join(map(str, e)))
def test_tuning_table_entries_compile(pool, entry, record_property):
  """Every entry of the tuning table compiles for its chip, and the tiling uses it."""
  program = _tuned_program(entry)
  [(_, t)] = program.tilings(entry[0])
  assert (t.block_m, t.block_k, t.block_n) == R.TUNED_BLOCKS[entry]
  _compile_and_check(pool, [program], entry[0], record_property)


# The heuristic's one-k-block tilings (`_one_k_block_tiling`) under scoped limits above the
# chip's default, at benchmarks/ragged_survey.py's models' prefill shapes: one k block, so
# the kernel keeps no float32 accumulator (the plan's side of that is
# test_ragged_dot_tiling.py::test_one_k_block_plans_count_no_accumulator).
@pytest.mark.parametrize("label, chip, experts, hidden, width, m, weight_dtype, out_dtype, blocks", [
    ("DeepSeek-V3", "v6e", 256, 7168, 2048, 65536, "bfloat16", None, (256, 2048, 1792)),
    ("Qwen3-30B-A3B", "v6e", 128, 2048, 768, 65536, "int8", None, (512, 768, 2048)),
    ("OLMoE-1B-7B", "v5e", 64, 2048, 1024, 8192, "bfloat16", "float32", (128, 1024, 2048)),
])
def test_one_k_block_tilings_under_raised_limits_compile(
    pool, label, chip, experts, hidden, width, m, weight_dtype, out_dtype, blocks,
    record_property):
  model = Model(f"{label} G={experts} H={hidden} I={width}", experts, hidden, width, True,
                "concatenated", "silu", False)
  program = Program(model, m, "down", "fwd", weight_dtype=weight_dtype, out_dtype=out_dtype)
  [(_, t)] = program.tilings(chip)
  assert (t.block_m, t.block_k, t.block_n) == blocks and t.block_k >= width, t
  assert t.vmem_limit_bytes > chips.get_chip(chip).default_scoped_vmem_bytes, t
  _compile_and_check(pool, [program], chip, record_property)


@pytest.mark.parametrize("m", [8, 65536])
def test_backward_program_holds_the_forward_kernel(m):
  """What lets the matrix skip forward-only compiles: every Mosaic kernel of the forward
  program (its serialized body, grid, blocks and compiler params, i.e. the backend
  config of the tpu_custom_call) appears verbatim in the backward program. Lowering
  only (no libtpu compile): about 0.3 s per program."""
  device = aot.topology_device("v6e")
  for model in MODELS:
    fwd, _, bwd, _ = model_programs(model, m)
    configs = []
    for program in (fwd, bwd):
      fn, specs = program.build("v6e")
      text = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower().as_text()
      configs.append([re.search(r'backend_config = "([^"]*)"', line).group(1)
                      for line in text.splitlines() if "@tpu_custom_call" in line
                      and f'kernel_name = "{R.VISIT_TABLE_KERNEL}"' not in line])
    assert [len(c) for c in configs] == [fwd.num_kernels("v6e"), bwd.num_kernels("v6e")]
    assert configs[0][0] in configs[1], f"{model} m={m}: forward kernel not in backward"
