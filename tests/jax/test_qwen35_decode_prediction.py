"""Qwen3.5-9B's decode-step prediction (benchmarks/qwen35_decode_prediction.py; its programs
and rating in benchmarks/rating/qwen35_decode.py), checked without the estimator: the
default programs against float64 NumPy written from Transformers' definitions at a tiny
shape, the step's arithmetic, and the docs' table made from the results file."""

import dataclasses
import json

import jax
import numpy as np
import pytest

from benchmarks import ROOT
from benchmarks.cases.seed import QWEN3_5_STEP, Qwen35DecodeStep
from benchmarks.rating import qwen35_decode as Q
from benchmarks.reports import tables

TINY = Qwen35DecodeStep(batch=3, context=16, hidden=32, intermediate=48, vocab=40,
                        q_heads=4, kv_heads=2, head_dim=16, rotary_dim=4, dtype="float32")


def _inputs(specs, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal(s.shape).astype(np.float32) for s in specs]


def _norm64(x, eps):
  x = x.astype(np.float64)
  return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def test_default_norms_are_transformers_formulas():
  """Qwen3_5RMSNorm: norm(x) * (1 + w); Qwen3_5RMSNormGated: w * norm(x) * silu(z)."""
  fn, specs = Q.default_norm(TINY)
  x, w = _inputs(specs)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, w)),
                             _norm64(x, TINY.eps) * (1 + w.astype(np.float64)), rtol=1e-5,
                             atol=1e-5)
  fn, specs = Q.default_gated_norm(TINY)
  x, z, w = _inputs(specs, seed=1)
  z64 = z.astype(np.float64)
  want = w * _norm64(x, TINY.eps) * z64 / (1 + np.exp(-z64))
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(x, z, w)), want, rtol=1e-5, atol=1e-5)


def test_default_attention_is_grouped_softmax_attention():
  """SDPA with GQA at decode: query head h reads KV head h // (Hq / Hkv)."""
  fn, specs = Q.default_attention(TINY)
  q, k, v = _inputs(specs, seed=2)
  group = TINY.q_heads // TINY.kv_heads
  want = np.empty(q.shape)
  for b in range(q.shape[0]):
    for h in range(TINY.q_heads):
      kv = h // group
      s = k[b, kv].astype(np.float64) @ q[b, h].astype(np.float64) / np.sqrt(TINY.head_dim)
      p = np.exp(s - s.max())
      want[b, h] = (p / p.sum()) @ v[b, kv].astype(np.float64)
  np.testing.assert_allclose(np.asarray(jax.jit(fn)(q, k, v)), want, rtol=1e-5, atol=1e-5)


def test_every_program_traces_at_the_models_shapes():
  """The shared programs and the defaults at Qwen3.5-9B's shapes (shapes only: no compile)."""
  shape = lambda build: jax.eval_shape(*(lambda fn, specs: (fn, *specs))(*build(QWEN3_5_STEP)))
  for build in Q.SHARED_PROGRAMS.values():
    shape(build)
  out = shape(Q.in_projections)
  assert [o.shape for o in out] == [(64, 8192), (64, 4096), (64, 32), (64, 32)]
  q, k, v, gate = shape(Q.attention_projections)
  assert q.shape == gate.shape == (64, 16, 256) and k.shape == v.shape == (64, 4, 256)
  assert shape(Q.default_attention).shape == (64, 16, 256)
  assert shape(Q.lm_head).shape == (64, 248320)


def test_step_counts_every_layer():
  step = QWEN3_5_STEP
  assert (step.gdn_layers, step.attention_layers) == (24, 8)
  counts = {p.name: p.count for p in Q.parts(step)}
  assert counts["gated delta rule, one token"] == 24
  assert counts["attention over the KV cache"] == 8
  assert counts["RMSNorm (input, post-attention, final)"] == 65
  assert counts["MLP gate / up / down + residual"] == 32


def test_totals_never_credit_an_unrated_part():
  """A pair part ours cannot rate counts at the default's time on both sides."""
  rated = {p.name: ({"shared": {"predicted_us": 1.0}} if p.sides == ("shared",) else
                    {"ours": {"predicted_us": 1.0}, "default": {"predicted_us": 2.0}})
           for p in Q.parts(TINY)}
  base = Q.step_totals(TINY, rated)
  rated["causal_conv1d_update"]["ours"] = {"error": "estimator abort"}
  worse = Q.step_totals(TINY, rated)
  count = next(p.count for p in Q.parts(TINY) if p.name == "causal_conv1d_update")
  assert worse["ours_us"] == pytest.approx(base["ours_us"] + count * 1.0)
  assert worse["default_us"] == base["default_us"]
  assert len(worse["substituted"]) == 1 and "estimator abort" in worse["substituted"][0]
  del rated["lm_head"]
  assert Q.step_totals(TINY, rated)["ours_us"] is None


def test_table_is_made_from_the_results_file():
  results = json.loads(Q.RESULTS_FILE.read_text())
  assert results["step"] == dataclasses.asdict(QWEN3_5_STEP)
  assert {"v5e", "v6e"} <= set(results["chips"])
  for chip, rated in results["chips"].items():
    stored = results["summary"][chip]
    again = Q.step_totals(QWEN3_5_STEP, rated)
    assert again["substituted"] == stored["substituted"]
    for key in ("ours_us", "default_us", "speedup"):
      assert stored[key] == pytest.approx(again[key], rel=1e-12), (chip, key)
    for part in rated.values():
      for p in part.values():
        if "predicted_us" in p:
          assert p["predicted_us"] == pytest.approx(max(p["compute_us"], p["hbm_us"]))
  table = tables.qwen35_step_table(results)
  docs = (ROOT / "docs" / "performance" / "gated-delta-rule.md").read_text()
  assert table in docs, "docs/performance/gated-delta-rule.md's step table is not the module's"


def test_step_shapes_are_transformers_defaults():
  """Qwen35DecodeStep's shapes are Qwen3_5TextConfig's defaults ("Qwen3.5-9B style").
  Needs Transformers (leg 1 only, as test_gated_delta_rule_aot's check)."""
  configs = pytest.importorskip("transformers")
  c, s = configs.Qwen3_5TextConfig(), QWEN3_5_STEP
  assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.vocab_size) == (
      s.layers, s.hidden, s.intermediate, s.vocab)
  assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
      s.q_heads, s.kv_heads, s.head_dim)
  assert int(c.head_dim * c.rope_parameters["partial_rotary_factor"]) == s.rotary_dim
  assert c.rms_norm_eps == s.eps and not c.tie_word_embeddings
  assert c.layer_types.count("full_attention") == s.attention_layers
  assert c.layer_types.count("linear_attention") == s.gdn_layers
  assert (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
          c.linear_conv_kernel_dim) == (s.gdn.key_heads, s.gdn.value_heads, s.gdn.head_dim,
                                        s.gdn.conv_width)
