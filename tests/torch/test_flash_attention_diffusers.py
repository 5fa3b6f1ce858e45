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
  """Each recorded op call's out and lse against the float64 reference, with the call's
  own causal flag, q_offset and segment ids."""
  for args, (out, lse) in calls:
    q, k, v, sinks, q_seg, kv_seg, offset, causal, sm_scale, window, cap, _ = args
    assert sinks is None and window == 0 and cap == 0.0
    segments = None if kv_seg is None else (q_seg.numpy(), kv_seg.numpy())
    failures = ref.attention_mismatches(dtype_name, _np(q), _np(k), _np(v), _np(out), _np(lse),
                                        sm_scale=sm_scale, segment_ids=segments,
                                        causal=causal, q_offset=int(offset[0]))
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
  assert not any(args[7] for args, _ in op_calls)      # none of these four is causal
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
                            "boolean masks only"),
    # a band (query i sees keys i + 1 ... i + 2): per query, but no key mask and causal
    "per-query mask of another pattern": (
        dict(attn_mask=torch.ones(5, 7, dtype=torch.bool).tril(2).triu(1)[None, None]),
        NotImplementedError, "pattern the kernel does not compute"),
    "per-head mask": (dict(attn_mask=torch.ones(1, 2, 5, 7, dtype=torch.bool)),
                      NotImplementedError, "differ per head"),
    "is_causal and a per-query mask": (
        dict(attn_mask=torch.ones(5, 7, dtype=torch.bool).tril(2)[None, None], is_causal=True),
        ValueError, "one or the other"),
    "flex BlockMask": (dict(block_mask=True), NotImplementedError, "QwenImage21AttnProcessor"),
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
  if kwargs.pop("block_mask", False):
    from torch.nn.attention.flex_attention import create_block_mask

    kwargs["attn_mask"] = create_block_mask(lambda b, h, i, j: j <= i, 1, None, 5, 7,
                                            device="cpu", _compile=False)
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


# ---------------------------------------------------------------- per-query (causal) masks
#
# Qwen-Image-2.1's block-causal prefill, as its default processor sends it: one call per
# prefix segment, a text segment's queries over every key up to its end, causal over its
# own keys (bottom-right: the last query sees the last key), padded text keys masked.


def _causal_mask(batch, q_len, kv_len, offset, keys):
  """bool [batch, 1, q_len, kv_len]: keys[b, j] and j <= i + offset (offset None: keys only)."""
  rows = keys[:, None, :].expand(batch, q_len, kv_len)
  if offset is not None:
    i = torch.arange(q_len)[:, None]
    rows = rows & (torch.arange(kv_len)[None, :] <= i + offset)
  return rows[:, None]


MASK_PATTERNS = {   # (q_len, kv_len, q_offset the mask means: None for a key mask)
    "text segment after an image (bottom-right)": (6, 25, 19),
    "first text segment (square)": (3, 3, 0),
    "top-left, query shorter": (6, 25, 0),
    "key mask as rows": (16, 41, None),
}


@pytest.mark.parametrize("pattern", MASK_PATTERNS, ids=list(MASK_PATTERNS))
def test_per_query_masks_reach_the_kernel_as_causal_and_segments(registered, op_calls, pattern):
  """A [B, 1, Sq, Skv] boolean mask that is a key mask AND a causal mask (bottom-right or
  top-left), or a key mask repeated per query, runs as the kernel's causal flag, q_offset
  and key segment ids: the recorded call says so, and out / lse match the float64
  reference of the mask itself (SDPA with that mask, in f64)."""
  q_len, kv_len, offset = MASK_PATTERNS[pattern]
  q, k, v = _qkv(batch=2, q_len=q_len, kv_len=kv_len, head_dim=128, seed=6)
  keys = torch.ones(2, kv_len, dtype=torch.bool)
  keys[1, 1] = False                                  # a hole and padding, row 1 only
  keys[1, min(kv_len, 2):min(kv_len, 3)] = False
  mask = _causal_mask(2, q_len, kv_len, offset, keys)
  out, lse = registered.diffusers_attention(q, k, v, attn_mask=mask, return_lse=True)
  (args, _), = op_calls
  assert args[7] == (offset is not None) and int(args[6][0]) == (offset or 0)
  want = torch.nn.functional.scaled_dot_product_attention(
      *(t.transpose(1, 2).double() for t in (q, k, v)), attn_mask=mask).transpose(1, 2)
  ref.assert_close(out, want, TOL, what=pattern)
  _check_calls_against_reference(op_calls, "float32")


