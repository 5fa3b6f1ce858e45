"""Every op of the six kernels through the real TorchTPU 0.2.0 `jax_op`, on "tpu" tensors,
as far as the wheel goes without a chip.

For each JaxKernel of each built package (walked from its `_custom_ops` module, not
listed by hand) the shim builds the TPU op with the real `torch.tpu.pallas.jax_op`, and:

  * its inferred schema must carry the public op's tensors and statics, plus `chip` and
    `interpret` (test_inferred_schema_matches_the_public_op);
  * the public API, called on FakeTensors on device "tpu" in every combination the torch
    layer sends (absent / present bias and scales, int8 / fp8 weights, sinks, segment ids,
    q_offset as a tensor, page tables, the KV-cache writes; forward and backward), runs
    its own torch layer and the shim into the wheel's fake, which `jax.export`s the kernel
    for platform "tpu" (Mosaic `tpu_custom_call` inside); the outputs and gradients must
    have the shapes and dtypes our own fakes give (test_public_api_through_the_real_jax_op);
  * the cases together reach every JaxKernel (test_cases_reach_every_jax_kernel);
  * the ops that update a tensor in place (the KV-cache writes, the conv state, the
    gated delta rule's decode state) donate it: the exported program aliases it to its
    output and the device call is asked to donate it.

How the torch layer is made to reach the wheel under FakeTensorMode: a custom op's fake
runs instead of its implementation there, so for the run through TorchTPU each public
op's fake is pointed at its own implementation (`recording_public_ops(kernel, through_tpu=True)`). The run
with our fakes is the package as shipped.

Backward: torch's autograd engine cannot run on "tpu" tensors here (it sizes its device
queues by the TPU count, which asks the TPU runtime: 0 devices, an internal assert). So
each case's forward records the public ops it called, and `backward_by_hand` applies
each op's own registered autograd formula (its setup_context and backward, exactly the
code autograd runs) to ones-like output gradients; the backward ops it calls go through
TorchTPU as the forward ops do.
"""

from __future__ import annotations

import contextlib
import inspect
import sys

import jax
import pytest
import torch
from torch._library import custom_ops
from torch._subclasses.fake_tensor import FakeTensorMode

from fake_tpu import (jax_kernels_of, ops_module_of, experts_module, on_device as _on,
                      recording_public_ops)

KERNEL_FIXTURES = ("rms", "ragged", "flash", "paged", "gdn", "conv")


class _Context:
  """What autograd hands a custom op's setup_context / backward."""

  def __init__(self, inputs):
    self.needs_input_grad = tuple(isinstance(x, torch.Tensor) for x in inputs)

  def save_for_backward(self, *tensors):
    self.saved_tensors = tensors

  def set_materialize_grads(self, value: bool):
    pass   # every output gradient is given (ones), so materialising changes nothing


def backward_by_hand(calls):
  """Applies each recorded forward op's registered autograd formula (newest first) to
  ones-like output gradients; returns every gradient tensor it produced."""
  grads = []
  for op, inputs, output in reversed(list(calls)):
    if op._backward_fn is None:
      continue
    ctx = _Context(inputs)
    op._setup_context_fn(ctx, inputs, output)
    outputs = output if isinstance(output, tuple) else (output,)
    result = op._backward_fn(ctx, *(torch.ones_like(o) for o in outputs))
    result = result if isinstance(result, tuple) else (result,)
    grads += [g for g in result if isinstance(g, torch.Tensor)]
  return grads


@pytest.fixture(autouse=True)
def chip(monkeypatch):
  """The host's chip, as a TPU host would report it (TPU_KERNELS_CHIP; the PCI route is
  tested in test_loader_on_a_tpu_host.py)."""
  monkeypatch.setenv("TPU_KERNELS_CHIP", "v6e")
  yield
  for name in list(sys.modules):
    if name.endswith("._shim.dispatch"):
      sys.modules[name].tpu_chip_name.cache_clear()


