"""Does the README's TPU-VM install line still give a user the versions this project tests?

    python scripts/check_install_line.py [--python PYTHON] [--report FILE]

Resolves build.toml's `tpu-vm-install` line (the README's and every card's) plus an
unpinned `transformers`, the way a user on a TPU VM would type them, with
`pip install --dry-run --ignore-installed --report` against the package index: nothing is
installed. Each package of the stack (STACK) that pip picks must be the version the locks
test: requirements-torchtpu.txt's (the real torch-tpu wheel's leg), else requirements.txt's
(the integrations' leg, the one with transformers). Exits 1 with a table of what differs:
a new release on the index (transformers 5.26, say) that the line lets in shows up here,
in README command 1, before a user meets it.

`--python`: the interpreter whose pip resolves (default: a Python 3.11, as on the TPU VM:
torch-tpu 0.2.0 is cp311 only). `--report`: read an existing pip report instead of
running pip (tests/release uses this with a report it writes).
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The packages whose versions the project's results depend on; pip's other picks (numpy,
# tokenizers, ...) are the index's business.
STACK = ("torch-tpu", "torch", "jax", "jaxlib", "libtpu", "kernels", "transformers",
         "huggingface-hub")
# Searched in this order: the first lock that pins a package is the tested version.
LOCKS = ("requirements-torchtpu.txt", "requirements.txt")


def normalize(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def install_line() -> str:
  with open(ROOT / "build.toml", "rb") as f:
    return tomllib.load(f)["collection"]["tpu-vm-install"]


def user_command(line: str) -> list[str]:
  """The pip arguments a user types: the install line's requirements, plus `transformers`
  unless the line pins it already."""
  words = shlex.split(line)
  if words[:2] != ["pip", "install"]:
    raise ValueError(f"build.toml tpu-vm-install is not a `pip install` line: {line!r}")
  requirements = words[2:]
  if "transformers" not in {normalize(re.split(r"[=<>!~\[]", r)[0]) for r in requirements}:
    requirements.append("transformers")
  return requirements


def tested_versions() -> dict[str, str]:
  """{package: version} of STACK from the locks (LOCKS order)."""
  tested = {}
  for lock in LOCKS:
    for line in (ROOT / lock).read_text().splitlines():
      if "==" in line and not line.lstrip().startswith("#"):
        name, version = (part.strip() for part in line.split("==", 1))
        if normalize(name) in STACK:
          tested.setdefault(normalize(name), version)
  missing = set(STACK) - set(tested)
  if missing:
    raise ValueError(f"no lock pins {sorted(missing)} ({', '.join(LOCKS)})")
  return tested


def picked_versions(report: dict) -> dict[str, str]:
  """{package: version} of STACK in a `pip install --report` (local labels such as +cpu
  dropped: the CPU and CUDA builds of torch 2.13.0 are one release)."""
  return {normalize(item["metadata"]["name"]): item["metadata"]["version"].split("+")[0]
          for item in report["install"] if normalize(item["metadata"]["name"]) in STACK}


def mismatches(picked: dict[str, str], tested: dict[str, str]) -> list[tuple[str, str, str]]:
  """(package, picked, tested) for each STACK package pip picks at another version, or
  does not pick at all."""
  return [(name, picked.get(name, "(not installed)"), tested[name]) for name in STACK
          if picked.get(name) != tested[name]]


def resolve(python: str, requirements: list[str]) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    report = Path(tmp) / "report.json"
    subprocess.run([python, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                    "--quiet", "--disable-pip-version-check", "--no-input",
                    "--report", str(report), *requirements], check=True)
    return json.loads(report.read_text())


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--python", default="python3.11")
  parser.add_argument("--report", type=Path, help="a pip report to check instead of running pip")
  args = parser.parse_args(argv)
  requirements = user_command(install_line())
  report = (json.loads(args.report.read_text()) if args.report
            else resolve(args.python, requirements))
  wrong = mismatches(picked_versions(report), tested_versions())
  command = "pip install " + " ".join(requirements)
  if wrong:
    print(f"`{command}` does not give the tested stack:", file=sys.stderr)
    for name, picked, tested in wrong:
      print(f"  {name}: pip picks {picked}, the locks test {tested}", file=sys.stderr)
    print("Pin the line (build.toml tpu-vm-install) or move the locks and test.", file=sys.stderr)
    return 1
  tested = tested_versions()
  print(f"`{command}` gives the tested stack: "
        + ", ".join(f"{name} {tested[name]}" for name in STACK))
  return 0


if __name__ == "__main__":
  sys.exit(main())
