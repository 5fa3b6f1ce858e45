"""The flash-attention-tpu torch op (CPU path: DLPack + Pallas interpret mode).

Reference: the float64 NumPy attention of tests/reference.py (`attention`, and
`attention_grads` for dq, dk, dv, dsinks written out by hand), never the kernel, judged
by `reference.attention_mismatches` with the reference module's tolerances per input
dtype (|got - ref| <= atol * scale + rtol * |ref|): outputs ATTENTION_TOLERANCE, lse
ATTENTION_LSE_TOLERANCE (-inf exactly where the reference has it), gradients
ATTENTION_GRAD_TOLERANCE against `attention_grad_scales`. The reasoning behind each
number is written next to them in tests/reference.py. Rows that see no key must be exactly 0 with
lse -inf (lse = sink with sinks) and pass no gradient.
"""

import math

import numpy as np
import pytest
import torch
from torch.library import opcheck

import reference as ref

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _np(t):
  return None if t is None else t.detach().float().numpy()


def _segments(batch, length, cuts):
  """int32 [B, length]: segment k spans [cuts[k-1], cuts[k]) (shifted per row)."""
  rows = []
  for b in range(batch):
    ids = np.zeros(length, np.int32)
    for c in cuts:
      ids[min(length, c + 2 * b):] += 1
    rows.append(ids)
  return torch.tensor(np.stack(rows), dtype=torch.int32)


# Each case compiles a forward and a backward (interpret mode): keep them few and small.
CASES = {
    "mha_d64_f32": dict(h=(2, 2), s=(32, 32), d=64),
    "gqa_causal_f32": dict(h=(4, 2), s=(48, 48), d=16, causal=True),
    "mqa_causal_window_f32": dict(h=(4, 1), s=(64, 64), d=16, causal=True, window=7),
    "soft_cap_scale_f32": dict(h=(2, 1), s=(24, 40), d=16, soft_cap=1.5, sm_scale=0.6,
                               lse_grad=True),
    "sinks_window_f32": dict(h=(4, 2), s=(32, 32), d=16, causal=True, window=5, sinks=True,
                             lse_grad=True),
    "segments_causal_f32": dict(h=(2, 1), s=(40, 40), d=16, causal=True, segments="one"),
    "segments_pair_f32": dict(h=(2, 2), s=(16, 40), d=16, segments="pair", sinks=True),
    "q_offset_int_f32": dict(h=(4, 2), s=(16, 48), d=16, causal=True, window=9, q_offset=20),
    "q_offset_tensor_f32": dict(h=(4, 2), s=(16, 48), d=16, causal=True, sinks=True,
                                q_offset=torch.tensor([27], dtype=torch.int32),
                                lse_grad=True),
    "gqa_causal_window_bf16": dict(h=(4, 2), s=(48, 48), d=64, causal=True, window=16,
                                   dtype="bfloat16"),
    "all_features_bf16": dict(h=(4, 2), s=(32, 32), d=16, causal=True, window=11,
                              soft_cap=2.0, sinks=True, segments="one", dtype="bfloat16",
                              lse_grad=True),
    # A value head_dim unlike the key's (MLA: DeepSeek-V3's 192 / 128 in small; and wider,
    # as MiMo-V2-Flash): the narrower side is zero-padded for the kernel.
    "mla_v_narrower_causal_f32": dict(h=(4, 2), s=(40, 40), d=24, dv=16, causal=True,
                                      lse_grad=True),
    "v_wider_sinks_bf16": dict(h=(2, 1), s=(24, 24), d=16, dv=32, causal=True, sinks=True,
                               dtype="bfloat16"),
}


