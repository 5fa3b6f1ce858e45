"""flash-attention-tpu as a Diffusers attention backend (diffusers 0.42.1, pinned): tiny
randomly initialised SD3.5-style, Flux, Wan and Qwen-Image transformers built from their
configs (scripts/diffusers_integration.py), run with Diffusers' "native" backend (SDPA)
and with ours, switched as a user does: kernel = get_kernel(..., version=1);
kernel.set_diffusers_backend(model) (SD3 needs its processors swapped; the others also
take model.set_attention_backend("flash_tpu") after register_diffusers_backend()).
Every model test records the kernel's op calls: one per attention module, so a model that
silently stayed on SDPA fails.

Tolerances:
float32: the model output within 2e-5 of native's (diffusers_integration.F32_TOLERANCE,
  justified there). Measured: <= 3e-7 of max|ref|.
bfloat16: the truth is the same model in f32 (the bf16 weights and inputs upcast) on
  native attention. A bf16 network is far from it whatever its attention does (Flux's
  tiny model: 6% relative L2, native attention as well as ours: its timestep and RoPE
  inputs round in bf16), so the model-level bound is additive: ours may be at most
  BF16_EPS = 2^-8 (one bf16 epsilon) of relative L2 error further from the truth than
  native bf16 is. Measured: within 1e-4 of native's error. Each attention call is then
  judged on its own against the float64 reference (reference.attention_mismatches, out
  and lse), with reference.ATTENTION_TOLERANCE["bfloat16"]: 4 * 2^-8 of max|out| for the
  P roundings and 2 * 2^-8 relative for the output's own rounding (derived there).
Both dtypes: every op call is also checked against that float64 reference.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings, strategies as st

import diffusers_integration as di
import reference as ref

BACKEND = "flash_tpu"
TOL = di.F32_TOLERANCE                   # float32 model output vs native
BF16_EPS = 2.0 ** -8


@pytest.fixture(scope="module")
def dispatch():
  from diffusers.models import attention_dispatch

  return attention_dispatch


@pytest.fixture(autouse=True)
def restore_active_backend(dispatch):
  """set_attention_backend also sets Diffusers' process-wide default backend (what
  processors without their own use): put it back after every test."""
  registry = dispatch._AttentionBackendRegistry
  before = registry._active_backend
  yield
  registry.set_active_backend(before)


@pytest.fixture(scope="module")
def registered(flash):
  assert flash.register_diffusers_backend() == BACKEND
  return flash


@pytest.fixture
def op_calls(registered, monkeypatch):
  """Every forward op call of the kernel: (args, (out, lse))."""
  calls = []
  forward = registered.flash_attention_op

  def recording(*args):
    result = forward(*args)
    calls.append((args, result))
    return result

  monkeypatch.setattr(registered, "flash_attention_op", recording)
  return calls


def _np(t):
  return None if t is None else t.detach().float().numpy()


def _check_calls_against_reference(calls, dtype_name):
  """Each recorded op call's out and lse against the float64 reference."""
  for args, (out, lse) in calls:
    q, k, v, sinks, q_seg, kv_seg, _, causal, sm_scale, window, cap, _ = args
    assert sinks is None and window == 0 and cap == 0.0 and not causal
    segments = None if kv_seg is None else (q_seg.numpy(), kv_seg.numpy())
    failures = ref.attention_mismatches(dtype_name, _np(q), _np(k), _np(v), _np(out), _np(lse),
                                        sm_scale=sm_scale, segment_ids=segments)
    assert not failures, f"call with q {tuple(q.shape)}, k {tuple(k.shape)}: {failures}"


def _forward(model, inputs):
  with torch.no_grad():
    return model(**inputs, return_dict=False)[0]


def _native(model, inputs):
  model.set_attention_backend("native")   # SD3's processors ignore it: they call SDPA
  return _forward(model, inputs)


def _rel_l2(a, b) -> float:
  a, b = a.double(), b.double()
  return float((a - b).norm() / b.norm())


