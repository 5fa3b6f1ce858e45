"""benchmarks/rating/calibration.py (benchmarks/calibration.py's library): reading tokamax's
real-chip caches and the ratio arithmetic.

Cheap (no libtpu compile): two entries copied verbatim from tokamax 0.0.17's caches
(tpu_v6_lite/pallas_mosaic_tpu_flash_attention.json, tpu_v5_lite/pallas_mosaic_tpu_ragged_dot.json)
are written to a temporary cache directory and read back through `read_entries`.
"""

import json

import pytest

from tpu_kernels import chips

from benchmarks.rating import calibration
from benchmarks.rating import calibration_specs

FLASH_KEY = ('{"q":"bf16[32,512,16,128]","k":"bf16[32,512,16,128]","v":"bf16[32,512,16,128]",'
             '"precision":[["DEFAULT","DEFAULT"],["DEFAULT","DEFAULT"]],"logits_dtype":"float32",'
             '"logits_scale":0.08838834764831843,"bias":null,"logits_soft_cap":null,"mask":'
             '{"bool_mask":null,"q_start":null,"q_end":null,"k_start":null,"k_end":null,'
             '"causal_mask":{"offset":0,"window_size":null}},"dropout_mask":null,"dropout_rate":0.0,'
             '"paging_info":null,"q_indices":null,"k_indices":null,"normalize_output":true,'
             '"return_residuals":false}')
FLASH_CONFIG = ('{"block_q":512,"block_kv":512,"block_kv_compute":512,"q_layout":1,"k_layout":1,'
                '"v_layout":1,"use_experimental_scheduler":true,"use_base2_exp":true}')
FLASH_TIMES = [0.793, 0.794, 0.795, 0.794, 0.793]
GMM_KEY = ('{"lhs":"bf16[8192,4096]","rhs":"bf16[8,4096,14336]","group_sizes":[1024,1024,1024,'
           '1024,1024,1024,1024,1024],"ragged_dot_dimension_numbers":{"dot_dimension_numbers":'
           '[[[1],[1]],[[],[]]],"lhs_ragged_dimensions":[0],"rhs_group_dimensions":[0]},'
           '"precision":["DEFAULT","DEFAULT"],"preferred_element_type":null,'
           '"return_residuals":false,"group_offset":null,"activation":null,'
           '"manual_axis_type":null,"zero_initialize":false,"fuse_gateup_activation":null}')
GMM_CONFIG = '{"tile_m":1024,"tile_k":512,"tile_n":1024,"input_buffer_count":2,"combine_scopes":false}'
GMM_TIMES = [5.254, 5.255, 5.254, 5.251, 5.256]


def _result(times):
  return {"compile_time_ms": 1.0, "lower_time_ms": 1.0, "evaluation_times_ms": times,
          "metadata": {}, "peak_memory_mb": 1.0}


@pytest.fixture
def cache(tmp_path):
  (tmp_path / "tpu_v6_lite").mkdir()
  (tmp_path / "tpu_v5_lite").mkdir()
  (tmp_path / "tpu_v6_lite" / "pallas_mosaic_tpu_flash_attention.json").write_text(json.dumps(
      {FLASH_KEY: {FLASH_CONFIG: _result(FLASH_TIMES)}, FLASH_KEY.replace("512,16", "1024,16"): {}}))
  (tmp_path / "tpu_v5_lite" / "pallas_mosaic_tpu_ragged_dot.json").write_text(json.dumps(
      {GMM_KEY: {GMM_CONFIG: _result(GMM_TIMES)}}))
  return tmp_path


def test_reads_timed_entries_only(cache):
  (flash,) = calibration.read_entries("v6e", "flash_attention", cache)   # untimed key skipped
  assert flash.measured_us == pytest.approx(794.0)                      # median, in µs
  assert flash.cfg["block_q"] == 512 and calibration.why_not_rated(flash) is None
  assert calibration.read_entries("v5e", "flash_attention", cache) == []  # no such file
  spec = calibration.spec_for(flash)
  assert (spec.batch, spec.q_heads, spec.kv_heads, spec.seq_q, spec.head_dim) == \
      (32, 16, 16, 512, 128)
  assert spec.causal and not spec.residuals and spec.glue and spec.nq == 1 and spec.active == 1