def _case_inputs(case, seed=0):
  gen = torch.Generator().manual_seed(seed)
  dtype = DTYPES[case.get("dtype", "float32")]
  (hq, hkv), (sq, skv), d, batch = case["h"], case["s"], case["d"], 2

  def leaf(*shape, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).requires_grad_()

  q, k = leaf(batch, hq, sq, d), leaf(batch, hkv, skv, d)
  v = leaf(batch, hkv, skv, case.get("dv", d))
  sinks = None
  if case.get("sinks"):
    sinks = (torch.randn(hq, generator=gen) + 1.0).to(dtype).requires_grad_()
  segment_ids = None
  if case.get("segments") == "one":
    segment_ids = _segments(batch, sq, (9, 23))
  elif case.get("segments") == "pair":
    # Keys in segments 0 / 1 / 2; queries in 0, 1 and 3 (no key has 3: fully masked rows).
    q_seg = torch.tensor([0] * 5 + [1] * 6 + [3] * (sq - 11), dtype=torch.int32)
    segment_ids = (q_seg.repeat(batch, 1), _segments(batch, skv, (12, 30)))
  return q, k, v, sinks, segment_ids


def _kwargs(case, sinks, segment_ids):
  return dict(causal=case.get("causal", False), sm_scale=case.get("sm_scale"),
              sliding_window=case.get("window"), soft_cap=case.get("soft_cap"),
              segment_ids=segment_ids, sinks=sinks, q_offset=case.get("q_offset", 0))


def _ref_kwargs(kwargs):
  out = dict(kwargs)
  out["sinks"] = _np(kwargs["sinks"])
  seg = kwargs["segment_ids"]
  if seg is not None:
    out["segment_ids"] = (tuple(s.numpy() for s in seg) if isinstance(seg, tuple)
                          else seg.numpy())
  offset = kwargs["q_offset"]
  out["q_offset"] = int(offset) if isinstance(offset, torch.Tensor) else offset
  return out


@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_backward_match_reference(flash, name):
  case = CASES[name]
  dtype_name = case.get("dtype", "float32")
  q, k, v, sinks, segment_ids = _case_inputs(case)
  kwargs = _kwargs(case, sinks, segment_ids)
  out, lse = flash.flash_attention(q, k, v, return_lse=True, **kwargs)
  assert out.shape == (*q.shape[:3], v.shape[3]) and out.dtype == q.dtype
  assert lse.shape == q.shape[:3] and lse.dtype == torch.float32

  gen = torch.Generator().manual_seed(1)
  grad_out = torch.randn(out.shape, generator=gen).to(q.dtype)
  grad_lse = torch.randn(lse.shape, generator=gen) if case.get("lse_grad") else None
  leaves = [t for t in (q, k, v, sinks) if t is not None]
  if grad_lse is None:
    got = torch.autograd.grad(out, leaves, grad_out)
  else:
    got = torch.autograd.grad((out, lse), leaves, (grad_out, grad_lse))
  for leaf, g in zip(leaves, got):
    assert g.dtype == leaf.dtype and g.shape == leaf.shape
  grads = {n: _np(g) for n, g in zip(("dq", "dk", "dv", "dsinks"), got)}
  failures = ref.attention_mismatches(dtype_name, _np(q), _np(k), _np(v), _np(out), _np(lse),
                                      grads, grad_out=_np(grad_out), grad_lse=_np(grad_lse),
                                      **_ref_kwargs(kwargs))
  assert not failures, failures