def _attention_module_count(registered, model) -> int:
  return len(registered.diffusers_backend._attention_modules(model))


CASES = [(family, dtype) for dtype in ("float32", "bfloat16") for family in di.FAMILIES]


@pytest.mark.parametrize("family, dtype_name", CASES, ids=[f"{f}-{d}" for f, d in CASES])
def test_model_matches_native(registered, op_calls, family, dtype_name):
  padded = family == "qwen_image"
  model = di.tiny_transformer(family)
  inputs = di.tiny_inputs(family, padded=padded)
  dtype = getattr(torch, dtype_name)
  if dtype == torch.float32:
    want = _native(model, inputs)
  else:
    model = model.to(dtype)
    inputs = di.cast_inputs(inputs, dtype)
    truth = _native(copy.deepcopy(model).float(), di.cast_inputs(inputs, torch.float32))
    want = _native(model, inputs)
  assert not op_calls
  assert registered.set_diffusers_backend(model) == BACKEND
  got = _forward(model, inputs)
  assert got.dtype == dtype and torch.isfinite(got).all()
  if dtype == torch.float32:
    ref.assert_close(got, want, TOL, what=f"{family} output")
  else:
    err, native_err = _rel_l2(got, truth), _rel_l2(want, truth)
    assert err <= native_err + BF16_EPS, (
        f"{family}: relative L2 error to the f32 model {err:.3g}, native bf16's "
        f"{native_err:.3g}")

  # One op call per attention module (SD3: 2 joint + 1 image-only; Flux: 2; Wan: self and
  # cross; Qwen-Image: 1), each right against the float64 reference.
  assert len(op_calls) == _attention_module_count(registered, model)
  _check_calls_against_reference(op_calls, dtype_name)
  if padded:   # the text padding mask arrived as segment ids: text first, then image
    mask = inputs["encoder_hidden_states_mask"].to(torch.int32)
    joint = torch.cat([mask, mask.new_ones(mask.shape[0], di.IMAGE_SIDE ** 2)], dim=1)
    q_seg, kv_seg = op_calls[0][0][4], op_calls[0][0][5]
    assert torch.equal(kv_seg, joint) and bool((q_seg == 1).all())


def test_padding_mask_matters():
  """Qwen-Image's padding mask (5 of 77 keys in row 1) changes the native output of that
  row 100x beyond the float32 tolerance (measured: 4.6e-3 of max|out|), and leaves row 0
  alone, so the padded float32 comparison above tests the mask (native only, no kernel;
  the bf16 comparison relies on the per-call reference check with the recorded mask)."""
  model = di.tiny_transformer("qwen_image")
  padded = _native(model, di.tiny_inputs("qwen_image", padded=True))
  unpadded = _native(model, di.tiny_inputs("qwen_image", padded=False))
  change = (padded[1] - unpadded[1]).abs().max() / unpadded[1].abs().max()
  assert change > 100 * TOL["atol"] and torch.equal(padded[0], unpadded[0])


def test_backward_matches_native(registered, op_calls):
  """Training (e.g. LoRA) runs the kernel's backward: every parameter's gradient of
  <output, direction> in the padded Qwen-Image model, f32, against native's. 1e-4
  (reference.ATTENTION_GRAD_TOLERANCE["float32"]): the backward's two chained f32
  matmuls after the softmax add a few 2^-24 per step, grown by the sums' length."""
  model = di.tiny_transformer("qwen_image")
  inputs = di.tiny_inputs("qwen_image", padded=True)
  # the output: [B, image tokens, patch^2 * out_channels]
  direction = torch.randn(di.BATCH, di.IMAGE_SIDE ** 2, 16,
                          generator=torch.Generator().manual_seed(5))

  def grads():
    model.zero_grad(set_to_none=True)
    out = model(**inputs, return_dict=False)[0]
    (out * direction).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

  model.set_attention_backend("native")
  want = grads()
  registered.set_diffusers_backend(model)
  got = grads()
  assert op_calls and set(got) == set(want)
  assert any(".attn.to_q." in name for name in got)
  for name, w in want.items():
    ref.assert_close(got[name], w, ref.ATTENTION_GRAD_TOLERANCE["float32"], what=name)