# ---------------------------------------------------------------------------------- schema

# jax_op's schema types per annotation. An int becomes "int" or "SymInt" (it depends on
# whether the parameter is positional); torch treats both alike for a static.
_SCHEMA_TYPE = {int: "int", float: "float", bool: "bool", str: "str"}


def _normal(schema_type: str) -> str:
  """A schema type with optional-ness and SymInt folded: Tensor? -> Tensor, SymInt -> int."""
  if schema_type.startswith("Optional["):
    schema_type = schema_type[len("Optional["):-1]
  return schema_type.rstrip("?").replace("SymInt", "int")


@pytest.mark.parametrize("fixture", KERNEL_FIXTURES)
def test_inferred_schema_matches_the_public_op(fixture, request, boundary):
  kernel = request.getfixturevalue(fixture)
  kernels = jax_kernels_of(kernel)
  assert kernels
  for qualname, k in kernels.items():
    tpu_op = k._tpu_op
    schema = tpu_op._opoverload._schema
    assert str(schema.name) == f"{qualname}_tpu_jax"
    params = inspect.signature(k.fn, eval_str=True).parameters
    inferred = {a.name: _normal(str(a.type)) for a in schema.arguments}
    assert list(inferred) == list(params), qualname
    for name, p in params.items():
      expected = "Tensor" if p.annotation is jax.Array else _SCHEMA_TYPE[p.annotation]
      assert inferred[name] == expected, (qualname, name, inferred[name])
    assert inferred["chip"] == "str" and inferred["interpret"] == "bool"
    # Against the public op: each of its arguments reaches the kernel under its own name,
    # an optional tensor (Tensor?) as a Tensor (an absent one is a (0,) placeholder).
    public = custom_ops.OPDEFS[qualname]._opoverload._schema
    for a in public.arguments:
      assert inferred[a.name] == _normal(str(a.type)), (qualname, a.name, str(a.type))
    assert all(a.name in inferred for a in public.arguments), qualname
    # jax_op declares no mutation and aliases nothing; donation is by donate_argnums.
    assert not any(a.alias_info for a in schema.arguments), qualname


# ---------------------------------------------------------------------------------- cases
#
# Each case calls the public API with tensors made by `t(shape, dtype)` on one device and
# returns the tensors to compare (outputs, then gradients when it runs backward).


def _routing(t, tokens=16, top_k=2):
  return t((tokens, top_k), torch.int64), t((tokens, top_k), torch.float32)


def _rms(k, t, fused):
  x, w = t((8, 256), torch.bfloat16), t((256,), torch.float32)
  if fused:
    return list(k.fused_add_rms_norm(x, t((8, 256), torch.bfloat16), w, 1e-6, offset=1.0))
  return [k.rms_norm(x, w, 1e-6)]


def _ragged_dot(k, t, *, quantized=None, bias=False, lhs_quant=None):
  lhs = t((64, 128), torch.bfloat16)
  rhs = t((4, 256, 128), quantized or torch.bfloat16)
  kwargs = dict(transpose_rhs=True, lhs_quant=lhs_quant)
  if quantized:
    kwargs["rhs_scale"] = t((4, 256), torch.float32)
  if bias:
    kwargs["bias"] = t((4, 256), torch.bfloat16)
  return [k.ragged_dot(lhs, rhs, t((4,), torch.int32), **kwargs)]


def _experts(k, t, kind, *, quantized=None, lhs_quant=None):
  m = experts_module(kind, t, quantized=quantized)
  m.lhs_quant = lhs_quant   # quantize_experts_(..., activations="int8") sets it
  index, weights = _routing(t)
  return [k.experts_forward(m, t((16, 128), torch.float32), index, weights)]