def test_rows_with_no_visible_key(flash):
  """Queries of a segment no key has, and causal queries before every key of their
  segment: out exactly 0, lse -inf (the sink's logit with sinks), no gradient, no NaN."""
  gen = torch.Generator().manual_seed(3)
  q = torch.randn(1, 2, 16, 16, generator=gen, requires_grad=True)
  k = torch.randn(1, 1, 16, 16, generator=gen, requires_grad=True)
  v = torch.randn(1, 1, 16, 16, generator=gen, requires_grad=True)
  q_seg = torch.tensor([[0] * 6 + [7] * 4 + [1] * 6], dtype=torch.int32)   # 7: no key
  kv_seg = torch.tensor([[0] * 6 + [1] * 10], dtype=torch.int32)
  masked = (q_seg[0] == 7)
  # With causal: query 10 (segment 1) sees keys 6..10, all of segment 1; no row beyond 7.
  for sinks in (None, torch.tensor([0.5, -1.0], requires_grad=True)):
    out, lse = flash.flash_attention(q, k, v, causal=True, segment_ids=(q_seg, kv_seg),
                                     sinks=sinks, return_lse=True)
    assert torch.isfinite(out).all()
    assert torch.equal(out[:, :, masked], torch.zeros_like(out[:, :, masked]))
    want_lse = (torch.full((1, 2, 4), -math.inf) if sinks is None
                else sinks.detach()[None, :, None].expand(1, 2, 4))
    assert torch.equal(lse[:, :, masked], want_lse)
    leaves = [t for t in (q, k, v, sinks) if t is not None]
    grads = torch.autograd.grad(out.sum(), leaves)
    assert all(torch.isfinite(g).all() for g in grads)
    assert torch.equal(grads[0][:, :, masked], torch.zeros_like(grads[0][:, :, masked]))
    want = ref.attention(_np(q), _np(k), _np(v), causal=True, sinks=_np(sinks),
                         segment_ids=(q_seg.numpy(), kv_seg.numpy()))[0]
    ref.assert_close(out.detach(), want, ref.ATTENTION_TOLERANCE["float32"])


def test_q_offset_compiles_once(flash, flash_ops):
  """Chunked prefill: the kernel reads q_offset at run time, so chunks at new offsets
  (ints or int32 tensors alike) reuse one compiled kernel, and give the reference's
  attention at each offset. The int 0 alone is static (zero_offset): one more compile,
  whatever the call's shapes allow (the folded causal grid where it applies)."""
  gen = torch.Generator().manual_seed(4)
  q = torch.randn(1, 2, 8, 16, generator=gen)
  k = torch.randn(1, 2, 40, 16, generator=gen)
  v = torch.randn(1, 2, 40, 16, generator=gen)
  jitted = flash_ops._forward._cpu_jit
  sizes = []
  for offset in (0, 13, 32):
    want = ref.attention(q.numpy(), k.numpy(), v.numpy(), causal=True, sliding_window=10,
                         q_offset=offset)[0]
    for given in (offset, torch.tensor(offset, dtype=torch.int32)):
      got = flash.flash_attention(q, k, v, causal=True, sliding_window=10, q_offset=given)
      ref.assert_close(got, want, ref.ATTENTION_TOLERANCE["float32"],
                       what=f"q_offset {given!r}")
      sizes.append(jitted._cache_size())
  assert sizes[1] == sizes[0] + 1, sizes    # the int 0, then the tensor 0: two compiles
  assert sizes[1:] == [sizes[1]] * 5, sizes  # every later offset reuses the tensor's


