"""The rms-norm-tpu torch ops (CPU path: DLPack + Pallas interpret mode) against references.

Forward references: the float64 NumPy ones in tests/reference.py. Gradient references:
plain torch float64 autograd through the definition (independent of both the kernel
and the NumPy Jacobian route).
"""

import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st
from torch.library import opcheck

import reference as ref

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _definition(x, weight, eps, offset):
  """RMSNorm from its definition, in float64 torch (differentiable)."""
  x64, w64 = x.double(), weight.double()
  return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * (offset + w64)


def _leaf(shape, dtype, seed, scale=1.0):
  g = torch.Generator().manual_seed(seed)
  return (torch.randn(shape, generator=g) * scale).to(dtype).requires_grad_()


@st.composite
def cases(draw):
  lead = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
  hidden = draw(st.sampled_from([1, 64, 100, 128, 384, 1000]))
  dtype = draw(st.sampled_from(list(DTYPES)))
  return dict(shape=(*lead, hidden), dtype=dtype, offset=draw(st.sampled_from([0.0, 1.0])),
              eps=draw(st.sampled_from([1e-6, 1e-5])), seed=draw(st.integers(0, 2**31 - 1)))


@given(cases())
def test_rms_norm_forward_and_backward(rms, case):
  dtype = DTYPES[case["dtype"]]
  x = _leaf(case["shape"], dtype, case["seed"])
  w = _leaf(case["shape"][-1:], dtype, case["seed"] + 1, scale=0.1 if case["offset"] else 1.0)
  out = rms.rms_norm(x, w, case["eps"], offset=case["offset"])
  assert out.dtype == dtype and out.shape == x.shape
  ref.assert_close(out.detach().float(), ref.rms_norm(x.detach().float(), w.detach().float(),
                                                      case["eps"], case["offset"]),
                   ref.TOLERANCE[case["dtype"]], "out")

  grad = torch.randn(case["shape"], generator=torch.Generator().manual_seed(7)).to(dtype)
  dx, dw = torch.autograd.grad(out, (x, w), grad)
  x64 = x.detach().double().requires_grad_()
  w64 = w.detach().double().requires_grad_()
  dx_ref, dw_ref = torch.autograd.grad(_definition(x64, w64, case["eps"], case["offset"]),
                                       (x64, w64), grad.double())
  _, _, dx_scale, dw_scale = ref.rms_norm_grads(x64.detach(), w64.detach(), grad.double(),
                                                case["eps"], case["offset"])
  assert dx.dtype == dtype and dw.dtype == dtype
  tol = ref.GRAD_TOLERANCE[case["dtype"]]
  ref.assert_close(dx.float(), dx_ref, tol, "dx", dx_scale)
  ref.assert_close(dw.float(), dw_ref, tol, "dweight", dw_scale)


@given(cases())
def test_fused_add_rms_norm_forward_and_backward(rms, case):
  dtype = DTYPES[case["dtype"]]
  x = _leaf(case["shape"], dtype, case["seed"])
  residual = _leaf(case["shape"], dtype, case["seed"] + 2)
  w = _leaf(case["shape"][-1:], dtype, case["seed"] + 1)
  out, new_residual = rms.fused_add_rms_norm(x, residual, w, case["eps"], offset=case["offset"])
  s = ref.residual_sum(x.detach().float(), residual.detach().float(), case["dtype"])
  assert new_residual.dtype == dtype
  ref.assert_close(new_residual.detach().float(), s,
                   dict(rtol=2 * torch.finfo(dtype).eps, atol=0.0), "residual")
  ref.assert_close(out.detach().float(), ref.rms_norm(s, w.detach().float(), case["eps"],
                                                      case["offset"]),
                   ref.TOLERANCE[case["dtype"]], "out")

  g_out = torch.randn(case["shape"], generator=torch.Generator().manual_seed(3)).to(dtype)
  g_res = torch.randn(case["shape"], generator=torch.Generator().manual_seed(4)).to(dtype)
  dx, dres, dw = torch.autograd.grad((out, new_residual), (x, residual, w), (g_out, g_res))
  s64 = torch.as_tensor(s).requires_grad_()
  w64 = w.detach().double().requires_grad_()
  ds_ref, dw_ref = torch.autograd.grad(_definition(s64, w64, case["eps"], case["offset"]),
                                       (s64, w64), g_out.double())
  ds_ref = ds_ref + g_res.double()
  _, _, ds_scale, dw_scale = ref.rms_norm_grads(s, w64.detach(), g_out.double(), case["eps"],
                                                case["offset"])
  ds_scale = max(ds_scale, g_res.double().abs().max().item())
  tol = ref.GRAD_TOLERANCE[case["dtype"]]
  ref.assert_close(dx.float(), ds_ref, tol, "dx", ds_scale)
  ref.assert_close(dres.float(), ds_ref, tol, "dresidual", ds_scale)
  ref.assert_close(dw.float(), dw_ref, tol, "dweight", dw_scale)