def _flash(k, t, **features):
  q = t((2, 4, 256, 128), torch.bfloat16)
  kv = [t((2, 2, 256, 128), torch.bfloat16) for _ in range(2)]
  if "sinks" in features:
    features["sinks"] = t((4,), torch.float32)
  if "segment_ids" in features:
    features["segment_ids"] = t((2, 256), torch.int32)
  if features.get("q_offset") == "tensor":
    features["q_offset"] = t((), torch.int32)
  return list(k.flash_attention(q, *kv, return_lse=True, **features))


PAGES, HKV, PAGE, D = 16, 2, 16, 128


def _paged(k, t, *, cache_dtype=torch.bfloat16, **features):
  q = t((32, 4, D), torch.bfloat16)
  caches = [t((PAGES, HKV, PAGE, D), cache_dtype) for _ in range(2)]
  scales = {}
  if cache_dtype in (torch.int8, torch.float8_e4m3fn):
    scales = dict(k_scale=t((HKV,), torch.float32), v_scale=t((HKV,), torch.float32))
  if "sinks" in features:
    features["sinks"] = t((4,), torch.float32)
  out = k.ragged_paged_attention(q, *caches, t((4,), torch.int32), t((4, 4), torch.int32),
                                 t((5,), torch.int32), **scales, **features)
  return [out]


def _write(k, t, *, cache_dtype=torch.bfloat16):
  caches = [t((PAGES, HKV, PAGE, D), cache_dtype) for _ in range(2)]
  new_dtype = torch.bfloat16 if cache_dtype in (torch.int8, torch.float8_e4m3fn) else cache_dtype
  scales = {}
  if new_dtype is not cache_dtype:
    scales = dict(k_scale=t((HKV,), torch.float32), v_scale=t((HKV,), torch.float32))
  k.write_kv_cache_(*caches, t((8, HKV, D), new_dtype), t((8, HKV, D), new_dtype),
                    t((8,), torch.int32), **scales)
  return caches


def _write_pages(k, t, *, cache_dtype=torch.bfloat16):
  """One cache holding K and V pages (continuous batching's layout): K and V rows in one
  call."""
  cache = t((PAGES, HKV, PAGE, D), cache_dtype)
  quantized = cache_dtype in (torch.int8, torch.float8_e4m3fn)
  rows = t((16, HKV, D), torch.bfloat16 if quantized else cache_dtype)
  scale = dict(scale=t((HKV,), torch.float32)) if quantized else {}
  k.write_kv_pages_(cache, rows, t((16,), torch.int32), **scale)
  return [cache]


def _rms_gated(k, t):
  x = t((64, 128), torch.bfloat16)
  return [k.rms_norm_gated(x, t((64, 128), torch.bfloat16), t((128,), torch.float32), 1e-6)]


# Gated DeltaNet at a model's head dim: 2 key heads and 4 value heads of 128.
GDN_HK, GDN_HV, GDN_D = 2, 4, 128


def _gdn_inputs(t, batch, seq):
  return [t((batch, seq, GDN_HK, GDN_D), torch.bfloat16) for _ in range(2)] + [
      t((batch, seq, GDN_HV, GDN_D), torch.bfloat16), t((batch, seq, GDN_HV), torch.float32),
      t((batch, seq, GDN_HV), torch.bfloat16)]


def _gdn(k, t, function, *, seq, packed=False):
  """A hub function with an initial state and the final state (packed: 2 sequences)."""
  batch, states = (1, 2) if packed else (2, 2)
  q, kk, v, g, beta = _gdn_inputs(t, batch, seq)
  o, final = getattr(k, function)(
      q, kk, v, g=g, beta=beta, initial_state=t((states, GDN_HV, GDN_D, GDN_D), torch.float32),
      output_final_state=True, use_qk_l2norm_in_kernel=True,
      cu_seqlens=t((3,), torch.int32) if packed else None)
  return [o, final]


def _gdn_in_place(k, t):
  state = t((2, GDN_HV, GDN_D, GDN_D), torch.float32)
  o = k.fused_recurrent_gated_delta_rule_(*_gdn_inputs(t, 2, 1), state,
                                          use_qk_l2norm_in_kernel=True)
  return [o, state]