def test_set_attention_backend_and_context_manager(registered, op_calls, dispatch):
  """The two-line route for dispatcher-based models (here Wan), and Diffusers'
  attention_backend(...) context manager, reach the kernel."""
  model = di.tiny_transformer("wan")
  inputs = di.tiny_inputs("wan")
  want = _native(model, inputs)
  model.set_attention_backend(BACKEND)
  ref.assert_close(_forward(model, inputs), want, TOL, what="set_attention_backend")
  assert len(op_calls) == 2
  model = di.tiny_transformer("wan")          # processors without a backend of their own
  with dispatch.attention_backend(BACKEND):
    ref.assert_close(_forward(model, inputs), want, TOL, what="attention_backend")
  assert len(op_calls) == 4
  assert dispatch.AttentionBackendName(BACKEND) is dispatch.AttentionBackendName.FLASH_TPU
  assert BACKEND in {m.value for m in dispatch.AttentionBackendName}


def test_sd3_needs_the_processor_swap(registered, op_calls):
  """Diffusers 0.42.1's SD3 processor (JointAttnProcessor2_0) calls SDPA itself:
  set_attention_backend alone leaves it there, which is why set_diffusers_backend swaps
  it. If this fails, Diffusers now dispatches SD3 and the swap may go."""
  model = di.tiny_transformer("sd3")
  model.set_attention_backend(BACKEND)
  _forward(model, di.tiny_inputs("sd3"))
  assert not op_calls


def test_registration_rules(registered, dispatch):
  assert registered.register_diffusers_backend() == BACKEND       # again: re-points, no error
  fn = dispatch._AttentionBackendRegistry._backends[dispatch.AttentionBackendName(BACKEND)]
  assert fn is registered.diffusers_attention
  with pytest.raises(ValueError, match="already has an attention backend named 'native'"):
    registered.register_diffusers_backend("native")
  with pytest.raises(ValueError, match="lowercase"):
    registered.register_diffusers_backend("Flash-TPU")
  assert not dispatch._AttentionBackendRegistry._is_context_parallel_available(
      dispatch.AttentionBackendName(BACKEND))


def test_backend_names_every_argument_any_backend_takes(registered, dispatch):
  """The dispatcher silently drops arguments a backend's signature does not name, so ours
  names every one that any registered Diffusers backend takes (a window, a soft-cap, ...)
  and applies or refuses it. Walks the installed registry, so a new argument fails here."""
  import inspect

  registry = dispatch._AttentionBackendRegistry
  taken = set().union(*(names for backend, names in registry._supported_arg_names.items()
                        if backend.value != BACKEND))
  ours = set(inspect.signature(registered.diffusers_attention).parameters)
  assert taken <= ours, sorted(taken - ours)
  assert registry._supported_arg_names[dispatch.AttentionBackendName(BACKEND)] == ours


def test_set_diffusers_backend_refuses_processors_that_bypass_the_dispatcher(registered):
  from diffusers.models.attention_processor import Attention, AttnProcessor2_0

  model = torch.nn.Sequential(Attention(query_dim=16, heads=2, dim_head=8))
  with pytest.raises(NotImplementedError, match="AttnProcessor2_0"):
    registered.set_diffusers_backend(model)
  assert type(model[0].processor) is AttnProcessor2_0


def _qkv(batch=1, q_len=5, kv_len=7, q_heads=2, kv_heads=2, head_dim=64, dtype=torch.float32,
         seed=0):
  gen = torch.Generator().manual_seed(seed)
  q = torch.randn(batch, q_len, q_heads, head_dim, generator=gen).to(dtype)
  k, v = (torch.randn(batch, kv_len, kv_heads, head_dim, generator=gen).to(dtype)
          for _ in range(2))
  return q, k, v


