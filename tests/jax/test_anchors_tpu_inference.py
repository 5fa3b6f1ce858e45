"""benchmarks/peers/tpu_inference_ops/: tpu-inference 0.32.0's kernels as anchors.

Default profile: the map from cases to specs and their arithmetic (no venv), plus children in
.venv-tpu-inference that import the kernels through the stand-ins: one compiles the gmm spec
for v6e at Qwen3-30B-A3B int8 m=64 (plain compile), checking its closed form against
tpu-inference's own make_group_metadata, one asks gmm's tiling at gpt-oss-20b (~10 s in all);
benchmarks/probes/fused_moe.py runs there (~15 s). HYPOTHESIS_PROFILE=thorough also compiles
the flash and RPA v3 specs there (marked `thorough`; no static profile: the estimates come from
`benchmarks/estimate.py`)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from benchmarks import ROOT, cases, peers
from benchmarks.cases.headline import (HEADLINE, Attention, GroupedMatmul, PagedDecode,
                                       RmsNorm)
from benchmarks.cases.quantized_decode import QUANTIZED_DECODE
from benchmarks.cases.serving import SERVING_PAGED, PagedBatch
from benchmarks.peers import protocol
from benchmarks.peers import tpu_inference_ops as T
from benchmarks.peers.megablox import GMM_TRUNCATED_VISITS, GmmAnchor
from benchmarks.peers.tpu_inference_ops import common
from benchmarks.peers.tpu_inference_ops.attention import FLASH_HEADS


def _specs() -> list:
  return [s for case in cases.all_cases() for s in T.specs_for(case)]



def test_every_headline_case_but_rms_norm_has_a_tpu_inference_anchor():
  listed = {a.case: a for case in cases.all_cases() for a in peers.implementations(case)
            if a.implementation.startswith("tpu-inference")}
  for case in HEADLINE:
    specs = T.specs_for(case)
    assert (case.name in listed) == (not isinstance(case, RmsNorm)) == bool(specs)
    for s in specs:
      assert f"tpu-inference {common.VERSION}" in s.implementation and s.case == case
  assert len({s.key for s in _specs()}) == len(_specs())
  assert set(T.NOT_RATED) == {"quantized_matmul"}


@dataclasses.dataclass(frozen=True)
class _ExpertsLayer:   # what an experts-layer case offers (cases/experts_layer.py's class)
  tokens: int
  experts: int = 128
  top_k: int = 8
  hidden: int = 2048
  width: int = 768
  name: str = "experts layer"


@dataclasses.dataclass(frozen=True)
class _Int8Gmm(GroupedMatmul):   # a grouped matmul with int8 weights
  weight_dtype: str = "int8"


def test_fused_moe_spec_for_an_experts_layer_case():
  """Rated on any case with tokens / experts / top_k / hidden / width; round-robin routing
  gives ceil(T * top_k / E) rows an expert; every expert's weights once per token block."""
  (spec,) = T.specs_for(_ExpertsLayer(64))
  assert isinstance(spec, T.FusedMoeSpec) and spec.rows_per_expert == 4
  assert T.FusedMoeSpec(_ExpertsLayer(1)).rows_per_expert == 1
  routing = [(t * 8 + k) % 128 for t in range(64) for k in range(8)]
  assert all(routing.count(e) == 4 for e in range(128))
  c = spec.case
  spec = T.FusedMoeSpec(c, common.frozen_config(dict(bt=64)))
  assert spec.hbm_bytes() == (128 * 3 * 2048 * 768 * 2 + 64 * 128 * 2 + 3 * 64 * 8 * 2048 * 2
                              + 64 * 2048 * 2)


def test_gmm_spec_int8_weights_bytes():
  """int8 weights: the bf16 replay's weight blocks at one byte, plus one f32 scale row of tn
  per (group, n tile) visit."""
  case = _Int8Gmm(512, "down")
  config = common.frozen_config(dict(tiling=[128, 768, 2048]))
  int8, bf16 = T.GmmSpec(case, config), T.GmmSpec(GroupedMatmul(512, "down"), config)
  assert int8.quantized and "rhs_scale" in int8.implementation and not bf16.quantized
  tiles = int8.closed_form.num_tiles          # one n tile, one k tile: a new group each visit
  assert tiles == 128
  assert bf16.hbm_bytes() - int8.hbm_bytes() == tiles * 768 * 2048 * 1 - tiles * 2048 * 4


