"""The main job (README command 1 ends with it) runs end to end and says what it proved."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_runs(tmp_path):
  result = subprocess.run([sys.executable, str(ROOT / "scripts" / "demo.py"), "--dist",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
  out = result.stdout
  assert "MISMATCH" not in out
  # Five generations compared: kernelized RMSNorm, ragged-dot experts, tpu_attention,
  # generate_batch on paged-attention-tpu, Qwen3.5 on the linear-attention kernels.
  assert out.count("MATCH (") == 5, out[-3000:]
  # Qwen3.5's linear attention: every call on the kernels, prefill and decode ops seen.
  assert "linear-attention calls run the kernels (causal_conv1d_forward, " \
         "chunk_gated_delta_rule, rms_norm_gated)" in out, out[-3000:]
  generate = next(line for line in out.splitlines() if "generate ran" in line)
  assert "fused_recurrent_gated_delta_rule" in generate and "causal_conv1d_update" in generate
  assert "DIFFER" not in out
  assert "registered attention implementation 'tpu_attention'" in out
  assert "continuous-batching attention 'paged_attention_tpu_flash'" in out
  # Two Diffusers transformers (Flux, Qwen-Image) through the "flash_tpu" backend vs native.
  assert out.count("agrees with native") == 2, out[-3000:]
  assert "attention backend 'flash_tpu'" in out
  for chip in ("v5e", "v6e", "v5p"):
    assert f"{chip}: compiled" in out
  assert "FAILED" not in out
  assert (tmp_path / "rms-norm-tpu" / "build" / "torch-cpu" / "metadata.json").is_file()
