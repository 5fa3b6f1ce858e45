"""Every default RMSNorm tiling compiles ahead of time for v5e and v6e (libtpu, no TPU).

The compiler is the real TPU compiler: it rejects illegal block shapes and
scoped-VMEM overflow, so a pass here means the kernel would load on the chip.
Shapes: hidden sizes of Llama, Qwen3, Gemma, gpt-oss, Mistral and friends (and 1000,
not a multiple of 128), rows 1 to 65536.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tpu_kernels import aot, chips, rms_norm as K, vmem

pytestmark = pytest.mark.aot

# hidden: Qwen2.5-0.5B 896, odd 1000, Qwen3-1.7B/Llama-3.2-1B/Qwen3-30B-A3B 2048,
# Gemma-2-2B 2304, gpt-oss 2880, Gemma-7B 3072, Llama-8B/Qwen3-8B 4096, Qwen3-14B 5120,
# Gemma-3-27B 5376, Llama-70B 8192, Llama-405B 16384.
HIDDEN = [896, 1000, 2048, 2304, 2880, 3072, 4096, 5120, 5376, 8192, 16384]
# The CI profile's columns (the rest under HYPOTHESIS_PROFILE=thorough): not a multiple
# of 128 (1000, 2880), the seed's Qwen3-30B-A3B (2048) and Qwen3.5-9B (4096), the largest.
CI_HIDDEN = (1000, 2048, 2880, 4096, 16384)
ROWS = [1, 7, 4096, 65536]
AOT_CHIPS = ["v5e", "v6e"]
S = jax.ShapeDtypeStruct


def _compile_all(chip, rows, hidden, dtype):
  """Forward, backward, fused forward and fused backward: the four kernels."""
  x, w = S((rows, hidden), dtype), S((hidden,), dtype)
  kw = dict(chip=chip, offset=1.0)
  plain = functools.partial(K.rms_norm, **kw)
  fused = functools.partial(K.fused_add_rms_norm, **kw)
  programs = {
      "fwd": (plain, [x, w]),
      "bwd": (lambda a, b, g: jax.vjp(plain, a, b)[1](g), [x, w, x]),
      "fused_fwd": (fused, [x, x, w]),
      "fused_bwd": (lambda a, r, b, g, gr: jax.vjp(fused, a, r, b)[1]((g, gr)),
                    [x, x, w, x, x]),
  }
  return {name: aot.compile_for_chip(fn, specs, chip) for name, (fn, specs) in programs.items()}


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("hidden", [
    pytest.param(h, marks=() if h in CI_HIDDEN else pytest.mark.thorough) for h in HIDDEN])
def test_model_shapes_compile_bf16(chip, hidden):
  for rows in ROWS:
    for name, report in _compile_all(chip, rows, hidden, jnp.bfloat16).items():
      assert report.ok, f"{name} rows={rows}: {report.error}"
      assert report.num_kernels >= 1
      assert report.scoped_vmem_bytes <= chips.get_chip(chip).max_vmem_limit_bytes


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
@pytest.mark.parametrize("hidden", [1000, 4096, 16384])
def test_other_dtypes_compile(chip, dtype, hidden):
  for rows in (7, 8192):
    for name, report in _compile_all(chip, rows, hidden, dtype).items():
      assert report.ok, f"{name} rows={rows}: {report.error}"


@pytest.mark.parametrize("chip", ["v5e", "v6e", "v5p"])
def test_default_scoped_vmem_limit_matches_chip_table(chip):
  """A kernel compiled without an override runs under the chip's default limit."""
  fn = functools.partial(K.rms_norm, chip=chip)
  report = aot.compile_for_chip(fn, [S((64, 512), jnp.float32), S((512,), jnp.float32)], chip)
  assert report.ok, report.error
  assert report.scoped_vmem_bytes == chips.get_chip(chip).default_scoped_vmem_bytes


def test_compiler_rejects_vmem_overflow():
  """The AOT check has teeth: blocks forced past the limit fail with a VMEM error."""
  fn = functools.partial(K.rms_norm, chip="v5e", block_rows=1024,
                         vmem_limit_bytes=4 * 2**20)
  report = aot.compile_for_chip(fn, [S((8192, 4096), jnp.float32), S((4096,), jnp.float32)],
                                "v5e")
  assert not report.ok
  assert "vmem" in report.error.lower() or "RESOURCE_EXHAUSTED" in report.error, report.error


def test_explicit_vmem_limit_reaches_the_compiler():
  fn = functools.partial(K.rms_norm, chip="v6e", vmem_limit_bytes=48 * 2**20)
  report = aot.compile_for_chip(fn, [S((64, 512), jnp.float32), S((512,), jnp.float32)], "v6e")
  assert report.ok and report.scoped_vmem_bytes == 48 * 2**20


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_column_major_rule_is_libtpus_default_layout(chip):
  """vmem.prefers_column_major, which picks the narrow-row forward, says what libtpu's own
  default layout of a 2-D array is, over a grid of shapes and dtypes; the one known
  difference is one-wide arrays of 7 or 8 rows (never a norm's shape)."""
  device = aot.topology_device(chip)
  differ = set()
  for dtype in ("float32", "bfloat16", "float16"):
    for rows in (1, 7, 8, 9, 17, 63, 64, 65, 100, 127, 128, 129, 200, 1000, 4096, 196608):
      for cols in (1, 8, 32, 64, 80, 96, 127, 128, 129, 192, 256, 1000, 2880, 4096):
        layout = str(device.client.get_default_layout(np.dtype(dtype), (rows, cols), device))
        if layout.startswith("{0,1") != vmem.prefers_column_major(rows, cols):
          differ.add((rows, cols))
  assert differ <= {(7, 1), (8, 1)}, sorted(differ)


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("shape, dtype", [((196608, 64), jnp.bfloat16),
                                          ((2, 24, 4096, 64), jnp.bfloat16),
                                          ((15984, 64), jnp.bfloat16),
                                          ((1000, 64), jnp.float32)])
def test_narrow_rows_compile_on_the_transpose_without_copies(chip, shape, dtype):
  """SD3.5's q / k norms (head_dim 64; Diffusers calls them on [B, H, S, D]): the forward
  and the backward each compile as the one transposed kernel reading x (and the gradient)
  where the TPU keeps them, with no copy of an x-sized array around it."""
  device = aot.topology_device(chip)
  plain = functools.partial(K.rms_norm, chip=chip, offset=1.0)
  size = int(np.prod(shape))
  programs = {
      "rms_norm_fwd_columns": (plain, [S(shape, dtype), S((64,), dtype)]),
      "rms_norm_bwd_columns": (lambda a, b, g: jax.vjp(plain, a, b)[1](g),
                               [S(shape, dtype), S((64,), dtype), S(shape, dtype)]),
  }
  for kernel, (fn, specs) in programs.items():
    text = jax.jit(fn).trace(*[aot._on_device(s, device) for s in specs]).lower().compile()
    text = text.as_text()
    names = aot.kernel_names(text)   # under jax.vjp the name carries a prefix
    assert len(names) == 1 and kernel in names[0], names
    big_copies = [line for line in text.splitlines() if " copy(" in line and any(
        int(np.prod([int(d) for d in dims.split(",")])) == size
        for dims in re.findall(r"\[([\d,]+)\]", line.split("copy(")[0]))]
    assert not big_copies, (kernel, big_copies)