def test_gmm_spec_at_fewer_rows_than_experts():
  """Qwen3-30B-A3B at m=64 (128 experts): 64 experts of one row, 64 empty and not visited,
  as jax's megablox anchor assumes (same closed form, same bytes)."""
  case = GroupedMatmul.of("Qwen3-30B-A3B", 64, "down")
  config = common.frozen_config(dict(tiling=[64, 768, 2048]))
  spec = T.GmmSpec(case, config)
  cf = spec.closed_form
  assert (cf.groups, cf.total_groups, cf.num_tiles) == (64, 128, 64)
  assert [cf.group_id(v) for v in range(64)] == list(range(64))
  assert {cf.m_tile_id(v) for v in range(64)} == {0}
  twin = GmmAnchor(64, "down", "64x768x2048")
  assert twin.case == case and twin.closed_form == cf
  assert spec.hbm_bytes() == twin.hbm_bytes()
  # one lhs / out tile, 64 experts' weights once each
  assert spec.hbm_bytes() == 64 * 768 * 2 + 64 * 768 * 2048 * 2 + 64 * 2048 * 2
  every = [s for c in QUANTIZED_DECODE for s in T.specs_for(c)]
  assert len(every) == len(QUANTIZED_DECODE)
  for s in every:   # every quantized-decode case has a closed form at its default tm
    tm = min(s.case.m, 128)
    T.GmmSpec(s.case, common.frozen_config(dict(tiling=[tm, 128, 128]))).closed_form.num_tiles


def test_gmm_spec_is_jax_megablox_at_its_tiling():
  """The same algorithm and index maps as jax's megablox: bytes and extrapolation are its."""
  case = GroupedMatmul(512, "down")
  spec = T.GmmSpec(case, common.frozen_config(dict(tiling=[128, 768, 2048])))
  twin = GmmAnchor(512, "down", "128x768x2048")
  assert spec.hbm_bytes() == twin.hbm_bytes()
  model = {json.dumps([v]): 100 + 7 * v for v in GMM_TRUNCATED_VISITS}
  assert spec.extrapolate(model) == 100 + 7 * twin.closed_form.num_tiles
  with pytest.raises(RuntimeError, match="not resolved"):
    T.GmmSpec(case).tiling


def test_flash_spec_bytes_replay_by_hand():
  """Single step (block_k = S): per head q and o once, k and v once; plus the k/v repeat.
  128 blocks: the causal replay (kv block j on or below the diagonal, else 0)."""
  case = Attention(1024)
  c = case
  one = T.FlashSpec(case, common.frozen_config(dict(block_q=128, block_k_major=1024, block_k=1024,
                                         block_b=1, vmem_limit_bytes=None)))
  repeat = 2 * (c.kv_heads + c.q_heads) * c.seq * c.head_dim * 2
  assert one.hbm_bytes() == c.q_heads * 4 * c.seq * c.head_dim * 2 + repeat
  tiled = T.FlashSpec(case, common.frozen_config(dict(block_q=128, block_k_major=128, block_k=128,
                                           block_b=1, vmem_limit_bytes=None)))
  n, blk = 8, 128 * c.head_dim * 2
  moved, last = 0, {}
  for i in range(n):
    for j in range(n):
      kv = j if j <= i else 0
      for name, idx in (("q", i), ("k", kv), ("v", kv), ("o", i)):
        if last.get(name) != idx:
          moved, last[name] = moved + blk, idx
  assert tiled.hbm_bytes() == c.q_heads * moved + repeat
  model = {json.dumps([h]): 11 + 5 * h for h in FLASH_HEADS}
  assert one.extrapolate(model) == 11 + 5 * c.q_heads


def test_rpa_v3_truncations_extrapolation_and_bytes():
  for context, blocks in ((2048, 1), (32768, 8)):
    case = PagedDecode(context)
    spec = T.RpaV3Spec(case, common.frozen_config(dict(d_block_sizes=[1, min(context, 4096), 1,
                                                           min(context, 4096)], page_size=64)))
    assert spec.kv_blocks() == blocks
    model = {json.dumps(t): 9 + 13 * spec.kv_blocks(t[0]) for t in spec.truncations}
    assert spec.extrapolate(model) == 9 + 13 * blocks
    c = case
    assert spec.hbm_bytes() == (2 * c.batch * c.kv_heads * c.context * c.head_dim * 2
                                + 2 * c.batch * c.q_heads * c.head_dim * 2)
  assert [t[0] for t in T.RpaV3Spec(PagedDecode(32768), common.frozen_config(dict(
      d_block_sizes=[1, 4096, 1, 4096]))).truncations] == [4096, 8192]


