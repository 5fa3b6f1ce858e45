"""Checks that a kernel build on disk is exactly what was released: its files against the
digest in its metadata.json, with kernels' own hasher.

    python scripts/verify.py dist/rms-norm-tpu                 # a repo folder (every variant)
    python scripts/verify.py path/to/build/torch-cpu           # one variant
    python scripts/verify.py --lockfile kernels.lock tpu-kernels/rms-norm-tpu
                                     # the variant get_locked_kernel would load, from the HF cache
    python scripts/verify.py --version 1 tpu-kernels/rms-norm-tpu   # what get_kernel(version=1) would load

Why this script exists: kernels 0.17 has the digest check, but only behind a sigstore
signature. `kernels.verify.verify_variant` (and `kernels verify-signature`) first requires
`metadata.json.sigstore` signed by a trusted GitHub workflow and returns
`SignatureBundleMissing` otherwise, before looking at any file; `get_kernel` /
`get_locked_kernel` never re-hash anything, and a `kernels.lock` pins only the Hub commit
(in the cache that is a directory name, not a content hash). Signing needs GitHub
Actions' OIDC identity, which this repository does not have. So this runs the second half
of `verify_variant` on its own: `Metadata` parses metadata.json, `Digest.hash_variant`
re-hashes the variant (every file but metadata.json / its signature, `__pycache__` and
*.pyc excluded), `Digest.validate` lists every missing, unknown or changed file. The
variant is located by kernels' own resolvers (`LockedHubCacheResolver` for a lock file,
`HubCacheResolver` for a version), so it is the folder the loader would import.

What it does not give: protection against someone who rewrites metadata.json too. Only
a signature can, or a digest obtained out of band (the build report of the release).
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


def locked_variant(repo_id: str, lockfile: Path, backend: str | None = None) -> Path:
  """The variant folder `get_locked_kernel(repo_id, lockfile=lockfile)` loads offline."""
  from kernels.hf_hub import _get_hf_api
  from kernels.locking import get_locked_kernel_revision
  from kernels.resolver import LockedHubCacheResolver

  locks, dependency = get_locked_kernel_revision(repo_id, Path(lockfile))
  resolver = LockedHubCacheResolver(kernel_locks=locks, trust_remote_code=True)
  return resolver.resolve(api=_get_hf_api(), backend=backend, kernel=dependency).variant_path


def cached_variant(repo_id: str, version: int, backend: str | None = None) -> Path:
  """The variant folder `get_kernel(repo_id, version=version)` loads with HF_HUB_OFFLINE=1."""
  from kernels._rust import KernelDependency, KernelVersion
  from kernels.hf_hub import _get_hf_api
  from kernels.resolver import HubCacheResolver

  dependency = KernelDependency(repo_id=repo_id, version=KernelVersion.Version(version))
  resolver = HubCacheResolver(trust_remote_code=True)
  return resolver.resolve(api=_get_hf_api(), backend=backend, kernel=dependency).variant_path


class TamperedKernelError(RuntimeError):
  pass


def get_verified_locked_kernel(repo_id: str, lockfile: Path, **kwargs):
  """`kernels.get_locked_kernel`, after checking the files it is about to import."""
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
      path = cached_variant(target, args.version, args.backend)
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
