"""What a release of a kernel is made of, and the gate it must pass. Pure Python, no torch/jax.

Shared by `scripts/build.py` (writes the build report), the pytest plugin
`scripts/release_pytest.py` (writes the test reports), `scripts/upload.py` (reads both
and refuses what does not pass) and the release tests.

Naming, all derived from build.toml so a new kernel (e.g. paged-attention-tpu) needs no
edit here:

* torch package `torch-ext/<stem>_tpu`  ->  the kernel's *stem* (`rms_norm`,
  `paged_attention`).
* the kernel's *own modules*: its stem plus every entry of its `kernel-modules` that no
  other kernel of build.toml lists (`chips` and `vmem` are everyone's; `moe` is
  ragged-dot-tpu's alone).
* its tests: `tests/jax/` and `tests/torch/` files named `test_<own module>.py` or
  `test_<own module>_*.py`. Files whose stem ends in `_aot` are its ahead-of-time
  compile tests, the others its property / functional tests. A kernel whose AOT tests do
  not follow the naming lists them in build.toml as `aot-tests` (rms-norm-tpu's
  `tests/jax/test_aot_compile.py` predates the convention).
* the chips every release must have compiled for: `[collection] release-chips`
  (a kernel may override with its own `release-chips`). An AOT test item counts for a
  chip through its `chip` parameter, which every AOT test here uses.

Reports, and why they live where they do:

* build report: `<out>/<name>.build-report.json`, next to `<out>/<name>/` (never inside:
  the repo folder is what is uploaded). Deterministic for a given commit, so dist/ stays
  reproducible. It records the package's source hash, the source commit and whether the
  tree was dirty, and a hash of every file of the built repo folder.
* test reports: `build-reports/tests/<name>.<stack>.json` (env `TPU_KERNELS_REPORT_DIR`
  overrides the `build-reports` dir), one per Python/jax stack (`scripts/test.sh` runs
  two), written by the pytest plugin. Keyed by the kernel's source hash and a hash of the
  test files that judge it: when either changes, the old outcomes are discarded, never
  merged. Within one key, runs accumulate per test id (a partial re-run updates the
  items it ran), and every collected item of every mapped file must have passed.
"""

from __future__ import annotations

import base64
import fcntl
import fnmatch
import hashlib
import json
import os
import re
import subprocess
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPORT_SCHEMA = 1
TEST_DIRS = ("jax", "torch")


# ---------------------------------------------------------------------------- manifest


def load_manifest(root: Path = ROOT) -> dict:
  with open(root / "build.toml", "rb") as f:
    return tomllib.load(f)


def python_name(hub_name: str) -> str:
  return hub_name.replace("-", "_")


def package_name(hub_name: str, manifest: dict) -> str:
  return Path(manifest["kernel"][hub_name]["torch-package"]).name


def stem(hub_name: str, manifest: dict) -> str:
  """`torch-ext/paged_attention_tpu` -> `paged_attention`."""
  package = package_name(hub_name, manifest)
  return package[: -len("_tpu")] if package.endswith("_tpu") else package


def own_modules(hub_name: str, manifest: dict) -> list[str]:
  kernels = manifest["kernel"]
  others = {m for name, k in kernels.items() if name != hub_name for m in k.get("kernel-modules", [])}
  own = [stem(hub_name, manifest)]
  own += [m for m in kernels[hub_name].get("kernel-modules", []) if m not in others and m not in own]
  return own


def release_chips(hub_name: str, manifest: dict) -> list[str]:
  kernel = manifest["kernel"][hub_name]
  return list(kernel.get("release-chips", manifest["collection"].get("release-chips", [])))


def classify_test_file(rel: str, hub_name: str, manifest: dict) -> str | None:
  """"aot", "property" or None: what `rel` (e.g. "tests/jax/test_moe.py") is for this kernel."""
  rel = Path(rel).as_posix()
  kernel = manifest["kernel"][hub_name]
  if rel in kernel.get("aot-tests", []):
    return "aot"
  parts = rel.split("/")
  if len(parts) < 2 or parts[-2] not in TEST_DIRS:
    return None
  name = parts[-1]
  for module in own_modules(hub_name, manifest):
    if name == f"test_{module}.py" or fnmatch.fnmatch(name, f"test_{module}_*.py"):
      return "aot" if name.endswith("_aot.py") else "property"
  return None