def test_rpa_v3_on_serving_decode_batches():
  """Decode-only serving batches get RPA v3 rows (an fp8 cache at 1 byte an element); int8
  caches, mixed batches and windows say why not."""
  rated = {c.name: T.specs_for(c) for c in SERVING_PAGED}
  for c in SERVING_PAGED:
    why = T.not_rated_why(c)
    assert bool(why) == (c.kv_dtype == "int8" or c.prefill > 0 or c.sliding_window is not None)
    assert bool(rated[c.name]) == (why is None)
  fp8 = PagedBatch(kv_dtype="float8_e4m3fn")
  (spec,) = T.specs_for(fp8)
  spec = T.RpaV3Spec(fp8, common.frozen_config(dict(d_block_sizes=[1, 2048, 1, 2048], page_size=64)))
  assert spec.batch == 64 and "k_scale" in spec.note
  assert spec.hbm_bytes() == fp8.min_bytes()     # whole pages, one block: exactly the roofline's
  assert spec.truncations == ([2048],)


def _compiles_in_the_venv(spec, trunc_of) -> dict:
  assert common.VENV.exists(), "scripts/setup.sh makes .venv-tpu-inference"
  resolved = common.resolved(spec, "v6e")     # the kernel's own choice, asked in the venv
  return protocol.compile_in_child(resolved, "v6e", trunc_of(resolved), profile=False)


def test_gmm_spec_compiles_in_its_venv_and_its_closed_form_holds():
  """Imports tpu-inference's megablox through the stand-ins, checks the closed form against
  its make_group_metadata (in `build`), compiles for v6e: one Mosaic kernel. At Qwen3-30B-A3B
  int8 m=64: fewer rows than experts (64 of 128 groups empty) and its rhs_scale path."""
  spec = T.specs_for(GroupedMatmul.of("Qwen3-30B-A3B", 64, "down", "int8"))[0]
  out = _compiles_in_the_venv(spec, lambda s: [2])
  assert out["kernels"] == 1
  # gpt-oss: its default tk 2048 does not divide k = 2880, so gmm runs tk = k (the tiling
  # the bytes are replayed at); its tm is 2 * m / experts rounded up to 128, then cut to m.
  (oss,) = T.specs_for(GroupedMatmul.of("gpt-oss-20b", 64, "down", "int8"))
  config = dict(common.resolved(oss, "v6e").chosen)
  assert list(config["picked"]) == [64, 2048, 2048] and list(config["tiling"]) == [64, 2880, 2048]


@pytest.mark.thorough   # ~30 s of compiles
@pytest.mark.parametrize("case,kernels", [(Attention(4096), 1),
                                          (PagedDecode(2048), 2)])
def test_flash_and_rpa_v3_specs_compile_in_their_venv(case, kernels):
  """RPA v3 runs its decode kernel and its (here empty) mixed kernel: two Mosaic kernels."""
  (spec,) = T.specs_for(case)
  out = _compiles_in_the_venv(spec, lambda s: s.truncations[0])
  assert out["kernels"] == kernels



def test_fused_moe_probe_shows_why_it_is_not_rated():
  """docs/performance/tpu-inference.md (fused_moe v1): libtpu 0.0.48 rates the kernel 0
  cycles; with its remote copies local it aborts on the bf16 gating softmax; with that in
  float32, on DMA waits it cannot pair. `benchmarks/probes/fused_moe.py` in its venv (~15 s)."""
  import subprocess
  assert common.VENV.exists(), "scripts/setup.sh makes .venv-tpu-inference"
  env = {k: v for k, v in os.environ.items() if k != "TPU_LIBRARY_PATH"}
  probe = ROOT / "benchmarks" / "probes" / "fused_moe.py"
  out = subprocess.run([str(common.VENV / "bin" / "python"), str(probe), "--chip", "v6e"],
                       capture_output=True, text=True, timeout=600, env=env)
  assert out.returncode == 0, out.stderr[-2000:]
  steps = dict(line.split(None, 1) for line in out.stdout.splitlines() if line.strip())
  assert steps["as-is"] == "0 cycles in 1 kernel"
  assert "vmul.bf16" in steps["local-copies"]
  assert "No DMA issue node found" in steps["f32-softmax"]
