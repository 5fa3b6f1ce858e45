"""Expert parallelism: the grouped matmul under jax.shard_map over an expert axis.

The checks live in tests/jax/ragged_dot_sharded.py and run in a subprocess, because the
4 CPU host devices (XLA_FLAGS=--xla_force_host_platform_device_count=4) must be
requested before jax initialises, and this process's jax must keep its one device for
the other tests.

  * test_expert_parallel_matches_unsharded_and_reference: 4 CPU devices, each holding
    G/4 experts and passing group_offset = axis_index * G/4; lhs and group_sizes
    replicated; outputs summed with psum. Forward and gradients (lhs, weight, bias) equal
    the unsharded kernel and the float64 NumPy reference; plain, transposed with bias and
    activation, gated silu, gpt-oss interleaved with bias (interpret mode, f32).
  * test_expert_parallel_compiles_on_v6e_2x2: the same program compiled ahead of time on
    a v6e:2x2 topology mesh (interpret=False, chip="v6e") at real shapes.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("ragged_dot_sharded.py")


def _run(mode, **env):
  result = subprocess.run([sys.executable, str(SCRIPT), mode], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **env})
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
  return result.stdout


def test_expert_parallel_matches_unsharded_and_reference():
  xla_flags = (os.environ.get("XLA_FLAGS", "") +
               " --xla_force_host_platform_device_count=4").strip()
  out = _run("cpu", XLA_FLAGS=xla_flags)
  assert out.count("sharded == unsharded == float64 reference") == 4, out


@pytest.mark.aot
def test_expert_parallel_compiles_on_v6e_2x2():
  out = _run("aot")
  assert out.count("on v6e:2x2: compiled") == 6, out
