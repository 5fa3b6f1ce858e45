"""scripts/build.py output: a Hub kernel repo the real `kernels` loader accepts."""

import ast
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
from kernels import get_kernel, get_local_kernel
from kernels._rust import Metadata

import reference as ref

ROOT = Path(__file__).resolve().parents[2]


def _ready(manifest):
  return [n for n, k in manifest["kernel"].items() if k["status"] == "ready"]


def test_manifest_lists_the_collection(manifest):
  assert set(manifest["kernel"]) == {"rms-norm-tpu", "ragged-dot-tpu", "flash-attention-tpu",
                                     "paged-attention-tpu", "gated-delta-rule-tpu",
                                     "causal-conv1d-tpu"}
  assert manifest["collection"]["hub-org"]
  for name, kernel in manifest["kernel"].items():
    assert isinstance(kernel["version"], int) and kernel["version"] >= 1, name
    assert kernel["license"] and set(kernel["backends"]) <= {"tpu", "cpu"}, name
    for module in kernel["kernel-modules"] if kernel["status"] == "ready" else []:
      assert (ROOT / manifest["collection"]["kernel-sources"] / f"{module}.py").is_file()


def test_repo_layout(dist_dir, manifest):
  for name in _ready(manifest):
    repo = dist_dir / name
    package = name.replace("-", "_")
    for path in ["build.toml", "flake.nix", "README.md", f"torch-ext/{package}/__init__.py",
                 f"torch-ext/{package}/_ops.py", f"torch-ext/{package}/_shim/dispatch.py",
                 f"torch-ext/{package}/tpu_kernels/chips.py"]:
      assert (repo / path).is_file(), path
    variants = sorted(p.name for p in (repo / "build").iterdir())
    assert variants == ["torch-cpu", "torch-tpu"]
    for variant in variants:
      files = sorted(p.relative_to(repo / "build" / variant).as_posix()
                     for p in (repo / "build" / variant).rglob("*.py"))
      package_files = sorted(p.relative_to(repo / "torch-ext" / package).as_posix()
                             for p in (repo / "torch-ext" / package).rglob("*.py"))
      assert files == package_files  # the same code in both variants


def test_metadata_is_accepted_by_kernels(dist_dir, manifest):
  for name in _ready(manifest):
    for backend in ("cpu", "tpu"):
      raw = (dist_dir / name / "build" / f"torch-{backend}" / "metadata.json").read_bytes()
      metadata = Metadata.from_bytes(raw)  # kernels' own (strict) parser
      assert metadata.version == manifest["kernel"][name]["version"]
      assert json.loads(raw)["backend"]["type"] == backend
      assert json.loads(raw)["name"] == name


def test_kernel_builder_build_toml(dist_dir, manifest):
  for name in _ready(manifest):
    config = tomllib.loads((dist_dir / name / "build.toml").read_text())
    assert set(config) == {"general", "torch-noarch"}
    general = config["general"]
    assert set(general) == {"name", "version", "edition", "license", "backends", "hub"}
    assert general["name"] == name and general["edition"] == 5
    assert general["hub"]["repo-id"] == f"{manifest['collection']['hub-org']}/{name}"
    assert general["hub"]["branch"] == f"v{general['version']}"
    flake = (dist_dir / name / "flake.nix").read_text()
    assert "genKernelFlakeOutputs" in flake and "path = ./.;" in flake


def test_card_is_complete(dist_dir, manifest):
  for name in _ready(manifest):
    card = (dist_dir / name / "README.md").read_text()
    # A card's placeholders are str.format fields ({repo_id}, {version}, ...); its code
    # keeps literal braces (dicts), so only a bare {name} left over is unfilled.
    assert not re.findall(r"\{[A-Za-z_]\w*\}", card), "unfilled placeholder"
    for needle in (f"{manifest['collection']['hub-org']}/{name}", "jax", "v5e", "v6e",
                   "bfloat16", "interpret"):
      assert needle in card, needle