def test_files(hub_name: str, manifest: dict, root: Path = ROOT) -> dict[str, list[str]]:
  """{"property": [...], "aot": [...]}: the existing test files of this kernel (repo-relative)."""
  out: dict[str, list[str]] = {"property": [], "aot": []}
  candidates = {p.relative_to(root).as_posix() for d in TEST_DIRS for p in (root / "tests" / d).glob("test_*.py")}
  candidates |= set(manifest["kernel"][hub_name].get("aot-tests", []))
  for rel in sorted(candidates):
    kind = classify_test_file(rel, hub_name, manifest)
    if kind and (root / rel).is_file():
      out[kind].append(rel)
  return out


def kernel_of_test_path(path: Path, manifest: dict, root: Path = ROOT) -> list[tuple[str, str]]:
  """[(hub_name, kind)] a test file judges. Matched on its last two path parts
  (`jax/test_x.py`) or its repo-relative path, so a copy of the tree matches too."""
  path = Path(path)
  try:
    rel = path.resolve().relative_to(root).as_posix()
  except ValueError:
    rel = "tests/" + "/".join(path.parts[-2:])
  found = []
  for name in manifest["kernel"]:
    kind = classify_test_file(rel, name, manifest)
    if kind:
      found.append((name, kind))
  return found


# ------------------------------------------------------------------------------ hashes


def sha256_files(files: dict[str, Path]) -> str:
  """sha256 over sorted (relative path, bytes) pairs: the algorithm of build.py's
  `_content_hash` (whose first 10 hex digits name the op namespace)."""
  digest = hashlib.sha256()
  for rel in sorted(files):
    digest.update(rel.encode())
    digest.update(Path(files[rel]).read_bytes())
  return digest.hexdigest()


def tree_files(folder: Path, skip=("__pycache__",)) -> dict[str, Path]:
  return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
          if p.is_file() and not any(s in p.parts for s in skip) and p.suffix != ".pyc"}


def kernel_sources(hub_name: str, manifest: dict, root: Path = ROOT) -> dict[str, Path]:
  """Vendored path -> source file of the kernel's pure-JAX part: `tpu_kernels/` with
  every module listed in `kernel-modules` and each one's tuning tables
  (`tuned/<module>.<chip>.json`, read by tuning_tables.py)."""
  collection, kernel = manifest["collection"], manifest["kernel"][hub_name]
  sources = root / collection["kernel-sources"]
  files = {}
  for module in ["__init__", *kernel["kernel-modules"]]:
    files[f"tpu_kernels/{module}.py"] = sources / f"{module}.py"
    for table in sorted((sources / "tuned").glob(f"{module}.*.json")):
      files[f"tpu_kernels/tuned/{table.name}"] = table
  return files


def package_sources(hub_name: str, manifest: dict, root: Path = ROOT) -> dict[str, Path]:
  """Vendored path -> source file, exactly the files build.py copies into the package
  before it writes `_ops.py` (their hash is the package's content hash)."""
  collection, kernel = manifest["collection"], manifest["kernel"][hub_name]
  files = {}
  for rel, path in tree_files(root / kernel["torch-package"]).items():
    if Path(rel).name != "CARD.md":
      files[rel] = path
  for rel, path in tree_files(root / collection["shim-sources"]).items():
    if Path(rel).name != "CARD.md":
      files[f"_shim/{rel}"] = path
  files.update(kernel_sources(hub_name, manifest, root))
  return files


def source_hash(hub_name: str, manifest: dict, root: Path = ROOT) -> str:
  return sha256_files(package_sources(hub_name, manifest, root))


def tests_hash(hub_name: str, manifest: dict, root: Path = ROOT) -> str:
  """Hash of what judges the kernel: its mapped test files, the test helpers and
  conftests (every non-`test_*` .py under tests/ outside tests/release), the AOT case
  tables (scripts/*_cases.py) and build.toml's table of the kernel."""
  files = {}
  for kind_files in test_files(hub_name, manifest, root).values():
    for rel in kind_files:
      files[rel] = root / rel
  for p in sorted((root / "tests").rglob("*.py")):
    rel = p.relative_to(root).as_posix()
    if not p.name.startswith("test_") and "/release/" not in f"/{rel}" and "__pycache__" not in p.parts:
      files[rel] = p
  for p in sorted((root / "scripts").glob("*_cases.py")):
    files[p.relative_to(root).as_posix()] = p
  digest = hashlib.sha256(sha256_files(files).encode())
  digest.update(json.dumps(manifest["kernel"][hub_name], sort_keys=True).encode())
  return digest.hexdigest()


def git_blob_sha1(data: bytes) -> str:
  return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def b64_sha256(data: bytes) -> str:
  return base64.b64encode(hashlib.sha256(data).digest()).decode()


