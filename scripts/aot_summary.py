"""Ahead-of-time compile summary of each kernel at representative shapes, per chip.

    python scripts/aot_summary.py

Each case is compiled with libtpu for every chip whose topology the installed libtpu knows
(`aot.topology_known`: v5e, v6e, v5p and v7 with 0.0.42.1 and 0.0.50.1; no TPU needed;
run with JAX_PLATFORMS=cpu; all 191 cases compiled for v7 in 416 s on 2026-12-06). Later
kernels add their cases to CASES.

The script prints CASES, the full table (the grouped matmul at the real shapes of
Qwen3-30B-A3B, Mixtral-8x7B and gpt-oss-20b, m = 8 .. 65536, forward and backward, and
quantized weights; 192 compiles for three chips: 19 minutes measured on a busy 2-core
machine; then flash attention, scripts/flash_attention_cases.py: 32 / 8 heads, causal,
S = 2048 .. 32768 at head_dim 128, 256, 80, and the feature programs, forward and
backward; 78 compiles for three chips: 13 minutes more, measured on the same busy
machine; then paged attention, scripts/paged_attention_cases.py: the decode matrix and
feature programs, 87 programs per chip; then the linear-attention kernels at Qwen3.5-9B's
shapes, LINEAR_ATTENTION_CASES: the gated delta rule's prefill, training backward and
batch-64 decode, the conv's forward + backward and decode update, the gated norm). The
main job (scripts/demo.py) calls main() and gets DEMO_CASES, a
representative slice of it (Qwen3-30B-A3B at m=64, backward programs, which hold the
forward kernel too).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))   # benchmarks: the cases' shapes

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, causal_conv1d, chips, gated_delta_rule, rms_norm  # noqa: E402

from benchmarks.cases.gated_delta_rule import (CONV_STATE_LEN, DECODE_BATCH,  # noqa: E402
                                               PREFILL_TOKENS, QWEN3_5_9B)
import flash_attention_cases  # noqa: E402  (scripts/, next to this file)
import paged_attention_cases  # noqa: E402
import ragged_dot_cases  # noqa: E402

S = jax.ShapeDtypeStruct


@dataclasses.dataclass(frozen=True)
class Case:
  kernel: str                                   # hub name
  label: str                                    # what is compiled, for the printout
  build: Callable[[str], tuple[Callable, list]]  # chip -> (fn, arg specs)
  plan: Callable[[str], str] | None = None       # chip -> the kernel's own tiling / VMEM plan


def _rms_case(rows, hidden, dtype, label):
  x, w = S((rows, hidden), dtype), S((hidden,), dtype)

  def build(chip):
    fn = functools.partial(rms_norm.fused_add_rms_norm, chip=chip)
    return (lambda a, r, b, g, gr: jax.vjp(fn, a, r, b)[1]((g, gr))), [x, x, w, x, x]

  def plan(chip):
    config = rms_norm.RmsNormConfig(chip=chip)
    fwd = rms_norm.forward_tiling(rows, hidden, dtype, dtype, True, config)
    bwd = rms_norm.backward_tiling(rows, hidden, dtype, dtype, True, config)
    return (f"fwd block_rows {fwd.block_rows}, plan {fwd.vmem_plan_bytes / 2**20:.1f} MiB; "
            f"bwd block_rows {bwd.block_rows}, plan {bwd.vmem_plan_bytes / 2**20:.1f} MiB")

  return Case("rms-norm-tpu", label, build, plan)


def _ragged_case(program: ragged_dot_cases.Program) -> Case:
  return Case("ragged-dot-tpu", program.label, program.build, program.plan)


def _attention_case(program: flash_attention_cases.Program) -> Case:
  return Case("flash-attention-tpu", program.label, program.build, program.plan)


def _paged_case(program: paged_attention_cases.Program) -> Case:
  return Case("paged-attention-tpu", program.label, program.build, program.plan)


RMS_CASES = [
    _rms_case(8192, 4096, jnp.bfloat16, "fused add+norm fwd+bwd, bf16[8192, 4096] (Llama-8B)"),
    _rms_case(8, 4096, jnp.bfloat16, "fused add+norm fwd+bwd, bf16[8, 4096] (decode)"),
    _rms_case(65536, 2880, jnp.bfloat16, "fused add+norm fwd+bwd, bf16[65536, 2880] (gpt-oss)"),
    _rms_case(4096, 16384, jnp.float32, "fused add+norm fwd+bwd, f32[4096, 16384] (Llama-405B)"),
]

# Linear attention at Qwen3.5-9B's shapes (Qwen3-Next-80B's defaults give the same), from
# their one home, benchmarks/cases/gated_delta_rule.py: the Gated DeltaNet's 16 key / 32
# value heads of 128, its conv over 8192 channels of width 4, the gated norm over 128 per
# value head; prefill at 4096 tokens, decode at batch 64.
_HK, _HV, _HD = QWEN3_5_9B.key_heads, QWEN3_5_9B.value_heads, QWEN3_5_9B.head_dim
_CONV_DIM, _PREFILL, _DECODE = QWEN3_5_9B.conv_dim, PREFILL_TOKENS, DECODE_BATCH
_WIDTH, _STATE = QWEN3_5_9B.conv_width, CONV_STATE_LEN
_BF16, _F32 = jnp.bfloat16, jnp.float32


def _gdn_specs(batch, seq):
  q = S((batch, seq, _HK, _HD), _BF16)
  return [q, q, S((batch, seq, _HV, _HD), _BF16), S((batch, seq, _HV), _F32),
          S((batch, seq, _HV), _BF16)]


def _gdn_chunk_plan(chip):
  t = gated_delta_rule.gdn_tiling(_HK, _HV, _HD, _HD, dtype=_BF16, chip=chip)
  return (f"{t.heads_per_step} value heads per step, limit {t.vmem_limit_bytes / 2**20:.0f} "
          f"MiB, plan {t.vmem_plan_bytes / 2**20:.1f} MiB")


def _gdn_decode_plan(chip):
  t = gated_delta_rule.decode_tiling(_HK, _HV, _HD, _HD, 1, dtype=_BF16, chip=chip)
  return (f"{t.heads_per_step} value heads per step, limit {t.vmem_limit_bytes / 2**20:.0f} "
          f"MiB, plan {t.vmem_plan_bytes / 2**20:.1f} MiB")


def _gdn_prefill(chip):
  fn = functools.partial(gated_delta_rule.chunk_gated_delta_rule, output_final_state=True,
                         use_qk_l2norm_in_kernel=True, chip=chip)
  return fn, _gdn_specs(1, _PREFILL)


def _gdn_train(chip):
  fn = functools.partial(gated_delta_rule.chunk_gated_delta_rule,
                         use_qk_l2norm_in_kernel=True, chip=chip)

  def grads(q, k, v, g, beta, do):
    return jax.vjp(lambda *a: fn(*a)[0], q, k, v, g, beta)[1](do)

  return grads, _gdn_specs(1, _PREFILL) + [S((1, _PREFILL, _HV, _HD), _BF16)]


def _gdn_decode(chip):
  fn = functools.partial(gated_delta_rule.fused_recurrent_gated_delta_rule,
                         output_final_state=True, use_qk_l2norm_in_kernel=True, chip=chip)
  return ((lambda q, k, v, g, beta, h0: fn(q, k, v, g, beta, initial_state=h0)),
          _gdn_specs(_DECODE, 1) + [S((_DECODE, _HV, _HD, _HD), _F32)])


def _conv_config(chip):
  return causal_conv1d.CausalConv1dConfig(activation="silu", chip=chip)


def _conv_train(chip):
  fn = functools.partial(causal_conv1d.causal_conv1d_fn, activation="silu", channels_last=True,
                         chip=chip)
  x = S((1, _PREFILL, _CONV_DIM), _BF16)
  return ((lambda x_, w, g: jax.vjp(fn, x_, w)[1](g)), [x, S((_CONV_DIM, _WIDTH), _BF16), x])


def _conv_train_plan(chip):
  fwd = causal_conv1d.forward_tiling(1, _PREFILL, _CONV_DIM, _WIDTH, _BF16, _BF16, False,
                                     _conv_config(chip))
  bwd = causal_conv1d.backward_tiling(1, _PREFILL, _CONV_DIM, _WIDTH, _BF16, _BF16, False,
                                      _conv_config(chip))
  return (f"fwd {fwd.block_t}x{fwd.block_d}, plan {fwd.vmem_plan_bytes / 2**20:.1f} MiB; "
          f"bwd {bwd.block_t}x{bwd.block_d}, plan {bwd.vmem_plan_bytes / 2**20:.1f} MiB")


def _conv_decode(chip):
  fn = functools.partial(causal_conv1d.causal_conv1d_update, activation="silu", chip=chip)
  return fn, [S((_DECODE, _CONV_DIM, 1), _BF16), S((_DECODE, _CONV_DIM, _STATE), _BF16),
              S((_CONV_DIM, _WIDTH), _BF16)]


def _conv_decode_plan(chip):
  t = causal_conv1d.update_tiling(_DECODE, 1, _STATE, _CONV_DIM, _WIDTH, _BF16, _BF16, _BF16,
                                  _conv_config(chip))
  return f"{t.block_b} rows x {t.block_d} channels, plan {t.vmem_plan_bytes / 2**20:.1f} MiB"


def _gated_norm(chip):
  rows = _PREFILL * _HV
  x = S((rows, _HD), _BF16)
  fn = functools.partial(rms_norm.rms_norm_gated, chip=chip)
  return ((lambda a, gate, w, g: jax.vjp(fn, a, gate, w)[1](g)), [x, x, S((_HD,), _BF16), x])


def _gated_norm_plan(chip):
  config = rms_norm.RmsNormGatedConfig(chip=chip)
  fwd = rms_norm.gated_forward_tiling(_PREFILL * _HV, _HD, _BF16, _BF16, config)
  bwd = rms_norm.gated_backward_tiling(_PREFILL * _HV, _HD, _BF16, _BF16, config)
  return (f"fwd block_rows {fwd.block_rows}, plan {fwd.vmem_plan_bytes / 2**20:.1f} MiB; "
          f"bwd block_rows {bwd.block_rows}, plan {bwd.vmem_plan_bytes / 2**20:.1f} MiB")


LINEAR_ATTENTION_CASES = [
    Case("gated-delta-rule-tpu", "prefill fwd, T=4096, 16/32 heads of 128 (Qwen3.5-9B)",
         _gdn_prefill, _gdn_chunk_plan),
    Case("gated-delta-rule-tpu", "train bwd, T=4096, 16/32 heads of 128 (Qwen3.5-9B)",
         _gdn_train, _gdn_chunk_plan),
    Case("gated-delta-rule-tpu", "decode, batch 64, 16/32 heads of 128 (Qwen3.5-9B)",
         _gdn_decode, _gdn_decode_plan),
    Case("causal-conv1d-tpu", "train bwd, T=4096, D=8192, width 4, bf16 (Qwen3.5-9B)",
         _conv_train, _conv_train_plan),
    Case("causal-conv1d-tpu", "update, batch 64, D=8192, state 4, bf16 (Qwen3.5-9B)",
         _conv_decode, _conv_decode_plan),
    Case("rms-norm-tpu", "gated norm bwd, bf16[131072, 128] (Qwen3.5-9B)",
         _gated_norm, _gated_norm_plan),
]
RAGGED_CASES = [_ragged_case(p) for p in ragged_dot_cases.all_programs()]
ATTENTION_CASES = [_attention_case(p)
                   for p in flash_attention_cases.all_programs(directions=("fwd", "bwd"))]
PAGED_CASES = [_paged_case(p) for p in paged_attention_cases.all_programs()]
CASES = RMS_CASES + RAGGED_CASES + ATTENTION_CASES + PAGED_CASES + LINEAR_ATTENTION_CASES
# The main job's slice: decode (m=64) backward of Qwen3-30B-A3B (each holds the forward kernel).
DEMO_CASES = RMS_CASES + [
    _ragged_case(p) for p in ragged_dot_cases.model_programs("qwen3-30b-a3b", 64, ("bwd",))]


def iter_summary(cases=CASES, chip_names=None):
  """(case, chip, report) per case and chip, compiled as the caller iterates."""
  chip_names = chip_names or [c.name for c in chips.CHIPS.values()
                              if aot.topology_known(c.name)]
  for case in cases:
    for chip in chip_names:
      fn, specs = case.build(chip)
      yield case, chip, aot.compile_for_chip(fn, specs, chip)


def summary(cases=CASES, chip_names=None) -> list[tuple[Case, str, aot.CompileReport]]:
  return list(iter_summary(cases, chip_names))


def main(cases=None) -> int:
  """Prints one line per (case, chip); cases default to DEMO_CASES (the main job's)."""
  failed = 0
  for case, chip, report in iter_summary(DEMO_CASES if cases is None else cases):
    plan = f"  [{case.plan(chip)}]" if case.plan and report.ok else ""
    print(f"{case.kernel:14s} {case.label:55s} {report.summary()}{plan}", flush=True)
    failed += not report.ok
  for c in chips.CHIPS.values():
    if not aot.topology_known(c.name):
      print(f"{c.name}: not compiled (libtpu {aot.libtpu_version()} has no {c.aot_topology} "
            "topology)")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main(CASES))
