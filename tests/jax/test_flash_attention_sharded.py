"""Tensor parallelism: flash attention under jax.shard_map over a head axis.

The checks live in tests/jax/flash_attention_sharded.py and run in a subprocess, because
the 4 CPU host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4) must be
requested before jax initialises, and this process's jax must keep its one device for
the other tests.

  * test_head_parallel_matches_unsharded_and_reference: 4 CPU devices; q split on Hq,
    k / v on Hkv (each device holds whole GQA groups), sinks on Hq, segment ids
    replicated; shard_map with check_vma=False (its default check rejects pallas_call's
    out_shape, as for the grouped matmul). Interpret mode, f32, causal, + sliding window,
    + soft-cap, + sinks, and all of them with segment ids: out, lse and the gradients
    w.r.t. q, k, v and sinks equal the unsharded kernel and the float64 reference.
  * test_head_parallel_compiles_on_v6e_2x2: the same program compiled ahead of time on a
    v6e:2x2 topology mesh (interpret=False, chip="v6e"), bf16: 32 / 8 heads, S=8192,
    D=128, causal, forward and backward; gpt-oss-like (64 / 8, D=64, window 128, sinks)
    backward. Each chip's kernels see only its heads; no collective in the program.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("flash_attention_sharded.py")


def _run(mode, **env):
  result = subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
  return result.stdout


def test_head_parallel_matches_unsharded_and_reference():
  xla_flags = (os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=4").strip()
  out = _run("cpu", XLA_FLAGS=xla_flags)
  assert out.count("sharded == unsharded == float64 reference") == 5, out


@pytest.mark.aot
def test_head_parallel_compiles_on_v6e_2x2():
  out = _run("aot")
  assert out.count("on v6e:2x2: compiled") == 3, out
  assert out.count("no collective") == 3, out
