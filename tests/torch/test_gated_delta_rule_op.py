"""gated-delta-rule-tpu's torch functions (CPU path: DLPack + Pallas interpret mode), loaded
with get_kernel as a user loads them, against the float64 token-by-token reference
(tests/reference_gdn.py, written from the definition; its hand-written reverse recurrence
is checked against float64 autodiff and finite differences in tests/jax).

Forward (o, final state) and torch autograd's gradients of sum(do * o) + sum(dht * final)
for query, key, value, g, beta and the initial state, for both hub functions, grouped
values, both dtypes, initial states, packed sequences (cu_seqlens); prefill followed by
decode steps equals one pass; the in-place decode; the hub signatures; clear errors.

Tolerances (tests/jax/test_gated_delta_rule_kernel.py measures them): float32 results
(everything from float32 inputs; states, dg and dh0 always) rtol 1e-5 + atol 1e-4 of the
largest reference value; bfloat16 results one rounding (rtol 2^-8) + atol 1e-4.

Cost: interpret mode compiles every new shape (5-10 s a program here), so shapes come
from short lists and the properties draw a third of the profile's examples (the kernels'
depth is in tests/jax).
"""

import inspect

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch.library import opcheck

import reference as ref
import reference_gdn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": dict(rtol=1e-5, atol=1e-4), "bfloat16": dict(rtol=2.0 ** -8, atol=1e-4)}
SEQ = {"chunk": [1, 5, 70], "recurrent": [1, 2]}
HEADS = [(1, 1), (2, 2)]          # (key heads, value heads per key head)
DIMS = [16, 32]
FUNCTIONS = {"chunk": "chunk_gated_delta_rule", "recurrent": "fused_recurrent_gated_delta_rule"}


