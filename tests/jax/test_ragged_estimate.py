"""The grouped-matmul static estimate shows the estimator the real visit table: check that
what it substitutes is what the kernel really reads, and that the substituted kernel still
computes the grouped matmul (benchmarks/rating/ragged_dot.py; interpret mode, no libtpu flag).
"""

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernels import ragged_dot as R

from benchmarks.cases.headline import GroupedMatmul
from benchmarks.rating import ragged_dot as E
from benchmarks.reports import tables


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("m", [512, 8192])
@pytest.mark.parametrize("gated", [True, False])
def test_closed_form_table_is_group_metadata(chip, m, gated):
  """The estimated Qwen3-30B-A3B cases: f(v) == group_metadata(balanced sizes)[v]."""
  k, n = (2048, 768) if gated else (768, 2048)
  case = E.GmmCase(m, 128, k, n, gated, chip)
  case.table().check(num_k_tiles=-(-k // case.tiling().block_k))


@pytest.mark.parametrize("rows", [2, 1024])   # below block_m (8), above it (512, the cap)
@pytest.mark.parametrize("gated", [True, False])
def test_visible_table_kernel_computes_the_grouped_matmul(rows, gated):
  groups, k, n = 8, 256, 256
  m = rows * groups
  case = E.GmmCase(m, groups, k, n, gated, "v6e", dtype="float32")
  table = case.table()
  assert (rows < table.block_m) if rows == 2 else (rows > table.block_m), table
  table.check(num_k_tiles=1)
  rng = np.random.default_rng(rows)
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((groups, case.num_rhs * n, k)) / 16, jnp.float32)
  sizes = jnp.full((groups,), rows, jnp.int32)
  t = case.tiling()
  visit_table, count = R.group_metadata(sizes, 0, num_local_groups=groups, m=m,
                                        block_m=t.block_m, num_k_tiles=-(-k // t.block_k),
                                        zero_visits=True, interpret=True)
  assert int(count) == table.num_visits
  got = jax.jit(case.function(table.num_visits, interpret=True))(x, w, visit_table)
  if gated:
    want = R.gated_ragged_dot(x, w, sizes, transpose_rhs=True, activation="silu",
                              interpret=True)
  else:
    want = R.ragged_dot(x, w, sizes, transpose_rhs=True, interpret=True)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_hbm_replay_counts_every_refetch():
  """Whole-n blocks: every weight once, lhs and out once. Two n tiles: lhs read twice."""
  one = E.GmmCase(64, 8, 256, 256, False, "v6e", dtype="float32")
  assert one.tiling().block_n == 256
  assert one.hbm_bytes() == one.min_bytes()
  assert one.hbm_bytes(num_visits=4) == 4 * (256 * 256 * 4) + 4 * (8 * 256 * 4) * 2
  wide = E.GmmCase(64, 8, 256, 8192, False, "v6e", dtype="float32")
  n_tiles = -(-8192 // wide.tiling().block_n)
  assert n_tiles > 1
  assert wide.hbm_bytes() == wide.min_bytes() + (n_tiles - 1) * 64 * 256 * 4



class _MetadataTable:
  """The visit table `ragged_dot.group_metadata` builds for concrete group sizes, read
  the way GmmCase.hbm_bytes reads a BalancedTable."""

  def __init__(self, sizes, m, block_m, num_k_tiles, paired=False):
    table, count = R.group_metadata(jnp.asarray(sizes, jnp.int32), 0,
                                    num_local_groups=len(sizes), m=m, block_m=block_m,
                                    num_k_tiles=num_k_tiles, zero_visits=True, paired=paired,
                                    interpret=True)
    self.num_visits = int(count)
    self._table = np.asarray(table).reshape(R._NUM_FIELDS, -1)

  def value(self, field, v):
    return self._table[field, v]


@pytest.mark.parametrize("num_rhs, m, k, n, groups, weight_dtype", [
    (1, 512, 1024, 768, 8, "bfloat16"),  # rows per group above and below block_m; k split or not
    (2, 512, 1024, 768, 8, "bfloat16"),
    (1, 256, 512, 512, 32, "bfloat16"),
    (2, 64, 2048, 256, 4, "bfloat16"),
    (1, 1024, 384, 640, 16, "bfloat16"),  # padded last k and n blocks
    (1, 512, 1024, 768, 8, "int8"),       # 1-byte weights and their f32 scale rows
    (2, 64, 2048, 256, 4, "float8_e4m3fn"),
])
def test_tuner_traffic_model_equals_the_replay(num_rhs, m, k, n, groups, weight_dtype):
  """benchmarks/tuning/ragged_dot.py ranks candidates by a closed form of the bytes the grid
  moves: it must equal the step-by-step replay of the index maps, for every candidate, at
  balanced routing and at unaligned routing (the real visit table of group sizes whose
  every boundary falls inside a row tile)."""
  from benchmarks.tuning import ragged_dot as T
  key = R.TuningKey("v6e", "bfloat16", weight_dtype, num_rhs, m, k, n, groups)
  candidates = T.candidates(key)
  assert len(candidates) > 10
  assert any(-(-k // bk) > 1 for _, bk, _ in candidates)       # some split k
  assert any(bm > m // groups for bm, _, _ in candidates)      # some tiles hold many groups
  rows = m // groups
  tables = {}
  for blocks in candidates:
    gmm = T.case(key, blocks)
    assert T.modelled_bytes(key, blocks, T.balanced_visits(key, blocks[0])) == \
        gmm.hbm_bytes(), blocks
    # The replay reads only the group and row-tile fields, which depend on block_m alone:
    # one table per block_m (its interpret-mode build is the slow part of this test).
    block_m = blocks[0]
    if block_m not in tables:
      shift = min(rows, block_m) // 2
      sizes = [rows - shift] + [rows] * (groups - 2) + [rows + shift]
      tables[block_m] = _MetadataTable(sizes, m, block_m, num_k_tiles=1)
    unaligned = tables[block_m]
    assert unaligned.num_visits == T.unaligned_visits(key, blocks[0]), blocks
    with mock.patch.object(type(gmm), "table", lambda self: unaligned):
      assert T.modelled_bytes(key, blocks, unaligned.num_visits) == gmm.hbm_bytes(), blocks


# ------------------------------------------------------------------ quantized decode (issue 28)


@pytest.mark.parametrize("shift", [0, 2, 3])   # group boundaries on the row tiles, or not
def test_two_visits_per_step_fetch_no_more_than_one(shift):
  """Qwen3-30B-A3B's down with int8 weights at m=512 (two visits per grid step): replayed
  over the paired visit table, the grid moves what it moves over the plain table with one
  visit per step, plus at most the second slot's first weight block and scale row."""
  case = E.GmmCase(512, 128, 768, 2048, False, "v6e", weight_dtype="int8")
  t = case.tiling()
  assert t.visits_per_step == 2 and t.block_k == 768
  sizes = [4 - shift] + [4] * 126 + [4 + shift]   # 4 rows a group, boundaries moved
  paired = _MetadataTable(sizes, 512, t.block_m, 1, paired=True)
  with mock.patch.object(type(case), "table", lambda self: paired):
    paired_bytes = case.hbm_bytes()
  one = _MetadataTable(sizes, 512, t.block_m, 1)
  with mock.patch.object(type(case), "table", lambda self: one), \
       mock.patch.object(R, "_paired_tiling", lambda t, **kw: t):
    assert case.tiling().visits_per_step == 1
    one_bytes = case.hbm_bytes()
  assert one_bytes <= paired_bytes <= one_bytes + 768 * 2048 + 2048 * 4


@pytest.mark.parametrize("m,groups,active", [(64, 128, 64), (8, 16, 8)])
def test_decode_table_with_empty_experts_is_group_metadata(m, groups, active):
  """Fewer rows than experts: the first `active` experts get one row each, the rest none;
  the closed form equals group_metadata over all `groups` (empty ones are not visited)."""
  case = E.GmmCase(m, groups, 256, 512, False, "v6e", weight_dtype="int8", active_groups=active)
  table = case.table()
  assert (table.groups, table.total_groups, table.num_visits) == (active, groups, active)
  table.check(num_k_tiles=1)


@pytest.mark.parametrize("weight_dtype", ["int8", "float8_e4m3fn"])
@pytest.mark.parametrize("gated,transpose_rhs", [(True, True), (False, True), (False, False)])
def test_visible_table_kernel_computes_the_quantized_grouped_matmul(weight_dtype, gated,
                                                                    transpose_rhs):
  """The substituted kernel with 1-byte weights and a per-channel scale, 4 of 8 experts
  with rows, against a float64 NumPy grouped matmul from the definition."""
  groups, active, rows, k, n = 8, 4, 2, 256, 256
  m = active * rows
  case = E.GmmCase(m, groups, k, n, gated, "v6e", dtype="float32", weight_dtype=weight_dtype,
                   active_groups=active, transpose_rhs=transpose_rhs)
  table = case.table()
  rng = np.random.default_rng(7)
  n_full = case.num_rhs * n
  x = rng.standard_normal((m, k)).astype(np.float32)
  if weight_dtype == "int8":
    q = rng.integers(-127, 128, (groups, n_full, k)).astype(np.int8)
  else:
    q = np.asarray(jnp.asarray(rng.standard_normal((groups, n_full, k)) * 8,
                               jnp.float8_e4m3fn))
  scale = (rng.random((groups, n_full)) / 256 + 1e-3).astype(np.float32)
  w = q if transpose_rhs else np.swapaxes(q, 1, 2)
  sizes = jnp.zeros((groups,), jnp.int32).at[:active].set(rows)
  t = case.tiling()
  visit_table, count = R.group_metadata(sizes, 0, num_local_groups=groups, m=m,
                                        block_m=t.block_m, num_k_tiles=-(-k // t.block_k),
                                        zero_visits=True, interpret=True)
  assert int(count) == table.num_visits == active
  got = jax.jit(case.function(table.num_visits, interpret=True))(
      jnp.asarray(x), jnp.asarray(w), jnp.asarray(scale), visit_table)
  # float64 reference: z[r] = (x[r] @ q[g].T) * scale[g], gated: silu(gate) * up
  q64 = np.asarray(q).astype(np.float64)
  z = np.zeros((m, n_full))
  for g in range(active):
    r = slice(g * rows, (g + 1) * rows)
    z[r] = (x[r].astype(np.float64) @ q64[g].T) * scale[g]
  want = z[:, :n] / (1 + np.exp(-z[:, :n])) * z[:, n:] if gated else z
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)


def test_quantized_hbm_replay_counts_one_byte_weights_and_scales():
  """Whole blocks, 2 of 4 experts with rows: each visited expert's 1-byte weight and
  float32 scale row once, lhs and the bf16 out once; empty experts read nothing."""
  case = E.GmmCase(2, 4, 256, 512, False, "v6e", weight_dtype="int8", active_groups=2)
  t = case.tiling()
  assert (t.block_k, t.block_n) == (256, 512)
  want = 2 * 256 * 2 + 2 * (256 * 512 * 1 + 512 * 4) + 2 * 512 * 2
  assert case.hbm_bytes() == case.min_bytes() == want


def test_gpt_oss_gate_up_is_rated_as_the_route_the_op_takes():
  """gpt-oss's interleaved gate/up at decode: the plain kernel to a float32 (m, 2I)
  (ragged_dot.gate_up_route "gate_pass"), weights (G, k, n)."""
  case = GroupedMatmul.of("gpt-oss-20b", 64, "gate_up+gpt_oss", "int8")
  g = E.gmm_case(case, "v6e")
  assert (g.gated, g.n_out, g.out_dtype, g.transpose_rhs) == (False, 5760, "float32", False)
  assert (g.groups, g.active_groups, g.k) == (32, None, 2880)
  # Quantized weights are rated as quantize_experts_ stores them, (G, k, n), bf16 ones as
  # Transformers does, (G, n, k).
  qwen = E.gmm_case(GroupedMatmul.of("Qwen3-30B-A3B", 64, "down", "float8_e4m3fn"),
                    "v5e")
  assert (qwen.gated, qwen.active_groups, qwen.transpose_rhs, qwen.quantized) == \
      (False, 64, False, True)
  assert E.gmm_case(GroupedMatmul.of("Qwen3-30B-A3B", 64, "down"), "v5e").transpose_rhs


def test_quantized_decode_table_compares_with_the_best_bf16_anchor():
  """Goals of issue 28 from rows: speed-up over the fastest bf16 anchor of the same model /
  part / m (not over XLA, not over a tokamax quantized row), and the efficiency goal."""
  q, b = "ragged_dot M down int8 m=64", "ragged_dot M down bf16 m=64"
  row = lambda case, source, impl, us, eff=0.5: dict(
      case=case, chip="v6e", source=source, implementation=impl, predicted_us=us,
      roofline_us=us * eff, efficiency=eff)
  rows = [row(q, "ours", "pallas", 100.0, 0.9), row(q, "xla", "xla (lax.ragged_dot)", 50.0),
          row(q, "anchor", "tokamax ragged_dot (x)", 400.0),
          row(b, "ours", "pallas", 190.0), row(b, "anchor", "jax megablox gmm (a)", 170.0),
          row(b, "anchor", "tokamax ragged_dot (b)", 250.0)]
  table = tables.quantized_decode_table(rows, [q])
  line = next(line for line in table.splitlines() if line.startswith(f"| {q} |"))
  cells = [c.strip() for c in line.strip("|").split("|")]
  assert cells[2:] == ["100.0", "90.0", "0.90", "170.0 (jax megablox gmm)", "1.70x", "400.0",
                       "50.0", "190.0", "efficiency met, speed-up missed"]


def test_tpu_inference_gmm_table_cells():
  """tpu-inference's gmm beside ours per case and chip: both predictions, its efficiency,
  the roofline and ours ÷ theirs; a row without a prediction says why (VMEM OOM, estimator
  aborts) and one missing says "no row", with no ratio."""
  case = "ragged_dot M down fp8 m=64"
  tpu_inference = "tpu-inference megablox gmm (tpu-inference 0.32.0, its tiling)"
  rows = [dict(case=case, chip="v6e", source="ours", implementation="pallas",
               predicted_us=150.0, roofline_us=100.0, efficiency=100 / 150),
          dict(case=case, chip="v6e", source="anchor", implementation=tpu_inference,
               predicted_us=120.0, roofline_us=100.0, efficiency=100 / 120),
          dict(case=case, chip="v5e", source="anchor", implementation=tpu_inference,
               error="RuntimeError: child exit 1: RESOURCE_EXHAUSTED: E1001: "
                     "CompileTimeScopedVmemOom: ...")]
  table = tables.tpu_inference_gmm_table(rows, [case]).splitlines()
  cells = {line.split("|")[2].strip(): [c.strip() for c in line.strip("|").split("|")]
           for line in table[2:]}
  assert cells["v6e"] == ["M down fp8 m=64", "v6e", "120.0", "0.83", "150.0", "100.0", "1.25x"]
  assert cells["v5e"] == ["M down fp8 m=64", "v5e", "VMEM OOM", "", "no row", "", ""]
