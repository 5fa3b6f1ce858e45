"""Issue 59's conv and gated-norm kernels compile ahead of time for v5e and v6e at
Qwen3.5-9B's shapes (libtpu, no TPU).

Qwen3.5-9B's Gated DeltaNet layer: conv over D = key_dim * 2 + value_dim = 16*128*2 +
32*128 = 8192 channels, width 4, SiLU, no bias, bf16; the gated norm over the value heads,
(T * 32 rows, 128), SiLU gate. Programs: prefill / training at batch 1, T = 4096
(forward, backward; packed by cu_seqlens too), decode at batch 64 (the update, state
[64, 8192, 4]), the gated norm's forward and backward at T = 4096 (131,072 rows).
Qwen3-Next-80B's defaults (16 / 32 heads of 128, width 4) give the same shapes.

Checked per program: it compiles; it holds exactly the one Mosaic kernel expected; the
kernel compiled under the scoped-VMEM limit its tiling asked for, within the chip's
allowance, and the tiling's own plan fits its budget. For the decode step, also that the
state is updated in place and nothing is copied: with the state donated, the compiled
program is the kernel and bitcasts, the state aliased through both.
Leg 2 (jax 0.12.1, libtpu 0.0.52) compiles the v6e column (scripts/test.sh).
"""

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from tpu_kernels import aot, causal_conv1d as C, chips, rms_norm as N, vmem

pytestmark = pytest.mark.aot

AOT_CHIPS = ["v5e", "v6e"]
S = jax.ShapeDtypeStruct
BF16 = jnp.bfloat16
DIM, WIDTH, T_PREFILL, DECODE_BATCH = 8192, 4, 4096, 64
HEADS, HEAD_DIM = 32, 128
ROWS = T_PREFILL * HEADS
NUM_SEQS = 8   # packed prefill: 8 sequences in the row (the values are data, not shapes)

X, W = S((1, T_PREFILL, DIM), BF16), S((DIM, WIDTH), BF16)
CU = S((NUM_SEQS + 1,), jnp.int32)


def _conv(chip):
  return functools.partial(C.causal_conv1d_fn, activation="silu", chip=chip,
                           channels_last=True)


def _programs(chip):
  """name -> (fn, arg specs, expected kernel name, tiling)."""
  conv = _conv(chip)
  config = C.CausalConv1dConfig(activation="silu", chip=chip)
  gated = functools.partial(N.rms_norm_gated, chip=chip)
  gconfig = N.RmsNormGatedConfig(chip=chip)
  xg = S((ROWS, HEAD_DIM), BF16)
  fwd_t = C.forward_tiling(1, T_PREFILL, DIM, WIDTH, BF16, BF16, False, config)
  fwd_packed_t = C.forward_tiling(1, T_PREFILL, DIM, WIDTH, BF16, BF16, True, config)
  bwd_t = C.backward_tiling(1, T_PREFILL, DIM, WIDTH, BF16, BF16, False, config)
  bwd_packed_t = C.backward_tiling(1, T_PREFILL, DIM, WIDTH, BF16, BF16, True, config)
  return {
      "conv_fwd": (conv, [X, W], "causal_conv1d_fwd", fwd_t),
      "conv_fwd_packed": (lambda x, w, cu: conv(x, w, cu_seqlens=cu), [X, W, CU],
                          "causal_conv1d_fwd", fwd_packed_t),
      "conv_bwd": (lambda x, w, g: jax.vjp(conv, x, w)[1](g), [X, W, X],
                   "causal_conv1d_bwd", bwd_t),
      "conv_bwd_packed": (lambda x, w, cu, g: jax.vjp(lambda a, b: conv(a, b, cu_seqlens=cu),
                                                      x, w)[1](g),
                          [X, W, CU, X], "causal_conv1d_bwd", bwd_packed_t),
      "conv_update": (functools.partial(C.causal_conv1d_update, activation="silu", chip=chip),
                      [S((DECODE_BATCH, DIM, 1), BF16), S((DECODE_BATCH, DIM, WIDTH), BF16), W],
                      "causal_conv1d_update",
                      C.update_tiling(DECODE_BATCH, 1, WIDTH, DIM, WIDTH, BF16, BF16, BF16,
                                      config)),
      "gated_fwd": (gated, [xg, xg, S((HEAD_DIM,), BF16)], "rms_norm_gated_fwd",
                    N.gated_forward_tiling(ROWS, HEAD_DIM, BF16, BF16, gconfig)),
      "gated_bwd": (lambda x, g, w, dy: jax.vjp(gated, x, g, w)[1](dy),
                    [xg, xg, S((HEAD_DIM,), BF16), xg], "rms_norm_gated_bwd",
                    N.gated_backward_tiling(ROWS, HEAD_DIM, BF16, BF16, gconfig)),
  }