CONV_D = 256


def _conv(k, t, *, packed=False, channels_last=False):
  """causal_conv1d_fn, width 4 with a bias; channels_last: x as the transposed view of a
  contiguous [B, T, D], as Transformers' layers hand it over."""
  x = (t((1, 64, CONV_D), torch.bfloat16).transpose(1, 2) if channels_last
       else t((1, CONV_D, 64), torch.bfloat16))
  packing = dict(cu_seq_lens_q=t((3,), torch.int32)) if packed else {}
  return [k.causal_conv1d_fn(x, t((CONV_D, 4), torch.bfloat16), t((CONV_D,), torch.bfloat16),
                             activation="silu", **packing)]


def _conv_update(k, t):
  state = t((8, CONV_D, 4), torch.bfloat16)
  out = k.causal_conv1d_update(t((8, CONV_D, 1), torch.bfloat16), state,
                               t((CONV_D, 4), torch.bfloat16), None, "silu")
  return [out, state]


CASES = {
    # name: (kernel fixture, case, run the backward too)
    "rms_norm": ("rms", lambda k, t: _rms(k, t, False), True),
    "fused_add_rms_norm": ("rms", lambda k, t: _rms(k, t, True), True),
    "ragged_dot": ("ragged", lambda k, t: _ragged_dot(k, t), True),
    "ragged_dot bias": ("ragged", lambda k, t: _ragged_dot(k, t, bias=True), True),
    "ragged_dot int8": ("ragged", lambda k, t: _ragged_dot(k, t, quantized=torch.int8), True),
    "ragged_dot fp8": ("ragged", lambda k, t: _ragged_dot(k, t, quantized=torch.float8_e4m3fn),
                       True),
    # int8 activations too: inference only (its backward raises by design)
    "ragged_dot w8a8": ("ragged", lambda k, t: _ragged_dot(k, t, quantized=torch.int8,
                                                           lhs_quant="int8"), False),
    "experts silu": ("ragged", lambda k, t: _experts(k, t, "silu"), True),
    "experts gpt_oss (bias, clamped gate)": ("ragged", lambda k, t: _experts(k, t, "gpt_oss"),
                                             True),
    "experts no_gate": ("ragged", lambda k, t: _experts(k, t, "no_gate"), True),
    "experts int8": ("ragged", lambda k, t: _experts(k, t, "silu", quantized=torch.int8), True),
    # int8 activations too: inference only (its backward raises by design)
    "experts w8a8": ("ragged", lambda k, t: _experts(k, t, "silu", quantized=torch.int8,
                                                     lhs_quant="int8"), False),
    "experts fp8 gpt_oss": ("ragged", lambda k, t: _experts(
        k, t, "gpt_oss", quantized=torch.float8_e4m3fn), True),
    "flash": ("flash", lambda k, t: _flash(k, t), True),
    "flash causal": ("flash", lambda k, t: _flash(k, t, causal=True), True),
    "flash window soft-cap sinks segments q_offset tensor": ("flash", lambda k, t: _flash(
        k, t, causal=True, sliding_window=64, soft_cap=30.0, sinks=True, segment_ids=True,
        q_offset="tensor"), True),
    # paged attention is forward-only (its backward raises by design)
    "paged": ("paged", lambda k, t: _paged(k, t), False),
    "paged window soft-cap sinks": ("paged", lambda k, t: _paged(
        k, t, sliding_window=64, soft_cap=30.0, sinks=True), False),
    "paged int8 cache": ("paged", lambda k, t: _paged(k, t, cache_dtype=torch.int8), False),
    "paged fp8 cache": ("paged", lambda k, t: _paged(k, t, cache_dtype=torch.float8_e4m3fn),
                        False),
    "write_kv_cache": ("paged", lambda k, t: _write(k, t), False),
    "write_kv_cache int8": ("paged", lambda k, t: _write(k, t, cache_dtype=torch.int8), False),
    "write_kv_cache fp8": ("paged", lambda k, t: _write(k, t, cache_dtype=torch.float8_e4m3fn),
                           False),
    "write_kv_pages": ("paged", lambda k, t: _write_pages(k, t), False),
    "write_kv_pages int8": ("paged", lambda k, t: _write_pages(k, t, cache_dtype=torch.int8),
                            False),
    "write_kv_pages fp8": ("paged", lambda k, t: _write_pages(
        k, t, cache_dtype=torch.float8_e4m3fn), False),
    "rms_norm_gated": ("rms", _rms_gated, True),
    "chunk_gated_delta_rule": ("gdn", lambda k, t: _gdn(k, t, "chunk_gated_delta_rule",
                                                         seq=70), True),
    "chunk_gated_delta_rule packed": ("gdn", lambda k, t: _gdn(
        k, t, "chunk_gated_delta_rule", seq=70, packed=True), True),
    "fused_recurrent_gated_delta_rule": ("gdn", lambda k, t: _gdn(
        k, t, "fused_recurrent_gated_delta_rule", seq=1), True),
    # the in-place decode has no gradient (by design)
    "fused_recurrent_gated_delta_rule_ (in place)": ("gdn", _gdn_in_place, False),
    "causal_conv1d_fn": ("conv", lambda k, t: _conv(k, t), True),
    "causal_conv1d_fn packed channels-last": ("conv", lambda k, t: _conv(
        k, t, packed=True, channels_last=True), True),
    # the in-place update has no gradient kernel (by design)
    "causal_conv1d_update": ("conv", _conv_update, False),
}


