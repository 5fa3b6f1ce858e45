"""The shim's TPU branch, wired to a stand-in for TorchTPU's device call (torch_tpu_stand_in.py).

What this shows: on "tpu" tensors the shim asks TorchTPU for the chip outside any
trace, builds one `jax_op` per kernel entry point from the typed JAX function (once),
and calls it with the statics, the detected chip and interpret=False. What it cannot
show: that TorchTPU compiles and runs it; that needs a TPU. The real wheel's jax_op, its
fake and export, and chip detection through torch.tpu.get_device_name() are tested in
tests/torchtpu.
"""

import importlib
import inspect
import sys

import jax
import pytest
import torch

from torch_tpu_stand_in import install_fake_torch_tpu


@pytest.fixture
def fake_torch_tpu(monkeypatch, rms):
  calls, dispatch = install_fake_torch_tpu(monkeypatch, rms)
  yield calls, dispatch
  dispatch.tpu_chip_name.cache_clear()


def test_tpu_branch_calls_jax_op_with_chip_and_statics(rms, fake_torch_tpu):
  calls, dispatch = fake_torch_tpu
  ops = sys.modules[f"{rms.__name__}._custom_ops"]
  kernel = dispatch.JaxKernel(ops._forward.qualname + "_probe", f"{rms.__name__}._jax_functions",
                              "rms_norm_forward", cpu_chip="v6e")
  x, w = torch.randn(4, 128), torch.randn(128)
  for _ in range(2):
    kernel({"x": x, "weight": w}, eps=1e-5, offset=1.0)
  assert len(calls["jax_op"]) == 1  # built once, lazily
  qualname, fn, donate_argnums = calls["jax_op"][0]
  assert donate_argnums is None
  assert qualname.endswith("::rms_norm_probe_tpu_jax") and qualname.startswith("_rms_norm_tpu_v1_")
  assert len(calls["op"]) == 2
  _, tensors, kwargs = calls["op"][0]
  assert tensors[0] is x and tensors[1] is w  # no copies on the TPU path
  assert kwargs == dict(eps=1e-5, offset=1.0, chip="v6e", interpret=False)
  # jax_op's contract: every parameter annotated; tensors as jax.Array, statics as POD types.
  signature = inspect.signature(fn, eval_str=True)
  for name, param in signature.parameters.items():
    assert param.annotation in (jax.Array, float, str, bool), name
  assert signature.return_annotation is jax.Array


def test_every_entry_point_satisfies_jax_op_contract(rms):
  functions = importlib.import_module(f"{rms.__name__}._jax_functions")
  for name in ("rms_norm_forward", "fused_add_rms_norm_forward", "rms_norm_backward",
               "fused_add_rms_norm_backward"):
    signature = inspect.signature(getattr(functions, name), eval_str=True)
    params = signature.parameters
    assert {"chip", "interpret"} <= set(params)
    assert all(p.annotation in (jax.Array, float, str, bool) for p in params.values()), name
    assert signature.return_annotation in (jax.Array, tuple[jax.Array, jax.Array]), name
