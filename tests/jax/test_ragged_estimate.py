"""The grouped-matmul static estimate shows the estimator the real visit table: check that
what it substitutes is what the kernel really reads, and that the substituted kernel still
computes the grouped matmul (benchmarks/ragged_estimate.py; interpret mode, no libtpu flag).
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import ragged_estimate as E  # noqa: E402
from tpu_kernels import ragged_dot as R  # noqa: E402


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
