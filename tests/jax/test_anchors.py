"""benchmarks/peers/: jax's own Pallas kernels and tokamax's as anchors (fast checks only: no
static profile compiles; the estimates themselves come from `python benchmarks/estimate.py`)."""

from __future__ import annotations

import importlib
import json

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from benchmarks import cases, peers
from benchmarks.cases.diffusion import DIFFUSION_ATTENTION, JointAttention
from benchmarks.cases.headline import HEADLINE, RmsNorm
from benchmarks.cases.quantized_decode import QUANTIZED_DECODE
from benchmarks.cases.serving import PagedBatch
from benchmarks.estimator import children, static_estimate
from benchmarks.peers import jax_ops, protocol, tokamax_ops
from benchmarks.peers.attention_geometry import triangle_col, triangle_row
from benchmarks.peers.jax_ops.attention import AttentionAnchor
from benchmarks.peers.jax_ops.paged import (PagedAnchor, RaggedPagedAnchor,
                                            RaggedPagedServingAnchor)
from benchmarks.peers.megablox import GmmAnchor, GmmClosedForm
from benchmarks.peers.tokamax_ops import TOKAMAX_ROWS, TokamaxAttentionAnchor, TokamaxGmmAnchor


def _anchor_rows() -> list[protocol.Implementation]:
  return [i for c in cases.all_cases() for i in peers.implementations(c)
          if i.source == protocol.ANCHOR]


def test_every_anchor_names_a_headline_case():
  names = {c.name for c in cases.all_cases()}
  listed = _anchor_rows()
  assert listed and all(a.case in names for a in listed)
  rated = {a.case for a in listed}
  # every headline case but RMSNorm has an anchor; RMSNorm has none in jax (said so)
  assert {c.name for c in HEADLINE if not isinstance(c, RmsNorm)} <= rated
  assert "rms_norm" in jax_ops.NOT_RATED
  # each Diffusers shape: jax flash, jax splash and tokamax, at blocks 128 and 512
  for case in DIFFUSION_ATTENTION:
    impls = [a.implementation for a in listed if a.case == case.name]
    for kind in ("jax flash_attention", "jax splash attention MHA (", "tokamax"):
      assert sum(i.startswith(kind) for i in impls) == 2, (case.name, kind, impls)


@pytest.mark.parametrize("m", [512, 8192])
@pytest.mark.parametrize("tm", [128, 512])
def test_gmm_closed_form_equals_make_group_metadata(m, tm):
  GmmClosedForm(m, 128, tm).check()


@pytest.mark.parametrize("tiling", ["default", "512x1024x1024"])
def test_gmm_tilings_of_the_headline_cases(tiling):
  for m in (512, 8192):
    for part in ("gate_up+silu", "down"):
      a = GmmAnchor(m, part, tiling)
      tm, tk, tn = a.tiling
      assert m % tm == 0 and a.case.k % tk == 0 and a.case.n_weight % tn == 0
      assert tk % 128 == 0 and tn % 128 == 0


