"""One rating per child process: what every estimator-driven tool shares (benchmarks/estimate.py,
the peers, the rating methods, the tuners, the probes).

Every rating runs in a child process: libtpu's static estimator may abort the process
(an LLO_CHECK is a fatal log line, not an exception), and its memory grows with every
compile of a process. A child prints each result as one `ROW {json}` line on stdout;
`run_child` collects them, and on failure returns the first fatal log line as the error.
A child is a script of this package (`python benchmarks/<path>.py`, in any venv: it puts the
repository root on sys.path itself) that asks for the static profile (`enable_static_profile`)
before it imports jax, where it wants cycles.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterable

ROW_PREFIX = "ROW "
PROFILE_FLAG = re.compile(r"--xla_jf_dump_static_llo_profile_to=\S+")


def enable_static_profile() -> None:
  """Asks libtpu to put its static cycle estimate into every Mosaic kernel it compiles
  (`--xla_jf_dump_static_llo_profile_to`, a fresh directory), unless already asked. Call
  before jax is imported: libtpu reads LIBTPU_INIT_ARGS once, when it loads. Not for
  processes that rate plain XLA by cost_analysis: with the flag, ragged_dot crashes."""
  args = os.environ.get("LIBTPU_INIT_ARGS", "")
  if not PROFILE_FLAG.search(args):
    directory = tempfile.mkdtemp(prefix="static_llo_profile_")
    # The cycles are read from the compiled HLO, not from these dumps: gone at exit (they
    # piled up by the hundred in /tmp otherwise).
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    os.environ["LIBTPU_INIT_ARGS"] = f"{args} --xla_jf_dump_static_llo_profile_to={directory}"
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


# A child's address-space cap where a rating may take all memory (some grouped-matmul tilings
# make the estimator do so): the child fails with a row instead of the machine swapping.
CHILD_MEMORY_BYTES = 12 << 30


def limit_memory(nbytes: int = CHILD_MEMORY_BYTES) -> None:
  """Called in a child: caps its address space at `nbytes` (RLIMIT_AS)."""
  import resource
  resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))


def print_row(row: dict) -> None:
  """Called in a child: hands one result to the parent."""
  print(ROW_PREFIX + json.dumps(row), flush=True)


def fatal_line(stderr: str) -> str:
  """The line that says why a child died: libtpu's first fatal log line (`F1130 ...`), else
  a C++ allocation failure (libtpu's startup logs an unrelated "Error" line on every CPU
  machine, which would hide it), else the last line naming an error, else the last line."""
  lines = stderr.strip().splitlines()
  found = [l for l in lines if re.match(r"F\d{4} ", l)][:1] or \
      [l for l in lines if "bad_alloc" in l][:1] or \
      [l for l in lines if "Error" in l][-1:] or lines[-1:]
  return found[0][:400] if found else ""


def short_error(error: str) -> str:
  """A child's error for a table cell: libtpu's LLO check reduced to what it expected, else
  the message without libtpu's log prefix (time, thread, file), cut to 120 characters."""
  expected = re.search(r"LLO_CHECK failure.*?(Expected \S+ got [^,\s]+)", error)
  if expected:
    return f"the estimator aborts: LLO_CHECK {expected.group(1).strip()}"
  return re.sub(r"F\d{4} [\d:.]+\s+\d+ \S+\] ", "", error)[:120]


def child_env(**extra: str) -> dict[str, str]:
  """This process's environment without a static-profile directory (each child that wants
  the profile makes its own, before jax loads), plus `extra`."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1", **extra}
  env["LIBTPU_INIT_ARGS"] = PROFILE_FLAG.sub("", env.get("LIBTPU_INIT_ARGS", "")).strip()
  return env


# v5e's static estimator has no latency model for a DMA from VMEM (direction 10 on "VL/VLP",
# v5 lite): it aborts on a kernel whose scalar-prefetched table XLA's memory-space assignment
# has moved into VMEM, as it does for some tables of a few hundred words (gpt-oss's down at
# m = 256 rows and more). With that assignment off (`V5E_VMEM_MSA_OFF`) the table stays in
# HBM and the kernel rates; its cycles move by under 1% where both rate (gpt-oss down bf16
# and int8, Qwen3 down, m = 128 on v5e: 20,061 -> 20,107 cycles per visit at most).
V5E_DMA_ABORT = "Unsupported DMA direction: 10 on VL/VLP"
V5E_VMEM_MSA_OFF = "--xla_vf_vmem_memory_space_assignment=false"
V5E_RETRY_NOTE = (f"rated with XLA's VMEM memory-space assignment off ({V5E_VMEM_MSA_OFF}): "
                  f"the estimator aborts otherwise ('{V5E_DMA_ABORT}')")


def run_child(script: str | Path, args: Iterable[str], *, timeout: float | None = None,
              env: dict[str, str] | None = None,
              python: str | Path | None = None) -> tuple[list[dict], str | None]:
  """Runs `python script args...` (this interpreter unless `python` names another); returns
  (the rows it printed, None) or, if it failed or printed no row, (the rows it printed, why).
  A child that dies of v5e's VMEM-DMA abort is run once more with `V5E_VMEM_MSA_OFF`; its
  rows then carry `V5E_RETRY_NOTE` (in `method` where they have one, else in
  `estimator_retry`)."""
  env = env or child_env()
  rows, error = _run_child_once(script, args, timeout=timeout, env=env, python=python)
  if error is None or V5E_DMA_ABORT not in error:
    return rows, error
  retry_env = {**env, "LIBTPU_INIT_ARGS": f"{env.get('LIBTPU_INIT_ARGS', '')} {V5E_VMEM_MSA_OFF}"}
  rows, retry_error = _run_child_once(script, args, timeout=timeout, env=retry_env, python=python)
  if retry_error:
    return rows, f"{error} / with {V5E_VMEM_MSA_OFF}: {retry_error}"
  for row in rows:
    if isinstance(row.get("method"), str):
      row["method"] += f"; {V5E_RETRY_NOTE}"
    else:
      row["estimator_retry"] = V5E_RETRY_NOTE
  return rows, None


def _run_child_once(script, args, *, timeout, env, python) -> tuple[list[dict], str | None]:
  """One run of the child. Its temporary files (its static-profile directory among them) go
  to a directory of ours, removed when it ends: a child libtpu aborts, or a timeout kills,
  never runs its own exit handlers (such directories piled up in /tmp)."""
  with tempfile.TemporaryDirectory(prefix="tuning_child_") as child_tmp:
    try:
      result = subprocess.run([str(python or sys.executable), str(script), *args],
                              capture_output=True, text=True, timeout=timeout,
                              env={**env, "TMPDIR": child_tmp})
    except subprocess.TimeoutExpired:
      return [], f"rating took over {timeout} s"
  rows = [json.loads(line[len(ROW_PREFIX):]) for line in result.stdout.splitlines()
          if line.startswith(ROW_PREFIX)]
  if result.returncode:
    return rows, f"exit {result.returncode}: {fatal_line(result.stderr)}"
  if not rows:
    return rows, f"no result: {fatal_line(result.stderr)}"
  return rows, None
