"""The estimator's arithmetic, checked without the estimator (fast, no static profile):
the cases' flops / bytes, the attention grid's visited tiles and HBM bytes by brute-force
replay, and the row / target logic of benchmarks/estimate.py (rating/rows.py,
reports/estimates.py)."""

import importlib

import jax.numpy as jnp
import pytest

from tpu_kernels import chips, flash_attention as F

from benchmarks import cases
from benchmarks.cases.diffusion import DIFFUSION_ATTENTION, JointAttention
from benchmarks.cases.headline import HEADLINE, Attention, GroupedMatmul, PagedDecode, RmsNorm
from benchmarks.cases.quantized_decode import QUANTIZED_DECODE, W8A8_DECODE
from benchmarks.cases.serving import SERVING_PAGED, PagedBatch
from benchmarks.peers.protocol import OURS, XLA, Implementation
from benchmarks.rating import flash_attention as attention_rating
from benchmarks.rating import ragged_dot
from benchmarks.rating.rows import finish_row
from benchmarks.reports import estimates as report
from benchmarks.reports import tables


@pytest.fixture(scope="module")
def estimate():
  """benchmarks/estimate.py without the profile flag (it would leak into later children)."""
  with pytest.MonkeyPatch.context() as mp:
    mp.setenv("ESTIMATE_STATIC_PROFILE", "0")
    yield importlib.import_module("benchmarks.estimate")


def test_headline_names_are_unique_and_found():
  names = [c.name for c in HEADLINE]
  assert len(set(names)) == len(names)
  for c in HEADLINE:
    assert cases.by_name(c.name) is c
    # Each name starts with its kernel's stem: the build picks a card's rows by it.
    assert c.name.split()[0] == c.kernel.removesuffix("-tpu").replace("-", "_")
  with pytest.raises(KeyError, match="known"):
    cases.by_name("nope")


def test_diffusion_cases_are_named_and_found():
  """The non-causal Diffusers cases: unique names among every case, found by name, named
  after their kernel (the card's rows), and the issue's shapes."""
  names = [c.name for c in cases.all_cases()]
  assert len(set(names)) == len(names)
  got = {(c.seq, c.heads, c.head_dim, c.batch) for c in DIFFUSION_ATTENTION}
  assert got == {(4096 + 333, 24, 64, 2), (4096 + 512, 24, 128, 1), (32760, 40, 128, 1)}
  for c in DIFFUSION_ATTENTION:
    assert cases.by_name(c.name) is c and not c.causal
    assert c.name.startswith("flash_attention non-causal ")


def test_joint_attention_flops_and_bytes_count_every_pair():
  case = JointAttention("toy", seq=7, heads=3, head_dim=16, batch=2)
  pairs = sum(1 for i in range(7) for j in range(7))
  assert case.flops() == 2 * 3 * pairs * 16 * 4   # QK^T and PV: 2 flops per MAC each
  assert case.min_bytes() == 4 * 2 * 7 * 3 * 16 * 2   # q, k, v read, out written
  assert (case.q_heads, case.kv_heads, case.bound) == (3, 3, "compute")


def test_attention_flops_count_the_causal_pairs():
  case = Attention(seq=8, batch=2, q_heads=4, kv_heads=2, head_dim=16)
  visible = sum(1 for i in range(8) for j in range(8) if j <= i)
  assert case.flops() == 2 * 4 * visible * 16 * 4   # QK^T and PV: 2 flops per MAC each
  assert case.min_bytes() == (2 * 2 * 8 * 4 * 16 + 2 * 2 * 8 * 2 * 16) * 2


def test_grouped_matmul_and_paged_roofline_bytes():
  g = GroupedMatmul(512, "gate_up+silu")
  assert (g.k, g.n_weight, g.n_out) == (2048, 1536, 768)
  assert g.min_bytes() == (512 * 2048 + 128 * 2048 * 1536 + 512 * 768) * 2
  p = PagedDecode(2048)
  assert p.min_bytes() == 2 * 64 * 8 * 2048 * 128 * 2 + 2 * 64 * 32 * 128 * 2