def _a_third_of_the_examples():
  return settings(max_examples=max(2, settings.default.max_examples // 3))


def _inputs(p):
  """Leaf tensors of problem p in the dtypes the kernels get (the reference widens them),
  and the output / final-state cotangents."""
  gen = torch.Generator().manual_seed(p["seed"])
  batch, seq, hk, hv = p["batch"], p["seq"], p["hk"], p["hk"] * p["group"]
  kd, vd, dtype = p["k_dim"], p["v_dim"], DTYPES[p["dtype"]]
  num_states = batch if p.get("lengths") is None else len(p["lengths"])

  def randn(*shape, scale=1.0):
    return torch.randn(*shape, generator=gen, dtype=torch.float64) * scale

  x = dict(query=randn(batch, seq, hk, kd), key=randn(batch, seq, hk, kd, scale=kd ** -0.5),
           value=randn(batch, seq, hv, vd),
           g=-torch.rand(batch, seq, hv, generator=gen, dtype=torch.float64),
           beta=torch.rand(batch, seq, hv, generator=gen, dtype=torch.float64))
  x = {n: t.to(dtype) for n, t in x.items()}
  x["g"] = x["g"].float()
  x["beta"] = x["beta"].to(dtype if p["beta_in_dtype"] else torch.float32)
  x["initial_state"] = (0.5 * randn(num_states, hv, kd, vd)).float() if p["initial"] else None
  x = {n: None if t is None else t.requires_grad_() for n, t in x.items()}
  cu = None
  if p.get("lengths") is not None:
    cu = torch.tensor([0, *np.cumsum(p["lengths"])], dtype=torch.int32)
  cotangents = dict(do=randn(batch, seq, hv, vd).to(dtype),
                    dht=randn(num_states, hv, kd, vd).float())
  return x, cu, cotangents


def _numpy(t):
  return None if t is None else t.detach().double().numpy()


def _check(p, x, cu, cot, o, final, grads):
  """o, final and the gradients (a dict by input name) against the reference."""
  args = [_numpy(x[n]) for n in ("query", "key", "value", "g", "beta")]
  want_o, want_final = reference_gdn.gated_delta_rule(
      *args, initial_state=_numpy(x["initial_state"]), use_qk_l2norm=p["l2norm"],
      cu_seqlens=None if cu is None else cu.numpy())
  assert o.dtype == x["query"].dtype and final.dtype == torch.float32
  ref.assert_close(o.detach().float(), want_o, TOL[p["dtype"]], "o")
  ref.assert_close(final.detach(), want_final, TOL["float32"], "final state")
  want = reference_gdn.gated_delta_rule_grads(
      *args, _numpy(cot["do"]), initial_state=_numpy(x["initial_state"]),
      dht=_numpy(cot["dht"]), use_qk_l2norm=p["l2norm"],
      cu_seqlens=None if cu is None else cu.numpy())
  for name, ref_name in (("query", "dq"), ("key", "dk"), ("value", "dv"), ("g", "dg"),
                         ("beta", "dbeta"), ("initial_state", "dh0")):
    if x[name] is None:
      continue
    got = grads[name]
    assert got.dtype == x[name].dtype, name
    dtype = "float32" if got.dtype == torch.float32 else "bfloat16"
    ref.assert_close(got.float(), want[ref_name], TOL[dtype], f"grad {name}")


def _run(gdn, fn, p, x, cu, cot):
  """The hub function forward with the final state, then torch autograd's gradients."""
  o, final = getattr(gdn, FUNCTIONS[fn])(
      x["query"], x["key"], x["value"], g=x["g"], beta=x["beta"],
      initial_state=x["initial_state"], output_final_state=True,
      use_qk_l2norm_in_kernel=p["l2norm"], cu_seqlens=cu)
  leaves = {n: t for n, t in x.items() if t is not None}
  grads = torch.autograd.grad((o, final), list(leaves.values()), (cot["do"], cot["dht"]))
  return o, final, dict(zip(leaves, grads))


@st.composite
def problems(draw, packed: bool = False):
  fn = draw(st.sampled_from(list(FUNCTIONS)))
  hk, group = draw(st.sampled_from(HEADS))
  p = dict(fn=fn, hk=hk, group=group, dtype=draw(st.sampled_from(list(DTYPES))),
           k_dim=draw(st.sampled_from(DIMS)), v_dim=draw(st.sampled_from(DIMS)),
           l2norm=draw(st.booleans()), initial=draw(st.booleans()),
           beta_in_dtype=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))
  if packed:
    # Sequences of 0 to 70 tokens (past a chunk) in one row; the decode kernel takes up to 16.
    lengths = [0, 1, 3, 70] if fn == "chunk" else [0, 1, 2]
    p["lengths"] = draw(st.lists(st.sampled_from(lengths), min_size=1, max_size=3))
    if sum(p["lengths"]) == 0:
      p["lengths"][-1] = 1
    p["batch"], p["seq"] = 1, sum(p["lengths"])
  else:
    p["batch"], p["seq"] = draw(st.sampled_from([1, 2])), draw(st.sampled_from(SEQ[fn]))
  return p


@_a_third_of_the_examples()
@given(p=problems())
def test_matches_reference_forward_and_backward(gdn, p):
  x, cu, cot = _inputs(p)
  o, final, grads = _run(gdn, p["fn"], p, x, cu, cot)
  _check(p, x, cu, cot, o, final, grads)


@_a_third_of_the_examples()
@given(p=problems(packed=True))
def test_packed_sequences_match_reference(gdn, p):
  """cu_seqlens: each sequence from its own initial state (an empty one keeps it), one
  final state each, all gradients (the initial states' too)."""
  x, cu, cot = _inputs(p)
  o, final, grads = _run(gdn, p["fn"], p, x, cu, cot)
  assert final.shape[0] == len(p["lengths"])
  _check(p, x, cu, cot, o, final, grads)


def _problem(**overrides):
  p = dict(fn="chunk", hk=2, group=2, dtype="float32", k_dim=16, v_dim=32, l2norm=True,
           initial=True, beta_in_dtype=False, seed=5, batch=2, seq=70)
  p.update(overrides)
  return p


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_prefill_then_decode_equals_one_pass(gdn, dtype):
  """The chunked kernel over the first 70 tokens, then the recurrent kernel one token at a
  time from its state (what a cached generate does), equals one pass over all 72 tokens
  and the reference; outputs and state."""
  p = _problem(seq=72, dtype=dtype)
  x, _, _ = _inputs(p)
  x = {n: t.detach() for n, t in x.items()}
  kw = dict(use_qk_l2norm_in_kernel=True, output_final_state=True)
  prefix = {n: x[n][:, :70] for n in ("query", "key", "value", "g", "beta")}
  outs, state = gdn.chunk_gated_delta_rule(**prefix, initial_state=x["initial_state"], **kw)
  outs = [outs]
  for t in (70, 71):
    step = {n: x[n][:, t:t + 1] for n in ("query", "key", "value", "g", "beta")}
    o, state = gdn.fused_recurrent_gated_delta_rule(**step, initial_state=state, **kw)
    outs.append(o)
  whole, whole_state = gdn.chunk_gated_delta_rule(
      **{n: x[n] for n in ("query", "key", "value", "g", "beta")},
      initial_state=x["initial_state"], **kw)
  want_o, want_state = reference_gdn.gated_delta_rule(
      *(_numpy(x[n]) for n in ("query", "key", "value", "g", "beta")),
      initial_state=_numpy(x["initial_state"]), use_qk_l2norm=True)
  stepped = torch.cat(outs, dim=1)
  for name, got in (("stepped", stepped), ("one pass", whole)):
    ref.assert_close(got.float(), want_o, TOL[dtype], f"o ({name})")
  ref.assert_close(stepped.float(), whole.float(), TOL[dtype], "stepped vs one pass")
  for got in (state, whole_state):
    ref.assert_close(got, want_state, TOL["float32"], "state")


def test_in_place_decode_writes_the_callers_state(gdn):
  """fused_recurrent_gated_delta_rule_: the new state lands in the caller's tensor (same
  storage), o and the state equal the reference; packed sequences too."""
  for lengths in (None, [1, 0, 2]):
    p = _problem(fn="recurrent", seq=2 if lengths is None else 3, lengths=lengths,
                 batch=2 if lengths is None else 1, dtype="bfloat16", beta_in_dtype=True)
    x, cu, _ = _inputs(p)
    x = {n: t.detach() for n, t in x.items()}
    state = x["initial_state"].clone()
    pointer = state.data_ptr()
    with torch.no_grad():
      o = gdn.fused_recurrent_gated_delta_rule_(
          x["query"], x["key"], x["value"], x["g"], x["beta"], state,
          use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    assert state.data_ptr() == pointer
    want_o, want_state = reference_gdn.gated_delta_rule(
        *(_numpy(x[n]) for n in ("query", "key", "value", "g", "beta")),
        initial_state=_numpy(x["initial_state"]), use_qk_l2norm=True,
        cu_seqlens=None if cu is None else cu.numpy())
    ref.assert_close(o.float(), want_o, TOL["bfloat16"], "o")
    ref.assert_close(state, want_state, TOL["float32"], "state")


def test_in_place_decode_refuses_a_gradient(gdn):
  p = _problem(fn="recurrent", seq=1)
  x, _, _ = _inputs(p)
  with pytest.raises(RuntimeError, match="no gradient"):
    gdn.fused_recurrent_gated_delta_rule_(x["query"], x["key"], x["value"], x["g"], x["beta"],
                                          x["initial_state"].detach().clone())


def test_scale_chunk_size_and_no_final_state(gdn):
  """scale from kwargs (fla's keyword) is applied; chunk_size is accepted (Transformers'
  torch function takes it; the result does not depend on it); without output_final_state
  the state is None."""
  p = _problem(seq=5, batch=1)
  x, _, _ = _inputs(p)
  x = {n: t.detach() for n, t in x.items()}
  args = [x[n] for n in ("query", "key", "value", "g", "beta")]
  o, state = gdn.chunk_gated_delta_rule(*args, initial_state=x["initial_state"],
                                        use_qk_l2norm_in_kernel=True, scale=0.3, chunk_size=32)
  assert state is None
  want, _ = reference_gdn.gated_delta_rule(*map(_numpy, args),
                                           initial_state=_numpy(x["initial_state"]),
                                           use_qk_l2norm=True, scale=0.3)
  ref.assert_close(o, want, TOL["float32"], "o")


def test_zero_tokens(gdn):
  """T = 0 (Transformers splits off the tokens it decodes one by one): empty output, the
  initial state as the final one (as Transformers' torch function returns it)."""
  x, _, _ = _inputs(_problem(seq=0, batch=1))
  x = {n: t.detach() for n, t in x.items()}
  o, state = gdn.chunk_gated_delta_rule(x["query"], x["key"], x["value"], x["g"], x["beta"],
                                        initial_state=x["initial_state"],
                                        output_final_state=True)
  assert o.shape == x["value"].shape and state is x["initial_state"]


def test_hub_signatures_are_transformers(gdn):
  """The functions take Transformers' hub arguments by name, and the layers exactly the
  arguments of the functions they replace (kernels checks count and kind when it
  kernelizes; names are compared here too)."""
  from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

  hub = ["query", "key", "value", "g", "beta", "initial_state", "output_final_state",
         "use_qk_l2norm_in_kernel", "cu_seqlens", "kwargs"]
  for name in FUNCTIONS.values():
    assert list(inspect.signature(getattr(gdn, name)).parameters) == hub, name
  for layer, replaced in ((gdn.layers.ChunkGatedDeltaRule, qwen.torch_chunk_gated_delta_rule),
                          (gdn.layers.FusedRecurrentGatedDeltaRule,
                           qwen.torch_recurrent_gated_delta_rule)):
    ours = inspect.signature(layer.forward).parameters
    theirs = inspect.signature(type(replaced).forward).parameters
    assert [(n, p.kind) for n, p in ours.items()] == [(n, p.kind) for n, p in theirs.items()]


def test_errors(gdn):
  x, _, _ = _inputs(_problem(seq=5, batch=1, initial=False))
  q, k, v, g, beta = (x[n].detach() for n in ("query", "key", "value", "g", "beta"))
  f = gdn.chunk_gated_delta_rule
  with pytest.raises(TypeError, match="query has dtype float16"):
    f(q.half(), k.half(), v.half(), g, beta)
  with pytest.raises(TypeError, match="g has dtype bfloat16"):
    f(q, k, v, g.bfloat16(), beta)
  with pytest.raises(TypeError, match="float64.*never down-cast"):
    f(q.double(), k, v, g, beta)
  with pytest.raises(ValueError, match="multiple of the key"):
    f(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
  with pytest.raises(TypeError, match="cu_seqlens must be int32"):
    f(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
  with pytest.raises(ValueError, match="rise from 0 to the sequence length 5"):
    f(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 2, 5], dtype=torch.int32))
  with pytest.raises(ValueError, match="initial_state must have shape"):
    f(q, k, v, g, beta, initial_state=torch.zeros(2, 4, 16, 32))
  with pytest.raises(NotImplementedError, match="head_first"):
    f(q, k, v, g, beta, head_first=True)
  with pytest.raises(ValueError, match="chunk_size"):
    f(q, k, v, g, beta, chunk_size=0)
  with pytest.raises(RuntimeError, match="device type 'meta'"):
    f(q.to("meta"), k.to("meta"), v.to("meta"), g.to("meta"), beta.to("meta"))


def test_opcheck(gdn_ops):
  """torch.library.opcheck on every op (schema, fake, autograd registration), at the shapes
  the tests above already compiled."""
  x, cu, cot = _inputs(_problem(seq=5, batch=1))
  a = [x[n].detach() for n in ("query", "key", "value", "g", "beta", "initial_state")]
  opcheck(gdn_ops.chunk_gated_delta_rule_op, (*a, None, 0.25, True, True))
  opcheck(gdn_ops.chunk_gated_delta_rule_backward_op,
          (*a, None, cot["do"], cot["dht"], 0.25, True))


def test_torch_compile_fullgraph(gdn):
  """torch.compile(fullgraph=True) of a prefill then a decode step: one graph, the same
  results as eager (the layers say can_torch_compile)."""
  x, _, _ = _inputs(_problem(seq=5, batch=1))
  q, k, v, g, beta, h0 = (x[n].detach() for n in ("query", "key", "value", "g", "beta",
                                                 "initial_state"))

  def block(q, k, v, g, beta, h0):
    o, state = gdn.chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=h0,
                                          output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, state = gdn.fused_recurrent_gated_delta_rule(
        q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1], initial_state=state,
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    return o, o1, state

  for got, want in zip(torch.compile(block, fullgraph=True)(q, k, v, g, beta, h0),
                       block(q, k, v, g, beta, h0)):
    torch.testing.assert_close(got, want, rtol=0, atol=0)
