"""The whole-experts-layer estimate (benchmarks/rating/experts_layer.py), checked without
the estimator (interpret mode, no profile flag): the case's roofline arithmetic against a
count from the definition, the decode routing table against group_metadata, the kernel on
that table against a float64 grouped matmul, and moe's route / combine against NumPy."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernels import moe

from benchmarks import cases
from benchmarks.cases.experts_layer import EXPERTS_LAYER, ExpertsLayer
from benchmarks.estimator import static_estimate, xla_cost
from benchmarks.peers.protocol import OURS, XLA
from benchmarks.rating import experts_layer as X
from benchmarks.reports import tables


def test_cases_cover_the_brief():
  got = {(c.model, c.tokens, c.experts, c.top_k, c.hidden, c.width, c.dtype)
         for c in EXPERTS_LAYER}
  want = {(m, t, e, k, h, i, "bfloat16")
          for m, e, k, h, i in (("Qwen3-30B-A3B", 128, 8, 2048, 768),
                                ("gpt-oss-20b", 32, 4, 2880, 2880))
          for t in (1, 8, 64, 8192)}
  assert got == want
  names = [c.name for c in cases.all_cases()]
  assert len(set(names)) == len(names)


def test_roofline_counts_both_projections_and_the_experts_hit():
  case = ExpertsLayer("Qwen3-30B-A3B", 64, 128, 8, 2048, 768)
  rows = 64 * 8
  assert case.flops() == 2 * rows * 2048 * (2 * 768) + 2 * rows * 768 * 2048
  # Expected distinct experts by simulation from the definition (top-8 distinct per token).
  rng = np.random.default_rng(0)
  hit = np.mean([len(np.unique(np.concatenate(
      [rng.choice(128, 8, replace=False) for _ in range(64)]))) for _ in range(400)])
  assert abs(case.experts_hit - hit) < 0.3, (case.experts_hit, hit)
  per_expert = 3 * 2048 * 768 * 2
  io = 2 * 64 * 2048 * 2 + rows * (4 + 2)
  assert case.min_bytes() == round(case.experts_hit * per_expert + io)
  assert case.all_experts_min_bytes() == 128 * per_expert + io
  one = ExpertsLayer("Qwen3-30B-A3B", 1, 128, 8, 2048, 768)
  assert one.experts_hit == pytest.approx(8)   # one token: exactly its top-k
  assert ExpertsLayer("gpt-oss-20b", 8192, 32, 4, 2880, 2880).experts_hit == \
      pytest.approx(32)


@pytest.mark.parametrize("case", [c for c in EXPERTS_LAYER if c.tokens <= 64],
                         ids=lambda c: f"{c.model}-T{c.tokens}")
def test_routed_table_is_group_metadata(case):
  """The decode tables the estimate shows the kernel equal what the kernel would build."""
  for g in X.gmms(case, "v6e").values():
    g.table().check(num_k_tiles=-(-g.k // g.tiling().block_k))


@pytest.mark.parametrize("gated, interleaved", [(True, False), (False, False), (True, True)])
def test_routed_table_kernel_computes_the_grouped_matmul(gated, interleaved):
  """4 of 8 experts hit (every other one), 2 rows each; float64 reference. Interleaved:
  gate / up in alternate weight rows, de-interleaved in the kernel (the "lanes" route)."""
  groups, hit, rows, k, n = 8, 4, 2, 256, 256
  m = hit * rows
  case = X.RoutedGmm(m, groups, k, n, gated, "v6e", dtype="float32", hit=hit,
                     interleaved=interleaved)
  table = case.table()
  table.check(num_k_tiles=1)
  rng = np.random.default_rng(1)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((groups, case.num_rhs * n, k)) / 16).astype(np.float32)
  sizes = np.asarray(table.group_sizes())
  from tpu_kernels import ragged_dot as R
  t = case.tiling()
  visit_table, count = R.group_metadata(jnp.asarray(sizes), 0, num_local_groups=groups, m=m,
                                        block_m=t.block_m, num_k_tiles=1, zero_visits=True,
                                        interpret=True)
  assert int(count) == table.num_visits == hit
  got = np.asarray(jax.jit(case.function(hit, interpret=True))(x, w, visit_table))
  group_of_row = np.repeat(np.arange(groups), sizes)
  z = np.einsum("mk,mnk->mn", x.astype(np.float64), w[group_of_row].astype(np.float64))
  gate, up = (z[:, 0::2], z[:, 1::2]) if interleaved else (z[:, :n], z[:, n:])
  want = gate / (1 + np.exp(-gate)) * up if gated else z
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_gpt_oss_prefill_rates_the_kernel_moe_experts_runs():
  """At 8192 tokens gpt-oss's interleaved gate/up takes the "lanes" route in ragged_dot (the
  f32 intermediate would outweigh the weights); the estimate rates that kernel, and the
  gate part only where the route is "gate_pass" (decode)."""
  for case in (c for c in EXPERTS_LAYER if c.model == "gpt-oss-20b"):
    kernels = X.gmms(case, "v6e")
    parts = list(kernels) + list(X.glue_programs(case, "v6e"))
    lanes = case.tokens == 8192
    assert X.gate_up_route(case) == ("lanes" if lanes else "gate_pass")
    assert kernels[parts[0]].interleaved == lanes
    assert any(p.startswith("gate (") for p in parts) != lanes


@pytest.mark.parametrize("tokens", [6, 300])   # moe_route's kernel, and XLA's argsort
def test_route_and_combine_match_numpy(tokens):
  rng = np.random.default_rng(2)
  top_k, experts, hidden = 3, 5, 4
  h = rng.standard_normal((tokens, hidden)).astype(np.float32)
  ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)]).astype(
      np.int32)
  w = rng.random((tokens, top_k)).astype(np.float32)
  x, pos, sizes = moe.route(jnp.asarray(h), jnp.asarray(ids), experts, interpret=True)
  np.testing.assert_array_equal(np.asarray(sizes), np.bincount(ids.ravel(), minlength=experts))
  perm = np.argsort(ids.ravel(), kind="stable")
  np.testing.assert_array_equal(np.asarray(pos), np.argsort(perm))
  np.testing.assert_array_equal(np.asarray(x), h[perm // top_k])
  # combine: each row scaled by its pair's weight, summed per token.
  y = rng.standard_normal((tokens * top_k, hidden)).astype(np.float32)
  got = np.asarray(moe.combine(jnp.asarray(y), pos, jnp.asarray(w), interpret=True))
  want = np.zeros((tokens, hidden))
  for row, pair in enumerate(perm):
    want[pair // top_k] += w.ravel()[pair] * y[row].astype(np.float64)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_kernel_fed_glue_takes_no_layout_copy():
  """gpt-oss's gate pass at T=64 writes [256, 2880] bfloat16 rows that the down kernel
  reads: compiled as a program's result they take a column-major copy, kernel-fed (the
  layout XLA chooses, as inside the layer) none; the combine, the layer's result, is not
  kernel-fed."""
  case = next(c for c in EXPERTS_LAYER
              if c.model == "gpt-oss-20b" and c.tokens == 64)
  parts = X.glue_programs(case, "v6e")
  gate = parts["gate (after the gate/up kernel)"]
  copies = [" copy(" in xla_cost.compile_glue(gate.fn, gate.specs, "v6e", fed)[0].as_text()
            for fed in (False, True)]
  assert copies == [True, False]
  assert [name for name, p in parts.items() if p.kernel_fed] == [
      "route (sort, group sizes, gather)", "gate (after the gate/up kernel)"]


def test_op_cycles_reads_every_op_and_the_unestimated_sentinel():
  text = ('%a = f32[2] add(%x, %y), backend_config={"estimated_cycles":"120"}\n'
          '  %s = s32[128] fusion(%p), kind=kCustom, backend_config='
          '{"estimated_cycles":"9223372036854775807"}\n'
          '  ROOT %r = f32[2] copy(%a), backend_config={"estimated_cycles":"7"}')
  assert static_estimate.op_cycles(text) == [("a", 120), ("s", 9223372036854775807), ("r", 7)]
  assert static_estimate.op_cycles(text)[1][1] >= static_estimate.UNESTIMATED


def test_estimate_dispatches_the_layer():
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("ESTIMATE_STATIC_PROFILE", "0")
    estimate = importlib.import_module("benchmarks.estimate")
  case = EXPERTS_LAYER[2]
  impls = estimate.implementations(False, [case.name], with_anchors=False)
  assert [i.source for i in impls] == [OURS, XLA]
  assert impls[0].implementation == X.IMPLEMENTATION
  assert not impls[1].static_profile


def test_summary_splits_kernels_and_glue():
  case = EXPERTS_LAYER[2]
  parts = {"gate/up+silu kernel": dict(predicted_us=60.0),
           "down kernel": dict(predicted_us=30.0),
           "route (sort, group sizes, gather)": dict(predicted_us=4.0, first_attempt="x"),
           "combine (weights, unsort, sum over top-k)": dict(predicted_us=6.0)}
  rows = [dict(case=case.name, implementation="pallas (whole layer)", source="ours",
               chip="v6e", roofline_us=80.0, predicted_us=100.0, efficiency=0.8,
               kernels_us=90.0, glue_us=10.0, breakdown=parts),
          dict(case=case.name, implementation="xla (lax.ragged_dot layer)", source="xla",
               chip="v6e", predicted_us=120.0)]
  line = tables.experts_layer_table(rows).splitlines()[-1]
  assert line == (f"| {case.model} | {case.tokens} | v6e | 80.0 | 100.0 | 0.80 | 90.0 | 10.0 "
                  "| route 4.0 (cost_analysis), combine 6.0 | 120 |")