def test_quantized_decode_rows_and_their_bytes():
  """Issue 28: every int8 / fp8 row of QUANTIZED_DECODE has its bf16 row (same model, part,
  m) among ALL_CASES; 1-byte weights and a float32 scale per output channel of each
  expert with rows; HEADLINE's grouped-matmul names are unchanged."""
  assert [c.name for c in HEADLINE if c.kernel == "ragged-dot-tpu"] == [
      f"ragged_dot Qwen3-30B-A3B {p} bf16 m={m}" for m in (512, 8192)
      for p in ("gate_up+silu", "down")]
  names = [c.name for c in cases.all_cases()]
  assert len(set(names)) == len(names)
  quantized = [c for c in QUANTIZED_DECODE if c.weight_dtype != "bfloat16"]
  assert len(quantized) == 3 * 2 * 2 * 2   # models x m x parts x (int8, fp8)
  for c in quantized:
    bf16 = cases.by_name(c.name.replace(" int8 ", " bf16 ").replace(" fp8 ", " bf16 "))
    assert (bf16.model, bf16.part, bf16.m, bf16.weight_dtype) == (c.model, c.part, c.m,
                                                                  "bfloat16")
  # Qwen3-30B-A3B down at m=64: 64 of 128 experts get a row each, weights [768, 2048].
  q = cases.by_name("ragged_dot Qwen3-30B-A3B down int8 m=64")
  assert q.min_bytes() == 64 * 768 * 2 + 64 * 768 * 2048 + 64 * 2048 * 4 + 64 * 2048 * 2
  b = cases.by_name("ragged_dot Qwen3-30B-A3B down bf16 m=64")
  assert b.min_bytes() == 64 * 768 * 2 + 64 * 768 * 2048 * 2 + 64 * 2048 * 2
  # Mixtral-8x7B gate_up at m=512: all 8 experts, weights [4096, 2 * 14336], output 14336.
  x = cases.by_name("ragged_dot Mixtral-8x7B gate_up+silu fp8 m=512")
  assert x.flops() == 2 * 512 * 4096 * 28672
  assert x.min_bytes() == 512 * 4096 * 2 + 8 * (4096 * 28672 + 28672 * 4) + 512 * 14336 * 2
  g = cases.by_name("ragged_dot gpt-oss-20b down int8 m=64")
  assert (g.groups, g.k, g.n_weight, g.active_groups) == (32, 2880, 2880, 32)


def test_w8a8_rows_pair_the_int8_rows():
  """Each int8 row of QUANTIZED_DECODE has its w8a8 row (int8 activations, lhs_quant):
  the same shapes and roofline (bf16 activations in), compared with the same bf16 row."""
  int8 = [c for c in QUANTIZED_DECODE if c.weight_dtype == "int8"]
  assert len(W8A8_DECODE) == len(int8) == 12
  for c, w in zip(int8, W8A8_DECODE):
    assert w.name == c.name.replace(" int8 ", " w8a8 ") and w.lhs_quant == "int8"
    assert cases.by_name(w.name) is w
    assert (w.flops(), w.min_bytes()) == (c.flops(), c.min_bytes())
    assert tables.bf16_case_name(w.name) == tables.bf16_case_name(c.name)
    gmm = ragged_dot.gmm_case(w, "v6e")
    assert gmm.lhs_quant == "int8" and gmm.lhs_dtype == jnp.int8
    assert gmm.specs()[0].dtype == jnp.int8 and gmm.specs()[-2].shape == (w.m, 1)


@pytest.mark.parametrize("seq,bq,bk", [(4096, 1024, 512), (4096, 512, 1024), (1000, 256, 128),
                                       (32768, 1024, 512), (640, 128, 256)])
