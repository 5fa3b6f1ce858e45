"""Fixtures shared by tests/torch and tests/torchtpu: the kernel repos are built fresh into a
temp dir and loaded with the real `kernels` loader, exactly as a user gets them
(`get_kernel` via LOCAL_KERNELS). Each suite's conftest star-imports this module.
`hub_cache_snapshot` (also used by tests/release) lays a built repo out as a download
from the Hub leaves it, for `get_kernel(..., version=1)` offline."""

import hashlib
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def hub_cache_snapshot(repo_folder: Path, cache: Path, repo_id: str,
                       refs=("main", "v1")) -> tuple[Path, str]:
  """Lays `repo_folder` (a built repo, dist/<name>) out in the Hugging Face cache `cache`
  (HF_HUB_CACHE) as huggingface_hub's download of branch v1 of the kernel repo `repo_id`
  leaves it, and returns (the repo's cache folder, its commit).

  The layout kernels 0.19.1 reads offline: the folder `kernels--<org>--<name>`
  (huggingface_hub's `repo_folder_name` for repo_type "kernel"; kernels looks in no other),
  `blobs/<git blob sha1>`, `snapshots/<commit>/<path>` as relative symlinks to the blobs,
  and `refs/<ref>` holding the commit. `get_kernel(repo_id, version=1)` with
  HF_HUB_OFFLINE=1 lists `refs/v*` (`_get_available_versions_from_cache`), takes v1's
  commit and opens `snapshots/<commit>/build/<variant>`; a lock file names the commit
  itself. The commit is the sha1 of the file listing: a full 40-hex id, as kernels requires
  (`Oid`), that changes whenever a file does.
  """
  import release
  from huggingface_hub.file_download import repo_folder_name

  files = release.tree_files(repo_folder)
  listing = "".join(f"{rel} {release.git_blob_sha1(p.read_bytes())}\n"
                    for rel, p in sorted(files.items()))
  commit = hashlib.sha1(listing.encode()).hexdigest()
  repo = Path(cache) / repo_folder_name(repo_id=repo_id, repo_type="kernel")
  assert repo.name.startswith("kernels--"), repo
  (repo / "blobs").mkdir(parents=True, exist_ok=True)
  (repo / "refs").mkdir(exist_ok=True)
  for rel, path in files.items():
    data = path.read_bytes()
    blob = repo / "blobs" / release.git_blob_sha1(data)
    blob.write_bytes(data)
    link = repo / "snapshots" / commit / rel
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(blob, link.parent))
  for ref in refs:
    (repo / "refs" / ref).write_text(commit)
  return repo, commit


@pytest.fixture(scope="session")
def manifest():
  with open(ROOT / "build.toml", "rb") as f:
    return tomllib.load(f)


@pytest.fixture(scope="session")
def dist_dir(tmp_path_factory):
  out = tmp_path_factory.mktemp("dist")
  subprocess.run([sys.executable, str(ROOT / "scripts" / "build.py"), "--out", str(out)],
                 check=True, capture_output=True)
  return out


@pytest.fixture(scope="session")
def repo_id(manifest):
  def make(name):
    return f"{manifest['collection']['hub-org']}/{name}"
  return make


@pytest.fixture(scope="session")
def local_kernels_env(dist_dir, manifest, repo_id):
  """LOCAL_KERNELS pointing every ready kernel's repo id at its build."""
  entries = [f"{repo_id(name)}={dist_dir / name}" for name, k in manifest["kernel"].items()
             if k["status"] == "ready"]
  os.environ["LOCAL_KERNELS"] = ":".join(entries)
  return os.environ["LOCAL_KERNELS"]


def _get_kernel(repo_id, name: str):
  """The kernel loaded as a user would: get_kernel(repo, version=1)."""
  from kernels import get_kernel

  return get_kernel(repo_id(name), version=1)


def _custom_ops(kernel):
  """The custom ops module of a loaded kernel build (for opcheck)."""
  return sys.modules[f"{kernel.__name__}._custom_ops"]


@pytest.fixture(scope="session")
def rms(local_kernels_env, repo_id):
  return _get_kernel(repo_id, "rms-norm-tpu")


@pytest.fixture(scope="session")
def rms_ops(rms):
  return _custom_ops(rms)


@pytest.fixture(scope="session")
def ragged(local_kernels_env, repo_id):
  return _get_kernel(repo_id, "ragged-dot-tpu")


@pytest.fixture(scope="session")
def ragged_ops(ragged):
  return _custom_ops(ragged)


@pytest.fixture(scope="session")
def flash(local_kernels_env, repo_id):
  return _get_kernel(repo_id, "flash-attention-tpu")


@pytest.fixture(scope="session")
def flash_ops(flash):
  return _custom_ops(flash)


@pytest.fixture(scope="session")
def paged(local_kernels_env, repo_id):
  return _get_kernel(repo_id, "paged-attention-tpu")


@pytest.fixture(scope="session")
def paged_ops(paged):
  return _custom_ops(paged)


@pytest.fixture(scope="session")
def gdn(local_kernels_env, repo_id):
  return _get_kernel(repo_id, "gated-delta-rule-tpu")


@pytest.fixture(scope="session")
def gdn_ops(gdn):
  return _custom_ops(gdn)


@pytest.fixture(scope="session")
def conv(local_kernels_env, repo_id):
  return _get_kernel(repo_id, "causal-conv1d-tpu")


@pytest.fixture(scope="session")
def conv_ops(conv):
  return _custom_ops(conv)
