"""Loading a released kernel offline through the real `kernels` code paths, and tampering.

The Hub is replaced by a Hugging Face cache laid out as `snapshot_download` leaves it for
a kernel repo (kernel_repos.hub_cache_snapshot: `kernels--<org>--<name>/blobs/...`,
`snapshots/<commit>/...`, `refs/main` and `refs/v1` holding the commit). kernels 0.19.1
then resolves `version=1` through `refs/v1`, `get_locked_kernel` through the full commit
id in the lock file, and `LOCAL_KERNELS` through a path; each test checks which folder was
imported and runs the op on a CPU tensor (torch-cpu variant, Pallas interpret mode).
"""

import json
import os
import shutil
import sys
import textwrap

from kernel_repos import hub_cache_snapshot
from release_helpers import ROOT, build, run

REPO_ID = "tpu-kernels/rms-norm-tpu"


def _hf_cache(dist, cache):
  """`cache`/kernels--tpu-kernels--rms-norm-tpu as a download of branch v1 leaves it."""
  return hub_cache_snapshot(dist / "rms-norm-tpu", cache, REPO_ID)


def _lockfile(path, commit):
  from kernels._rust import KernelDependency, KernelLock, KernelLocks, KernelVersion

  # exactly what `kernels lock` writes (kernels' lock_kernel_tree: KernelLock(commit=<full
  # commit id>), then KernelLocks(...).to_json()); kernels 0.19 refuses an abbreviated id.
  locks = KernelLocks({KernelDependency(repo_id=REPO_ID, version=KernelVersion.Version(1)):
                       KernelLock(commit=commit)})
  path.write_text(locks.to_json())
  return path


LOAD = textwrap.dedent("""
  import json, os, sys
  from pathlib import Path
  import torch
  import kernels

  def check(module):
    x, w = torch.randn(3, 64, dtype=torch.float64).float(), torch.randn(64).float()
    ref = x.double() * torch.rsqrt((x.double() ** 2).mean(-1, keepdim=True) + 1e-6) * w.double()
    err = (module.rms_norm(x, w, 1e-6).double() - ref).abs().max().item()
    return {"file": module.__file__, "name": module.__name__, "err": err}

  out = {}
  mode = sys.argv[1]
  if mode == "version":
    first = kernels.get_kernel("tpu-kernels/rms-norm-tpu", version=1)
    out["version"] = check(first)
    os.environ["LOCAL_KERNELS"] = "tpu-kernels/rms-norm-tpu=" + sys.argv[2]
    second = kernels.get_kernel("tpu-kernels/rms-norm-tpu", version=1)
    out["local"] = check(second)
    out["local_is_first"] = second is first
  else:   # "locked" (and run the op), "locked-import" (import only)
    try:
      module = kernels.get_locked_kernel("tpu-kernels/rms-norm-tpu", lockfile=Path(sys.argv[2]))
    except RuntimeError as e:
      out["refused"] = str(e)
    else:
      out["locked"] = check(module) if mode == "locked" else {"file": module.__file__}
  print("RESULT " + json.dumps(out))
""")


def _load(tmp_path, cache, *args):
  script = tmp_path / "load.py"
  script.write_text(LOAD)
  env = {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "JAX_PLATFORMS": "cpu",
         "TORCH_DEVICE_BACKEND_AUTOLOAD": "0", "HF_HUB_DISABLE_TELEMETRY": "1"}
  env_clear = {k: v for k, v in os.environ.items() if k not in ("LOCAL_KERNELS", "KERNELS_CACHE", "HF_HOME")}
  import subprocess
  result = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True,
                          env={**env_clear, **env}, cwd=tmp_path)
  assert result.returncode == 0, result.stdout + result.stderr
  line = next(l for l in result.stdout.splitlines() if l.startswith("RESULT "))
  return json.loads(line[len("RESULT "):])


def test_get_kernel_version_1_from_the_cache_and_local_kernels(repo, tmp_path):
  """version=1 resolves through refs/v1 to the cached snapshot. The same build named again
  through LOCAL_KERNELS has the same id (metadata.json `id`) and digest, so kernels 0.19.1
  returns the module it imported first instead of importing the local folder."""
  dist = build(repo, "rms-norm-tpu")
  cache = tmp_path / "hub"
  cached, commit = _hf_cache(dist, cache)
  out = _load(tmp_path, cache, "version", dist / "rms-norm-tpu")
  namespace = json.loads((dist / "rms-norm-tpu.build-report.json").read_text())["namespace"]
  snapshot_variant = cached / "snapshots" / commit / "build" / "torch-cpu"
  assert out["version"]["file"] == str(snapshot_variant / "__init__.py")     # refs/v1 -> commit
  assert out["version"]["name"] == f"{namespace}_cpu"
  assert out["local_is_first"] and out["local"]["file"] == out["version"]["file"]
  assert out["local"]["err"] < 1e-5
  assert out["version"]["err"] < 1e-5, out