def test_visited_and_interior_tiles_by_brute_force(seq, bq, bk):
  num_q, num_k = -(-seq // bq), -(-seq // bk)
  visited = interior = 0
  for i in range(num_q):
    rows = range(i * bq, min((i + 1) * bq, seq))
    for j in range(num_k):
      keys = range(j * bk, min((j + 1) * bk, seq))
      pairs_visible = [k <= r for r in (rows[0], rows[-1]) for k in (keys[0], keys[-1])]
      if keys[0] <= rows[-1]:                    # some (row, key) pair is visible
        visited += 1
        interior += all(pairs_visible)           # the mask crosses nothing
  assert sum(attention_rating.visited_tiles(seq, bq, bk)) == visited
  assert attention_rating.interior_tiles(seq, bq, bk) == interior


@pytest.mark.parametrize("seq,bq,bk", [(4429, 512, 512), (4608, 512, 1024), (32760, 512, 1024),
                                       (4096, 512, 512)])
def test_non_causal_tiles_by_brute_force(seq, bq, bk):
  """Non-causal: every padded tile is visited; interior = those with no padded key."""
  visited = interior = 0
  for i in range(-(-seq // bq)):
    for j in range(-(-seq // bk)):
      visited += 1
      interior += (j + 1) * bk <= seq
  assert sum(attention_rating.visited_tiles(seq, bq, bk, causal=False)) == visited
  assert attention_rating.interior_tiles(seq, bq, bk, causal=False) == interior


def _forward_grid(seq: int, bq: int, bk: int, folded: bool, causal: bool = True):
  """(q block, kv block, computes) of every forward grid step of one (batch row, KV head),
  from the kernel's documented schedule: folded, row i runs q block i then q block
  nq - 1 - i, each over the kv blocks it can see; else a row per q block over every kv
  step, the steps past its range waiting at kv block 0."""
  num_q, num_k = -(-seq // bq), -(-seq // bk)
  sees = [[j for j in range(num_k) if j * bk <= min((i + 1) * bq, seq) - 1 or not causal]
          for i in range(num_q)]                  # kv blocks with a key <= the last row
  if folded:
    return [(q, j, True) for i in range(num_q // 2) for q in (i, num_q - 1 - i)
            for j in sees[q]]
  return [(i, step if step in sees[i] else 0, step in sees[i]) for i in range(num_q)
          for step in range(num_k)]


@pytest.mark.parametrize("seq, folded", [(3000, False), (4096, True), (5120, False)])
def test_attention_hbm_bytes_replay_the_forward_grid(seq, folded):
  case = Attention(seq=seq, batch=2, q_heads=8, kv_heads=2, head_dim=128)
  t = attention_rating.tiling(case, "v6e")
  num_q = -(-case.seq // t.block_q)
  assert F._fold_causal(True, None, 0, seq, seq, t.block_q, t.block_k) == folded
  grid = _forward_grid(case.seq, t.block_q, t.block_k, folded)
  # Whichever the schedule, each tile with a visible (row, key) pair is computed once.
  computed = [(q, j) for q, j, runs in grid if runs]
  visible = {(q, j) for q in range(num_q) for j in range(-(-seq // t.block_k))
             if j * t.block_k <= min((q + 1) * t.block_q, seq) - 1}
  assert len(computed) == len(set(computed)) and set(computed) == visible
  assert len(computed) == sum(attention_rating.visited_tiles(case.seq, t.block_q, t.block_k))
  moved, last = 0, {}
  kv_block_bytes = t.block_k * case.head_dim * 2
  q_block_bytes = (case.q_heads // case.kv_heads) * t.block_q * case.head_dim * 2
  for b in range(case.batch):
    for h in range(case.kv_heads):
      for q, j, _ in grid:
        for name, index, nbytes in (("q", (b, h, q), q_block_bytes),
                                    ("k", (b, h, j), kv_block_bytes),
                                    ("v", (b, h, j), kv_block_bytes)):
          if last.get(name) != index:
            moved += nbytes
            last[name] = index
  out_and_lse = case.batch * case.q_heads * num_q * t.block_q * (case.head_dim * 2 + 4)
  assert attention_rating.hbm_bytes(case, t) == moved + out_and_lse


@pytest.mark.parametrize("case", DIFFUSION_ATTENTION, ids=lambda c: c.model)
@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_non_causal_hbm_bytes_replay_the_forward_grid(case, chip):
  """Every q block reads every kv block (no fold, no skipped step), whole blocks counted
  where the last ones are partial; no XLA copies around the kernel."""
  t = attention_rating.tiling(case, chip)
  grid = _forward_grid(case.seq, t.block_q, t.block_k, folded=False, causal=False)
  assert all(runs for _, _, runs in grid)
  num_q = -(-case.seq // t.block_q)
  moved, last = 0, {}
  for b in range(case.batch):
    for h in range(case.heads):
      for q, j, _ in grid:
        for name, index, nbytes in (("q", (b, h, q), t.block_q * case.head_dim * 2),
                                    ("k", (b, h, j), t.block_k * case.head_dim * 2),
                                    ("v", (b, h, j), t.block_k * case.head_dim * 2)):
          if last.get(name) != index:
            moved += nbytes
            last[name] = index
  out_and_lse = case.batch * case.heads * num_q * t.block_q * (case.head_dim * 2 + 4)
  assert attention_rating.hbm_bytes(case, t) == moved + out_and_lse


def test_long_non_causal_fit_is_exact_for_a_model(monkeypatch):
  """Wan's 32760 tokens are rated at two shorter lengths with the same tail and fitted per
  q block and per interior tile: a program whose cycles are exactly that is recovered."""
  case = next(c for c in DIFFUSION_ATTENTION if c.seq > attention_rating.MAX_RATED_SEQ)
  t = attention_rating.tiling(case, "v6e")
  rated = []

  def model(seq, heads, case_, t_, chip):
    rated.append(seq)
    nq = -(-seq // t.block_q)
    return 1000 + heads * (300 * nq + 7 * attention_rating.interior_tiles(
        seq, t.block_q, t.block_k, causal=False))
  monkeypatch.setattr(attention_rating, "_cycles", model)
  row = attention_rating.estimate(case, "v6e")
  big = max(t.block_q, t.block_k)
  assert {s % big for s in rated} == {case.seq % big} and max(rated) <= 4096
  assert row["estimated_cycles"] == round(model(case.seq, case.heads, case, t, "v6e"))
  assert "partial last blocks in the kernel" in row["method"]


def test_finish_row_and_targets():
  case = PagedDecode(2048)
  ours = Implementation(case.name, "pallas", OURS, None)
  other = Implementation(case.name, "xla", XLA, None)
  chip = chips.get_chip("v6e")
  row = finish_row(ours, "v6e", dict(compiled=True, error=None, estimated_cycles=1_750_000,
                                     hbm_bytes=case.min_bytes()))
  assert row["compute_us"] == pytest.approx(1000.0)
  assert row["hbm_us"] == pytest.approx(case.min_bytes() / chip.hbm_bytes_per_s * 1e6)
  assert row["predicted_us"] == pytest.approx(1000.0)
  assert row["efficiency"] == pytest.approx(row["roofline_us"] / 1000.0)
  assert (row["bound"], row["target"]) == ("memory", 0.85)
  xla = finish_row(other, "v6e", dict(compiled=True, error=None, estimated_cycles=None,
                                      compute_us=2000.0, hbm_bytes=1))
  assert xla["predicted_us"] == pytest.approx(2000.0)
  # No cycles: an error row, never a prediction.
  empty = finish_row(ours, "v6e", dict(compiled=True, error=None, estimated_cycles=0,
                                       hbm_bytes=10))
  assert "predicted_us" not in empty and "no estimate" in empty["error"]
  lines = report.targets([row, xla])
  mine = next(l for l in lines if l.startswith(f"| {case.name}"))
  assert "(short by" in mine and "2.00x (faster)" in mine and "| xla |" in mine


def test_markdown_keeps_failed_rows():
  case = RmsNorm(8, 4096)
  impl = Implementation(case.name, "pallas", OURS, None)
  failed = finish_row(impl, "v5e", dict(compiled=False, error="exit -6: LLO_CHECK"))
  text = report.markdown([failed])
  assert "not rated: exit -6: LLO_CHECK" in text


def test_mosaic_kernel_cycles_reads_instructions_that_span_lines():
  from tpu_kernels import aot
  text = ('  %a = f32[8] custom-call(), custom_call_target="tpu_custom_call", '
          'backend_config={"kernel":"x\n  more", "estimated_cycles":"12"}\n'
          '  %c = f32[8] add(%a, %a), backend_config={"estimated_cycles":"5"}\n'
          '  ROOT %b = f32[8] custom-call(), custom_call_target="tpu_custom_call", '
          'backend_config={"estimated_cycles":"30"}')
  assert aot.mosaic_kernel_cycles(text) == [12, 30]
  with pytest.raises(RuntimeError, match="no estimated_cycles"):
    aot.mosaic_kernel_cycles('  %a = custom-call(), custom_call_target="tpu_custom_call"')


def test_merge_replaces_rerated_rows_in_place(estimate):
  row = lambda case, impl, chip, v: dict(case=case, implementation=impl, chip=chip, v=v)
  old = [row("a", "ours", "v5e", 1), row("a", "xla", "v5e", 2), row("b", "ours", "v5e", 3)]
  new = [row("a", "xla", "v5e", 20), row("a", "anchor", "v5e", 21), row("c", "ours", "v5e", 4)]
  assert estimate.merged(old, new) == [row("a", "ours", "v5e", 1), row("a", "xla", "v5e", 20),
                                       row("a", "anchor", "v5e", 21), row("b", "ours", "v5e", 3),
                                       row("c", "ours", "v5e", 4)]


# ------------------------------------------------------------- serving paged shapes (issue 28)


def _brute_visible(case):
  """(query-key pairs, distinct keys read) of a PagedBatch by enumeration."""
  pairs, keys = 0, 0
  for q_len, kv_len in case.sequences():
    seen = set()
    for p in range(kv_len - q_len, kv_len):
      vis = [j for j in range(kv_len) if j <= p and (case.sliding_window is None
                                                       or p - j < case.sliding_window)]
      pairs += len(vis)
      seen.update(vis)
    keys += len(seen)
  return pairs, keys


@pytest.mark.parametrize("kw", [dict(decode=3, context=9), dict(decode=0, prefill=2, chunk=4,
                                                                prefill_context=10),
                                dict(decode=2, context=20, prefill=1, chunk=5,
                                     prefill_context=12, sliding_window=3),
                                dict(decode=1, context=7, sliding_window=30)])
def test_paged_batch_counts_only_visible_keys(kw):
  case = PagedBatch(q_heads=4, kv_heads=2, head_dim=8, **kw)
  pairs, keys = _brute_visible(case)
  assert case.flops() == 4 * 4 * 8 * pairs
  tokens = sum(q for q, _ in case.sequences())
  assert case.min_bytes() == 2 * keys * 2 * 8 * 2 + 2 * tokens * 4 * 8 * 2


def test_paged_batch_decode_equals_paged_decode_and_window_reads_the_window():
  assert PagedBatch().flops() == PagedDecode(2048).flops()
  assert PagedBatch().min_bytes() == PagedDecode(2048).min_bytes()
  w = PagedBatch(context=32768, sliding_window=4096)
  assert w.min_bytes() == PagedDecode(4096).min_bytes()
  with pytest.raises(ValueError, match="sequences"):
    PagedBatch(decode=0)
  with pytest.raises(ValueError, match="chunk"):
    PagedBatch(prefill=1, chunk=600, prefill_context=512)


def test_serving_rows_cover_the_issue_and_are_memory_bound():
  from tpu_kernels import chips
  rows = SERVING_PAGED
  names = [c.name for c in cases.all_cases()]
  assert len(set(names)) == len(names)
  assert {c.page_size for c in rows} >= {16, 32, 256}   # page 64: HEADLINE's row
  assert any(c.decode and c.prefill for c in rows)
  assert {c.kv_dtype for c in rows} >= {"int8", "float8_e4m3fn"}
  assert any(c.sliding_window for c in rows)
  for c in rows:
    assert cases.by_name(c.name) is c and c.name.startswith("paged_attention serving")
    for chip in ("v5e", "v6e"):
      ch = chips.get_chip(chip)
      assert c.flops() / ch.bf16_flops_per_s < c.min_bytes() / ch.hbm_bytes_per_s


def test_paged_batch_items_classes_and_hbm_replay():
  """The estimate's bookkeeping for a mixed step and a windowed decode: classes cover every
  work item; a decode batch's replayed bytes are each page of the window once plus the
  padded q / out blocks."""
  from benchmarks.rating import paged_attention as pe
  mixed = PagedBatch(decode=60, prefill=4)
  t = pe.batch_tiling(mixed, "v6e")
  tables = pe.batch_items(mixed, t)
  classes = pe.item_classes(mixed, t, tables["items"])
  assert sum(n for _, n in classes) == len(tables["items"]["rows"])
  by_rows = {}
  for floors, n in classes:
    by_rows[floors[0]] = by_rows.get(floors[0], 0) + n
  assert by_rows[1] == 60 and by_rows[t.block_q] == 4 * 512 // t.block_q
  for case in (PagedBatch(), PagedBatch(context=32768, sliding_window=4096),
               PagedBatch(page_size=16)):
    t = pe.batch_tiling(case, "v6e")
    tables = pe.batch_items(case, t)
    kv = min(case.context, case.sliding_window or case.context)
    q_blocks = 2 * 64 * 8 * t.rows * 128 * 2
    assert pe.batch_hbm_bytes(case, t, tables["slot_pages"], tables["items"]) == (
        2 * 64 * kv * 8 * 128 * 2 + q_blocks)
