"""The seed prediction (benchmarks/seed_prediction.py; its programs and rating in
benchmarks/rating/seed_prediction.py), checked without the estimator: both
experts programs (ours in interpret mode, Transformers' grouped_mm forward written in JAX)
against a float64 NumPy reference on a tiny expert-parallel shape, AllReduceEP's remap
summed over ranks against the unsplit experts, the split's arithmetic, and the docs' table
made from the results file."""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import reference_moe  # tests/

from benchmarks import ROOT
from benchmarks.cases.seed import QWEN3
from benchmarks.rating import seed_prediction as S
from benchmarks.reports import tables


def _case(seed=0, tokens=8, experts=16, top_k=4, hidden=256, width=128):
  rng = np.random.default_rng(seed)
  h = rng.standard_normal((tokens, hidden)).astype(np.float32)
  ids = np.stack([rng.choice(experts, top_k, replace=False) for _ in range(tokens)])
  w = rng.random((tokens, top_k)).astype(np.float32)
  gate_up = (rng.standard_normal((experts, 2 * width, hidden)) / 8).astype(np.float32)
  down = (rng.standard_normal((experts, hidden, width)) / 8).astype(np.float32)
  return h, ids.astype(np.int32), w, gate_up, down


def test_both_experts_programs_equal_the_reference_on_one_rank():
  """Rank 1 of 4 (4 local experts of 16), placeholders past the groups, f32."""
  h, ids, w, gate_up, down = _case()
  ranks, local = 4, 4
  rank = 1
  local_ids, local_w = S.ep_local_routing(jnp.asarray(ids), jnp.asarray(w), rank, local)
  assert int(jnp.sum(local_ids == local)) > 0   # some routes are placeholders
  shard = slice(rank * local, (rank + 1) * local)
  args = (jnp.asarray(h), local_ids, local_w, jnp.asarray(gate_up[shard]),
          jnp.asarray(down[shard]))
  want = reference_moe.moe_experts(h, np.asarray(local_ids), np.asarray(local_w),
                                   gate_up[shard], down[shard], num_experts=local)
  for copy in (True, False):
    gu, dn = args[3], args[4]
    if not copy:   # the pre-transposed layout the no-copy variant takes
      gu, dn = jnp.swapaxes(gu, 1, 2), jnp.swapaxes(dn, 1, 2)
    got = jax.jit(lambda *a: S.grouped_mm_experts(*a, num_experts=local, copy=copy))(
        *args[:3], gu, dn)
    reference_moe.assert_close(got, want, rtol=1e-5, atol=1e-5, what=f"grouped_mm copy={copy}")
  ours = S.ours_experts(*args, num_experts=local, interpret=True)
  reference_moe.assert_close(ours, want, rtol=1e-5, atol=1e-5, what="ours")
  assert ranks * local == gate_up.shape[0]


def test_all_reduce_ep_remap_sums_to_the_whole_experts():
  h, ids, w, gate_up, down = _case(seed=1)
  ranks, local = 4, 4
  total = np.zeros_like(h, dtype=np.float64)
  for rank in range(ranks):
    li, lw = S.ep_local_routing(jnp.asarray(ids), jnp.asarray(w), rank, local)
    shard = slice(rank * local, (rank + 1) * local)
    total += reference_moe.moe_experts(h, np.asarray(li), np.asarray(lw), gate_up[shard],
                                       down[shard], num_experts=local)
  want = reference_moe.moe_experts(h, ids, w, gate_up, down, num_experts=ranks * local)
  np.testing.assert_allclose(total, want, rtol=1e-12, atol=1e-12)


def test_the_split():
  layer = QWEN3
  assert (layer.local_experts, layer.local_q_heads, layer.local_kv_heads) == (16, 4, 1)
  assert layer.rows == 512
  # Expected distinct local experts hit by simulation from the definition.
  rng = np.random.default_rng(0)
  hit = np.mean([(np.unique(np.concatenate([rng.choice(128, 8, replace=False)
                                            for _ in range(64)])) < 16).sum()
                 for _ in range(300)])
  assert abs(layer.local_experts_hit - hit) < 0.2, (layer.local_experts_hit, hit)
  case = layer.experts_case()
  assert (case.tokens, case.experts, case.top_k, case.rows) == (64, 16, 8, 512)
  paged = layer.paged_case()
  assert (paged.batch, paged.q_heads, paged.kv_heads, paged.context) == (64, 4, 1, 2048)


