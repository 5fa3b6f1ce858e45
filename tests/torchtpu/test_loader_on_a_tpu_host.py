"""What `get_kernel` loads beside the real TorchTPU 0.2.0 wheel, and how the shim learns the chip.

kernels 0.17.2 picks the `torch-tpu` build variant only if `torch.backends.tpu` exists;
torch-tpu 0.2.0 never sets it (not with autoload off, nor in its autoload entry point,
which only initialises a device the PCI scan finds). So a TPU host is served `torch-cpu`.
Both variants ship the same package, whose shim dispatches on the tensors' device, so
"tpu" tensors still go to TorchTPU's jax_op (test_real_jax_op.py runs the packages loaded
here, by get_kernel, through the real jax_op).

Chip detection goes through the real `torch.tpu.get_device_name()`, which reads PCI ids
from /sys/bus/pci/devices. The only thing faked is that directory: a subprocess in its
own mount namespace (and no network) sees a directory with one Google device bind-mounted
over it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_picks_the_cpu_variant_which_dispatches_tpu_tensors(rms, ragged, flash, paged):
  import kernels.backends

  assert not hasattr(torch.backends, "tpu")           # what torch-tpu 0.2.0 leaves unset
  assert type(kernels.backends._backend()).__name__ == "CPU"
  for kernel in (rms, ragged, flash, paged):
    assert Path(kernel.__file__).parent.name == "torch-cpu", kernel.__file__
    dispatch = sys.modules[f"{kernel.__name__}._shim.dispatch"]
    assert dispatch.SUPPORTED_DEVICE_TYPES == ("cpu", "tpu")


_PROBE = """
import json, os, sys, torch, torch_tpu
from kernels import get_kernel
kernel = get_kernel(sys.argv[1], version=1)
dispatch = sys.modules[kernel.__name__ + "._shim.dispatch"]
out = {"device_name": torch.tpu.get_device_name(), "variant": os.path.basename(os.path.dirname(kernel.__file__))}
try:
  out["chip"] = dispatch.tpu_chip_name()
except ValueError as e:
  out["error"] = str(e)
print("PROBE " + json.dumps(out))
"""


def _probe(tmp_path, local_kernels_env, repo_id, pci_device: str | None, chip_env=None):
  """get_kernel + the shim's tpu_chip_name() in a subprocess whose /sys/bus/pci/devices
  holds one Google (0x1ae0) device `pci_device`, or nothing."""
  pci = tmp_path / "pci"
  pci.mkdir(exist_ok=True)
  if pci_device:
    dev = pci / "0000:00:04.0"
    dev.mkdir(exist_ok=True)
    (dev / "vendor").write_text("0x1ae0\n")
    (dev / "device").write_text(pci_device + "\n")
  env = dict(os.environ, LOCAL_KERNELS=local_kernels_env)
  env.pop("TPU_KERNELS_CHIP", None)
  if chip_env:
    env["TPU_KERNELS_CHIP"] = chip_env
  script = (f"mount --bind {pci} /sys/bus/pci/devices && "
            f"exec {sys.executable} -c '{_PROBE}' {repo_id('rms-norm-tpu')}")
  done = subprocess.run(["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", script],
                        env=env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  line = next(l for l in done.stdout.splitlines() if l.startswith("PROBE "))
  return json.loads(line.removeprefix("PROBE "))


@pytest.mark.parametrize("pci_device, name, chip", [
    ("0x006f", "TPU v6e", "v6e"), ("0x0063", "TPU v5e", "v5e"), ("0x0076", "TPU v7", "v7")])
def test_chip_from_the_pci_ids_through_torch_tpu(tmp_path, local_kernels_env, repo_id,
                                                   pci_device, name, chip):
  got = _probe(tmp_path, local_kernels_env, repo_id, pci_device)
  assert got == {"device_name": name, "variant": "torch-cpu", "chip": chip}


def test_chip_env_override_and_unknown_device(tmp_path, local_kernels_env, repo_id):
  assert _probe(tmp_path, local_kernels_env, repo_id, "0x006f", chip_env="v5e")["chip"] == "v5e"
  got = _probe(tmp_path, local_kernels_env, repo_id, "0x005e")   # v4: not supported
  assert got["device_name"] == "TPU v4" and "'TPU v4' is not supported" in got["error"]