def test_get_kernel_by_version_loads_the_cpu_variant(rms):
  """A host without a TPU (no device named "tpu") is served torch-cpu; a TPU host gets
  torch-tpu (tests/torchtpu/test_loader_on_a_tpu_host.py)."""
  assert Path(rms.__file__).parent.name == "torch-cpu" and rms.__name__.endswith("_cpu")
  x, w = torch.randn(3, 200), torch.randn(200)
  ref.assert_close(rms.rms_norm(x, w), ref.rms_norm(x, w, 1e-6), ref.TOLERANCE["float32"])


def test_tpu_variant_loads_and_runs_on_cpu(dist_dir):
  """The torch-tpu variant, the one a TPU host loads, carries the same dispatching code."""
  tpu_variant = get_local_kernel(dist_dir / "rms-norm-tpu" / "build" / "torch-tpu")
  x, w = torch.randn(3, 200), torch.randn(200)
  ref.assert_close(tpu_variant.rms_norm(x, w), ref.rms_norm(x, w, 1e-6),
                   ref.TOLERANCE["float32"])


def _namespace(kernel_module):
  return sys.modules[f"{kernel_module.__name__}._ops"].NAMESPACE


def test_same_build_imported_twice_reuses_its_ops(rms, dist_dir):
  """torch-cpu and torch-tpu variants of one build: two ids (kernels imports each under its
  own module name, and deduplicates only a repeated id), one op namespace.

  The second import must reuse the ops the first defined (torch refuses duplicates).
  """
  tpu_variant = get_local_kernel(dist_dir / "rms-norm-tpu" / "build" / "torch-tpu")
  assert tpu_variant.__name__ != rms.__name__
  assert _namespace(tpu_variant) == _namespace(rms)
  first = sys.modules[f"{rms.__name__}._custom_ops"]
  second = sys.modules[f"{tpu_variant.__name__}._custom_ops"]
  assert second.rms_norm_op is first.rms_norm_op
  x, w = torch.randn(2, 64), torch.randn(64)
  torch.testing.assert_close(tpu_variant.rms_norm(x, w), rms.rms_norm(x, w), rtol=0, atol=0)


def test_two_versions_load_side_by_side(tmp_path, rms):
  """A v2 build gets its own op namespace; both versions run in one process."""
  manifest_text = (ROOT / "build.toml").read_text().replace(
      '[kernel.rms-norm-tpu]\nstatus = "ready"\nversion = 1',
      '[kernel.rms-norm-tpu]\nstatus = "ready"\nversion = 2')
  assert "version = 2" in manifest_text
  code = (
      "import sys, tomllib, pathlib; sys.path.insert(0, 'scripts'); import build;"
      f"m = tomllib.loads({manifest_text!r});"
      f"build.build_kernel('rms-norm-tpu', m, pathlib.Path({str(tmp_path)!r}))")
  subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
  v2 = get_local_kernel(tmp_path / "rms-norm-tpu")
  assert _namespace(v2) != _namespace(rms)
  assert "_v2_" in _namespace(v2) and "_v1_" in _namespace(rms)
  x, w = torch.randn(2, 64), torch.randn(64)
  torch.testing.assert_close(v2.rms_norm(x, w), rms.rms_norm(x, w), rtol=0, atol=0)
  metadata = json.loads((tmp_path / "rms-norm-tpu/build/torch-cpu/metadata.json").read_text())
  assert metadata["version"] == 2


def test_build_is_deterministic(tmp_path, dist_dir):
  subprocess.run([sys.executable, str(ROOT / "scripts/build.py"), "--out", str(tmp_path)],
                 check=True, capture_output=True)
  for path in (dist_dir / "rms-norm-tpu").rglob("*"):
    if path.is_file():
      twin = tmp_path / path.relative_to(dist_dir)
      assert twin.read_bytes() == path.read_bytes(), path


def test_kernel_sources_import_no_torch():
  """House rule: kernels/ is pure JAX/Pallas."""
  for path in (ROOT / "kernels").rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = ([a.name for a in node.names] if isinstance(node, ast.Import)
               else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
      assert not any(n.split(".")[0] in ("torch", "torch_tpu") for n in names), path
