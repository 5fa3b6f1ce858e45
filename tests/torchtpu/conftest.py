"""The real TorchTPU 0.2.0 wheel (torch-tpu, in .venv-torchtpu), imported never autoloaded,
network cut by the runner. Run only there: `scripts/test.sh` leg 3.

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

from torch_tpu._internal.pallas import pallas as torch_tpu_pallas  # noqa: E402

# What TorchTPU's device initialisation does first on a TPU host (_loader._init_device):
# name PrivateUse1 "tpu", so that "tpu" is a device string. Nothing touches the runtime.
if torch._C._get_privateuse1_backend_name() != "tpu":
  torch.utils.rename_privateuse1_backend("tpu")

from fake_tpu import Boundary, current_boundaries as _current  # noqa: E402


@pytest.fixture
def boundary(monkeypatch):
  """Records jax_op's exports; stubs the native calls that need a device (see module doc)."""
  record = Boundary()
  native = torch_tpu_pallas.tpu_torch_pallas

  def register_custom_kernel(name, kernel_key, *, serialized_mlir_module):
    record.registered.append((name, kernel_key, serialized_mlir_module))

  def call_custom_kernel(name, kernel_key, *, inputs, output_shapes, donate_argnums=(),
                         device_assignment=()):
    record.calls.append(dict(name=name, inputs=list(inputs), output_shapes=list(output_shapes),
                             donate_argnums=list(donate_argnums)))
    raise RuntimeError("call_custom_kernel needs a TPU (stubbed in tests/torchtpu)")

  monkeypatch.setattr(native, "register_custom_kernel", register_custom_kernel)
  monkeypatch.setattr(native, "call_custom_kernel", call_custom_kernel)
  _current.append(record)
  yield record
  _current.pop()