def test_only_residual_used_downstream(rms):
  x, residual = (_leaf((3, 128), torch.float32, s) for s in (1, 2))
  w = _leaf((128,), torch.float32, 3)
  _, new_residual = rms.fused_add_rms_norm(x, residual, w)
  new_residual.sum().backward()
  assert torch.equal(x.grad, torch.ones_like(x)) and torch.equal(residual.grad, x.grad)
  assert torch.equal(w.grad, torch.zeros_like(w))


def test_mixed_weight_dtype_promotes(rms):
  x = torch.randn(4, 256, dtype=torch.bfloat16)
  w = torch.randn(256, dtype=torch.float32)
  out = rms.rms_norm(x, w)
  assert out.dtype == torch.float32
  ref.assert_close(out, ref.rms_norm(x.float(), w, 1e-6), ref.TOLERANCE["float32"], "out")


def test_non_contiguous_input(rms):
  x = torch.randn(256, 6)[::1].t()  # (6, 256) view with strides (1, 6)
  w = torch.randn(256)
  assert not x.is_contiguous()
  ref.assert_close(rms.rms_norm(x, w), ref.rms_norm(x, w, 1e-6), ref.TOLERANCE["float32"])


def test_zero_rows(rms):
  x = torch.randn(0, 5, 64)
  assert rms.rms_norm(x, torch.ones(64)).shape == (0, 5, 64)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_opcheck(rms_ops, requires_grad):
  def t(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype, requires_grad=requires_grad)
  for dtype in (torch.float32, torch.bfloat16):
    x, res, w = t(3, 5, 256, dtype=dtype), t(3, 5, 256, dtype=dtype), t(256, dtype=dtype)
    opcheck(rms_ops.rms_norm_op, (x, w, 1e-6, 0.0))
    opcheck(rms_ops.fused_add_rms_norm_op, (x, res, w, 1e-5, 1.0))
    g = torch.randn(3, 5, 256, dtype=dtype)
    opcheck(rms_ops.rms_norm_backward_op, (x.detach(), w.detach(), g, 1e-6, 0.0))
    opcheck(rms_ops.fused_add_rms_norm_backward_op,
            (x.detach(), w.detach(), g, g.clone(), 1e-6, 1.0))


@pytest.mark.parametrize("dynamic", [False, True])
def test_torch_compile_fullgraph(rms, dynamic):
  def block(x, residual, w):
    out, residual = rms.fused_add_rms_norm(x, residual, w, 1e-6)
    return rms.rms_norm(out * 2, w, 1e-5, offset=1.0), residual

  compiled = torch.compile(block, fullgraph=True, dynamic=dynamic)
  for rows in (5, 9):  # a second shape: recompiles (static) or reuses the graph (dynamic)
    x = torch.randn(rows, 256, requires_grad=True)
    residual = torch.randn(rows, 256, requires_grad=True)
    w = torch.randn(256, requires_grad=True)
    eager = block(x, residual, w)
    got = compiled(x, residual, w)
    for a, b in zip(got, eager):
      torch.testing.assert_close(a, b, rtol=0, atol=0)
    grads = torch.autograd.grad(sum(o.sum() for o in got), (x, residual, w))
    grads_eager = torch.autograd.grad(sum(o.sum() for o in eager), (x, residual, w))
    for a, b in zip(grads, grads_eager):
      torch.testing.assert_close(a, b, rtol=0, atol=0)