def test_self_attention_prefill_takes_the_folded_grid(flash):
  """Causal self-attention with the int offset 0 (the default) runs the kernel's folded
  grid where the tiling allows it: the reference's attention, and bit for bit what the
  rectangular grid (a tensor offset) gives."""
  import jax.numpy as jnp

  from tpu_kernels import chips, flash_attention as kernel

  gen = torch.Generator().manual_seed(6)
  q, k, v = (torch.randn(1, 2, 2048, 64, generator=gen) for _ in range(3))
  t = kernel.attention_tiling(2048, 2048, 64, group=1, dtype=jnp.float32,
                              chip=chips.DEFAULT_CHIP, causal=True)
  assert kernel._fold_causal(True, None, 0, 2048, 2048, t.block_q, t.block_k), t
  folded = flash.flash_attention(q, k, v, causal=True)
  rectangular = flash.flash_attention(q, k, v, causal=True,
                                      q_offset=torch.zeros((), dtype=torch.int32))
  torch.testing.assert_close(folded, rectangular, rtol=0, atol=0)
  want = ref.attention(q.numpy(), k.numpy(), v.numpy(), causal=True)[0]
  ref.assert_close(folded, want, ref.ATTENTION_TOLERANCE["float32"])


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(flash_ops, requires_grad):
  gen = torch.Generator().manual_seed(5)
  q = torch.randn(1, 2, 8, 16, generator=gen, requires_grad=requires_grad)
  k = torch.randn(1, 1, 16, 16, generator=gen, requires_grad=requires_grad)
  v = torch.randn(1, 1, 16, 16, generator=gen, requires_grad=requires_grad)
  sinks = torch.randn(2, generator=gen, requires_grad=requires_grad)
  q_seg = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]], dtype=torch.int32)
  kv_seg = torch.tensor([[0] * 10 + [1] * 6], dtype=torch.int32)
  offset = torch.tensor([8], dtype=torch.int32)
  opcheck(flash_ops.flash_attention_op,
          (q, k, v, sinks, q_seg, kv_seg, offset, True, 0.3, 6, 4.0, False))
  opcheck(flash_ops.flash_attention_op,
          (q, k, v, None, None, None, offset, False, 0.25, 0, 0.0, False))
  opcheck(flash_ops.flash_attention_op,   # causal self-attention at offset 0: folded grid
          (q, q, q, None, None, None, torch.zeros(1, dtype=torch.int32), True, 0.25, 0, 0.0,
           True))
  if not requires_grad:
    g, gl = torch.randn(1, 2, 8, 16, generator=gen), torch.randn(1, 2, 8, generator=gen)
    opcheck(flash_ops.flash_attention_backward_op,
            (q, k, v, sinks, q_seg, kv_seg, offset, g, gl, True, 0.3, 6, 4.0, False))
    opcheck(flash_ops.flash_attention_backward_op,
            (q, k, v, None, None, None, offset, g, None, False, 0.25, 0, 0.0, False))


def test_torch_compile_fullgraph(flash):
  def f(q, k, v, sinks, offset):
    out = flash.flash_attention(q, k, v, causal=True, sinks=sinks, q_offset=offset,
                                sliding_window=12)
    return out * 2

  compiled = torch.compile(f, fullgraph=True)
  gen = torch.Generator().manual_seed(6)
  q = torch.randn(1, 2, 8, 16, generator=gen, requires_grad=True)
  k = torch.randn(1, 1, 16, 16, generator=gen, requires_grad=True)
  v = torch.randn(1, 1, 16, 16, generator=gen, requires_grad=True)
  sinks = torch.randn(2, generator=gen, requires_grad=True)
  offset = torch.tensor([8], dtype=torch.int32)
  eager, got = f(q, k, v, sinks, offset), compiled(q, k, v, sinks, offset)
  torch.testing.assert_close(got, eager, rtol=0, atol=0)
  for a, b in zip(torch.autograd.grad(got.sum(), (q, k, v, sinks)),
                  torch.autograd.grad(eager.sum(), (q, k, v, sinks))):
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def _ok(hq=4, hkv=2, sq=8, skv=8, d=16, dtype=torch.float32):
  return (torch.randn(2, hq, sq, d, dtype=dtype), torch.randn(2, hkv, skv, d, dtype=dtype),
          torch.randn(2, hkv, skv, d, dtype=dtype))


def _seg(*shape, dtype=torch.int32):
  return torch.zeros(shape, dtype=dtype)


