"""Publishes built kernels to the Hub: `dist/<name>` -> `<hub-org>/<name>` (repo_type "kernel").

    python scripts/build.py                      # dist/<name>/ + dist/<name>.build-report.json
    bash scripts/test.sh                         # build-reports/tests/<name>.<stack>.json
    python scripts/upload.py --dry-run [KERNEL ...]
    python scripts/upload.py [KERNEL ...] [--allow-breaking]

Per kernel, in this order, one call each to huggingface_hub's HfApi:

1. `create_repo(repo_type="kernel", exist_ok=True)`;
2. `create_branch(branch="v<major>")` when the branch does not exist yet;
3. `create_commit(revision="v<major>")`: ONE commit holding the whole built repo folder
   (`build/torch-<backend>/**` for every variant, `torch-ext/`, `build.toml`,
   `flake.nix`, `README.md`), and deleting files of a previous release under `build/`
   or `torch-ext/` that this build no longer has (a stale file would fail the digest);
   its message names the source repository and commit;
4. `create_commit(revision="main")`: the card as README.md, so the repo page shows it.

The list of calls is built first (`plan`) and is exactly what runs: `--dry-run` prints
it, the real run hands each entry to `HfApi` (`execute`). The only thing the dry run
cannot know offline is the Hub's current state (does the repo / branch exist, which
files does it hold); it assumes a new repo unless `--published DIR` gives a local copy
of what is on `v<major>` (then the file list and API are read from it). The real run
asks the Hub (`list_repo_refs`, `list_repo_files`) and downloads the published variant's
Python files to compare APIs.

Refused, for each kernel, before any call is made (all kernels or none):
* the build is missing, differs from its build report, is stale (sources changed since,
  or built from a commit other than HEAD) or was built from uncommitted changes;
* a variant's files do not match the digest in its metadata.json;
* the test reports do not show every property test and every AOT compile test (for
  every release chip) passing for these sources and these tests (release.test_gate);
* changelog/<name>.md has no section for this version;
* the public API lost or changed anything against the published build of this major
  version, or its snapshot (scripts/api-snapshots/<name>-v<major>.json), unless
  `--allow-breaking` (the right fix is a new major version in build.toml).

The token is huggingface_hub's own: `HF_TOKEN`, or the one `hf auth login` stored. The
Hub cannot be reached from the development machines; only `--dry-run` is tested here.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import api_snapshot
import release
import verify

OWNED_PREFIXES = ("build/", "torch-ext/")


@dataclass
class Call:
  """One HfApi method call: `getattr(api, method)(**kwargs)`."""
  method: str
  kwargs: dict

  def describe(self) -> list[str]:
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    shown = {k: v for k, v in self.kwargs.items() if k not in ("operations", "commit_description")}
    lines = [f"{self.method}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"]
    if "commit_description" in self.kwargs:
      lines += [f"    | {l}" for l in self.kwargs["commit_description"].splitlines()]
    for op in self.kwargs.get("operations", []):
      if isinstance(op, CommitOperationAdd):
        data = Path(op.path_or_fileobj).read_bytes()
        lines.append(f"    add    {op.path_in_repo}  ({len(data)} bytes, "
                     f"sha256 {hashlib.sha256(data).hexdigest()[:16]})")
      elif isinstance(op, CommitOperationDelete):
        lines.append(f"    delete {op.path_in_repo}")
    return lines


@dataclass
class Remote:
  """What the Hub holds for one repo: None = the repo does not exist."""
  branches: set[str] | None = None
  files: dict[str, set[str]] = field(default_factory=dict)   # branch -> paths
  published_package: Path | None = None                      # v<major>'s package, for the API
  source: str = "assumed new (dry run: the Hub is not queried)"


def repo_id(hub_name: str, manifest: dict) -> str:
  return f"{manifest['collection']['hub-org']}/{hub_name}"


def plan(hub_name: str, manifest: dict, dist: Path, remote: Remote, build_report: dict) -> list[Call]:
  from huggingface_hub import CommitOperationAdd, CommitOperationDelete

  rid = repo_id(hub_name, manifest)
  version = manifest["kernel"][hub_name]["version"]
  branch = f"v{version}"
  folder = dist / hub_name
  files = release.tree_files(folder)
  source = manifest["collection"].get("source-repository", "tpu-kernels (no public URL recorded)")
  commit = build_report["source_commit"]
  calls = [Call("create_repo", dict(repo_id=rid, repo_type="kernel", exist_ok=True))]
  if remote.branches is None or branch not in remote.branches:
    calls.append(Call("create_branch", dict(repo_id=rid, repo_type="kernel", branch=branch,
                                            exist_ok=True)))
  stale = sorted(p for p in remote.files.get(branch, set())
                 if p.startswith(OWNED_PREFIXES) and p not in files)
  operations = [CommitOperationDelete(path_in_repo=p) for p in stale]
  operations += [CommitOperationAdd(path_in_repo=rel, path_or_fileobj=str(path))
                 for rel, path in sorted(files.items())]
  description = "\n".join([
      f"Source: {source} commit {commit}",
      f"Package content hash: {build_report['source_hash']}",
      f"Op namespace: {build_report['namespace']}",
      f"Variants: {', '.join(build_report['variants'])}",
      "Built by scripts/build.py; property tests and AOT compiles for "
      f"{', '.join(release.release_chips(hub_name, manifest))} passed (scripts/upload.py gate).",
  ])
  calls.append(Call("create_commit", dict(
      repo_id=rid, repo_type="kernel", revision=branch, operations=operations,
      commit_message=f"{hub_name} v{version}: build of {source}@{commit}",
      commit_description=description)))
  calls.append(Call("create_commit", dict(
      repo_id=rid, repo_type="kernel", revision="main",
      operations=[CommitOperationAdd(path_in_repo="README.md",
                                     path_or_fileobj=str(folder / "README.md"))],
      commit_message=f"{hub_name}: card of v{version} (source commit {commit})")))
  return calls


def execute(calls: list[Call], api) -> list:
  """Runs the plan, call by call, on an `HfApi`; stops at the first error."""
  return [getattr(api, call.method)(**call.kwargs) for call in calls]


def check(hub_name: str, manifest: dict, *, dist: Path, root: Path, reports: Path,
          remote: Remote, allow_breaking: bool) -> tuple[list[str], list[str]]:
  """(problems that refuse the upload, notes)."""
  kernel = manifest["kernel"].get(hub_name)
  if kernel is None:
    return [f"not in build.toml"], []
  if kernel.get("status") != "ready":
    return [f"status is {kernel.get('status')!r}, not ready"], []
  problems = release.check_build(hub_name, manifest, dist=dist, root=root)
  if (dist / hub_name).is_dir():
    problems += [f"integrity: {p}" for p in verify.verify_path(dist / hub_name)
                 if "built from uncommitted" not in p]
  gate = release.test_gate(hub_name, manifest, root=root, directory=reports)
  problems += [f"tests: {p}" for p in gate.problems]
  version = kernel["version"]
  if release.changelog_entry(hub_name, version, root) is None:
    problems.append(f"changelog/{hub_name}.md has no `## v{version}` section")
  notes = []
  package = dist / hub_name / "torch-ext" / release.package_name(hub_name, manifest)
  if package.is_dir():
    new = api_snapshot.extract(package)
    baselines = []
    if remote.published_package is not None:
      baselines.append(("published v%d" % version, api_snapshot.extract(remote.published_package)))
    snap = api_snapshot.snapshot_path(hub_name, version, root / "scripts" / "api-snapshots")
    if snap.is_file():
      baselines.append((f"snapshot {snap.name}", json.loads(snap.read_text())))
    if not baselines:
      notes.append(f"API: no published v{version} and no snapshot: first release of v{version}")
    for label, old in baselines:
      breaking, added = api_snapshot.compare(old, new)
      notes += [f"API vs {label}: + {a}" for a in added]
      for b in breaking:
        if allow_breaking:
          notes.append(f"API vs {label}: BREAKING (allowed by --allow-breaking) {b}")
        else:
          problems.append(f"API vs {label}: BREAKING {b} (bump the major version, or --allow-breaking)")
  return problems, notes


def remote_from_dir(published: Path, hub_name: str, manifest: dict) -> Remote:
  """A local copy of what `v<major>` holds on the Hub (repo folder layout)."""
  branch = f"v{manifest['kernel'][hub_name]['version']}"
  files = set(release.tree_files(published))
  variants = verify.variants_of(published) if (published / "build").is_dir() else []
  package = variants[0] if variants else None
  return Remote(branches={"main", branch}, files={branch: files}, published_package=package,
                source=f"from {published}")


def remote_from_hub(api, hub_name: str, manifest: dict, scratch: Path) -> Remote:  # pragma: no cover (needs the Hub)
  from huggingface_hub.errors import RepositoryNotFoundError

  rid = repo_id(hub_name, manifest)
  branch = f"v{manifest['kernel'][hub_name]['version']}"
  try:
    refs = api.list_repo_refs(rid, repo_type="kernel")
  except RepositoryNotFoundError:
    return Remote(source="the Hub: repo does not exist")
  branches = {b.name for b in refs.branches}
  remote = Remote(branches=branches, source="the Hub")
  if branch in branches:
    remote.files[branch] = set(api.list_repo_files(rid, repo_type="kernel", revision=branch))
    backend = manifest["kernel"][hub_name]["backends"][0]
    local = api.snapshot_download(rid, repo_type="kernel", revision=branch,
                                  allow_patterns=[f"build/torch-{backend}/*.py"],
                                  local_dir=scratch / hub_name)
    package = Path(local) / "build" / f"torch-{backend}"
    remote.published_package = package if (package / "__init__.py").is_file() else None
  return remote


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("kernels", nargs="*", help="hub names (default: every ready kernel)")
  parser.add_argument("--dry-run", action="store_true", help="print the calls, make none")
  parser.add_argument("--allow-breaking", action="store_true",
                      help="publish an API change to an existing major version anyway")
  parser.add_argument("--dist", type=Path, default=release.ROOT / "dist")
  parser.add_argument("--published", type=Path, action="append", default=[], metavar="NAME=DIR",
                      help="dry run: a local copy of what v<major> of NAME holds on the Hub")
  args = parser.parse_args(argv)
  root = release.ROOT
  manifest = release.load_manifest(root)
  names = args.kernels or [n for n, k in manifest["kernel"].items() if k.get("status") == "ready"]
  published = {}
  for entry in args.published:
    name, _, path = str(entry).partition("=")
    published[name] = Path(path)

  api = None
  scratch = tempfile.TemporaryDirectory()
  if not args.dry_run:  # pragma: no cover (needs the Hub)
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
      print("no Hugging Face token: set HF_TOKEN or run `hf auth login`", file=sys.stderr)
      return 2
    api = HfApi()

  reports = release.report_dir(root)
  plans, refused = {}, False
  for name in names:
    if name in published:
      remote = remote_from_dir(published[name], name, manifest)
    elif api is not None:  # pragma: no cover
      remote = remote_from_hub(api, name, manifest, Path(scratch.name))
    else:
      remote = Remote()
    problems, notes = check(name, manifest, dist=args.dist, root=root, reports=reports,
                            remote=remote, allow_breaking=args.allow_breaking)
    for note in notes:
      print(f"{name}: {note}")
    if problems:
      refused = True
      for p in problems:
        print(f"{name}: REFUSED: {p}")
      continue
    report = json.loads(release.build_report_path(args.dist, name).read_text())
    plans[name] = (remote, plan(name, manifest, args.dist, remote, report))
  if refused:
    print("nothing uploaded: fix the problems above", file=sys.stderr)
    return 1

  for name, (remote, calls) in plans.items():
    print(f"== {name} -> {repo_id(name, manifest)} (Hub state: {remote.source})")
    for call in calls:
      for line in call.describe():
        print(("DRY RUN " if args.dry_run else "") + line)
    if api is not None:  # pragma: no cover (needs the Hub)
      execute(calls, api)
      package = args.dist / name / "torch-ext" / release.package_name(name, manifest)
      snap = api_snapshot.snapshot_path(name, manifest["kernel"][name]["version"])
      snap.write_text(json.dumps(api_snapshot.extract(package), indent=1, sort_keys=True) + "\n")
      print(f"{name}: published; API snapshot {snap.name} updated (commit it)")
  return 0


if __name__ == "__main__":
  sys.exit(main())
