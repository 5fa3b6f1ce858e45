"""The grouped matmul's tuning table: keys are reachable, entries are legal, fit and are
used; anything outside the table keeps the heuristic. Pure Python (no kernel runs, no
compile): the entries' compiles are in test_ragged_dot_aot.py, the tuner's traffic model
against the index-map replay in test_ragged_estimate.py."""

import dataclasses
from unittest import mock

import jax.numpy as jnp
import pytest

from tpu_kernels import chips, ragged_dot as R, vmem

TABLE = R.TUNED_BLOCKS
BF16 = jnp.bfloat16


def _tiling(key: R.TuningKey, m: int, **blocks) -> R.Tiling:
  dt = jnp.dtype(key.dtype)
  return R.gmm_tiling(m, key.k, key.n, num_groups=key.num_groups, lhs_dtype=dt,
                      rhs_dtype=jnp.dtype(key.weight_dtype),
                      out_dtype=jnp.dtype(key.out_dtype), num_rhs=key.num_rhs,
                      n_must_divide=key.n_must_divide,
                      chip=key.chip, interleaved=key.interleaved, **blocks)


def _entry(chip, num_rhs, m, k, n, groups, **fields) -> tuple:
  """The table's key tuple of a bf16 call."""
  return dataclasses.astuple(R.TuningKey(chip, "bfloat16", "bfloat16", num_rhs, m, k, n,
                                         groups, **fields))


def test_the_table_covers_the_shapes_the_survey_found_slow():
  """Mixtral-8x7B's prefill down projection rated 0.40 of the roofline with the heuristic
  tiles (benchmarks/results/ragged_survey.jsonl): the tuner's winner must be in the table."""
  assert _entry("v6e", 1, 8192, 14336, 4096, 8) in TABLE


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_the_table_covers_the_headline_prefill(chip):
  """Qwen3-30B-A3B's experts at m=8192 with the heuristic tiles rated 0.51-0.57 of the
  roofline at unaligned routing on both chips (benchmarks/results/ragged_tuning.jsonl)."""
  for num_rhs, k, n in [(2, 2048, 768), (1, 768, 2048)]:
    assert _entry(chip, num_rhs, 8192, k, n, 128) in TABLE