def _meta(tensors):
  return [None if x is None else (tuple(x.shape), x.dtype, x.device.type) for x in tensors]


def run_case(name, kernel, *, through_tpu):
  """The case on FakeTensors on "tpu", forward and (if the case has one) backward: through
  TorchTPU's jax_op, or our own fakes. Returns the outputs, then the gradients."""
  _, case, backward = CASES[name]
  with FakeTensorMode(allow_non_fake_inputs=False):
    with recording_public_ops(kernel, through_tpu=through_tpu) as calls:
      outputs = case(kernel, _on("tpu"))
      grads = backward_by_hand(calls) if backward else []
  assert not backward or grads
  return outputs + grads


_REACHED = set()


@pytest.mark.parametrize("name", CASES)
def test_public_api_through_the_real_jax_op(name, request, boundary):
  kernel = request.getfixturevalue(CASES[name][0])
  ours = _meta(run_case(name, kernel, through_tpu=False))
  assert not boundary.exported          # our fakes never reach TorchTPU
  through = _meta(run_case(name, kernel, through_tpu=True))
  assert through == ours
  assert all(m is None or m[2] == "tpu" for m in through)
  assert boundary.exported, "the torch layer never reached jax_op"
  kernels = jax_kernels_of(kernel)
  for op_name, exported in boundary.exported:
    qualname = op_name.removesuffix("_tpu_jax")
    assert qualname in kernels, op_name
    _REACHED.add(qualname)
    assert exported.platforms == ("tpu",)
    text = exported.mlir_module()
    if kernels[qualname].function not in ("write_kv_cache", "write_kv_pages"):   # XLA scatters
      assert "tpu_custom_call" in text, op_name
  # Nothing reached the device boundary: the fake path needs none.
  assert not boundary.calls


def test_cases_reach_every_jax_kernel(request):
  """After the cases above: every JaxKernel of the four packages was exported for TPU."""
  wanted = set()
  for fixture in KERNEL_FIXTURES:
    wanted |= set(jax_kernels_of(request.getfixturevalue(fixture)))
  if not _REACHED:
    pytest.fail("run with test_public_api_through_the_real_jax_op (same session)")
  assert wanted - _REACHED == set()


# ------------------------------------------------------------------ the in-place cache write