def test_get_locked_kernel_from_the_cache(repo, tmp_path):
  dist = build(repo, "rms-norm-tpu")
  cache = tmp_path / "hub"
  cached, commit = _hf_cache(dist, cache)
  # a second, different commit on v1 must not matter: the lock pins the first
  other = "f" * 40
  shutil.copytree(cached / "snapshots" / commit, cached / "snapshots" / other, symlinks=True)
  (cached / "snapshots" / other / "build" / "torch-cpu" / "__init__.py").unlink()
  (cached / "refs" / "v1").write_text(other)
  lockfile = _lockfile(tmp_path / "kernels.lock", commit)
  out = _load(tmp_path, cache, "locked", lockfile)
  assert out["locked"]["file"] == str(cached / "snapshots" / commit / "build" / "torch-cpu" / "__init__.py")
  assert out["locked"]["err"] < 1e-5


def _verify(cache, *args):
  return run([sys.executable, str(ROOT / "scripts" / "verify.py"), *map(str, args)], check=False,
             env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})


def test_tampering_is_detected(repo, tmp_path):
  """kernels 0.19.1 re-hashes a cached variant on its first load only, then keeps a
  receipt: a file changed after that is imported. verify.py re-hashes every time."""
  dist = build(repo, "rms-norm-tpu")
  cache = tmp_path / "hub"
  cached, commit = _hf_cache(dist, cache)
  untouched = tmp_path / "untouched"                     # the same download, never loaded
  shutil.copytree(cached, untouched / cached.name, symlinks=True)
  lockfile = _lockfile(tmp_path / "kernels.lock", commit)
  ok = _verify(cache, "--lockfile", lockfile, REPO_ID)
  assert ok.returncode == 0 and "every file matches its digest" in ok.stdout, ok.stdout + ok.stderr
  assert _verify(cache, "--version", "1", REPO_ID).returncode == 0
  assert "locked" in _load(tmp_path, cache, "locked", lockfile)      # the first load: hashed

  for hub in (cache, untouched):
    variant = hub / cached.name / "snapshots" / commit / "build" / "torch-cpu"
    blob = (variant / "layers.py").resolve()
    blob.write_bytes(blob.read_bytes() + b"\nimport os  # injected\n")    # the cached file changes
    (variant / "_shim" / "extra.py").write_text("x = 1\n")               # a file appears
    (variant / "tpu_kernels" / "vmem.py").unlink()                       # a file disappears
  # The loader: on a first load it refuses; after a clean first load it imports the changes.
  refused = _load(tmp_path, untouched, "locked-import", lockfile)
  assert "do not match the digest" in refused["refused"] and "layers.py" in refused["refused"]
  loaded = _load(tmp_path, cache, "locked-import", lockfile)
  assert loaded["locked"]["file"] == str(cached / "snapshots" / commit / "build" / "torch-cpu" / "__init__.py")

  variant = cached / "snapshots" / commit / "build" / "torch-cpu"
  for args in (["--lockfile", lockfile, REPO_ID], ["--version", "1", REPO_ID], [variant]):
    bad = _verify(cache, *args)
    assert bad.returncode == 1, bad.stdout
    assert "layers.py" in bad.stdout and "_shim/extra.py" in bad.stdout and "tpu_kernels/vmem.py" in bad.stdout

  # the verifying loader refuses before importing anything
  code = ("import sys; sys.path.insert(0, sys.argv[1]); import verify\n"
          "try:\n  verify.get_verified_locked_kernel('tpu-kernels/rms-norm-tpu', sys.argv[2])\n"
          "except verify.TamperedKernelError as e:\n  print('REFUSED', e); sys.exit(3)\n")
  refused = run([sys.executable, "-c", code, str(ROOT / "scripts"), str(lockfile)], check=False,
                env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"})
  assert refused.returncode == 3 and "REFUSED" in refused.stdout and "layers.py" in refused.stdout
  assert "torch" not in refused.stderr.lower() or "Traceback" not in refused.stderr
