"""A stand-in for TorchTPU's device call, for tests of the shim's TPU branch with real data.

The real torch-tpu wheel is tested in tests/torchtpu (.venv-torchtpu): schema, fake and
export path, donation, the loader and chip detection, everything up to the device call.
What it cannot do here is run an op on "tpu" tensors with values, which the tests using
this stand-in need (which tensors the torch layer hands over, by identity and value, and
what it does with the outputs). So this stands in for exactly that: `jax_op` returns an op
that records its inputs, and the tensors are CPU tensors the shim believes are on a TPU.
"""

import sys
import types


def install_fake_torch_tpu(monkeypatch, package):
  """A stand-in for TorchTPU (no TPU, no torch_tpu here), wired into a loaded kernel
  package: `torch.tpu.pallas.jax_op` records what it is given, `get_device_name` says
  "TPU v6e", and the package's shim believes the tensors live on a TPU.

  Returns (calls, dispatch): calls["jax_op"] holds (qualname, fn) per op built,
  calls["op"] (qualname, tensors, kwargs) per call; dispatch is the package's shim module.
  The caller clears `dispatch.tpu_chip_name`'s cache when done.
  """
  import torch

  calls = {"jax_op": [], "op": []}

  def jax_op(qualname, fn, donate_argnums=None):   # the real one's signature, less mesh options
    calls["jax_op"].append((qualname, fn, donate_argnums))

    def op(*tensors, **kwargs):
      calls["op"].append((qualname, tensors, kwargs))
      return torch.zeros_like(tensors[0])
    return op

  pallas = types.ModuleType("torch.tpu.pallas")
  pallas.jax_op = jax_op
  tpu = types.ModuleType("torch.tpu")
  tpu.pallas = pallas
  tpu.get_device_name = lambda device=None: "TPU v6e"
  monkeypatch.setattr(torch, "tpu", tpu, raising=False)
  monkeypatch.setitem(sys.modules, "torch.tpu", tpu)
  monkeypatch.setitem(sys.modules, "torch.tpu.pallas", pallas)
  dispatch = sys.modules[f"{package.__name__}._shim.dispatch"]
  # Pretend the tensors live on a TPU: the only thing a CPU machine cannot provide.
  monkeypatch.setattr(dispatch, "device_type_of", lambda op, tensors: "tpu")
  monkeypatch.delenv(dispatch.CHIP_ENV_VAR, raising=False)
  dispatch.tpu_chip_name.cache_clear()
  return calls, dispatch