def _device_call_and_exported_main(kernel, tensors, boundary, **statics):
  """Calls a JaxKernel's TPU op on real "tpu" tensors (and its statics) up to the stubbed
  device call: (the device call's record, the signature line of the exported program's
  main, which carries its input/output aliasing)."""
  with pytest.raises(RuntimeError, match="needs a TPU"):
    kernel._tpu_op(*tensors, **statics, chip="v6e", interpret=False)
  (call,) = boundary.calls
  (_, _, program), = boundary.registered
  (_, exported), = boundary.exported
  assert exported.mlir_module_serialized == program
  main = next(line for line in exported.mlir_module().splitlines()
              if "func.func public @main" in line)
  return call, main


def test_cache_write_donates_the_caches_through_the_real_jax_op(paged, boundary):
  """write_kv_cache's TPU op is built with donate_argnums=(0, 1): the program jax_op
  exports aliases both caches to its outputs, and the device call (the stubbed boundary)
  is asked to donate them. Real "tpu" tensors here: allocated, never computed on."""
  write = ops_module_of(paged)._write
  assert write.donate_argnums == (0, 1)
  caches = [torch.empty((PAGES, HKV, PAGE, D), dtype=torch.bfloat16, device="tpu")
            for _ in range(2)]
  tensors = [*caches, torch.empty((8, HKV, D), dtype=torch.bfloat16, device="tpu"),
             torch.empty((8, HKV, D), dtype=torch.bfloat16, device="tpu"),
             torch.empty((8,), dtype=torch.int32, device="tpu"),
             torch.empty((0,), device="tpu"), torch.empty((0,), device="tpu")]
  call, main = _device_call_and_exported_main(write, tensors, boundary)
  assert call["donate_argnums"] == [0, 1]
  assert call["inputs"][0] is caches[0] and call["inputs"][1] is caches[1]   # no copies
  assert main.count("tf.aliasing_output") == 2, main
  assert "%arg0: tensor<16x2x16x128xbf16> {tf.aliasing_output = 0 : i32}" in main
  assert "%arg1: tensor<16x2x16x128xbf16> {tf.aliasing_output = 1 : i32}" in main


def test_one_cache_write_donates_the_one_cache_through_the_real_jax_op(paged, boundary):
  """write_kv_pages's TPU op is built with donate_argnums=(0,): the program jax_op exports
  aliases the one cache (input 0) to its output and nothing else, and the device call is
  asked to donate only it. So one buffer holding K and V pages is donated once (XLA
  refuses a buffer donated twice, which write_kv_cache would ask for if given it as both
  caches). Real "tpu" tensors here: allocated, never computed on."""
  write = ops_module_of(paged)._write_pages
  assert write.donate_argnums == (0,)
  cache = torch.empty((PAGES, HKV, PAGE, D), dtype=torch.bfloat16, device="tpu")
  tensors = [cache, torch.empty((16, HKV, D), dtype=torch.bfloat16, device="tpu"),
             torch.empty((16,), dtype=torch.int32, device="tpu"), torch.empty((0,), device="tpu")]
  call, main = _device_call_and_exported_main(write, tensors, boundary)
  assert call["donate_argnums"] == [0]
  assert call["inputs"][0] is cache                 # no copy
  assert main.count("tf.aliasing_output") == 1, main
  assert "%arg0: tensor<16x2x16x128xbf16> {tf.aliasing_output = 0 : i32}" in main


def _tpu(shape, dtype=torch.bfloat16):
  return torch.empty(shape, dtype=dtype, device="tpu")


def test_conv_update_donates_the_conv_state_through_the_real_jax_op(conv, boundary):
  """causal_conv1d_update's TPU op is built with donate_argnums=(1,): the exported program
  aliases the conv state (input 1) to its new-state output (output 1), and the device call
  is asked to donate it alone. Real "tpu" tensors: allocated, never computed on."""
  update = ops_module_of(conv)._update
  assert update.donate_argnums == (1,)
  state = _tpu((8, CONV_D, 4))
  tensors = [_tpu((8, CONV_D, 1)), state, _tpu((CONV_D, 4)), _tpu((0,), torch.float32)]
  call, main = _device_call_and_exported_main(update, tensors, boundary, activation="silu")
  assert call["donate_argnums"] == [1] and call["inputs"][1] is state   # no copy
  assert main.count("tf.aliasing_output") == 1, main
  assert f"%arg1: tensor<8x{CONV_D}x4xbf16> {{tf.aliasing_output = 1 : i32}}" in main, main


