"""Layers for `kernels.kernelize`: Transformers' hub function names, as function layers.

Transformers 5.25 wraps its conv functions with `use_kernel_func_from_hub_with_fallback`
("causal_conv1d_fn", "causal_conv1d_update") or `use_kernel_forward_from_hub`
("causal_conv1d_forward"): kernels function layers whose forward has the wrapped
function's signature, listed on the layers that call them (`use_kernelized_func`), so
`kernelize` swaps that layer's private copy of the function for the mapped layer's
forward (kernels checks that the two forwards take the same arguments):

    CausalConv1dFn       "causal_conv1d_fn"       (prefill, training; packed sequences)
        forward(hidden_states, weight, bias=None, activation=None, **kwargs)
    CausalConv1dUpdate   "causal_conv1d_update"   (decode; the conv state in place)
        forward(hidden_states, conv_state, weight, bias=None, activation=None)
    CausalConv1dForward  "causal_conv1d_forward"  (the layer-level dispatch between them,
                                                   reading the cache's conv state)
        forward(conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0,
                **kwargs)

the signatures of Transformers' functions of those names (the same in all 25 families that
call them in 5.25). Each calls this package's function of that name.
"""

from __future__ import annotations

from torch import nn


class CausalConv1dFn(nn.Module):
  """Transformers' "causal_conv1d_fn": this package's `causal_conv1d_fn`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states, weight, bias=None, activation=None, **kwargs):
    from . import causal_conv1d_fn

    return causal_conv1d_fn(hidden_states, weight, bias, activation, **kwargs)


class CausalConv1dUpdate(nn.Module):
  """Transformers' "causal_conv1d_update": this package's `causal_conv1d_update` (the conv
  state in place)."""

  has_backward = True
  can_torch_compile = True

  def forward(self, hidden_states, conv_state, weight, bias=None, activation=None):
    from . import causal_conv1d_update

    return causal_conv1d_update(hidden_states, conv_state, weight, bias, activation)


class CausalConv1dForward(nn.Module):
  """Transformers' "causal_conv1d_forward": this package's `causal_conv1d_forward`."""

  has_backward = True
  can_torch_compile = True

  def forward(self, conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0,
              **kwargs):
    from . import causal_conv1d_forward

    return causal_conv1d_forward(conv1d, hidden_states, cache, layer_idx, activation,
                                 state_idx, **kwargs)
