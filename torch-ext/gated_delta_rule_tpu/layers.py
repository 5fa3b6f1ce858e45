"""Layers for `kernels.kernelize`: Transformers' hub function names, as function layers.

Transformers 5.25 wraps its gated-delta-rule functions with
`use_kernel_func_from_hub_with_fallback(name, "fla")`, a kernels function layer whose
forward has the wrapped function's signature, and lists them on the layer that calls them
(`use_kernelized_func`), so `kernelize` swaps that layer's private copy of the function
for the mapped layer's forward (kernels checks that the two forwards take the same
arguments):

    ChunkGatedDeltaRule            "chunk_gated_delta_rule"            (prefill, training)
        forward(query, key, value, g, beta, chunk_size=64, initial_state=None,
                output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs)
    FusedRecurrentGatedDeltaRule   "fused_recurrent_gated_delta_rule"  (decode)
        forward(query, key, value, g, beta, initial_state=None, output_final_state=False,
                use_qk_l2norm_in_kernel=False, **kwargs)

the signatures of Transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` (every family that calls these names, 5.25: Qwen3.5 and
its MoE, Qwen3-Next, OLMo-Hybrid, Qwen4-Exp, Lara-mini). Each calls this package's function
of that name; packed sequences arrive as `cu_seqlens` in kwargs.
"""

from __future__ import annotations

from torch import nn


class ChunkGatedDeltaRule(nn.Module):
  """Transformers' "chunk_gated_delta_rule": this package's `chunk_gated_delta_rule`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, query, key, value, g, beta, chunk_size=64, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    from . import chunk_gated_delta_rule

    return chunk_gated_delta_rule(query, key, value, g, beta, initial_state=initial_state,
                                  output_final_state=output_final_state,
                                  use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  chunk_size=chunk_size, **kwargs)


class FusedRecurrentGatedDeltaRule(nn.Module):
  """Transformers' "fused_recurrent_gated_delta_rule": this package's
  `fused_recurrent_gated_delta_rule` (a new state: Transformers' cache copies it)."""

  has_backward = True
  can_torch_compile = True

  def forward(self, query, key, value, g, beta, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, **kwargs):
    from . import fused_recurrent_gated_delta_rule

    return fused_recurrent_gated_delta_rule(query, key, value, g, beta,
                                            initial_state=initial_state,
                                            output_final_state=output_final_state,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                            **kwargs)