QWEN21_LAYERS = 2
QWEN21_IMAGE = (1, 4, 4)        # condition and target image, latent tokens (frame, h, w)


def _qwenimage21(layers=QWEN21_LAYERS, seed=0):
  """A tiny Qwen-Image-2.1 transformer (its own config class, f32, random weights):
  `layers` blocks of 2 heads x 128 (the real head_dim)."""
  from diffusers import QwenImage21Transformer2DModel

  torch.manual_seed(seed)
  return QwenImage21Transformer2DModel(
      patch_size=1, in_channels=16, out_channels=16, num_layers=layers,
      attention_head_dim=128, num_attention_heads=2, context_in_dim=32,
      axes_dims_rope=(16, 56, 56)).eval()


def _qwenimage21_inputs(step: int, padded: bool = True) -> dict:
  """The transformer's inputs as QwenImage21Pipeline passes them at denoising step `step`
  (latents and timestep change per step, the prompt and condition image do not): a
  vision-language sequence of 3 text tokens, one condition image (4 slots of 2 x 2
  latents), 6 text tokens, then the target image's 4 slots the pipeline appends. Joint
  sequence: 3 text + 16 image + 6 text + 16 target = 41 tokens; prefix 25. padded: row 1
  of the prompt mask has a hole (text token 1) and padding (its last 2 tokens)."""
  gen = torch.Generator().manual_seed(10)
  prompt = torch.randn(di.BATCH, 13, 32, generator=gen)
  condition = torch.randn(di.BATCH, 16, 16, generator=gen)
  target = torch.randn(di.BATCH, 16, 16, generator=torch.Generator().manual_seed(20 + step))
  img_mask = torch.zeros(di.BATCH, 17, dtype=torch.bool)
  img_mask[:, 3:7] = img_mask[:, 13:] = True
  inputs = dict(hidden_states=torch.cat([condition, target], dim=1),
                encoder_hidden_states=prompt, timestep=torch.full((di.BATCH,), 0.9 - 0.3 * step),
                img_shapes=[[QWEN21_IMAGE, QWEN21_IMAGE]] * di.BATCH, img_mask=img_mask)
  if padded:
    mask = torch.ones(di.BATCH, 13, dtype=torch.bool)
    mask[1, 1] = False
    mask[1, 11:] = False
    inputs["encoder_hidden_states_mask"] = mask
  return inputs


def _qwenimage21_run(model):
  """Two denoising steps as the pipeline runs them with its KV cache: step 0 prefills
  ("extract": the block-causal prefill, caching the 25 prefix tokens' K/V per block), step
  1 decodes ("cached": the target's 16 queries over cached prefix + target keys).
  Returns (step 0 output, step 1 output, the cache)."""
  from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

  cache = QwenImage21KVCache(QWEN21_LAYERS)
  with torch.no_grad():
    first = model(**_qwenimage21_inputs(0), kv_cache=cache, kv_cache_mode="extract",
                  return_dict=False)[0]
    second = model(**_qwenimage21_inputs(1), kv_cache=cache, kv_cache_mode="cached",
                   return_dict=False)[0]
  return first, second, cache


def test_qwenimage21_kv_cache_steps_match_native(registered, op_calls):
  """Qwen-Image-2.1 (diffusers' default QwenImage21AttnProcessor), padded prompt, f32: the
  prefill step, the K/V it caches (block 1's depend on block 0's attention) and the cached
  step equal native's. Per block the prefill makes 4 kernel calls (text 0-3 causal
  square, image 3-19 over keys 0-19, text 19-25 causal at q_offset 19 over keys 0-25,
  target over all 41) and the cached step one; each is checked against the float64
  reference."""
  model = _qwenimage21()
  model.set_attention_backend("native")
  want_first, want_second, want_cache = _qwenimage21_run(model)
  assert not op_calls
  registered.set_diffusers_backend(model)
  got_first, got_second, got_cache = _qwenimage21_run(model)
  ref.assert_close(got_first, want_first, TOL, what="prefill step")
  ref.assert_close(got_second, want_second, TOL, what="cached step")
  for layer, (got, want) in enumerate(zip(got_cache.layer_caches, want_cache.layer_caches)):
    ref.assert_close(got.k, want.k, TOL, what=f"cached k, block {layer}")
    ref.assert_close(got.v, want.v, TOL, what=f"cached v, block {layer}")

  shapes = [(args[0].shape[2], args[1].shape[2], args[7], int(args[6][0]))
            for args, _ in op_calls]        # (queries, keys, causal, q_offset)
  prefill = [(3, 3, True, 0), (16, 19, False, 0), (6, 25, True, 19), (16, 41, False, 0)]
  assert shapes == prefill * QWEN21_LAYERS + [(16, 41, False, 0)] * QWEN21_LAYERS
  _check_calls_against_reference(op_calls, "float32")


