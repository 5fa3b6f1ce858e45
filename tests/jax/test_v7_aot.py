"""Every kernel compiles ahead of time for v7 (Ironwood, `TPU7x`).

CI runs this module on its second leg (.venv-jax012, libtpu 0.0.52: the newer compiler
for the newest chip); scripts/test.sh deselects it on leg 1, whose libtpu 0.0.42.1
compiles it too (22 passed on 2026-12-06). A libtpu without the TPU7x topology skips it,
saying why. On v7 each TensorCore is its own JAX device (the chip table's v7 row is per
TensorCore: kernels/tpu_kernels/chips.py).

All 191 programs of scripts/aot_summary.py's CASES compiled for v7 on 2026-12-06 (416 s on
this 2-core machine) once the chip table's v7 row was made per TensorCore; before, two
paged-attention programs sized their cache to the whole chip's 192 GiB and ran out of a
device's HBM (144 G of 94.74 G). The suite compiles a slice of them: every RMSNorm case,
the grouped matmul at decode (forward and backward), under raised scoped-VMEM limits, and
with int8 / fp8 weights, flash attention's headline shape and its all-features program,
and paged attention's largest caches, mixed step, 1-byte caches and page 256.
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl

import aot_summary
from tpu_kernels import aot, chips

pytestmark = [
    pytest.mark.aot,
    pytest.mark.skipif(not aot.topology_known("v7"),
                       reason="this libtpu has no TPU7x topology"),
]

V7_LABELS = [
    "fused add+norm fwd+bwd, bf16[8192, 4096] (Llama-8B)",
    "fused add+norm fwd+bwd, bf16[8, 4096] (decode)",
    "fused add+norm fwd+bwd, bf16[65536, 2880] (gpt-oss)",
    "fused add+norm fwd+bwd, f32[4096, 16384] (Llama-405B)",
    "qwen3-30b-a3b gate_up bwd m=64",
    "qwen3-30b-a3b down bwd m=64",
    "qwen3-30b-a3b down fwd m=65536",           # whole k under a raised limit (56 MiB)
    "mixtral-8x7b gate_up fwd m=8",             # 34 MiB
    "mixtral-8x7b down fwd m=512 int8 weights",
    "gpt-oss-20b gate_up fwd m=512 float8_e4m3fn weights",
    "default: 32/8 heads D=128 S=8192 causal bwd",
    "all features: 32/8 heads D=128 S=8192 causal window=4096 soft_cap=50 sinks segments bwd",
    "decode: S=256 ctx=131072 T=256 32/8 heads D=64 page=16",   # sized by the device's HBM
    "decode: S=256 ctx=131072 T=256 64/8 heads D=64 page=16",
    "mixed: S=64 ctx=32768 T=4152 32/8 heads D=128 page=16 window=4096 soft_cap=50 sinks",
    "int8: S=64 ctx=32768 T=64 32/8 heads D=128 page=16 q bfloat16 cache int8",
    "fp8: S=64 ctx=32768 T=64 32/8 heads D=128 page=16 q bfloat16 cache float8_e4m3fn",
    "page 256: S=64 ctx=32768 T=64 32/8 heads D=128 page=256",
]
CASES = {case.label: case for case in aot_summary.CASES}


def test_the_slice_names_cases_that_exist():
  assert [label for label in V7_LABELS if label not in CASES] == []


@pytest.mark.parametrize("label", V7_LABELS)
def test_compiles_for_v7(label):
  case = CASES[label]
  fn, specs = case.build("v7")
  report = aot.compile_for_chip(fn, specs, "v7")
  assert report.ok, f"{case.kernel} {label}: {report.error}"
  assert report.num_kernels >= 1 and "?" not in report.kernel_names, report


def _copy_program(block_bytes: int):
  """A Pallas copy whose double-buffered float32 in and out blocks need 4 x block_bytes of
  scoped VMEM, with no limit asked for: it compiles iff that fits Mosaic's default. Four
  grid steps: over two, a copy of 4 x 8.25 MiB compiled under the 32 MiB default too."""
  rows = block_bytes // (1024 * 4)

  def copy(x):
    return pl.pallas_call(
        lambda a, b: b.__setitem__(..., a[...] * 2), grid=(4,),
        in_specs=[pl.BlockSpec((rows, 1024), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((rows, 1024), lambda i: (i, 0)),
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype))(x)

  return copy, [jax.ShapeDtypeStruct((4 * rows, 1024), jnp.float32)]


@pytest.mark.parametrize("extra_mib, fits", [(0, True), (1, False)])
def test_default_scoped_vmem_limit_is_the_chip_tables(extra_mib, fits):
  """Mosaic's own default for v7, not a limit we pass: a kernel needing exactly
  chips' default_scoped_vmem_bytes compiles, one needing 1 MiB more does not."""
  need = chips.get_chip("v7").default_scoped_vmem_bytes + extra_mib * chips.MiB
  fn, specs = _copy_program(need // 4)
  report = aot.compile_for_chip(fn, specs, "v7")
  assert report.ok == fits, report
  if not fits:
    assert "vmem" in report.error.lower(), report.error


def test_a_device_is_one_tensorcore():
  """The chip table's v7 row is per TensorCore because a device is one: the topology of 4
  chips holds 8 devices, cores 0 and 1 of each chip."""
  devices = aot.topology_devices("v7")
  assert len(devices) == 8
  assert sorted({d.core_on_chip for d in devices}) == [0, 1]
