"""What a user's process on a TPU host gets from `get_kernel`: run by
test_loader_on_a_tpu_host.py in a subprocess whose /sys/bus/pci/devices (and /dev/vfio)
show one faked TPU chip, with TORCH_DEVICE_BACKEND_AUTOLOAD=1 and the network cut.

    python tpu_host_probe.py probe REPO_ID [PCI_DEVICE_FILE CHIPS_JSON CHIP_OVERRIDE]
    python tpu_host_probe.py dedup JSON_ARGS

`import torch` runs torch_tpu's autoload entry point (`torch_tpu._loader:load`), as on a
TPU VM: its PCI scan finds the chip and `_init_device("tpu")` names the device "tpu". Then
`probe` loads REPO_ID with `get_kernel(..., version=1)` (LOCAL_KERNELS) and, on a TPU
host, for each chip it is shown in turn, calls the package's `rms_norm` on real "tpu"
tensors: the public API, the custom op, the shim and TorchTPU's real `jax_op` (export for
platform "tpu", `register_custom_kernel`), up to `call_custom_kernel`, the call that would
run the program on the chip, which is stubbed (fake_tpu.device_call_stubs). `dedup` loads two kernels
from the Hub cache and from LOCAL_KERNELS (see test_two_repos_loaded_twice_...). Prints one
line, "PROBE <json>".

Never print or compare a "tpu" tensor's values: reading them starts the TPU runtime, which
on this faked host would wait for a metadata server.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch   # with TORCH_DEVICE_BACKEND_AUTOLOAD=1: torch_tpu._loader.load()
from torch_tpu import _loader
from torch_tpu._internal.pallas import pallas as torch_tpu_pallas

import fake_tpu
from kernels import get_kernel, get_loaded_kernels


def _variant(module) -> str:
  return Path(module.__file__).parent.name


def _rms_norm_through_jax_op(kernel) -> dict:
  """kernel.rms_norm on real "tpu" tensors, up to the stubbed device call."""
  record = fake_tpu.Boundary()
  fake_tpu.current_boundaries.append(record)
  for name, stub in fake_tpu.device_call_stubs(record).items():
    setattr(torch_tpu_pallas.tpu_torch_pallas, name, stub)
  x = torch.empty((8, 256), dtype=torch.bfloat16, device="tpu")
  weight = torch.empty((256,), dtype=torch.bfloat16, device="tpu")
  try:
    kernel.rms_norm(x, weight, 1e-6)
    stopped = None
  except RuntimeError as e:
    stopped = str(e)
  finally:
    fake_tpu.current_boundaries.pop()
  (call,) = record.calls
  (name, program), = record.exported
  (_, _, registered), = record.registered
  return {
      "stopped": stopped,
      "exported": name, "platforms": list(program.platforms),
      "mosaic": "tpu_custom_call" in program.mlir_module(),
      "program_sha256": hashlib.sha256(program.mlir_module_serialized).hexdigest(),
      "registered_is_exported": registered == program.mlir_module_serialized,
      "called": call["name"],
      "inputs_are_the_tensors": [a is b for a, b in zip(call["inputs"], (x, weight))],
      "outputs": [(list(o.shape), str(o.dtype), o.device.type) for o in call["output_shapes"]],
  }


def probe(repo_id: str, pci_device_file: str | None = None, chips_json: str = "[]",
          chip_override: str | None = None) -> dict:
  """get_kernel(repo_id, version=1) on this host; then, if it has a TPU, for each PCI
  device id of `chips_json` in turn (written to `pci_device_file`, the faked device's
  `device` file as the parent laid it out, which this process sees under
  /sys/bus/pci/devices): the device name torch_tpu reads, the shim's chip (or its error)
  and, for a supported chip, rms_norm through the real jax_op; then the chip with
  TPU_KERNELS_CHIP=chip_override."""
  accelerator = torch.accelerator.current_accelerator()
  out = {"device_initialised": _loader._LOADED,
         "accelerator": accelerator.type if accelerator is not None else None}
  kernel = get_kernel(repo_id, version=1)
  (loaded,) = [k for k in get_loaded_kernels() if k.module is kernel]
  out["variant"] = _variant(kernel)
  out["metadata_backend"] = str(loaded.metadata.backend.backend_type)
  if accelerator is None:
    return out
  dispatch = sys.modules[f"{kernel.__name__}._shim.dispatch"]
  out["chips"] = {}
  for device_id in json.loads(chips_json):
    Path(pci_device_file).write_text(device_id + "\n")
    dispatch.tpu_chip_name.cache_clear()       # the shim asks once per process; ask again
    seen = out["chips"][device_id] = {"device_name": torch.tpu.get_device_name()}
    try:
      seen["chip"] = dispatch.tpu_chip_name()
    except ValueError as e:
      seen["chip_error"] = str(e)
      continue
    seen["rms_norm"] = _rms_norm_through_jax_op(kernel)
  if chip_override:
    os.environ[dispatch.CHIP_ENV_VAR] = chip_override
    dispatch.tpu_chip_name.cache_clear()
    out["chip_overridden"] = dispatch.tpu_chip_name()
  return out


def dedup(args: dict) -> dict:
  """Each of two repos loaded from the Hub cache (HF_HUB_CACHE, or KERNELS_CACHE when set,
  offline: `version=1` through refs/v1) and from LOCAL_KERNELS, in opposite orders, then
  an edited copy of each with the same id; and a copy whose files no longer match its
  digest. args: {"rms": {"repo_id", "local", "edited", "tampered"}, "paged": {"repo_id",
  "local", "edited_cache"}}."""
  def hub(cache=None):
    os.environ.pop("LOCAL_KERNELS", None)
    if cache:
      os.environ["KERNELS_CACHE"] = cache
    else:
      os.environ.pop("KERNELS_CACHE", None)

  def local(repo_id, path):
    os.environ["LOCAL_KERNELS"] = f"{repo_id}={path}"

  def load(repo_id):
    try:
      module = get_kernel(repo_id, version=1)
    except RuntimeError as e:
      return None, str(e)
    return module, None

  rms, paged = args["rms"], args["paged"]
  out = {}
  hub()
  first, _ = load(rms["repo_id"])                          # rms: the Hub cache first
  local(rms["repo_id"], rms["local"])
  second, _ = load(rms["repo_id"])
  local(rms["repo_id"], rms["edited"])
  _, edited_error = load(rms["repo_id"])
  local(rms["repo_id"], rms["tampered"])
  _, tampered_error = load(rms["repo_id"])
  out["rms"] = {"first": first.__file__, "second_is_first": second is first,
                "edited_error": edited_error, "tampered_error": tampered_error}
  local(paged["repo_id"], paged["local"])
  first, _ = load(paged["repo_id"])                        # paged: LOCAL_KERNELS first
  hub()
  second, _ = load(paged["repo_id"])
  hub(paged["edited_cache"])
  _, edited_error = load(paged["repo_id"])
  out["paged"] = {"first": first.__file__, "second_is_first": second is first,
                  "edited_error": edited_error}
  # kernels' registry: one entry per variant folder loaded, with the commit for a Hub one.
  out["loaded"] = sorted((k.metadata.id, str(k.repo_info.revision) if k.repo_info else "")
                         for k in get_loaded_kernels())
  return out


if __name__ == "__main__":
  mode, *rest = sys.argv[1:]
  result = probe(*rest) if mode == "probe" else dedup(json.loads(rest[0]))
  print("PROBE " + json.dumps(result), flush=True)