def test_gmm_entry_and_its_visits(cache):
  (gmm,) = calibration.read_entries("v5e", "ragged_dot", cache)
  assert gmm.measured_us == pytest.approx(5254.0)
  spec = calibration.spec_for(gmm)
  assert (spec.m, spec.k_dim, spec.n_dim, spec.groups, spec.tiling, spec.input_buffer_count) == \
      (8192, 4096, 14336, 8, (1024, 512, 1024), 2)
  # 8 groups of 1024 rows on 1024-row tiles: one visit each, group g on tile g.
  assert spec.closed_form.visits == tuple((g, g) for g in range(8))
  # Uneven sizes, counted by hand: rows [0,3) [3,3) [3,300) [300,301) with tm=128 ->
  # group 0: tile 0; group 1: empty; group 2: tiles 0,1,2; group 3: tile 2.
  groups = calibration_specs.MeasuredGroups((3, 0, 297, 1), 128)
  assert groups.visits == ((0, 0), (2, 0), (2, 1), (2, 2), (3, 2)) and groups.num_tiles == 5


def test_skips_what_is_not_the_plain_forward_kernel():
  entry = lambda key: calibration.Entry("flash_attention", "v6e", key, FLASH_CONFIG, (1.0,))
  assert calibration.why_not_rated(entry(FLASH_KEY.replace('"bias":null', '"bias":"bf16[1,4,512,512]"')))
  assert "not plain bf16" in calibration.why_not_rated(entry(FLASH_KEY.replace("bf16[32", "f16[32")))
  gmm = lambda key: calibration.Entry("ragged_dot", "v5e", key, GMM_CONFIG, (1.0,))
  assert "residuals" in calibration.why_not_rated(gmm(GMM_KEY.replace(
      '"return_residuals":false', '"return_residuals":true')))
  assert "forward" in calibration.why_not_rated(gmm(GMM_KEY.replace(
      '"lhs_ragged_dimensions":[0]', '"lhs_ragged_dimensions":[1]')))


def test_causal_closed_forms_walk_the_lower_triangle():
  spec = calibration_specs.CalibrationAttention(
      batch=1, q_heads=2, kv_heads=2, seq_q=4096, seq_kv=4096, head_dim=128, head_dim_v=128,
      causal=True, residuals=False, config=(("block_kv", 512), ("block_q", 512)), glue=False)
  want = [(i, j) for i in range(8) for j in range(i + 1)]
  assert [(spec.row(g), spec.col(g)) for g in range(spec.active)] == want
  full = calibration_specs.CalibrationAttention(**{**spec.__dict__, "causal": False})
  assert [(full.row(g), full.col(g)) for g in range(full.active)] == \
      [(i, j) for i in range(8) for j in range(8)]


def test_ratio_arithmetic_and_summary(tmp_path):
  v6e = chips.get_chip("v6e")
  # 1.75e6 cycles = 1000 µs at 1.75 GHz; 1.64e9 bytes = 1000 µs at 1640 GB/s; glue 0.82e9 = 500.
  row = dict(measured_us=3000.0, estimated_cycles=1_750_000, hbm_bytes=820_000_000,
             glue_bytes=820_000_000)
  p = calibration.predicted(row, v6e)
  assert p["compute_us"] == pytest.approx(1000.0) and p["hbm_us"] == pytest.approx(500.0)
  assert p["predicted_us"] == pytest.approx(1500.0) and p["ratio"] == pytest.approx(2.0)
  assert p["kernel_only_ratio"] == pytest.approx(3.0)   # glue left out: 3000 / 1000
  rows = [dict(family="ragged_dot", chip="v5e", rated=True, ratio=x) for x in (0.5, 1.0, 4.0)]
  rows.append(dict(family="ragged_dot", chip="v5e", rated=False, error="not rated: x"))
  (s,) = calibration.summary(rows)
  assert (s["rated"], s["listed"], s["median"], s["min"], s["max"]) == (3, 4, 1.0, 0.5, 4.0)
  log = tmp_path / "calibration.jsonl"
  log.write_text("".join(json.dumps(r) + "\n" for r in rows))
  factor, basis = calibration.expected_factor("v5e", "ragged-dot-tpu", log)
  assert factor == 1.0 and "3 ragged_dot" in basis
  assert calibration.expected_factor("v6e", "ragged-dot-tpu", log) is None
  assert calibration.expected_factor("v5e", "rms-norm-tpu", log) is None