_BAD = [
    ("q not a tensor", lambda f: f.flash_attention(np.ones((2, 4, 8, 16), np.float32),
                                                   *_ok()[1:]),
     TypeError, "q must be a torch.Tensor"),
    ("float64", lambda f: f.flash_attention(*_ok(dtype=torch.float64)),
     TypeError, "q has dtype float64"),
    ("float16", lambda f: f.flash_attention(*_ok(dtype=torch.float16)),
     TypeError, "q has dtype float16"),
    ("k dtype", lambda f: f.flash_attention(_ok()[0], _ok()[1].bfloat16(), _ok()[2]),
     TypeError, "k must have the dtype of q"),
    ("3-d q", lambda f: f.flash_attention(_ok()[0][0], *_ok()[1:]), ValueError,
     "q must be 4-D"),
    ("v shape", lambda f: f.flash_attention(*_ok()[:2], _ok(skv=9)[2]), ValueError,
     r"v must have shape \(2, 2, 8, 16\)"),
    ("heads do not divide", lambda f: f.flash_attention(*_ok(hq=3)), ValueError,
     "3 heads must be a multiple of k's 2 heads"),
    ("head_dim", lambda f: f.flash_attention(_ok(d=32)[0], *_ok()[1:]), ValueError,
     "must have q's batch"),
    ("empty", lambda f: f.flash_attention(*_ok(sq=0)), ValueError, "no empty dimension"),
    ("window 0", lambda f: f.flash_attention(*_ok(), sliding_window=0), ValueError,
     "sliding_window must be >= 1"),
    ("window < 0", lambda f: f.flash_attention(*_ok(), sliding_window=-3), ValueError,
     "sliding_window must be >= 1"),
    ("window float", lambda f: f.flash_attention(*_ok(), sliding_window=4.0), TypeError,
     "sliding_window must be None or an int"),
    ("soft_cap 0", lambda f: f.flash_attention(*_ok(), soft_cap=0.0), ValueError,
     "soft_cap must be None or > 0"),
    ("soft_cap inf", lambda f: f.flash_attention(*_ok(), soft_cap=math.inf), ValueError,
     "soft_cap must be finite"),
    ("sm_scale nan", lambda f: f.flash_attention(*_ok(), sm_scale=math.nan), ValueError,
     "sm_scale must be finite"),
    ("causal int", lambda f: f.flash_attention(*_ok(), causal=1), TypeError,
     "causal must be a bool"),
    ("int64 segments", lambda f: f.flash_attention(*_ok(), segment_ids=_seg(2, 8,
                                                                            dtype=torch.int64)),
     TypeError, "segment_ids must be int32, got int64"),
    ("segments shape", lambda f: f.flash_attention(*_ok(), segment_ids=_seg(2, 7)),
     ValueError, r"segment_ids must have shape \(2, 8\)"),
    ("one segment tensor, Sq != Skv", lambda f: f.flash_attention(
        *_ok(skv=12), segment_ids=_seg(2, 8)), ValueError, "needs Sq == Skv"),
    ("kv segments shape", lambda f: f.flash_attention(
        *_ok(skv=12), segment_ids=(_seg(2, 8), _seg(2, 8))), ValueError,
     r"kv_segment_ids must have shape \(2, 12\)"),
    ("segments triple", lambda f: f.flash_attention(*_ok(), segment_ids=(_seg(2, 8),) * 3),
     ValueError, "a sequence of 3"),
    ("sinks shape", lambda f: f.flash_attention(*_ok(), sinks=torch.zeros(2)), ValueError,
     r"sinks must have shape \(4,\)"),
    ("sinks float64", lambda f: f.flash_attention(*_ok(), sinks=torch.zeros(4).double()),
     TypeError, "sinks has dtype float64"),
    ("q_offset < 0", lambda f: f.flash_attention(*_ok(), q_offset=-1), ValueError,
     "q_offset must be >= 0"),
    ("q_offset tensor < 0", lambda f: f.flash_attention(
        *_ok(), q_offset=torch.tensor([-2], dtype=torch.int32)), ValueError,
     "q_offset must be >= 0, got -2"),
    ("q_offset float", lambda f: f.flash_attention(*_ok(), q_offset=1.0), TypeError,
     "q_offset must be an int or an int32 tensor"),
    ("q_offset int64 tensor", lambda f: f.flash_attention(*_ok(), q_offset=torch.tensor(1)),
     TypeError, "q_offset must be int32, got int64"),
    ("q_offset two values", lambda f: f.flash_attention(
        *_ok(), q_offset=torch.tensor([1, 2], dtype=torch.int32)), ValueError,
     r"must hold one int32"),
    ("mixed devices", lambda f: f.flash_attention(_ok()[0], _ok()[1].to("meta"), _ok()[2]),
     RuntimeError, "same device"),
]


