"""Quantized decode (issue 28): int8 / fp8 expert weights at decode sizes, each beside the
bf16 row of the same model, projection and rows, and int8 weights with int8 activations.
Grouped-matmul cases (`headline.GroupedMatmul`) of the three MoE models of
`headline.MOE_MODELS`."""

from __future__ import annotations

from benchmarks.cases.headline import GroupedMatmul

QUANTIZED_DECODE: tuple = tuple(   # int8 / fp8 expert weights at decode (issue 28)
    GroupedMatmul.of(model, m, part, weight_dtype)
    for model, gate_up in (("Qwen3-30B-A3B", "gate_up+silu"), ("Mixtral-8x7B", "gate_up+silu"),
                           ("gpt-oss-20b", "gate_up+gpt_oss"))
    for m in (64, 512)
    for part in (gate_up, "down")
    for weight_dtype in ("bfloat16", "int8", "float8_e4m3fn")
    # the bf16 rows every quantized row is compared with (Qwen3 m=512 is in HEADLINE)
    if not (weight_dtype == "bfloat16" and model == "Qwen3-30B-A3B" and m == 512))
# int8 weights with int8 activations (ragged_dot's lhs_quant="int8": tpu-inference's dynamic
# per-token activation quantization), beside the int8 rows: the same models, parts and m.
W8A8_DECODE: tuple = tuple(GroupedMatmul.of(c.model, c.m, c.part, "int8", lhs_quant="int8")
                           for c in QUANTIZED_DECODE if c.weight_dtype == "int8")
CASES = QUANTIZED_DECODE + W8A8_DECODE