PROGRAMS = list(_programs("v6e"))


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("name", PROGRAMS)
def test_qwen35_9b_shapes_compile(name, chip, record_property):
  fn, specs, kernel, tiling = _programs(chip)[name]
  report = aot.compile_for_chip(fn, specs, chip)
  what = f"{name} on {chip}"
  assert report.ok, f"{what}: {report.error}"
  assert report.num_kernels == 1 and kernel in report.kernel_names[0], (
      f"{what}: Mosaic kernels {report.kernel_names}")
  record_property(f"{name} {chip}", f"{tiling}; compiled under {report.scoped_vmem_bytes}")
  assert report.scoped_vmem_bytes == tiling.vmem_limit_bytes, (
      f"{what}: compiled under {report.scoped_vmem_bytes} bytes of scoped VMEM, the tiling "
      f"asked for {tiling.vmem_limit_bytes}")
  assert report.scoped_vmem_bytes <= chips.get_chip(chip).max_vmem_limit_bytes, what
  assert tiling.vmem_plan_bytes <= tiling.vmem_limit_bytes * vmem.BUDGET_FRACTION, (
      f"{what}: {tiling}")


@pytest.mark.parametrize("chip", AOT_CHIPS)
def test_decode_step_is_the_kernel_alone_in_place(chip):
  """One decode step at batch 64, the state donated: the compiled program is the kernel and
  bitcasts, nothing else. x [64, 8192, 1] goes in as [64, 8192], the state [64, 8192, 4]
  as the kernel's [64, 4, 8192] (XLA's TPU layout for it is S-major: the same bytes), the
  kernel's state output aliases its input and the program's output aliases the donated
  state. So the state is read once and written once, in place, and nothing is copied."""
  device = aot.topology_device(chip)
  sharding = jax.sharding.make_single_device_sharding(device)
  specs = [S((DECODE_BATCH, DIM, 1), BF16, sharding=sharding),
           S((DECODE_BATCH, DIM, WIDTH), BF16, sharding=sharding),
           S((DIM, WIDTH), BF16, sharding=sharding)]
  fn = functools.partial(C.causal_conv1d_update, activation="silu", chip=chip)
  text = jax.jit(fn, donate_argnums=(1,)).trace(*specs).lower().compile().as_text()
  assert re.search(r"input_output_alias=\{ \{1\}: \(1, \{\}", text), "state not donated"
  kernel = [line for line in text.splitlines() if 'custom_call_target="tpu_custom_call"' in line]
  assert len(kernel) == 1 and "output_to_operand_aliasing={{1}: (1, {})}" in kernel[0]
  others = [line.strip()[:160] for line in program_ops(text)
            if program_ops(text)[line] not in ("parameter", "bitcast", "custom-call",
                                               "get-tuple-element", "tuple")]
  assert not others, f"more than the kernel and bitcasts: {others}"


def program_ops(hlo_text):
  """{instruction line: opcode} of the entry computation of compiled HLO text."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  ops = {}
  for line in entry.splitlines()[1:]:
    match = re.match(r"\s*(?:ROOT )?%\S+ = (?:\([^=]*?\)|\S+) ([a-z-]+)\(", line)
    if match:
      ops[line] = match.group(1)
  return ops


ODD_PROGRAMS = {
    # (T not a multiple of anything, D not of 128, LFM3's width 7, packed, with bias)
    "bwd_packed_T300_D200_W7_bf16": (
        lambda chip: lambda x, w, b, cu, g: jax.vjp(
            lambda a, c, d: _conv(chip)(a, c, d, cu_seqlens=cu), x, w, b)[1](g),
        [S((1, 300, 200), BF16), S((200, 7), BF16), S((200,), BF16), S((5,), jnp.int32),
         S((1, 300, 200), BF16)]),
    "fwd_T4097_D1000_W3_f32": (
        lambda chip: _conv(chip),
        [S((2, 4097, 1000), jnp.float32), S((1000, 3), jnp.float32)]),
    "update_B7_T2_S6_D200_bf16": (
        lambda chip: functools.partial(C.causal_conv1d_update, activation="silu", chip=chip),
        [S((7, 200, 2), BF16), S((7, 200, 6), BF16), S((200, 4), BF16), S((200,), BF16)]),
}


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("name", list(ODD_PROGRAMS))
def test_odd_shapes_compile(name, chip):
  """Shapes no model has: partial T / D / batch blocks and unaligned widths pass Mosaic."""
  make, specs = ODD_PROGRAMS[name]
  report = aot.compile_for_chip(make(chip), specs, chip)
  assert report.ok, f"{name} on {chip}: {report.error}"
  assert report.num_kernels == 1, report.kernel_names


def test_default_scoped_vmem_limits():
  """The limits the tilings ask for at these shapes are the chips' defaults (nothing
  raised), so the compiles above ran under 16 MiB on v5e and 32 MiB on v6e."""
  for chip in AOT_CHIPS:
    for name, (_, _, _, tiling) in _programs(chip).items():
      assert tiling.vmem_limit_bytes == chips.get_chip(chip).default_scoped_vmem_bytes, (
          name, chip, tiling)