@pytest.mark.parametrize("entry", sorted(TABLE), ids=lambda e: "-".join(map(str, e)))
def test_every_key_is_produced_by_the_lookup(entry):
  """The key's own shape, and a row count inside its bucket, map back to it."""
  key = R.TuningKey(*entry)
  for m in (key.m_bucket, key.m_bucket // 2 + 1):
    assert R.tuning_key(m, key.k, key.n, num_groups=key.num_groups, lhs_dtype=key.dtype,
                        rhs_dtype=key.weight_dtype, out_dtype=key.out_dtype,
                        num_rhs=key.num_rhs, chip=key.chip, interleaved=key.interleaved) == key


@pytest.mark.parametrize("entry", sorted(TABLE), ids=lambda e: "-".join(map(str, e)))
def test_every_entry_is_a_legal_block_that_fits_and_is_used(entry):
  key, (block_m, block_k, block_n) = R.TuningKey(*entry), TABLE[entry]
  chip = chips.get_chip(key.chip)
  assert block_m & (block_m - 1) == 0 and block_m <= R.MAX_BLOCK_M
  # the whole k may be past MAX_BLOCK_K (the tuner rates it, gmm_tiling takes it)
  assert block_k in R._lane_block_candidates(key.k, None, None) or block_k == key.k
  assert block_n in R._lane_block_candidates(key.n, None, key.n_must_divide)
  for m in (key.m_bucket, key.m_bucket // 2 + 1):
    t = _tiling(key, m)
    assert (t.block_m, t.block_k, t.block_n) == (min(block_m, m), block_k, block_n)
    assert t.vmem_plan_bytes <= vmem.vmem_budget(chip, t.vmem_limit_bytes)
    assert t.vmem_limit_bytes <= chip.max_vmem_limit_bytes
    explicit = _tiling(key, m, block_m=block_m, block_k=block_k, block_n=block_n)
    assert explicit == t   # what the tuner rated: the same tiles, the same limit


def _blocks(t: R.Tiling) -> tuple[int, int, int]:
  return t.block_m, t.block_k, t.block_n


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_the_experts_layers_prefill_kernels_have_keys_of_their_own(chip):
  """moe_experts at 8192 tokens: gpt-oss's gate/up takes the "lanes" kernel (interleaved
  columns: 2 x block_n weight columns per tile and the de-interleave) and both models'
  down write float32. Each is its own key, so an entry for the concatenated gate/up or the
  bf16-out down of the same shape never tiles them, nor theirs those."""
  interleaved = R.TuningKey(chip, "bfloat16", "bfloat16", 2, 32768, 2880, 2880, 32,
                            interleaved=True)
  args = dict(num_groups=32, lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16, num_rhs=2,
              chip=chip)
  assert R.tuning_key(32768, 2880, 2880, interleaved=True, **args) == interleaved
  assert R.tuning_key(32768, 2880, 2880, **args) == dataclasses.replace(interleaved,
                                                                        interleaved=False)
  downs = [R.TuningKey(chip, "bfloat16", "bfloat16", 1, m, k, n, g, f32_out=True)
           for m, k, n, g in [(65536, 768, 2048, 128), (32768, 2880, 2880, 32)]]
  for key in [interleaved] + downs:   # each tuned (benchmarks/tuning/ragged_dot.py)
    entry = TABLE[dataclasses.astuple(key)]
    assert _blocks(_tiling(key, key.m_bucket)) == entry
    fake = (16, *entry[1:])   # a legal entry no heuristic picks
    with mock.patch.dict(R.TUNED_BLOCKS, {dataclasses.astuple(key): fake}):
      assert _blocks(_tiling(key, key.m_bucket)) == fake
      # the concatenated gate/up ("split": halves off the lane grid) / the bf16-out down
      other = R.gmm_tiling(key.m_bucket, key.k, key.n, num_groups=key.num_groups,
                           lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16,
                           num_rhs=key.num_rhs, chip=chip)
      assert _blocks(other) != fake


def test_outside_the_table_the_heuristic_decides():
  key = R.TuningKey("v6e", "bfloat16", "bfloat16", 1, 8192, 14336, 4096, 8)
  with mock.patch.dict(R.TUNED_BLOCKS, clear=True):
    want = _tiling(key, 8192)
  with mock.patch.dict(R.TUNED_BLOCKS, {dataclasses.astuple(key): (64, 256, 256)}):
    assert _blocks(_tiling(key, 8192)) == (64, 256, 256)
    # Explicit blocks or a limit from the caller bypass the table.
    assert _blocks(_tiling(key, 8192, block_m=128)) != (64, 256, 256)
    assert _blocks(_tiling(key, 8192, vmem_limit_bytes=32 * vmem.MiB)) == _blocks(want)
    # Another bucket of m, another chip, another weight dtype or a float32 output (its
    # own key) miss the key; an output dtype neither lhs's nor float32 has no key at all.
    assert _blocks(_tiling(key, 2048)) != (64, 256, 256)
    assert _blocks(_tiling(dataclasses.replace(key, chip="v5e"), 8192)) != (64, 256, 256)
    assert _blocks(_tiling(dataclasses.replace(key, weight_dtype="int8"), 8192)) != (64, 256, 256)
    assert R.tuning_key(8192, key.k, key.n, num_groups=8, lhs_dtype=BF16, rhs_dtype=jnp.int8,
                        out_dtype=BF16, num_rhs=1, chip="v6e") == dataclasses.replace(
                            key, weight_dtype="int8")
    assert R.tuning_key(8192, key.k, key.n, num_groups=8, lhs_dtype=BF16, rhs_dtype=BF16,
                        out_dtype=jnp.float32, num_rhs=1, chip="v6e") == dataclasses.replace(
                            key, f32_out=True)
    assert _blocks(_tiling(dataclasses.replace(key, f32_out=True), 8192)) != (64, 256, 256)
    assert R.tuning_key(8192, key.k, key.n, num_groups=8, lhs_dtype=jnp.float32,
                        rhs_dtype=jnp.float32, out_dtype=BF16, num_rhs=1, chip="v6e") is None
  # 384 is not a block the kernel takes (above 256 it cuts lanes in multiples of 256):
  # the entry is ignored.
  with mock.patch.dict(R.TUNED_BLOCKS, {dataclasses.astuple(key): (64, 256, 384)}):
    assert _tiling(key, 8192) == want


@pytest.mark.parametrize("entry", [e for e in sorted(TABLE) if e[1:3] == ("bfloat16", "int8")
                                    and not R.TuningKey(*e).f32_out],
                         ids=lambda e: "-".join(map(str, e)))
def test_int8_rows_take_the_tiles_of_their_bf16_rows(entry):
  """lhs_quant="int8": the rows quantized from bf16 rows, with the same int8 weights and a
  bf16 output, take that call's tuned tiles (the same weight traffic per visit)."""
  key = R.TuningKey(*entry)
  assert R.tuning_key(key.m_bucket, key.k, key.n, num_groups=key.num_groups,
                      lhs_dtype=jnp.int8, rhs_dtype=jnp.int8, out_dtype=BF16,
                      num_rhs=key.num_rhs, chip=key.chip) == key
  t = R.gmm_tiling(key.m_bucket, key.k, key.n, num_groups=key.num_groups, lhs_dtype=jnp.int8,
                   rhs_dtype=jnp.int8, out_dtype=BF16, num_rhs=key.num_rhs,
                   n_must_divide=key.n_must_divide, chip=key.chip)
  assert _blocks(t) == TABLE[entry]
  # int8 rows with a float32 output (no such call was tuned) take no tuned tiles
  assert R.tuned_blocks(key.m_bucket, key.k, key.n, num_groups=key.num_groups,
                        lhs_dtype=jnp.int8, rhs_dtype=jnp.int8, out_dtype=jnp.float32,
                        num_rhs=key.num_rhs, chip=key.chip) is None


def test_table_is_built_from_the_rated_heuristic_and_a_gain():
  """An entry needs the heuristic's pick rated, a gain of at least 1% at unaligned
  routing, and no loss at balanced routing; an unrated candidate cannot win."""
  from benchmarks.tuning import ragged_dot as T
  key = T.grid()[0]

  def row(blocks, unaligned, balanced, heuristic=False):
    return dict(key=list(dataclasses.astuple(key)), blocks=list(blocks), heuristic=heuristic,
                unaligned=dict(predicted_us=unaligned), balanced=dict(predicted_us=balanced))

  own = row((16, 512, 512), 100.0, 50.0, heuristic=True)
  unrated = dict(key=list(dataclasses.astuple(key)), blocks=[8, 512, 256], heuristic=False,
                 error="exit -6")
  assert T.table_from_ratings([row((8, 256, 256), 90.0, 40.0)]) == {}       # own unrated
  assert T.table_from_ratings([own, row((8, 256, 256), 99.5, 40.0)]) == {}  # gain < 1%
  assert T.table_from_ratings([own, row((8, 256, 256), 90.0, 51.0)]) == {}  # slower balanced
  assert T.table_from_ratings([own, unrated, row((8, 256, 256), 90.0, 50.0),
                               row((8, 256, 512), 90.0, 45.0)]) == {key: (8, 256, 512)}
  # The best unaligned candidate is slower balanced: the next best that is not wins.
  assert T.table_from_ratings([own, row((8, 256, 256), 80.0, 51.0),
                               row((8, 512, 256), 95.0, 50.0)]) == {key: (8, 512, 256)}


def test_a_rerun_keeps_a_keys_other_ratings_and_replaces_its_heuristic():
  """tuning/ragged_dot.merged_log: a new rating replaces the same key and blocks; the key's
  earlier candidates stay (so a run ranking other candidates loses no good one), but its
  earlier heuristic pick goes (a changed heuristic must not leave two)."""
  from benchmarks.tuning import ragged_dot as T
  a, b = (list(dataclasses.astuple(k)) for k in T.grid()[:2])

  def row(key, blocks, heuristic=False, us=1.0):
    return dict(key=key, blocks=list(blocks), heuristic=heuristic, us=us)

  old = [row(a, (64, 512, 512), heuristic=True), row(a, (128, 512, 512)), row(a, (256, 512, 512)),
         row(b, (64, 512, 512), heuristic=True)]
  new = [row(a, (32, 512, 512), heuristic=True, us=2.0), row(a, (256, 512, 512), us=2.0)]
  assert T.merged_log(old, new) == [row(a, (128, 512, 512)), row(b, (64, 512, 512), heuristic=True),
                                    *new]
  # A run of other blocks only (`--also`: no heuristic rating) keeps the key's pick.
  extra = [row(b, (32, 512, 512))]
  assert T.merged_log(old, extra) == old + extra


def test_summary_rates_against_the_roofline_and_is_the_performance_page_table():
  """`benchmarks/tuning/ragged_dot.py --summary` divides the roofline by each prediction
  (capped at 1); docs/performance/ragged-dot.md's table is its output for the shipped log, one
  row per tuned key."""
  from benchmarks import ROOT, read_rows
  from benchmarks.tuning import ragged_dot as T
  key = R.TuningKey("v6e", "bfloat16", "bfloat16", 1, 8192, 768, 2048, 128)
  c, gmm = chips.get_chip(key.chip), T.case(key)
  roofline_us = max(gmm.flops() / c.bf16_flops_per_s, gmm.min_bytes() / c.hbm_bytes_per_s) * 1e6

  def row(blocks, balanced, unaligned, heuristic=False):
    return dict(key=list(dataclasses.astuple(key)), blocks=list(blocks), heuristic=heuristic,
                balanced=dict(predicted_us=balanced), unaligned=dict(predicted_us=unaligned))

  rows = [row((64, 768, 2048), roofline_us, 4 * roofline_us, heuristic=True),
          row((256, 768, 2048), roofline_us / 2, 2 * roofline_us)]
  line = next(l for l in T.summary(rows) if "| v6e | qwen3-30b-a3b | 8192 | down |" in l)
  assert line.endswith("| 1.00 / 0.25 | 1.00 / 0.50 | (256, 768, 2048) |"), line

  shipped = T.summary(read_rows(ROOT / "benchmarks/results/ragged_tuning.jsonl"))
  assert len(shipped) == 2 + len(T.grid())
  performance = (ROOT / "docs" / "performance" / "ragged-dot.md").read_text()
  assert "\n".join(shipped) in performance


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("m, k, n", [(64, 14336, 4096), (512, 4096, 14336), (64, 2880, 5760)])
def test_one_byte_weights_get_a_block_k_that_divides_k(chip, m, k, n):
  """A partial last k block of int8 / fp8 weights is converted before its mask, off the
  dot's fast widening, so the heuristic takes a block_k dividing k where one fits
  (Mixtral-8x7B down / gate_up, gpt-oss-20b gate_up at decode); bf16 weights keep the
  largest block, tail or not."""
  common = dict(num_groups=8, lhs_dtype=BF16, out_dtype=BF16, chip=chip)
  for weights in (jnp.int8, jnp.float8_e4m3fn):
    t = R.gmm_tiling(m, k, n, rhs_dtype=weights, **common)
    assert k % t.block_k == 0, (weights, t)
    assert t.vmem_plan_bytes <= t.vmem_limit_bytes
  if k == 14336 and chip == "v6e":
    with mock.patch.dict(R.TUNED_BLOCKS, clear=True):   # the heuristic's, not the table's
      assert k % R.gmm_tiling(m, k, n, rhs_dtype=BF16, **common).block_k   # a tail for bf16


@pytest.mark.parametrize("chip, experts, k, n, m, weights, out, blocks", [
    ("v6e", 256, 2048, 7168, 65536, BF16, BF16, (256, 2048, 1024)),
    ("v6e", 128, 768, 2048, 65536, jnp.int8, BF16, (512, 768, 1024)),
    ("v5e", 64, 1024, 2048, 8192, BF16, jnp.float32, (128, 1024, 1024)),
], ids=["DeepSeek-V3-down", "Qwen3-30B-A3B-down-int8", "OLMoE-1B-7B-down-f32-out"])
def test_one_k_block_plans_count_no_accumulator(chip, experts, k, n, m, weights, out, blocks):
  """Where one k block covers k the kernel keeps no float32 accumulator, and the VMEM plan
  counts none. Under the chip's default scoped limit, given by the caller (which keeps the
  heuristic within it), these down projections fit their block_n only by that: with an
  accumulator the plan took block_n 512."""
  limit = chips.get_chip(chip).default_scoped_vmem_bytes
  t = R.gmm_tiling(m, k, n, num_groups=experts, lhs_dtype=BF16, rhs_dtype=weights,
                   out_dtype=out, chip=chip, vmem_limit_bytes=limit)
  assert _blocks(t) == blocks and t.vmem_limit_bytes == limit, t


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
def test_outside_the_table_one_k_block_under_a_raised_limit(chip):
  """Outside the table the heuristic takes one k block wherever a scoped limit of up to
  _ONE_K_BLOCK_MAX_LIMIT holds one (`_one_k_block_tiling`). Under the default limit it
  split k: Mixtral-8x7B's gate/up at decode on both chips (block_k 1536 on v5e, 1024 on
  v6e), Qwen3-30B-A3B's on v5e (1024). The tiling is the one a caller gets by asking for
  its blocks. A k beyond MAX_BLOCK_K (Mixtral's down, k = 14336) is still cut, under the
  default limit; the table holds one k block for it (at decode, 64 rows: 14336 x 512
  bf16 weight blocks under a raised limit)."""
  chip_ = chips.get_chip(chip)
  common = dict(lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16, chip=chip)
  for m, k, n, groups, num_rhs in [(64, 4096, 14336, 8, 2), (64, 2048, 768, 128, 2),
                                   (65536, 2048, 7168, 256, 1)]:
    shape = dict(num_groups=groups, num_rhs=num_rhs, n_must_divide=n if num_rhs == 2 else None,
                 **common)
    with mock.patch.dict(R.TUNED_BLOCKS, clear=True):
      t = R.gmm_tiling(m, k, n, **shape)
      assert t.block_k == k, (m, k, n, t)
      assert t.vmem_plan_bytes <= vmem.vmem_budget(chip_, t.vmem_limit_bytes)
      assert t.vmem_limit_bytes <= min(chip_.max_vmem_limit_bytes, R._ONE_K_BLOCK_MAX_LIMIT)
      assert R.gmm_tiling(m, k, n, block_m=t.block_m, block_k=k, block_n=t.block_n,
                          **shape) == t
  mixtral_gate_up = R.gmm_tiling(64, 4096, 14336, num_groups=8, num_rhs=2,
                                 n_must_divide=14336, **common)
  assert mixtral_gate_up.vmem_limit_bytes > chip_.default_scoped_vmem_bytes
  with mock.patch.dict(R.TUNED_BLOCKS, clear=True):
    mixtral_down = R.gmm_tiling(64, 14336, 4096, num_groups=8, **common)
  assert mixtral_down.block_k < 14336
  assert mixtral_down.vmem_limit_bytes == chip_.default_scoped_vmem_bytes
  tuned_down = R.gmm_tiling(64, 14336, 4096, num_groups=8, **common)
  assert tuned_down.block_k == 14336, tuned_down
  assert tuned_down.vmem_limit_bytes > chip_.default_scoped_vmem_bytes


@pytest.mark.parametrize("chip", ["v5e", "v6e"])
@pytest.mark.parametrize("weights, out", [(BF16, BF16), (BF16, jnp.float32), (jnp.int8, BF16),
                                          (jnp.float8_e4m3fn, BF16)],
                         ids=["bf16", "bf16-f32-out", "int8", "fp8"])
def test_an_n_that_every_lane_block_pads_takes_the_whole_weight(chip, weights, out):
  """gpt-oss-20b's down at decode (n = 2880 = 22.5 x 128; m = 256 over 32 experts): no lane
  block divides n, so each visit takes the whole weight under a raised limit, the tiling a
  caller gets by asking for those blocks. An n of 2048 keeps a dividing block; an n whose
  whole weight the chip cannot hold keeps a padded block."""
  chip_ = chips.get_chip(chip)
  common = dict(num_groups=32, lhs_dtype=BF16, rhs_dtype=weights, out_dtype=out, chip=chip)
  t = R.gmm_tiling(256, 2880, 2880, **common)
  assert _blocks(t) == (16, 2880, 2880)
  assert chip_.default_scoped_vmem_bytes < t.vmem_limit_bytes <= chip_.max_vmem_limit_bytes
  assert t.vmem_plan_bytes <= vmem.vmem_budget(chip_, t.vmem_limit_bytes)
  assert R.gmm_tiling(256, 2880, 2880, block_m=t.block_m, block_k=2880, block_n=2880,
                      **common) == t
  dividing = R.gmm_tiling(256, 2880, 2048, **common)
  assert 2048 % dividing.block_n == 0
  too_big = R.gmm_tiling(256, 8192, 4000, **common)
  assert too_big.block_n < 4000 and vmem.round_up(4000, too_big.block_n) > 4000
  assert too_big.vmem_plan_bytes <= vmem.vmem_budget(chip_, too_big.vmem_limit_bytes)


def test_a_tuned_whole_k_past_max_block_k_is_taken():
  """The heuristic cuts a k past MAX_BLOCK_K; a table entry may still hold the whole k
  (the tuner rates it: Mixtral-8x7B's down, k = 14336), and gmm_tiling takes it, under a
  scoped limit raised to its plan. An entry whose block_k is neither a candidate nor the
  whole k is not taken."""
  m, k, n = 64, 1024, 256   # n within the patched MAX_BLOCK_K, which caps block_n's candidates too
  key = R.tuning_key(m, k, n, num_groups=8, lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16,
                     num_rhs=1, chip="v6e")
  shape = dict(num_groups=8, lhs_dtype=BF16, rhs_dtype=BF16, out_dtype=BF16, chip="v6e")
  with mock.patch.object(R, "MAX_BLOCK_K", 256):
    assert k not in R._lane_block_candidates(k, None, None)
    with mock.patch.dict(R.TUNED_BLOCKS, {dataclasses.astuple(key): (64, k, 256)}, clear=True):
      t = R.gmm_tiling(m, k, n, **shape)
      assert (t.block_m, t.block_k, t.block_n) == (64, k, 256), t
      assert t.vmem_plan_bytes <= vmem.vmem_budget(chips.get_chip("v6e"), t.vmem_limit_bytes)
    with mock.patch.dict(R.TUNED_BLOCKS, {dataclasses.astuple(key): (64, 768, 256)}, clear=True):
      assert R.gmm_tiling(m, k, n, **shape).block_k <= 256   # 768: not a block the kernel takes