def test_gmm_hbm_replay_equals_brute_force_on_real_metadata():
  """The replay through the closed form equals a replay through megablox's own metadata."""
  gmm_mod = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
  a = GmmAnchor(256, "down", "default", groups=8)
  tm, tk, tn = a.tiling
  c = a.case
  sizes = jnp.full((8,), 256 // 8, jnp.int32)
  (_, gids, mtiles), num = gmm_mod.make_group_metadata(
      group_sizes=sizes, m=256, tm=tm, start_group=jnp.int32(0), num_nonzero_groups=8,
      visit_empty_groups=False)
  gids, mtiles, num = np.asarray(gids), np.asarray(mtiles), int(num)
  moved, last = 0, {}
  for j in range(c.n_weight // tn):
    for v in range(num):
      for kk in range(c.k // tk):
        for name, idx, nbytes in (("lhs", (mtiles[v], kk), tm * tk * 2),
                                  ("rhs", (gids[v], kk, j), tk * tn * 2),
                                  ("out", (mtiles[v], j), tm * tn * 2)):
          if last.get(name) != idx:
            moved += nbytes
            last[name] = idx
  assert num == a.closed_form.num_tiles
  assert a.hbm_bytes() == moved


@pytest.mark.parametrize("kind", ["flash", "splash"])
def test_attention_hbm_per_head_equals_full_replay(kind):
  a = AttentionAnchor(512, kind, block=128)
  c, nq, blk = a.case, a.nq, 128 * 128 * 2
  group = c.q_heads // c.kv_heads
  moved, last = 0, {}
  for h in range(c.q_heads):
    kv_head = h if kind == "flash" else h // group   # flash: k / v repeated to all heads
    for i in range(nq):
      for j in range(nq):
        kv = (kv_head, j if j <= i else 0)
        for name, idx in (("q", (h, i)), ("k", kv), ("v", kv), ("o", (h, i))):
          if last.get(name) != idx:
            moved += blk
            last[name] = idx
  repeat = 2 * (c.kv_heads + c.q_heads) * a.seq * c.head_dim * 2 if kind == "flash" else 0
  assert a.hbm_bytes() == moved + repeat


@pytest.mark.parametrize("seq", [1024, 32768])
def test_splash_causal_closed_form_equals_process_mask(seq):
  AttentionAnchor(seq, "splash", 512 if seq > 1024 else 128).validate()


def _joint(seq=500, heads=3, batch=2):
  return JointAttention("toy", seq=seq, heads=heads, head_dim=64, batch=batch)


def test_splash_full_mask_closed_form_equals_process_mask():
  case = DIFFUSION_ATTENTION[0]
  a = AttentionAnchor(case.seq, "splash", 128, joint=case)
  assert a.padded_seq == 4480 and a.nq == 35 and not a.causal
  a.validate()   # the 8, 16 and 32 block grids the fit builds


@pytest.mark.parametrize("kind", ["flash", "splash"])
def test_non_causal_attention_hbm_equals_full_replay(kind):
  """S=500 padded to 512: every (q, kv) block pair of each (batch row, head) in order,
  plus the caller's pad (q, k, v: read 500 rows, write 512) and slice (out) copies."""
  a = AttentionAnchor(500, kind, block=128, joint=_joint())
  c, nq, blk = a.case, a.nq, 128 * 64 * 2
  assert nq == 4
  moved, last = 0, {}
  for h in range(c.batch * c.heads):
    for i in range(nq):
      for j in range(nq):
        for name, idx in (("q", (h, i)), ("k", (h, j)), ("v", (h, j)), ("o", (h, i))):
          if last.get(name) != idx:
            moved += blk
            last[name] = idx
  copies = 4 * (500 + 512) * c.batch * c.heads * 64 * 2
  assert a.hbm_bytes() == moved + copies
  from tpu_kernels import chips
  hand = a.hand(chips.get_chip("v6e"))
  assert hand["hand_mxu_flops"] == c.batch * c.heads * nq * nq * 4 * 128 * 128 * 64


def test_non_causal_length_fit_and_heads():
  """Long non-causal cases use the same a + b*n + c*n^2 fit (n rows of n computed steps),
  times B*H / 2 (the truncations rate 2 heads)."""
  case = DIFFUSION_ATTENTION[-1]
  a = AttentionAnchor(case.seq, "flash", 512, joint=case)
  assert a.nq == 64 and not a.small
  model = lambda n: 7 + 11 * n + 13 * n * n
  cycles = {json.dumps(t): model(t[1]) for t in a.truncations}
  assert a.extrapolate(cycles) == pytest.approx(case.batch * case.heads / 2 * model(a.nq))


def test_attention_length_fit_is_exact_for_a_model():
  """A long case is rated at shorter whole causal grids and fitted in the block count n:
  per-row work (n rows) plus per-step work (n^2 steps, computed or skipped) is exact."""
  a = AttentionAnchor(32768, "splash", 512)
  assert [t[1] for t in a.truncations] == list(a.SHORT_BLOCKS) and a.nq == 64
  model = lambda n: 7 + 11 * n + 13 * n * (n + 1) // 2 + 3 * n * (n - 1) // 2
  cycles = {json.dumps(t): model(t[1]) for t in a.truncations}
  assert a.extrapolate(cycles) == pytest.approx(16 * model(a.nq))


def test_kernel_cycles_reads_multiline_instructions():
  text = ('  %a = f32[8] custom-call(%x), custom_call_target="tpu_custom_call", backend_config='
          '{"x":"line one\n line two"}, "bundle_analysis_data":{"estimated_cycles":"1234"}\n'
          '  %b = f32[8] add(%a, %a)\n'
          '  ROOT %c = f32[8] custom-call(%b), custom_call_target="tpu_custom_call", '
          '"estimated_cycles":"66"\n')
  assert static_estimate.kernel_cycles(text) == (1300, 2)


def test_paged_hbm_counts_every_page_once():
  a = PagedAnchor(2048)
  c = a.case
  assert a.hbm_bytes() == (2 * c.batch * c.kv_heads * c.context * c.head_dim * 2
                           + 2 * c.batch * c.q_heads * c.head_dim * 2 + 2 * c.batch * c.q_heads * 4)


def test_ragged_paged_static_loops_and_bytes():
  """The static-length variant's trip counts are the batch's (one sequence per outer
  iteration over a full q block; whole kv blocks per sequence), and its bytes are each
  page once."""
  for ctx, inner in ((2048, 1), (32768, 16)):
    a = RaggedPagedAnchor(ctx)
    c = a.case
    assert a.loop_counts() == (32, inner)
    a.validate()
    # Linear in kv blocks: a model a + b * blocks is extrapolated exactly.
    model = {json.dumps(t): 5 + 7 * a.loop_counts(t[1])[1] for t in a.truncations}
    assert a.extrapolate(model) == 5 + 7 * inner
    assert a.hbm_bytes() == (2 * c.batch * c.kv_heads * c.context * c.head_dim * 2
                             + 2 * c.batch * c.q_heads * c.head_dim * 2)
  with pytest.raises(ValueError, match="full q blocks"):
    RaggedPagedAnchor(2048, num_queries_per_block=48).validate()


def test_rpa_serving_parts_loops_and_bytes():
  """The serving anchor rates decodes at whole q blocks (scaled back) and prefill chunks
  per q block; each q block re-reads its sequence's pages (jax's RPA skips none)."""
  a = RaggedPagedServingAnchor(PagedBatch(decode=60, prefill=4))
  a.validate()
  assert a.parts() == [("decode", 60, 64, 1, 2048), ("prefill", 4, 4, 512, 2048)]
  assert a.pages_per_block == 32
  token = 2 * 8 * 128 * 2
  assert a.hbm_bytes() == (60 * 2048 + 4 * 16 * 2048) * token + 2 * (60 + 2048) * 32 * 128 * 2
  model = {json.dumps(t): 100 * t[1] for t in a.truncations}
  assert a.extrapolate(model) == 100 * 60 + 100 * 4
  w = RaggedPagedServingAnchor(PagedBatch(context=32768, sliding_window=4096))
  # Long contexts: rated at 2k and 4k, linear in kv blocks (2048 keys each) to 16 blocks.
  model = {json.dumps(t): 5 + 7 * (t[3] // 2048) for t in w.truncations}
  assert w.extrapolate(model) == 5 + 7 * 16
  assert w.hbm_bytes() == 64 * 32768 * token + 2 * 64 * 32 * 128 * 2   # no window skipping
  assert RaggedPagedServingAnchor(PagedBatch(page_size=16)).pages_per_block \
      == 128
  with pytest.raises(ValueError, match="whole q blocks"):
    RaggedPagedServingAnchor(PagedBatch(prefill=1, chunk=48)).validate()


@pytest.mark.parametrize("key,trunc", [("gmm:512:down:default:128", [2]),
                                       ("attn:splash:4096:128", [1, 2]),
                                       ("attn:flash:4429:128:joint:SD3.5-medium 1024x1024",
                                        [1, 2]),
                                       ("attn:splash:4429:128:joint:SD3.5-medium 1024x1024",
                                        [1, 2]),
                                       ("paged:2048:8", [1]),
                                       ("rpa:2048:32:32", [32, 2048])])
def test_anchor_compiles_for_v6e(key, trunc):
  """The visible-metadata builds compile ahead of time for v6e (plain compile: no profile)."""
  pytest.importorskip("jax.experimental.topologies")
  spec = peers.spec_by_key(key)
  with protocol.lowering(spec, "v6e"):
    fn, specs = spec.build(trunc, "v6e")
    compiled = static_estimate.compile_on_chip(fn, specs, "v6e")
  assert 'custom_call_target="tpu_custom_call"' in compiled.as_text()


def test_anchor_keys_are_unique():
  specs = [s for c in cases.all_cases() for s in peers.specs_for(c)]
  assert len({s.key for s in specs}) == len(specs)


def test_tokamax_causal_block_list_closed_forms():
  """row / col enumerate the blocks on or below the diagonal row by row (tokamax's compact
  causal grid; its own process_mask is compared in the child, see the compile test)."""
  a = TokamaxAttentionAnchor(32768)
  rows = max(TOKAMAX_ROWS)
  want = [(i, j) for i in range(rows) for j in range(i + 1)]
  assert [(a.row(g), a.col(g)) for g in range(len(want))] == want
  traced = jax.jit(lambda g: (a.row(g), a.col(g)))
  assert [tuple(int(x) for x in traced(jnp.int32(g))) for g in range(len(want))] == want


def test_tokamax_attention_fit_and_bytes():
  a = TokamaxAttentionAnchor(4096)
  model = lambda rows: 7 + 11 * rows + 13 * rows * (rows + 1) // 2
  cycles = {json.dumps(t): model(t[1]) for t in a.truncations}
  assert a.extrapolate(cycles) == pytest.approx(16 * model(a.nq))
  # per head: q and o once per row; k and v at every step but the second (row 1 starts
  # at column 0, which row 0 left in place); the [bq, 128] int32 q_sequence once per row
  c, nq, run = a.case, a.nq, a.nq * (a.nq + 1) // 2
  block = a.block * c.head_dim * 2
  per_head = block * (2 * nq + 2 * (run - 1)) + nq * a.block * 128 * 4
  assert a.hbm_bytes() == c.q_heads * per_head


def test_tokamax_non_causal_fit_and_bytes():
  """Full grid: identical rows, so a + b*rows; bytes: q / o once per row, k / v at every
  step (the kv index wraps to 0 at each new row), no q_sequence block, plus pad copies."""
  a = TokamaxAttentionAnchor(500, 128, joint=_joint())
  model = lambda rows: 7 + 11 * rows
  cycles = {json.dumps(t): model(t[1]) for t in a.truncations}
  assert a.extrapolate(cycles) == pytest.approx(2 * 3 / 2 * model(a.nq))
  c, nq, block = a.case, a.nq, 128 * 64 * 2
  per_head = block * (2 * nq + 2 * nq * nq)
  assert a.hbm_bytes() == c.batch * c.heads * per_head + 4 * (500 + 512) * 2 * 3 * 64 * 2


def test_tokamax_gmm_heuristic_tiling_and_bytes_match_megablox():
  """Same algorithm, same index maps: the same bytes as megablox at the same tiling."""
  for m in (512, 8192):
    t = TokamaxGmmAnchor(m, "down", "heuristic")
    assert t.tiling == (128, 128, 128)
    assert t.hbm_bytes() == GmmAnchor(m, "down", "default").hbm_bytes()
    big = TokamaxGmmAnchor(m, "down", "512x1024x1024")
    assert big.tiling == GmmAnchor(m, "down", "512x1024x1024").tiling


def test_quantized_decode_anchors():
  """Issue 28: a tokamax quantized anchor beside every int8 / fp8 row, megablox beside every
  added bf16 row; 1-byte weight blocks and the (8, tn) float32 scale block in the replay."""
  listed = [s for c in QUANTIZED_DECODE for s in peers.specs_for(c) if isinstance(s, GmmAnchor)]
  assert len(listed) == len(QUANTIZED_DECODE)
  assert {a.case.name for a in listed} == {c.name for c in QUANTIZED_DECODE}
  for a in listed:
    assert isinstance(a, TokamaxGmmAnchor) == a.case.quantized
  q = TokamaxGmmAnchor(64, "down", "512x1024x1024", groups=8, model="Mixtral-8x7B",
                               weight_dtype="int8")
  tm, tk, tn = q.tiling
  assert (tm, tk, tn) == (64, 1024, 1024) and q.closed_form.num_tiles == 8
  # one tile of 64 rows, 8 experts of 8 rows: per n tile each expert's weights once, lhs
  # per (n tile, k tile) change, out once per n tile (consecutive visits share the tile)
  n_tiles, k_tiles = 4096 // tn, 14336 // tk
  want = n_tiles * (8 * k_tiles * tk * tn + 8 * 8 * tn * 4 + 8 * k_tiles * tm * tk * 2
                    + tm * tn * 2)
  # lhs: the m tile never changes but k does, so it is refetched every step
  assert q.hbm_bytes() == want
  b = GmmAnchor(64, "down", "512x1024x1024", groups=8, model="Mixtral-8x7B")
  assert b.case.name == "ragged_dot Mixtral-8x7B down bf16 m=64"
  assert q.case.name == "ragged_dot Mixtral-8x7B down int8 m=64"


def test_gmm_closed_form_with_empty_experts_equals_make_group_metadata():
  """Qwen3-30B-A3B at m=64: 64 of 128 experts with one row each."""
  a = GmmAnchor(64, "down", "512x1024x1024")
  assert a.closed_form == GmmClosedForm(64, 64, 64, 128)
  a.closed_form.check()


@pytest.mark.parametrize("key,trunc", [("tokamax-gmm:512:down:heuristic:128", [2]),
                                       ("tokamax-attn:4096:128", [2, 4]),
                                       ("tokamax-attn:4608:128:joint:Flux.1 1024x1024", [2, 2])])
def test_tokamax_anchor_compiles_in_its_environment(key, trunc):
  """Built and compiled for v6e in this stack's tokamax environment (0.0.12 beside jax
  0.10, 0.0.17 beside jax 0.12; plain compile: no profile). The build checks, against
  tokamax itself, its version, that the case gets its heuristic config, and that the
  closed forms equal its own make_group_metadata / process_mask."""
  version, python = tokamax_ops.tokamax_environment()
  assert python.exists(), f"scripts/setup.sh makes {python.parent.parent.name}"
  assert f"tokamax {version}," in peers.spec_by_key(key).implementation
  out = protocol.compile_in_child(peers.spec_by_key(key), "v6e", trunc, profile=False)
  assert out["kernels"] == 1


def test_triangle_row_and_col_enumerate_the_lower_triangle():
  """The causal block list's closed forms (tokamax's anchor and calibration.py share them):
  grid index g walks the on-or-below-diagonal blocks row by row, for int and traced g."""
  rows = 7
  expected = [(i, j) for i in range(rows) for j in range(i + 1)]
  for g, (i, j) in enumerate(expected):
    assert triangle_row(g, rows - 1) == i
    assert triangle_col(g, i) == j
    traced = triangle_row(jnp.int32(g), rows - 1)
    assert (int(traced), int(triangle_col(jnp.int32(g), traced))) == (i, j)


def test_the_v5e_retry_is_named_in_the_anchors_method():
  """A truncation rated by children.run_child's retry (XLA's VMEM memory-space assignment off)
  puts its note in the row's method, saying at how many truncations where not all."""
  note = children.V5E_RETRY_NOTE
  plain = [dict(trunc=[2], cycles=10), dict(trunc=[4], cycles=20)]
  assert protocol.method_with_retries("m", plain) == "m"
  both = [dict(t, estimator_retry=note) for t in plain]
  assert protocol.method_with_retries("m", both) == f"m; {note}"
  one = [plain[0], both[1]]
  assert protocol.method_with_retries("m", one) == f"m; {note} (at 1 of its 2 truncations)"