def test_gdn_decode_donates_the_state_through_the_real_jax_op(gdn, boundary):
  """fused_recurrent_gated_delta_rule_'s TPU op is built with donate_argnums=(5,): the
  exported program aliases the float32 state (input 5) to its new-state output (output 1),
  and the device call is asked to donate it alone."""
  in_place = ops_module_of(gdn)._in_place
  assert in_place.donate_argnums == (5,)
  state = _tpu((2, GDN_HV, GDN_D, GDN_D), torch.float32)
  tensors = [_tpu((2, 1, GDN_HK, GDN_D)), _tpu((2, 1, GDN_HK, GDN_D)),
             _tpu((2, 1, GDN_HV, GDN_D)), _tpu((2, 1, GDN_HV), torch.float32),
             _tpu((2, 1, GDN_HV)), state, _tpu((0,), torch.int32)]
  call, main = _device_call_and_exported_main(
      in_place, tensors, boundary, scale=GDN_D ** -0.5, use_qk_l2norm_in_kernel=True,
      max_seqlen=1)
  assert call["donate_argnums"] == [5] and call["inputs"][5] is state   # no copy
  assert main.count("tf.aliasing_output") == 1, main
  assert (f"%arg5: tensor<2x{GDN_HV}x{GDN_D}x{GDN_D}xf32> {{tf.aliasing_output = 1 : i32}}"
          in main), main


# ------------------------------------------------------------------------ torch.compile


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_torch_compile_fullgraph_traces_the_public_ops(rms, flash, dynamic, boundary):
  """torch.compile(fullgraph=True) of a block calling two public ops on "tpu" FakeTensors
  traces without a graph break, each op opaque in the graph. Static shapes: the ops'
  fakes are pointed at their implementations, so tracing goes through TorchTPU's jax_op
  fake (a jax.export per op). Dynamic shapes: the package's own fakes (TorchTPU's fake
  rejects symbolic shapes; at run time the shapes are concrete and it exports then)."""
  graphs = []

  def recording_backend(gm, example_inputs):
    graphs.append(gm)
    return gm

  def block(x, w, q, k, v):
    return rms.rms_norm(x, w, 1e-6), flash.flash_attention(q, k, v, causal=True)

  compiled = torch.compile(block, fullgraph=True, dynamic=dynamic, backend=recording_backend)
  with FakeTensorMode(allow_non_fake_inputs=False) as mode:
    t = _on("tpu")
    args = (t((8, 256), torch.bfloat16), t((256,), torch.float32),
            t((1, 4, 256, 128), torch.bfloat16), t((1, 2, 256, 128), torch.bfloat16),
            t((1, 2, 256, 128), torch.bfloat16))
    with contextlib.ExitStack() as stack:
      if not dynamic:
        for kernel in (rms, flash):
          stack.enter_context(recording_public_ops(kernel, through_tpu=True))
      out, attn = compiled(*args)
  assert (tuple(out.shape), out.dtype) == ((8, 256), torch.float32)
  assert tuple(attn.shape) == (1, 4, 256, 128) and attn.device.type == "tpu"
  (gm,) = graphs
  targets = {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}
  assert any(t.endswith("rms_norm.default") for t in targets), targets
  assert any(t.endswith("flash_attention.default") for t in targets), targets
  exported = {name.split("::")[1] for name, _ in boundary.exported}
  assert exported == (set() if dynamic else {"rms_norm_tpu_jax", "flash_attention_tpu_jax"})
