"""The real TorchTPU 0.2.0 wheel (torch-tpu, in .venv-torchtpu), imported (never autoloaded:
its device initialisation is called below) with the network cut by the runner. Run only
there: `scripts/test.sh` leg 3.

The one boundary stubbed is the one that needs a device: the pybind functions
`torch_tpu._internal.pallas.pallas.tpu_torch_pallas.register_custom_kernel` (stores the
serialized program under a key: no device needed, so it is recorded and passed through)
and `call_custom_kernel` (runs it on the chip: recorded, never called). Everything above
them, `jax_op`'s schema inference, its fake, its `jax.export` for platform "tpu", runs
as shipped. Tensors on device "tpu" exist as FakeTensors only: a real "tpu" tensor can be
allocated here, but the first computation on one starts the TPU runtime, which looks
for a chip and a metadata server.
"""

import pytest

from kernel_repos import *  # noqa: F401,F403  (pytest finds fixtures by name)

import torch  # noqa: E402

try:
  import torch_tpu  # noqa: F401,E402
except ModuleNotFoundError as e:  # not a skip: this suite exists to run the real wheel
  raise RuntimeError("tests/torchtpu needs the real torch-tpu wheel: run it with "
                     ".venv-torchtpu/bin/python (scripts/test.sh does)") from e

from torch_tpu import _loader  # noqa: E402
from torch_tpu._internal.pallas import pallas as torch_tpu_pallas  # noqa: E402

# A TPU host, as far as torch is concerned: on one, torch_tpu's autoload entry point
# (`_loader.load`) finds the chip on the PCI bus and runs `_loader._init_device("tpu")`,
# which names PrivateUse1 "tpu" (so "tpu" is a device string and
# `torch.accelerator.current_accelerator()` is "tpu"), registers the device module and
# patches torch.compile; the TPU runtime itself starts only when something asks for it.
# There is no PCI device here for `load` to find, so this process calls what it would
# call; test_loader_on_a_tpu_host.py runs `load` itself, in a subprocess that sees a
# faked chip. kernels 0.19.1 therefore serves this process `build/torch-tpu`.
if not _loader._DEVICE_INITIALIZED:
  _loader._init_device("tpu")

from fake_tpu import Boundary, current_boundaries as _current, device_call_stubs  # noqa: E402


@pytest.fixture
def boundary(monkeypatch):
  """Records jax_op's exports; stubs the native calls that need a device (see module doc)."""
  record = Boundary()
  for name, stub in device_call_stubs(record).items():
    monkeypatch.setattr(torch_tpu_pallas.tpu_torch_pallas, name, stub)
  _current.append(record)
  yield record
  _current.pop()