# --------------------------------------------------------------------------------- git


def _git(root: Path, *args: str) -> str | None:
  try:
    result = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                            check=True)
  except (OSError, subprocess.CalledProcessError):
    return None
  return result.stdout


def git_head(root: Path = ROOT) -> str | None:
  out = _git(root, "rev-parse", "HEAD")
  return out.strip() if out else None


def build_inputs(hub_name: str, manifest: dict, root: Path = ROOT) -> list[str]:
  """Repo-relative paths whose content goes into the built repo folder."""
  collection, kernel = manifest["collection"], manifest["kernel"][hub_name]
  paths = [kernel["torch-package"], collection["shim-sources"], "build.toml", "flake.nix",
           f"changelog/{hub_name}.md", "benchmarks/results/estimates.md",
           f"benchmarks/results/estimates-{stem(hub_name, manifest)}.png"]
  paths += [p.relative_to(root).as_posix() for p in kernel_sources(hub_name, manifest, root).values()]
  if "card" in kernel:
    paths.append(kernel["card"])
  return paths


def git_dirty_paths(paths: list[str], root: Path = ROOT) -> list[str] | None:
  """Changed or untracked files among `paths` (None when `root` is not a git work tree)."""
  out = _git(root, "status", "--porcelain", "--untracked-files=all", "--", *paths)
  if out is None:
    return None
  return sorted(line[3:] for line in out.splitlines() if line.strip())


# ------------------------------------------------------------------------ test reports


def report_dir(root: Path = ROOT) -> Path:
  return Path(os.environ.get("TPU_KERNELS_REPORT_DIR", root / "build-reports"))


def stack_id() -> str:
  """Python and jax versions, read without importing jax ("py3.11-jax0.10.2")."""
  import importlib.metadata
  import sys

  try:
    jax = importlib.metadata.version("jax")
  except importlib.metadata.PackageNotFoundError:
    jax = "none"
  return f"py{sys.version_info.major}.{sys.version_info.minor}-jax{jax}"


def test_report_path(hub_name: str, stack: str, directory: Path) -> Path:
  return directory / "tests" / f"{hub_name}.{stack}.json"