_BAD = [
    # (what, call, exception, message fragment)
    ("float64 x", lambda k: k.rms_norm(torch.randn(2, 8, dtype=torch.float64), torch.ones(8)),
     TypeError, "x has dtype float64.*never down-cast"),
    ("int x", lambda k: k.rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8)),
     TypeError, "x has dtype int64"),
    ("float64 weight", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.float64)),
     TypeError, "weight has dtype float64"),
    ("weight shape", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(4)),
     ValueError, r"weight must have shape \(8,\)"),
    ("weight 2-d", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(1, 8)),
     ValueError, r"weight must have shape \(8,\)"),
    ("0-d x", lambda k: k.rms_norm(torch.tensor(1.0), torch.ones(1)),
     ValueError, "x must have at least 1 dimension"),
    ("empty hidden", lambda k: k.rms_norm(torch.randn(2, 0), torch.ones(0)),
     ValueError, "non-empty last"),
    ("nan eps", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8), float("nan")),
     ValueError, "eps must be finite"),
    ("inf eps", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8), float("inf")),
     ValueError, "eps must be finite"),
    ("negative eps", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8), -1e-6),
     ValueError, "eps must be >= 0"),
    ("tensor eps", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8), torch.tensor(1e-6)),
     TypeError, "eps must be a real number"),
    ("nan offset", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8), offset=float("nan")),
     ValueError, "offset must be finite"),
    ("x not a tensor", lambda k: k.rms_norm(np.ones((2, 8), np.float32), torch.ones(8)),
     TypeError, "x must be a torch.Tensor"),
    ("residual shape", lambda k: k.fused_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8),
                                                      torch.ones(8)),
     ValueError, r"residual must have shape \(2, 8\)"),
    ("residual dtype", lambda k: k.fused_add_rms_norm(torch.randn(2, 8),
                                                      torch.randn(2, 8, dtype=torch.bfloat16),
                                                      torch.ones(8)),
     TypeError, "residual must have the dtype of x"),
    ("mixed devices", lambda k: k.rms_norm(torch.randn(2, 8), torch.ones(8, device="meta")),
     RuntimeError, "same device, got x on cpu, weight on meta"),
    ("unsupported device", lambda k: k.rms_norm(torch.randn(2, 8, device="meta"),
                                                torch.ones(8, device="meta")),
     RuntimeError, "device type 'meta'; supported: 'tpu'"),
]


@pytest.mark.parametrize("what, call, error, message", _BAD, ids=[b[0] for b in _BAD])
def test_bad_input_gives_clear_error(rms, what, call, error, message):
  with pytest.raises(error, match=message):
    call(rms)


def test_cpu_path_never_imports_torch_tpu(rms):
  rms.rms_norm(torch.randn(2, 128), torch.ones(128))
  assert "torch_tpu" not in sys.modules


def test_import_does_not_import_jax(dist_dir):
  """jax (and TorchTPU) load on the first op call, not when the kernel is imported."""
  code = (
      "import sys, pathlib; from kernels import get_local_kernel;"
      f"k = get_local_kernel(pathlib.Path({str(dist_dir / 'rms-norm-tpu')!r}));"
      "assert 'jax' not in sys.modules, 'jax imported at load';"
      "assert 'torch_tpu' not in sys.modules;"
      "import torch; k.rms_norm(torch.ones(2, 8), torch.ones(8));"
      "assert 'jax' in sys.modules and 'torch_tpu' not in sys.modules; print('ok')")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]