@pytest.mark.parametrize("what, call, error, message", _BAD, ids=[b[0] for b in _BAD])
def test_bad_input_gives_clear_error(flash, what, call, error, message):
  with pytest.raises(error, match=message):
    call(flash)


def test_every_entry_point_satisfies_jax_op_contract(flash, flash_ops):
  """TorchTPU's jax_op needs every parameter annotated: tensors as jax.Array, statics as
  plain types, and chip / interpret (filled in by the shim)."""
  import importlib
  import inspect

  import jax

  functions = importlib.import_module(f"{flash.__name__}._jax_functions")
  for kernel in (flash_ops._forward, flash_ops._backward):
    signature = inspect.signature(getattr(functions, kernel.function), eval_str=True)
    params = signature.parameters
    assert {"chip", "interpret"} <= set(params), kernel.function
    assert all(p.annotation in (jax.Array, int, float, str, bool) for p in params.values())
    assert all(a is jax.Array for a in signature.return_annotation.__args__), kernel.function


def test_tpu_branch_passes_placeholders_and_statics(flash, flash_ops, monkeypatch):
  """On "tpu" tensors the op goes to TorchTPU's jax_op (a stand-in here: no TPU) with (0,)
  placeholders for absent tensors (float32 sinks, int32 segment ids), q_offset as a (1,)
  int32 tensor, the statics, the chip and interpret=False."""
  import sys

  from torch_tpu_stand_in import install_fake_torch_tpu

  calls, dispatch = install_fake_torch_tpu(monkeypatch, flash)

  def jax_op(qualname, fn, donate_argnums=None):   # the forward returns (out, lse)
    def op(*tensors, **kwargs):
      calls["op"].append((qualname, tensors, kwargs))
      q = tensors[0]
      return torch.zeros_like(q), q.new_zeros(q.shape[:3])
    return op

  monkeypatch.setattr(sys.modules["torch.tpu.pallas"], "jax_op", jax_op)
  monkeypatch.setattr(flash_ops, "_forward", dispatch.JaxKernel(
      flash_ops._forward.qualname + "_probe", flash_ops._forward.module,
      flash_ops._forward.function, cpu_chip="v6e"))
  try:
    q, k, v = _ok()
    with torch.no_grad():
      flash.flash_attention(q, k, v, causal=True, sliding_window=4, q_offset=3)
      flash.flash_attention(q, k, v, soft_cap=5.0, sinks=torch.zeros(4),
                            segment_ids=_seg(2, 8), q_offset=torch.tensor(2, dtype=torch.int32))
  finally:
    dispatch.tpu_chip_name.cache_clear()
  (name, tensors, kwargs), (_, tensors2, kwargs2) = calls["op"]
  assert name.endswith("::flash_attention_probe_tpu_jax")
  assert tensors[0] is q and tensors[1] is k and tensors[2] is v   # no copies
  assert [(tuple(t.shape), t.dtype) for t in tensors[3:]] == [
      ((0,), torch.float32), ((0,), torch.int32), ((0,), torch.int32), ((1,), torch.int32)]
  assert int(tensors[6]) == 3
  assert kwargs == dict(causal=True, sm_scale=0.25, sliding_window=4, soft_cap=0.0,
                        zero_offset=False, chip="v6e", interpret=False)
  assert [tuple(t.shape) for t in tensors2[3:]] == [(4,), (2, 8), (2, 8), (1,)]
  assert int(tensors2[6]) == 2
  assert kwargs2["soft_cap"] == 5.0 and kwargs2["sliding_window"] == 0
