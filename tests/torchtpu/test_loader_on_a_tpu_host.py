"""What `get_kernel` loads beside the real TorchTPU 0.2.0 wheel, and how the shim learns the chip.

kernels 0.19.1 picks the build variant by `torch.accelerator.current_accelerator()`: "tpu"
once PrivateUse1 is named "tpu", which torch_tpu does in `_loader._init_device`, run by its
autoload entry point (`_loader.load`) when its PCI scan finds a chip. So a TPU host is
served `build/torch-tpu`, and there the `torch-cpu` variant is rejected (a noarch variant
whose backend is not the system's); a host without a TPU is served `torch-cpu`. Both
variants ship the same package, whose shim sends "tpu" tensors to TorchTPU's `jax_op`.

The host is faked at the one place torch_tpu looks: a subprocess in its own mount
namespace (and no network) sees a directory with one Google PCI device bind-mounted over
/sys/bus/pci/devices, its `iommu_group` link, and the matching /dev/vfio/<group> (on an
overlay of /dev that only this subprocess sees), and imports torch with autoload on, as a
user's script on a TPU VM does. Chip detection then goes through the real
`torch.tpu.get_device_name()`, which reads the same PCI ids.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kernels import get_loaded_kernels, get_local_kernel

import build as build_py   # scripts/build.py: kernels' digest of a variant, as the build writes it
from kernel_repos import hub_cache_snapshot

HERE = Path(__file__).resolve().parent
PCI_DEVICE, IOMMU_GROUP = "0000:00:04.0", "7"    # the faked chip's PCI address and VFIO group


def on_a_tpu_host(host: Path, args: list[str], *, pci_device: str | None,
                  env: dict[str, str]) -> dict:
  """Runs tpu_host_probe.py `args` on a host whose PCI bus (laid out under `host`/pci)
  holds one Google (0x1ae0) device `pci_device` exposed through VFIO, or no device, with
  torch_tpu autoloaded; returns the probe's result."""
  pci, upper, work = host / "pci", host / "dev-upper", host / "dev-work"
  for d in (pci, upper, work):
    d.mkdir(parents=True, exist_ok=True)
  fake_dev = ""
  if pci_device:
    dev = pci / PCI_DEVICE
    dev.mkdir(exist_ok=True)
    (dev / "vendor").write_text("0x1ae0\n")
    (dev / "device").write_text(pci_device + "\n")
    if not (dev / "iommu_group").is_symlink():
      (dev / "iommu_group").symlink_to(f"../../../kernel/iommu_groups/{IOMMU_GROUP}")
    # torch_tpu counts a chip only if /dev/vfio/<its iommu group> exists.
    fake_dev = (f"mount -t overlay overlay -o lowerdir=/dev,upperdir={shlex.quote(str(upper))},"
                f"workdir={shlex.quote(str(work))} /dev && mkdir -p /dev/vfio && "
                f": > /dev/vfio/{IOMMU_GROUP} && ")
  script = f"mount --bind {shlex.quote(str(pci))} /sys/bus/pci/devices && {fake_dev}exec \"$@\""
  full_env = {k: v for k, v in os.environ.items()
              if k not in ("LOCAL_KERNELS", "KERNELS_CACHE", "TPU_KERNELS_CHIP")}
  full_env.update(env, TORCH_DEVICE_BACKEND_AUTOLOAD="1", HF_HUB_OFFLINE="1",
                  PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
  done = subprocess.run(["unshare", "-m", "-n", "--propagation", "private", "sh", "-c", script,
                         "sh", sys.executable, str(HERE / "tpu_host_probe.py"), *args],
                        env=full_env, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  line = next(l for l in done.stdout.splitlines() if l.startswith("PROBE "))
  return json.loads(line.removeprefix("PROBE "))


# PCI device id -> (torch_tpu's name for it, our chip; None: not supported)
CHIPS = {"0x006f": ("TPU v6e", "v6e"), "0x0063": ("TPU v5e", "v5e"),
         "0x0076": ("TPU v7", "v7"), "0x005e": ("TPU v4", None)}


@pytest.fixture(scope="module")
def tpu_host(tmp_path_factory, local_kernels_env, repo_id):
  """One process on a faked v6e host: torch imported (autoload), rms-norm-tpu loaded;
  then the chip's PCI id is changed to each of CHIPS in turn (torch_tpu reads it afresh
  each time it is asked), and finally TPU_KERNELS_CHIP=v5e set."""
  host = tmp_path_factory.mktemp("tpu-host")
  return on_a_tpu_host(host, ["probe", repo_id("rms-norm-tpu"),
                              str(host / "pci" / PCI_DEVICE / "device"), json.dumps(list(CHIPS)),
                              "v5e"],
                       pci_device="0x006f", env={"LOCAL_KERNELS": local_kernels_env})


def test_a_tpu_host_gets_the_tpu_variant(tpu_host):
  assert tpu_host["device_initialised"] and tpu_host["accelerator"] == "tpu"
  assert tpu_host["variant"] == "torch-tpu" and tpu_host["metadata_backend"] == "tpu"


@pytest.mark.parametrize("pci_device", [d for d, (_, chip) in CHIPS.items() if chip])
def test_the_tpu_variant_runs_tpu_tensors_through_the_real_jax_op(tpu_host, pci_device):
  name, chip = CHIPS[pci_device]
  seen = tpu_host["chips"][pci_device]
  assert seen["device_name"] == name and seen["chip"] == chip
  op = seen["rms_norm"]
  assert op["stopped"] == "call_custom_kernel needs a TPU (stubbed in tests/torchtpu)"
  assert op["exported"].endswith("::rms_norm_tpu_jax") and op["called"] == op["exported"]
  assert op["platforms"] == ["tpu"] and op["mosaic"] and op["registered_is_exported"]
  assert op["inputs_are_the_tensors"] == [True, True]    # the tensors themselves, no copies
  assert op["outputs"] == [[[8, 256], "torch.bfloat16", "tpu"]]


def test_the_chip_reaches_the_kernel(tpu_host):
  """The shim passes the host's chip to the kernel: v5e's program (its default scoped
  VMEM, 16 MiB) is not v6e's (32 MiB)."""
  programs = {d: tpu_host["chips"][d]["rms_norm"]["program_sha256"] for d in ("0x0063", "0x006f")}
  assert programs["0x0063"] != programs["0x006f"]


def test_an_unsupported_chip_is_refused_by_name(tpu_host):
  seen = tpu_host["chips"]["0x005e"]                      # v4: torch_tpu knows it, we do not
  assert seen["device_name"] == "TPU v4" and "'TPU v4' is not supported" in seen["chip_error"]


def test_the_chip_env_var_overrides_the_pci_ids(tpu_host):
  assert tpu_host["chip_overridden"] == "v5e"


def test_a_host_without_a_tpu_gets_the_cpu_variant(tmp_path, local_kernels_env, repo_id):
  got = on_a_tpu_host(tmp_path, ["probe", repo_id("rms-norm-tpu")], pci_device=None,
                      env={"LOCAL_KERNELS": local_kernels_env})
  assert not got["device_initialised"] and got["accelerator"] is None
  assert got["variant"] == "torch-cpu" and got["metadata_backend"] == "cpu"


def test_this_process_is_a_tpu_host_and_loaded_the_tpu_variants(rms, ragged, flash, paged):
  """conftest.py ran torch_tpu's device initialisation: every fixture is torch-tpu, which
  test_real_jax_op.py runs through the real jax_op."""
  assert torch.accelerator.current_accelerator().type == "tpu"
  backends = {k.metadata.id: str(k.metadata.backend.backend_type) for k in get_loaded_kernels()}
  for kernel in (rms, ragged, flash, paged):
    assert Path(kernel.__file__).parent.name == "torch-tpu", kernel.__file__
    assert backends[kernel.__name__] == "tpu"
    dispatch = sys.modules[f"{kernel.__name__}._shim.dispatch"]
    assert dispatch.SUPPORTED_DEVICE_TYPES == ("cpu", "tpu")


def test_a_cpu_only_build_does_not_load_on_a_tpu_host(tmp_path, dist_dir):
  """Why every build ships build/torch-tpu: a repo with only the noarch torch-cpu variant
  is refused on a TPU host."""
  cpu_only = tmp_path / "rms-norm-tpu"
  shutil.copytree(dist_dir / "rms-norm-tpu", cpu_only)
  shutil.rmtree(cpu_only / "build" / "torch-tpu")
  with pytest.raises(FileNotFoundError, match=r"torch-cpu.*backend \(cpu\) does not match "
                                              r"system backend \(tpu\)"):
    get_local_kernel(cpu_only)


# ------------------------------------------------------------------------- deduplication


def _edited(source: Path, dest: Path, *, redigest: bool) -> Path:
  """A copy of a built repo whose torch-tpu layers.py gained a line; its metadata.json
  (so its id) unchanged, or with the digest rewritten for the new files (redigest)."""
  shutil.copytree(source, dest)
  variant = dest / "build" / "torch-tpu"
  with open(variant / "layers.py", "a") as f:
    f.write("\n# edited after the build\n")
  if redigest:
    metadata = json.loads((variant / "metadata.json").read_text())
    metadata["digest"] = build_py._variant_digest(variant)
    (variant / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
  return dest


def test_two_repos_loaded_twice_from_the_hub_cache_and_local_kernels(tmp_path, dist_dir,
                                                                      repo_id):
  """kernels 0.19.1 deduplicates kernels by metadata.json's `id`. rms-norm-tpu is loaded
  from the Hub cache and then through LOCAL_KERNELS, paged-attention-tpu the other way
  round: the second load of the same build (same id, same digest) returns the module the
  first imported. A copy edited after the build keeps the id but not the digest: with its
  digest rewritten it is refused as another build of a loaded id, without it as files that
  do not match their digest (checked on every load of a local folder). Our ids carry the
  package's content hash (scripts/build.py), so a real rebuild never collides."""
  rms_id, paged_id = repo_id("rms-norm-tpu"), repo_id("paged-attention-tpu")
  cache, edited_cache = tmp_path / "hub", tmp_path / "hub-edited"
  rms_hub, rms_commit = hub_cache_snapshot(dist_dir / "rms-norm-tpu", cache, rms_id)
  _, paged_commit = hub_cache_snapshot(dist_dir / "paged-attention-tpu", cache, paged_id)
  paged_edited = _edited(dist_dir / "paged-attention-tpu", tmp_path / "paged-edited",
                         redigest=True)
  hub_cache_snapshot(paged_edited, edited_cache, paged_id)   # what KERNELS_CACHE points at
  args = {"rms": {"repo_id": rms_id, "local": str(dist_dir / "rms-norm-tpu"),
                  "edited": str(_edited(dist_dir / "rms-norm-tpu", tmp_path / "rms-edited",
                                        redigest=True)),
                  "tampered": str(_edited(dist_dir / "rms-norm-tpu", tmp_path / "rms-tampered",
                                          redigest=False))},
          "paged": {"repo_id": paged_id, "local": str(dist_dir / "paged-attention-tpu"),
                    "edited_cache": str(edited_cache)}}
  got = on_a_tpu_host(tmp_path / "host", ["dedup", json.dumps(args)], pci_device="0x006f",
                      env={"HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "hf-home")})

  rms, paged = got["rms"], got["paged"]
  assert rms["first"] == str(rms_hub / "snapshots" / rms_commit / "build/torch-tpu/__init__.py")
  assert paged["first"] == str(dist_dir / "paged-attention-tpu/build/torch-tpu/__init__.py")
  assert rms["second_is_first"] and paged["second_is_first"]
  for name, error, source in (("rms-norm-tpu", rms["edited_error"], tmp_path / "rms-edited"),
                              ("paged-attention-tpu", paged["edited_error"], edited_cache)):
    assert f"Kernel '{name}' at `{source}/" in error, error
    assert "but it is a different build" in error and "layers.py" in error, error
  assert "variant 'torch-tpu': the files do not match the digest" in rms["tampered_error"]
  assert "layers.py" in rms["tampered_error"]
  ids = {name: json.loads((dist_dir / name / "build/torch-tpu/metadata.json").read_text())["id"]
         for name in ("rms-norm-tpu", "paged-attention-tpu")}
  # Each of the four loads that succeeded is registered; the refused ones are not.
  loaded = [tuple(entry) for entry in got["loaded"]]
  assert loaded == sorted([(ids["rms-norm-tpu"], ""), (ids["rms-norm-tpu"], rms_commit),
                           (ids["paged-attention-tpu"], ""),
                           (ids["paged-attention-tpu"], paged_commit)])