BAD = {
    "additive float mask": (dict(attn_mask=torch.zeros(1, 7)), NotImplementedError,
                            "boolean key masks only"),
    "per-query mask": (dict(attn_mask=torch.ones(1, 1, 5, 7, dtype=torch.bool)),
                       NotImplementedError, "same keys for every query"),
    "3-D mask": (dict(attn_mask=torch.ones(1, 1, 7, dtype=torch.bool)), NotImplementedError,
                 "3-D masks"),
    "mask of other keys": (dict(attn_mask=torch.ones(1, 6, dtype=torch.bool)),
                           NotImplementedError, "boolean key mask of shape"),
    "dropout": (dict(dropout_p=0.1), NotImplementedError, "dropout"),
    "window": (dict(window_size=(4, 4)), NotImplementedError, "window_size"),
    "attention probs": (dict(return_attn_probs=True), NotImplementedError, "probabilities"),
    "context parallel": (dict(_parallel_config=object()), NotImplementedError,
                         "context parallelism"),
    "gqa not enabled": (dict(kv_heads=1), ValueError, "enable_gqa=True"),
    "3-D query": (dict(query_3d=True), ValueError, "4-D tensor"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_bad_input_gives_clear_error(registered, case):
  kwargs, error, match = BAD[case]
  kwargs = dict(kwargs)
  q, k, v = _qkv(kv_heads=kwargs.pop("kv_heads", 2))
  if kwargs.pop("query_3d", False):
    q = q[0]
  with pytest.raises(error, match=match):
    registered.diffusers_attention(q, k, v, **kwargs)


# ------------------------------------------------------------------ properties at these shapes
#
# tests/jax/test_flash_attention_kernel.py checks the kernel's non-causal path among many
# options, with forced small blocks. What it does not pin down is this use: non-causal
# joint attention, Sq == Skv = image + text tokens (a multiple of 64 plus an odd count:
# SD3.5 at 1024 px is 4096 + 333), or image queries over text keys (Wan's cross-attention),
# head_dim 64 and 128, a key padding mask over the text tokens (Qwen-Image), through
# Diffusers' layout [B, S, H, D] and the default tiling, with out, lse and the gradients
# of both. Lengths are scaled down (interpret mode); 1024 + 333 spans several default
# blocks with a partial last one.


def _examples(fraction):
  return max(1, round(settings.default.max_examples * fraction))


@st.composite
def joint_problems(draw):
  image = draw(st.sampled_from([64, 256, 1024]))
  text = draw(st.sampled_from([13, 77, 333]))
  cross = draw(st.booleans())
  q_len, kv_len = (image, text) if cross else (text + image, text + image)
  kv_heads = draw(st.integers(1, 3))
  return dict(batch=draw(st.integers(1, 2)), q_len=q_len, kv_len=kv_len, text=text,
              kv_heads=kv_heads, group=draw(st.sampled_from([1, 1, 2])),
              head_dim=draw(st.sampled_from([64, 128])),
              dtype=draw(st.sampled_from(["float32", "bfloat16"])),
              mask=draw(st.sampled_from([None, "text_padding"])),
              scale=draw(st.sampled_from([None, 0.3])), seed=draw(st.integers(0, 2**31 - 1)))


# (restore_active_backend is function-scoped; nothing here reads what it restores)
@settings(max_examples=_examples(0.3),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(joint_problems())
# SD3.5's structure scaled down: 1024 image + 333 text tokens, D 64, padded text keys.
@example(dict(batch=1, q_len=1357, kv_len=1357, text=333, kv_heads=2, group=1, head_dim=64,
              dtype="bfloat16", mask="text_padding", scale=None, seed=7))
def test_joint_attention_matches_reference(registered, p):
  rng = np.random.default_rng(p["seed"])
  dtype = getattr(torch, p["dtype"])
  q_heads = p["kv_heads"] * p["group"]
  q, k, v = _qkv(p["batch"], p["q_len"], p["kv_len"], q_heads, p["kv_heads"], p["head_dim"],
                 dtype, seed=p["seed"] % 2**31)
  mask = None
  if p["mask"] == "text_padding":   # Qwen-Image: text first; padding in the text tokens
    mask = torch.ones(p["batch"], p["kv_len"], dtype=torch.bool)
    mask[:, :p["text"]] = torch.from_numpy(rng.random((p["batch"], p["text"])) < 0.7)
    mask = mask[:, None, None, :]
  q, k, v = (t.requires_grad_() for t in (q, k, v))
  out, lse = registered.diffusers_attention(q, k, v, attn_mask=mask, scale=p["scale"],
                                            enable_gqa=p["group"] > 1, return_lse=True)
  assert out.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
  grad_out = torch.from_numpy(rng.standard_normal(out.shape)).to(dtype)
  grad_lse = torch.from_numpy(rng.standard_normal(lse.shape)).float()
  torch.autograd.backward((out, lse), (grad_out, grad_lse))

  to_bhsd = lambda t: _np(t.transpose(1, 2))
  segments = None
  if mask is not None:
    kv_seg = mask[:, 0, 0].to(torch.int32).numpy()
    segments = (np.ones((p["batch"], p["q_len"]), np.int32), kv_seg)
  grads = dict(dq=to_bhsd(q.grad), dk=to_bhsd(k.grad), dv=to_bhsd(v.grad), dsinks=None)
  failures = ref.attention_mismatches(
      p["dtype"], to_bhsd(q), to_bhsd(k), to_bhsd(v), to_bhsd(out), _np(lse.transpose(1, 2)),
      grads, grad_out=to_bhsd(grad_out), grad_lse=_np(grad_lse.transpose(1, 2)),
      sm_scale=p["scale"], segment_ids=segments)
  assert not failures, "\n".join([f"problem {p}", *failures.values()])


def test_causal_softcap_gqa_options_reach_the_kernel(registered):
  """The dispatcher's other arguments: is_causal (SDPA's top-left alignment, j <= i, also
  for Sq < Skv), scale, softcap and GQA, against the float64 reference."""
  q, k, v = _qkv(batch=2, q_len=21, kv_len=40, q_heads=4, kv_heads=2, seed=3)
  out, lse = registered.diffusers_attention(q, k, v, is_causal=True, scale=0.2, softcap=5.0,
                                            enable_gqa=True, return_lse=True)
  to_bhsd = lambda t: _np(t.transpose(1, 2))
  failures = ref.attention_mismatches("float32", to_bhsd(q), to_bhsd(k), to_bhsd(v),
                                      to_bhsd(out), _np(lse.transpose(1, 2)), causal=True,
                                      sm_scale=0.2, soft_cap=5.0)
  assert not failures, failures
  # softcap 0.0 is flash-attn's "none", as Diffusers' other backends read it
  plain = registered.diffusers_attention(q, k, v, softcap=0.0, enable_gqa=True)
  want = torch.nn.functional.scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), enable_gqa=True).transpose(1, 2)
  ref.assert_close(plain, want, TOL, what="softcap 0.0")


def test_dispatcher_call_compiles_fullgraph(registered, dispatch):
  """torch.compile(fullgraph=True) traces Diffusers' dispatcher into the backend (the added
  enum member, the mask's conversion to segment ids) and the kernel's custom op, with no
  graph break (a whole tiny Flux compiled fullgraph also matched native once, 50 s: too
  slow for the suite)."""
  q, k, v = _qkv(batch=2, q_len=77, kv_len=77, seed=4)
  mask = torch.ones(2, 1, 1, 77, dtype=torch.bool)
  mask[1, ..., 3:9] = False
  member = dispatch.AttentionBackendName(BACKEND)

  def attend(q, k, v, mask):
    return dispatch.dispatch_attention_fn(q, k, v, attn_mask=mask, backend=member)

  got = torch.compile(attend, fullgraph=True)(q, k, v, mask)
  want = torch.nn.functional.scaled_dot_product_attention(
      q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask).transpose(1, 2)
  ref.assert_close(got, want, TOL, what="compiled dispatch")
