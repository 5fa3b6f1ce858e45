"""The artifact TorchTPU would run: for each kernel at a headline shape (the linear-attention
ops at Qwen3.5-9B's: prefill at 4096 tokens, batch-64 decode with the states donated), the
program the real `jax_op` exports (captured above the native boundary,
`jax.export.Exported`, the same bytes its real kernel registers with
`register_custom_kernel`) is compiled ahead of time
by libtpu for v5e and v6e, with the newest libtpu torch-tpu 0.2.0 and jax accept
(.venv-jax012: jax 0.12.1, libtpu 0.0.52; scripts/compile_exported.py).

Each compile must succeed and hold the kernel's Mosaic calls; the largest scoped-VMEM
limit it compiled under must be the largest its exported calls asked for (a call that
asks none gets the chip's default), within the chip's largest limit.
The program is exported per chip: the shim passes the host's chip to the kernel, whose
tiling depends on it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fake_tpu import Boundary, current_boundaries, experts_module, on_device, recording_public_ops
from tpu_kernels import chips

ROOT = Path(__file__).resolve().parents[2]
JAX012_PYTHON = ROOT / ".venv-jax012" / "bin" / "python"
CHIPS = ("v5e", "v6e")


def _rms(k, t):     # Llama-3-8B prefill: 8192 tokens x 4096
  k.rms_norm(t((8192, 4096), torch.bfloat16), t((4096,), torch.bfloat16), 1e-6)


def _experts(k, t):  # Qwen3-30B-A3B decode: 64 tokens, 128 experts of 768, top-8
  m = experts_module("silu", t, experts=128, hidden=2048, intermediate=768,
                     dtype=torch.bfloat16)
  k.experts_forward(m, t((64, 2048), torch.bfloat16), t((64, 8), torch.int64),
                    t((64, 8), torch.bfloat16))


def _flash(k, t):    # Llama-3-8B heads, 4096 tokens, causal
  k.flash_attention(t((1, 32, 4096, 128), torch.bfloat16), t((1, 8, 4096, 128), torch.bfloat16),
                    t((1, 8, 4096, 128), torch.bfloat16), causal=True)


def _paged(k, t):    # decode: 64 sequences of up to 4096 tokens, pages of 64, 32/8 heads x 128
  cache = [t((4096, 8, 64, 128), torch.bfloat16) for _ in range(2)]
  k.ragged_paged_attention(t((64, 32, 128), torch.bfloat16), *cache, t((64,), torch.int32),
                           t((64, 64), torch.int32), t((65,), torch.int32))


# Qwen3.5-9B's linear-attention layers: 16 key / 32 value heads of 128, conv over 8192
# channels of width 4, the gated norm over 128 per value head.
QWEN35 = dict(hk=16, hv=32, d=128, conv=8192)


def _gdn_inputs(t, batch, seq):
  hk, hv, d = QWEN35["hk"], QWEN35["hv"], QWEN35["d"]
  return [t((batch, seq, hk, d), torch.bfloat16), t((batch, seq, hk, d), torch.bfloat16),
          t((batch, seq, hv, d), torch.bfloat16), t((batch, seq, hv), torch.float32),
          t((batch, seq, hv), torch.bfloat16)]


def _gdn_prefill(k, t):   # 4096 tokens, the final state returned (the cache)
  k.chunk_gated_delta_rule(*_gdn_inputs(t, 1, 4096), output_final_state=True,
                           use_qk_l2norm_in_kernel=True)


def _gdn_decode(k, t):    # batch 64, one token, the states updated in place (donated)
  state = t((64, QWEN35["hv"], QWEN35["d"], QWEN35["d"]), torch.float32)
  k.fused_recurrent_gated_delta_rule_(*_gdn_inputs(t, 64, 1), state,
                                      use_qk_l2norm_in_kernel=True)


def _conv_prefill(k, t):  # 4096 tokens, channels-last as Transformers hands x over
  x = t((1, 4096, QWEN35["conv"]), torch.bfloat16).transpose(1, 2)
  k.causal_conv1d_fn(x, t((QWEN35["conv"], 4), torch.bfloat16), None, activation="silu")


def _conv_decode(k, t):   # batch 64, the conv state updated in place (donated)
  k.causal_conv1d_update(t((64, QWEN35["conv"], 1), torch.bfloat16),
                         t((64, QWEN35["conv"], 4), torch.bfloat16),
                         t((QWEN35["conv"], 4), torch.bfloat16), None, "silu")


def _gated_norm(k, t):    # the prefill's 4096 tokens x 32 heads
  rows = 4096 * QWEN35["hv"]
  k.rms_norm_gated(t((rows, QWEN35["d"]), torch.bfloat16), t((rows, QWEN35["d"]), torch.bfloat16),
                   t((QWEN35["d"],), torch.bfloat16), 1e-6)


HEADLINE = {"rms_norm": ("rms", _rms), "experts": ("ragged", _experts),
            "flash_attention": ("flash", _flash), "ragged_paged_attention": ("paged", _paged),
            "chunk_gated_delta_rule": ("gdn", _gdn_prefill),
            "fused_recurrent_gated_delta_rule_in_place": ("gdn", _gdn_decode),
            "causal_conv1d_forward": ("conv", _conv_prefill),
            "causal_conv1d_update": ("conv", _conv_decode),
            "rms_norm_gated": ("rms", _gated_norm)}


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory, monkeypatch_module):
  """{(op, chip): compile_exported's record}: each headline case exported through the real
  jax_op for each chip, then compiled in one .venv-jax012 process."""
  out = tmp_path_factory.mktemp("exported")
  files = []
  for op, (fixture, case) in HEADLINE.items():
    kernel = request.getfixturevalue(fixture)
    dispatch = sys.modules[f"{kernel.__name__}._shim.dispatch"]
    for chip in CHIPS:
      monkeypatch_module.setenv("TPU_KERNELS_CHIP", chip)
      dispatch.tpu_chip_name.cache_clear()
      record = Boundary()
      current_boundaries.append(record)
      try:
        with FakeTensorMode(), recording_public_ops(kernel, through_tpu=True):
          case(kernel, on_device("tpu"))
      finally:
        current_boundaries.pop()
        dispatch.tpu_chip_name.cache_clear()
      (name, exported), = [(n, e) for n, e in record.exported if n.endswith(f"::{op}_tpu_jax")]
      path = out / f"{op}.{chip}.jaxexport"
      path.write_bytes(exported.serialize())
      files.append(str(path))
  done = subprocess.run([str(JAX012_PYTHON), str(ROOT / "scripts" / "compile_exported.py"),
                         *files], capture_output=True, text=True, timeout=1200)
  assert done.returncode == 0, done.stderr[-3000:]
  records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
  return {tuple(r["file"].split(".")[:2]): r for r in records}


@pytest.fixture(scope="module")
def monkeypatch_module():
  with pytest.MonkeyPatch.context() as mp:
    yield mp


@pytest.mark.parametrize("chip", CHIPS)
@pytest.mark.parametrize("op", HEADLINE)
def test_exported_program_compiles_for_the_chip(compiled, op, chip):
  record = compiled[(op, chip)]
  report = record["report"]
  assert record["platforms"] == ["tpu"]
  assert report["ok"], report["error"]
  assert report["num_kernels"] >= 1
  asked = record["asked_vmem_bytes"]
  assert len(asked) == report["num_kernels"] and any(asked)
  assert report["scoped_vmem_bytes"] == max(asked) <= chips.get_chip(chip).max_vmem_limit_bytes
