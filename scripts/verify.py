"""Checks that a kernel build on disk is exactly what was released: its files against the
digest in its metadata.json, with kernels' own hasher.

    python scripts/verify.py dist/rms-norm-tpu                 # a repo folder (every variant)
    python scripts/verify.py path/to/build/torch-cpu           # one variant
    python scripts/verify.py --lockfile kernels.lock tpu-kernels/rms-norm-tpu
                                     # the variant get_locked_kernel would load, from the HF cache
    python scripts/verify.py --version 1 tpu-kernels/rms-norm-tpu   # what get_kernel(version=1) would load

Why this script exists beside kernels' own check: kernels 0.19.1 checks a variant's files
against its digest when it loads it (`DigestValidator`), but a variant from the Hub cache
only the first time: it then stores a receipt (`<HF_HUB_CACHE>/.verified-kernels/`) and
later loads of that commit and variant skip the hashing, so a cached file changed after
the first load is imported unnoticed (tests/release/test_release_loading.py shows it). A
variant whose metadata has no digest only logs a warning. This script re-hashes every
time, before anything is imported, and lists every missing, unknown or changed file:
`Metadata` parses metadata.json, `Digest.hash_variant` re-hashes the variant (every file
but metadata.json / its signature, `__pycache__` and *.pyc excluded), `Digest.validate`
compares. The variant is located by kernels' public `install_kernel(...,
local_files_only=True)`, the resolver `get_kernel` / `get_locked_kernel` use offline, so
it is the folder the loader would import. `scripts/upload.py` runs the same check on
dist/ before publishing.

What it does not give: protection against someone who rewrites metadata.json too. Only
a signature can (sigstore, which needs a GitHub Actions OIDC identity this repository does
not have), or a digest obtained out of band (the build report of the release).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def verify_variant(variant: Path) -> list[str]:
  """Problems with one variant folder; [] when every file matches its digest."""
  from kernels._rust import Digest, DigestValidationError, Metadata

  variant = Path(variant)
  metadata_path = variant / "metadata.json"
  if not metadata_path.is_file():
    return [f"{variant}: no metadata.json"]
  try:
    metadata = Metadata.read_from_file(metadata_path)
  except ValueError as e:
    return [f"{variant}: metadata.json does not parse: {e}"]
  if metadata.digest is None:
    return [f"{variant}: metadata.json has no digest"]
  current = Digest.hash_variant(metadata.digest.algorithm, variant)
  try:
    metadata.digest.validate(current)
  except DigestValidationError as e:
    return [f"{variant.name}: {v}" for v in e.violations]
  problems = []
  provenance = metadata.provenance
  if provenance is None or provenance.kernel is None:
    problems.append(f"{variant.name}: no source commit in metadata.json (provenance.kernel)")
  elif provenance.kernel.dirty:
    problems.append(f"{variant.name}: built from uncommitted changes on top of {provenance.kernel.commit}")
  return problems


def variants_of(path: Path) -> list[Path]:
  path = Path(path)
  if (path / "metadata.json").is_file():
    return [path]
  build = path / "build" if (path / "build").is_dir() else path
  return sorted(p for p in build.iterdir() if (p / "metadata.json").is_file())


def verify_path(path: Path) -> list[str]:
  variants = variants_of(path)
  if not variants:
    return [f"{path}: no build variant (build/<variant>/metadata.json) found"]
  return [problem for v in variants for problem in verify_variant(v)]


def locked_commit(repo_id: str, lockfile: Path) -> str:
  """The commit `kernels.lock` pins for `repo_id` (a full 40/64-hex id, as kernels writes it)."""
  from kernels._rust import KernelLocks

  locks = KernelLocks.from_json(Path(lockfile).read_text())
  for dependency, lock in locks.items():
    if dependency.repo_id == repo_id:
      return str(lock.commit)
  raise ValueError(f"{repo_id} is not locked in {lockfile}")


def cached_variant(repo_id: str, *, version: int | None = None, revision: str | None = None,
                   backend: str | None = None) -> Path:
  """The variant folder `get_kernel(repo_id, version=...)` (or, with the locked commit as
  revision, `get_locked_kernel`) loads from the Hugging Face cache with HF_HUB_OFFLINE=1."""
  from kernels import install_kernel

  return Path(install_kernel(repo_id, version=version, revision=revision, backend=backend,
                             local_files_only=True, trust_remote_code=[repo_id]))


def locked_variant(repo_id: str, lockfile: Path, backend: str | None = None) -> Path:
  """The variant folder `get_locked_kernel(repo_id, lockfile=lockfile)` loads offline."""
  return cached_variant(repo_id, revision=locked_commit(repo_id, lockfile), backend=backend)


class TamperedKernelError(RuntimeError):
  pass


def get_verified_locked_kernel(repo_id: str, lockfile: Path, **kwargs):
  """`kernels.get_locked_kernel`, after re-hashing the files it is about to import (the
  loader itself re-hashes a cached variant only on its first load)."""
  from kernels import get_locked_kernel

  problems = verify_variant(locked_variant(repo_id, lockfile))
  if any("built from uncommitted" not in p for p in problems):
    raise TamperedKernelError(f"{repo_id}: " + "; ".join(problems))
  return get_locked_kernel(repo_id, lockfile=Path(lockfile), **kwargs)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("targets", nargs="+", help="folders, or repo ids with --lockfile / --version")
  group = parser.add_mutually_exclusive_group()
  group.add_argument("--lockfile", type=Path)
  group.add_argument("--version", type=int)
  parser.add_argument("--backend", default=None, help="variant backend (default: as the loader detects)")
  args = parser.parse_args(argv)
  status = 0
  for target in args.targets:
    if args.lockfile:
      path = locked_variant(target, args.lockfile, args.backend)
      problems = verify_variant(path)
    elif args.version is not None:
      path = cached_variant(target, version=args.version, backend=args.backend)
      problems = verify_variant(path)
    else:
      path = Path(target)
      problems = verify_path(path)
    failures = [p for p in problems if "built from uncommitted" not in p]
    for problem in problems:
      print(f"{'FAIL' if problem in failures else 'warn'} {target}: {problem}")
    if failures:
      status = 1
    else:
      print(f"ok   {target}: {path}: every file matches its digest")
  return status


if __name__ == "__main__":
  sys.exit(main())
