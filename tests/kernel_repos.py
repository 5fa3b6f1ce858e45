"""Fixtures shared by tests/torch and tests/torchtpu: the kernel repos are built fresh into a
temp dir and loaded with the real `kernels` loader, exactly as a user gets them
(`get_kernel` via LOCAL_KERNELS). Each suite's conftest star-imports this module."""

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
