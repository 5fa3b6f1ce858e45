"""Release tests: scripts run in a throw-away clone of this repository.

A release needs a clean git tree (the upload gate refuses uncommitted sources), while
this work tree is shared and usually dirty. So each test that builds or uploads does it
in a fresh `git clone` of HEAD with the current (possibly uncommitted) release scripts
copied over and committed there. Nothing here touches the network: the Hub is replaced
by a Hugging Face cache laid out on disk, and uploads only run as --dry-run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# The release tooling and its inputs: copied from the work tree into every clone so the
# tests judge the current scripts, not only the last commit.
RELEASE_FILES = ["scripts/release.py", "scripts/release_pytest.py", "scripts/api_snapshot.py",
                 "scripts/verify.py", "scripts/upload.py", "scripts/build.py", "build.toml",
                 "changelog", "scripts/api-snapshots"]
GIT = ["git", "-c", "user.name=release-test", "-c", "user.email=release-test@localhost",
       "-c", "commit.gpgsign=false"]


def run(args, cwd=None, env=None, check=True):
  full_env = dict(os.environ, **(env or {}))
  result = subprocess.run(args, cwd=cwd, env=full_env, capture_output=True, text=True)
  if check and result.returncode != 0:
    raise AssertionError(f"{args} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
  return result


def git(repo: Path, *args):
  return run([*GIT, "-C", str(repo), *args]).stdout.strip()


def make_repo(path: Path) -> Path:
  run(["git", "clone", "--quiet", str(ROOT), str(path)])
  for rel in RELEASE_FILES:
    src, dst = ROOT / rel, path / rel
    if src.is_dir():
      shutil.rmtree(dst, ignore_errors=True)
      shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    elif src.is_file():
      shutil.copy2(src, dst)
  git(path, "add", "--", *[r for r in RELEASE_FILES if (path / r).exists()])
  if git(path, "status", "--porcelain"):
    git(path, "commit", "--quiet", "-m", "release test: current release scripts")
  return path


def build(repo: Path, *kernels: str) -> Path:
  run([sys.executable, str(repo / "scripts" / "build.py"), *kernels], cwd=repo)
  return repo / "dist"


def release_module(repo: Path):
  """scripts/release.py of `repo` (functions take the root explicitly)."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import release

  return release


def pass_all_tests(repo: Path, kernel: str, *, failing: str | None = None,
                   chips: list[str] | None = None, stack: str = "py3.11-jax0.10.2") -> Path:
  """Writes a test report in `repo` as if every mapped test of `kernel` had passed (one
  item per file, one AOT item per chip), through the plugin's own writer. The plugin
  itself is tested on real pytest runs in test_release_report.py."""
  release = release_module(repo)
  manifest = release.load_manifest(repo)
  files = release.test_files(kernel, manifest, repo)
  chips = release.release_chips(kernel, manifest) if chips is None else chips
  items, collected = {}, {}
  for kind, rels in files.items():
    for rel in rels:
      ids = [f"{rel}::test_{c}[{c}]" for c in chips] if kind == "aot" else [f"{rel}::test_property"]
      collected[rel] = ids
      for i in ids:
        chip = i.rsplit("[", 1)[1][:-1] if kind == "aot" else None
        items[i] = {"file": rel, "kind": kind, "chip": chip,
                    "outcome": "failed" if i == failing else "passed"}
  key = {"source_hash": release.source_hash(kernel, manifest, repo),
         "tests_hash": release.tests_hash(kernel, manifest, repo)}
  return release.record_test_outcomes(kernel, stack=stack, directory=repo / "build-reports",
                                      key=key, items=items, collected=collected)