def test_qwenimage21_flex_processor_is_swapped(registered, op_calls):
  """QwenImage21FlexAttnProcessor sends its prefill (a flex BlockMask) to "flex" by name,
  whatever backend is set; set_diffusers_backend swaps it for Diffusers' per-segment
  QwenImage21AttnProcessor, whose prefill equals the flex one (native flex, unpadded
  prompt, f32) on the kernel."""
  from diffusers.models.transformers.transformer_qwenimage21 import (
      QwenImage21AttnProcessor, QwenImage21FlexAttnProcessor)

  model = _qwenimage21(layers=1)
  model.set_attn_processor(QwenImage21FlexAttnProcessor())
  model.set_attention_backend("native")
  inputs = _qwenimage21_inputs(0, padded=False)
  want = _forward(model, inputs)
  assert not op_calls
  registered.set_diffusers_backend(model)
  assert all(type(m.processor) is QwenImage21AttnProcessor
             for _, m in registered.diffusers_backend._attention_modules(model))
  ref.assert_close(_forward(model, inputs), want, TOL, what="flex prefill")
  assert len(op_calls) == 4          # text, image, text, target


def _minimax_h3(seed=0):
  """A tiny MiniMax-H3 transformer (its own config class, f32, random weights): one token
  refiner block and one transformer block, 2 heads x 128 (the real head_dim; the model
  has 56), 3 x 16 rotary frequencies as the real one."""
  from diffusers import MiniMaxH3Transformer3DModel

  torch.manual_seed(seed)
  return MiniMaxH3Transformer3DModel(
      num_attention_heads=2, attention_head_dim=128, hidden_size=64, num_layers=1,
      num_refiner_layers=1, ffn_dim=64, in_channels=4, audio_in_channels=4, text_dim=32,
      freq_dim=32, time_embed_hidden_dim=64, time_embed_dim=32).eval()


def _minimax_h3_inputs() -> dict:
  """One packed sequence as the model takes it: 5 text rows, 2 frames x 2 x 3 video rows
  (the first frame a conditioning frame at t = 0), 4 audio rows: 21 rows, odd."""
  gen = torch.Generator().manual_seed(3)
  text, video, audio = 5, 12, 4
  seq = text + video + audio
  t, h, w = torch.meshgrid(torch.arange(2), torch.arange(2), torch.arange(3), indexing="ij")
  position_ids = torch.cat([torch.zeros(text, 3, dtype=torch.long),
                            torch.stack([t, h, w], -1).reshape(-1, 3) + 1,
                            torch.arange(audio)[:, None].expand(audio, 3) + 1])
  timestep_indices = torch.ones(seq, dtype=torch.long)
  timestep_indices[:text + 6] = 0                     # text and the conditioning frame
  token_tags = torch.tensor([1] * text + [0] * video + [2] * audio)
  return dict(hidden_states=torch.randn(di.BATCH, video, 16, generator=gen),
              audio_hidden_states=torch.randn(di.BATCH, audio, 4, generator=gen),
              encoder_hidden_states=torch.randn(di.BATCH, text, 32, generator=gen),
              timestep=torch.tensor([0.0, 0.6]), timestep_indices=timestep_indices,
              token_tags=token_tags, position_ids=position_ids,
              text_indices=torch.arange(text), video_indices=torch.arange(text, text + video),
              audio_indices=torch.arange(text + video, seq))


def test_minimax_h3_matches_native(registered, op_calls):
  """MiniMax-H3 (full bidirectional attention over one packed text + video + audio
  sequence, no mask), f32: video and audio outputs equal native's; one kernel call per
  attention module (refiner and block), non-causal, each checked against the float64
  reference."""
  model = _minimax_h3()
  inputs = _minimax_h3_inputs()
  model.set_attention_backend("native")
  with torch.no_grad():
    want_video, want_audio = model(**inputs, return_dict=False)
  assert registered.set_diffusers_backend(model) == BACKEND
  with torch.no_grad():
    got_video, got_audio = model(**inputs, return_dict=False)
  ref.assert_close(got_video, want_video, TOL, what="video")
  ref.assert_close(got_audio, want_audio, TOL, what="audio")
  assert len(op_calls) == _attention_module_count(registered, model) == 2
  assert not any(args[7] or args[5] is not None for args, _ in op_calls)
  _check_calls_against_reference(op_calls, "float32")