def record_test_outcomes(hub_name: str, *, stack: str, directory: Path, key: dict,
                         items: dict[str, dict], collected: dict[str, list[str]]) -> Path:
  """Merges one run's outcomes into the kernel's report for this stack.

  key: {"source_hash", "tests_hash"}; a report under another key is replaced, not merged.
  items: nodeid -> {"file", "kind", "chip", "outcome"}; collected: file -> every nodeid
  collected in it this run (the items a file must have passed).
  """
  path = test_report_path(hub_name, stack, directory)
  path.parent.mkdir(parents=True, exist_ok=True)
  # scripts/test.sh runs leg 1 as two pytest sessions on one stack at the same time: the
  # read-merge-write below holds a lock.
  with open(path.with_suffix(".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    return _merge_test_outcomes(path, hub_name, stack, key, items, collected)


def _merge_test_outcomes(path, hub_name, stack, key, items, collected) -> Path:
  report = None
  if path.is_file():
    try:
      report = json.loads(path.read_text())
    except ValueError:
      report = None
  if not report or report.get("schema") != REPORT_SCHEMA or report.get("key") != key:
    report = {"schema": REPORT_SCHEMA, "kernel": hub_name, "stack": stack, "key": key,
              "items": {}, "collected": {}}
  report["items"].update(items)
  report["collected"].update({f: sorted(ids) for f, ids in collected.items()})
  tmp = path.with_suffix(".tmp")
  tmp.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
  tmp.replace(path)
  return path


@dataclass
class GateResult:
  kernel: str
  problems: list[str] = field(default_factory=list)
  summary: dict = field(default_factory=dict)

  @property
  def ok(self) -> bool:
    return not self.problems


def test_gate(hub_name: str, manifest: dict, *, root: Path = ROOT,
              directory: Path | None = None) -> GateResult:
  """Do the recorded test outcomes show this kernel's property tests and its AOT
  compiles for every release chip passing, for the current sources and tests?"""
  directory = report_dir(root) if directory is None else directory
  result = GateResult(hub_name)
  key = {"source_hash": source_hash(hub_name, manifest, root),
         "tests_hash": tests_hash(hub_name, manifest, root)}
  files = test_files(hub_name, manifest, root)
  chips = release_chips(hub_name, manifest)
  if not files["property"]:
    result.problems.append("no property test files found for it (tests/{jax,torch}/test_<module>_*.py)")
  if not files["aot"]:
    result.problems.append("no ahead-of-time compile test files found for it (test_<module>_aot.py or aot-tests)")
  if not chips:
    result.problems.append("no release-chips in build.toml")

  reports, stale = [], []
  for path in sorted((directory / "tests").glob(f"{hub_name}.*.json")):
    try:
      report = json.loads(path.read_text())
    except ValueError:
      stale.append(f"{path.name} (unreadable)")
      continue
    if report.get("schema") == REPORT_SCHEMA and report.get("key") == key:
      reports.append(report)
    else:
      stale.append(path.name)
  if not reports:
    why = f"stale: {', '.join(stale)} were recorded for other sources or tests" if stale else "missing"
    result.problems.append(f"test report {why}; run the tests (bash scripts/test.sh)")
    return result

  items: dict[str, list[dict]] = {}
  collected: dict[str, set[str]] = {}
  for report in reports:
    for nodeid, item in report["items"].items():
      items.setdefault(nodeid, []).append(item)
    for f, ids in report["collected"].items():
      collected.setdefault(f, set()).update(ids)

  for kind in ("property", "aot"):
    for f in files[kind]:
      ids = collected.get(f)
      if not ids:
        result.problems.append(f"{f}: not run")
        continue
      bad = [i for i in sorted(ids) if not items.get(i) or any(x["outcome"] != "passed" for x in items[i])]
      not_run = [i for i in bad if not items.get(i)]
      failed = [i for i in bad if items.get(i)]
      if failed:
        result.problems.append(f"{f}: {len(failed)} not passed, e.g. {failed[0]} "
                               f"({'/'.join(sorted({x['outcome'] for x in items[failed[0]]}))})")
      if not_run:
        result.problems.append(f"{f}: {len(not_run)} collected but never run, e.g. {not_run[0]}")
      result.summary[f] = {"items": len(ids), "passed": len(ids) - len(bad)}
  for chip in chips:
    passed = [i for f in files["aot"] for i in collected.get(f, ())
              if items.get(i) and all(x["outcome"] == "passed" and x.get("chip") == chip for x in items[i])]
    result.summary[f"aot:{chip}"] = len(passed)
    if not passed:
      result.problems.append(f"no ahead-of-time compile for {chip} passed")
  result.summary["stacks"] = sorted(r["stack"] for r in reports)
  return result


# ------------------------------------------------------------------------ build report


def build_report_path(out_dir: Path, hub_name: str) -> Path:
  return out_dir / f"{hub_name}.build-report.json"


def check_build(hub_name: str, manifest: dict, *, dist: Path, root: Path = ROOT) -> list[str]:
  """Problems with dist/<name> as a release: missing, not matching its build report,
  built from other sources than the checked-out commit, or from a dirty tree."""
  problems = []
  repo = dist / hub_name
  path = build_report_path(dist, hub_name)
  if not repo.is_dir():
    return [f"{repo} does not exist; run python scripts/build.py {hub_name}"]
  if not path.is_file():
    return [f"build report {path.name} missing; rebuild with python scripts/build.py {hub_name}"]
  report = json.loads(path.read_text())
  tree = sha256_files(tree_files(repo))
  if report.get("tree_sha256") != tree:
    problems.append(f"{repo} differs from what its build report records (edited after the build?)")
  if report.get("version") != manifest["kernel"][hub_name]["version"]:
    problems.append(f"built as v{report.get('version')}, build.toml says v{manifest['kernel'][hub_name]['version']}")
  current = source_hash(hub_name, manifest, root)
  if report.get("source_hash") != current:
    problems.append("stale: the sources changed since the build (source hash differs)")
  head = git_head(root)
  if head is None:
    problems.append("not a git checkout: no source commit to name")
  elif report.get("source_commit") != head:
    problems.append(f"stale: built from commit {str(report.get('source_commit'))[:12]}, HEAD is {head[:12]}")
  if report.get("dirty"):
    problems.append(f"built from uncommitted changes: {', '.join(report['dirty'][:5])}")
  return problems


def changelog_entry(hub_name: str, version: int, root: Path = ROOT) -> str | None:
  """The `## v<version>` section of changelog/<hub_name>.md (without its heading)."""
  path = root / "changelog" / f"{hub_name}.md"
  if not path.is_file():
    return None
  match = re.search(rf"^## v{version}\b[^\n]*\n(.*?)(?=^## |\Z)", path.read_text(), re.M | re.S)
  return match.group(1).strip() if match else None
