"""causal-conv1d-tpu's torch functions (CPU path: DLPack + Pallas interpret mode), loaded with
get_kernel as a user loads them, against the float64 token-loop references of
tests/reference_linear.py (Transformers' roundings modelled; tolerances documented there).

causal_conv1d_fn: forward and torch autograd's gradients of x, weight and bias, both
layouts Transformers hands over (a contiguous [B, D, T], and the transposed view of a
contiguous [B, T, D], which goes to the kernel channels-last), packing by the
`cu_seq_lens_q` a model passes through and by `seq_idx`. causal_conv1d_update: out and the
conv state, updated in the caller's tensor; with a gradient wanted, against Transformers'
own function's autograd in float64. causal_conv1d_forward against Transformers' own over a
real cache (prefill, then decode steps). The hub signatures; clear errors.
"""

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.library import opcheck

import reference as ref
import reference_linear as rl
import transformers_integration as ti

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _a_third_of_the_examples():
  return settings(max_examples=max(2, settings.default.max_examples // 3))


@st.composite
def problems(draw):
  packing = draw(st.sampled_from([None, "cu_seq_lens_q", "seq_idx"]))
  batch = 1 if packing == "cu_seq_lens_q" else draw(st.sampled_from([1, 2]))
  return dict(batch=batch, dim=draw(st.sampled_from([24, 130])),
              seq=draw(st.sampled_from([1, 9, 40])), width=draw(st.sampled_from([2, 4])),
              x_dtype=draw(st.sampled_from(list(DTYPES))),
              w_dtype=draw(st.sampled_from(list(DTYPES))), bias=draw(st.booleans()),
              activation=draw(st.sampled_from([None, "silu"])),
              channels_last=draw(st.booleans()), packing=packing,
              seed=draw(st.integers(0, 2**16)))


def _conv_inputs(p):
  gen = torch.Generator().manual_seed(p["seed"])
  b, d, t, w = p["batch"], p["dim"], p["seq"], p["width"]
  if p["channels_last"]:   # how Transformers' layers hand it over: [B, T, D] transposed
    x = torch.randn(b, t, d, generator=gen).to(DTYPES[p["x_dtype"]]).transpose(1, 2)
  else:
    x = torch.randn(b, d, t, generator=gen).to(DTYPES[p["x_dtype"]])
  weight = (torch.randn(d, w, generator=gen) * 0.5).to(DTYPES[p["w_dtype"]])
  bias = (torch.randn(d, generator=gen) * 0.3).to(DTYPES[p["w_dtype"]]) if p["bias"] else None
  kwargs = {}
  if p["packing"] == "cu_seq_lens_q":
    cuts = sorted(torch.randint(0, t + 1, (2,), generator=gen).tolist())
    kwargs["cu_seq_lens_q"] = torch.tensor([0, *cuts, t], dtype=torch.int32)
  elif p["packing"] == "seq_idx":
    kwargs["seq_idx"] = torch.sort(torch.randint(0, 3, (b, t), generator=gen),
                                   dim=1).values.to(torch.int32)
  grad_out = torch.randn(b, d, t, generator=gen).to(x.dtype)
  return x, weight, bias, kwargs, grad_out


def _packing_args(kwargs):
  cu = kwargs.get("cu_seq_lens_q")
  seq_idx = kwargs.get("seq_idx")
  return dict(cu_seqlens=None if cu is None else cu.numpy(),
              seq_idx=None if seq_idx is None else seq_idx.numpy())


def _np(t):
  return None if t is None else t.detach().double().numpy()


@_a_third_of_the_examples()
@given(p=problems())
def test_causal_conv1d_fn_forward_and_backward(conv, p):
  x, weight, bias, kwargs, grad_out = _conv_inputs(p)
  leaves = [t.requires_grad_() for t in (x, weight, bias) if t is not None]
  out = conv.causal_conv1d_fn(x, weight, bias, activation=p["activation"], use_cache=True,
                              **kwargs)   # use_cache: a model's pass-through, ignored
  assert out.dtype == x.dtype and out.shape == x.shape
  coarsest = rl.coarsest(p["x_dtype"], p["w_dtype"])
  want, _, scale = rl.causal_conv1d(_np(x), _np(weight), _np(bias), p["activation"],
                                    **_packing_args(kwargs))
  ref.assert_close(out.detach().float(), want, rl.CONV_TOLERANCE[coarsest], "out", scale)
  grads = torch.autograd.grad(out, leaves, grad_out)
  rdx, rdw, rdb, scales = rl.causal_conv1d_grads(_np(x), _np(weight), _np(bias),
                                                 p["activation"], _np(grad_out),
                                                 **_packing_args(kwargs))
  tol = rl.CONV_GRAD_TOLERANCE[coarsest]
  ref.assert_close(grads[0].float(), rdx, tol, "dx", scales["dx"])
  ref.assert_close(grads[1].float(), rdw, tol, "dweight", scales["dweight"])
  if bias is not None:
    ref.assert_close(grads[2].float(), rdb, tol, "dbias", scales["dbias"])
  assert [g.dtype for g in grads] == [t.dtype for t in leaves]


@pytest.mark.parametrize("x_dtype, state_dtype, seq", [("float32", "float32", 1),
                                                       ("bfloat16", "float32", 2)])
def test_update_writes_the_callers_state(conv, x_dtype, state_dtype, seq):
  """One (or two) decode steps: out and the new state (exactly the last S inputs, through
  the weight's dtype) against the reference, written into the caller's tensor."""
  gen = torch.Generator().manual_seed(3)
  x = torch.randn(3, 130, seq, generator=gen).to(DTYPES[x_dtype])
  state = torch.randn(3, 130, 4, generator=gen).to(DTYPES[state_dtype])
  weight, bias = torch.randn(130, 4, generator=gen) * 0.5, torch.randn(130, generator=gen)
  old, pointer = state.clone(), state.data_ptr()
  out = conv.causal_conv1d_update(x, state, weight, bias, "silu")
  want, want_state, scale = rl.causal_conv1d_update(_np(x), _np(old), _np(weight), _np(bias),
                                                    "silu")
  assert state.data_ptr() == pointer and out.dtype == x.dtype
  ref.assert_close(out.float(), want, rl.CONV_TOLERANCE[x_dtype], "out", scale)
  np.testing.assert_array_equal(_np(state), want_state)


def test_update_with_a_gradient_is_transformers_function(conv):
  """A step whose inputs require a gradient (the update kernel has none) runs as the conv of
  cat(state, x): out, the state and the gradients of x, weight and bias equal Transformers'
  own causal_conv1d_update under float64 autograd."""
  from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

  gen = torch.Generator().manual_seed(4)
  x = torch.randn(2, 24, 1, generator=gen)
  state = torch.randn(2, 24, 4, generator=gen)
  weight, bias = torch.randn(24, 4, generator=gen), torch.randn(24, generator=gen)
  grad_out = torch.randn(2, 24, 1, generator=gen)
  ours = [t.clone().requires_grad_() for t in (x, weight, bias)]
  theirs = [t.double().requires_grad_() for t in (x, weight, bias)]
  state64 = state.double()
  out = conv.causal_conv1d_update(ours[0], state, ours[1], ours[2], "silu")
  # The module-level name, called outside a model: Transformers' own torch function.
  want = qwen.causal_conv1d_update(theirs[0], state64, theirs[1], theirs[2], activation="silu")
  ref.assert_close(out.detach(), want.detach(), rl.CONV_TOLERANCE["float32"], "out")
  np.testing.assert_allclose(state.double().numpy(), state64.detach().numpy(), rtol=1e-7)
  got = torch.autograd.grad(out, ours, grad_out)
  expected = torch.autograd.grad(want, theirs, grad_out.double())
  for name, g, e in zip(("dx", "dweight", "dbias"), got, expected):
    ref.assert_close(g, e, rl.CONV_GRAD_TOLERANCE["float32"], name)


def test_causal_conv1d_forward_is_transformers_over_a_cache(conv):
  """causal_conv1d_forward against Transformers' own over a real DynamicCache of a tiny
  Qwen3.5 (its linear-attention layer 0): a prefill of 6 tokens (the conv state created and
  filled), two single-token steps (the in-place update), then a 3-token continuation (the
  previous inputs prepended): outputs and the cache's conv state after each call."""
  from transformers import DynamicCache
  from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

  config = ti.tiny_linear_attention_config("qwen3_5")
  torch.manual_seed(0)
  conv1d = torch.nn.Conv1d(128, 128, 4, groups=128, padding=3, bias=False)
  caches = [DynamicCache(config=config) for _ in range(2)]
  gen = torch.Generator().manual_seed(5)
  for step, seq in enumerate((6, 1, 1, 3)):
    x = torch.randn(2, seq, 128, generator=gen).transpose(1, 2)   # as the layer hands it over
    with torch.no_grad():
      got = conv.causal_conv1d_forward(conv1d, x, caches[0], 0, activation="silu")
      want = qwen.causal_conv1d_forward(conv1d, x, caches[1], 0, activation="silu")
    ref.assert_close(got, want, rl.CONV_TOLERANCE["float32"], f"out, step {step}")
    ref.assert_close(caches[0].get_conv_state(0), caches[1].get_conv_state(0),
                     dict(rtol=0.0, atol=0.0), f"conv state, step {step}")
    assert caches[0].get_seq_length(0) == caches[1].get_seq_length(0)


def test_hub_signatures_are_transformers(conv):
  """The layers take exactly the arguments of the Transformers functions they replace
  (kernels checks count and kind; names are compared here too), the functions their names."""
  from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

  for layer, replaced in ((conv.layers.CausalConv1dFn, qwen.causal_conv1d_fn),
                          (conv.layers.CausalConv1dUpdate, qwen.causal_conv1d_update),
                          (conv.layers.CausalConv1dForward, qwen.causal_conv1d_forward)):
    ours = inspect.signature(layer.forward).parameters
    theirs = inspect.signature(type(replaced).forward).parameters
    assert [(n, p.kind) for n, p in ours.items()] == [(n, p.kind) for n, p in theirs.items()]
  assert list(inspect.signature(conv.causal_conv1d_update).parameters) == [
      "x", "conv_state", "weight", "bias", "activation"]
  assert list(inspect.signature(conv.causal_conv1d_fn).parameters) == [
      "x", "weight", "bias", "activation", "kwargs"]


def test_errors(conv):
  x, w = torch.randn(1, 24, 9), torch.randn(24, 4)
  with pytest.raises(TypeError, match="x has dtype float16"):
    conv.causal_conv1d_fn(x.half(), w)
  with pytest.raises(TypeError, match="float64.*never down-cast"):
    conv.causal_conv1d_fn(x, w.double())
  with pytest.raises(ValueError, match="weight must be"):
    conv.causal_conv1d_fn(x, torch.randn(24, 17))
  with pytest.raises(NotImplementedError, match="activation 'gelu'"):
    conv.causal_conv1d_fn(x, w, activation="gelu")
  with pytest.raises(ValueError, match="rise from 0 to the sequence length 9"):
    conv.causal_conv1d_fn(x, w, cu_seq_lens_q=torch.tensor([0, 4], dtype=torch.int32))
  with pytest.raises(ValueError, match="need batch 1"):
    conv.causal_conv1d_fn(x.expand(2, -1, -1), w,
                          cu_seq_lens_q=torch.tensor([0, 9], dtype=torch.int32))
  with pytest.raises(NotImplementedError, match="initial_states"):
    conv.causal_conv1d_fn(x, w, initial_states=torch.zeros(1, 24, 3))
  with pytest.raises(ValueError, match="conv_state must be"):
    conv.causal_conv1d_update(x[:, :, :1], torch.zeros(1, 24, 2), w)
  with pytest.raises(ValueError, match="contiguous"):
    conv.causal_conv1d_update(x[:, :, :1], torch.zeros(1, 4, 24).transpose(1, 2), w)


def test_opcheck(conv_ops):
  gen = torch.Generator().manual_seed(0)
  x, w, b = torch.randn(1, 24, 9, generator=gen), torch.randn(24, 4, generator=gen), None
  opcheck(conv_ops.causal_conv1d_forward_op, (x, w, b, None, None, "silu", False))
  opcheck(conv_ops.causal_conv1d_backward_op, (x, w, b, None, None, torch.randn(1, 24, 9),
                                               "silu", False))
  opcheck(conv_ops.causal_conv1d_update_op, (x[:, :, :1].contiguous(), torch.randn(1, 24, 4),
                                             w, b, "silu"))


def test_torch_compile_fullgraph(conv):
  """torch.compile(fullgraph=True) of the conv over a channels-last view and an in-place
  update: one graph, the same output and the same state as eager."""
  gen = torch.Generator().manual_seed(0)
  x, w = torch.randn(1, 9, 24, generator=gen), torch.randn(24, 4, generator=gen)
  step, state = torch.randn(1, 24, 1, generator=gen), torch.randn(1, 24, 4, generator=gen)

  def block(x, w, step, state):
    out = conv.causal_conv1d_fn(x.transpose(1, 2), w, None, activation="silu")
    return out, conv.causal_conv1d_update(step, state, w, None, "silu")

  states = [state.clone(), state.clone()]
  got = torch.compile(block, fullgraph=True)(x, w, step, states[0])
  want = block(x, w, step, states[1])
  for a, b in zip((*got, states[0]), (*want, states[1])):
    torch.testing.assert_close(a, b, rtol=0, atol=0)
  assert not torch.equal(states[0], state)   # the compiled update wrote the caller's state