def test_table_is_made_from_the_results_file():
  results = json.loads(S.RESULTS_FILE.read_text())
  summary = S.summary(results)
  for chip, parts in results["chips"].items():
    sums = {g: sum(p["predicted_us"] for p in ps.values()) for g, ps in parts.items()}
    assert summary[chip]["ours_experts_us"] == pytest.approx(sums["ours"])
    assert summary[chip]["default_experts_ratio"] == pytest.approx(sums["default"] / sums["ours"])
    assert summary[chip]["default_layer_ratio"] == pytest.approx(
        (sums["shared"] + sums["default"]) / (sums["shared"] + sums["ours"]))
    for p in [p for ps in parts.values() for p in ps.values()]:
      assert p["predicted_us"] == pytest.approx(max(p["compute_us"], p["hbm_us"]))
  # The stored summary is the module's, to the last few ulps: Python 3.12's sum() of floats
  # is compensated (Neumaier), 3.11's is not, and the file was written on 3.11.
  stored = results["summary"]
  assert {c: sorted(v) for c, v in stored.items()} == {c: sorted(v) for c, v in summary.items()}
  for chip, values in summary.items():
    for key, value in values.items():
      assert stored[chip][key] == pytest.approx(value, rel=1e-12, abs=0), (chip, key)
  table = tables.seed_table(results)
  docs = (ROOT / "docs" / "performance.md").read_text()
  assert table in docs, "docs/performance.md's seed table is not the module's table"
  ratio = f"{summary['v6e']['default_experts_ratio']:.2f}x"
  assert re.search(re.escape(ratio), table)


def _ragged_dot_lowering(hlo_text: str) -> str:
  """How XLA compiled lax.ragged_dot for a TPU, read from the compiled HLO text: "kernel"
  (libtpu's Mosaic ragged-dot kernel, a tpu_custom_call named ragged-dot-none) or "dense"
  (a convolution over every group, masked: each row multiplied by every expert)."""
  lines = [l for l in hlo_text.splitlines() if "ragged_dot_general" in l]
  if any("ragged-dot-none" in l and "tpu_custom_call" in l for l in lines):
    return "kernel"
  if any(" convolution(" in l for l in lines):
    return "dense"
  raise AssertionError(f"no known lowering of ragged_dot in: {lines}")


@pytest.mark.aot
def test_default_as_written_copies_the_transposed_weights_for_v6e():
  """The claim behind the default's "as written" rows: compiled for v6e, XLA's ragged_dot on
  Transformers' transposed (E, 2I, H) weights first copies all of them; on (E, H, 2I) it
  does not. It holds with either lowering XLA picks by default: libtpu's Mosaic ragged-dot
  kernel up to 0.0.50.1 (0.0.42.1 on leg 1), a masked convolution over all experts from
  0.0.52, which turned `xla_tpu_enable_ragged_dot_kernel` off by default (with the flag on,
  0.0.52's kernel reads the transposed weights without a copy)."""
  from importlib.metadata import version
  from tpu_kernels import aot
  device = aot.topology_device("v6e")
  layer = QWEN3
  weights = f"bf16[{layer.local_experts},{2 * layer.width},{layer.hidden}]"
  libtpu = tuple(int(p) for p in version("libtpu").split(".")[:3])
  for copy in (True, False):
    fn, specs, how = next(v for k, v in S.default_programs(layer, copy).items()
                          if k.startswith("gate/up grouped_mm"))
    assert how == "cost_analysis"
    text = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower() \
        .compile().as_text()
    assert _ragged_dot_lowering(text) == ("dense" if libtpu >= (0, 0, 52) else "kernel")
    copies = [l for l in text.splitlines() if " copy(" in l and weights in l.split("=")[1]]
    assert bool(copies) == copy, (copy, copies)
