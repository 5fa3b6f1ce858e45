"""The autotuners: each rates a kernel's candidate tilings with libtpu's static estimate and
writes the winners as the kernel's per-chip JSON tables, which ship with it
(kernels/tpu_kernels/tuned/<kernel>.<chip>.json; the format and its reader:
kernels/tpu_kernels/tuning_tables.py).

    python benchmarks/tuning/flash_attention.py   (block_q, block_k) of causal prefill
    python benchmarks/tuning/paged_attention.py   decode block_kv
    python benchmarks/tuning/ragged_dot.py        the grouped matmul's forward blocks

What they share is here: their options, the rating log (every rating as JSON lines in
benchmarks/results/<kernel>_tuning.jsonl; re-rating some chips keeps the other chips' rows;
`--from-log` rebuilds a table from the log alone) and the table writer. Each rating runs in
a child process (estimator/children.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Callable, Iterable

from benchmarks import ROOT, read_rows


def argument_parser(doc: str, log: str | Path, chips: Iterable[str]) -> argparse.ArgumentParser:
  """The options every tuner takes: where the tables and the log go, which chips to
  re-rate, and rebuilding the tables from the log alone."""
  from tpu_kernels import tuning_tables
  p = argparse.ArgumentParser(description=doc.splitlines()[0])
  p.add_argument("--out", default=str(tuning_tables.TABLES_DIR),
                 help="directory of the <kernel>.<chip>.json tables (default: the kernels')")
  p.add_argument("--log", default=str(log))
  p.add_argument("--chips", nargs="+", default=list(chips),
                 help="re-rate these chips; the log's rows for the others are kept")
  p.add_argument("--from-log", action="store_true",
                 help="rebuild the table from the ratings already in --log (no estimator)")
  return p


def kept_rows(path: str | Path, replaced: Callable[[dict], bool]) -> list[dict]:
  """The rows of the log at `path` that a new run does not replace."""
  return [r for r in read_rows(path) if not replaced(r)]


def write_tables(out_dir: str | Path, tuner_file: str, kernel: str, key_type,
                 value_fields: tuple[str, ...], table: dict[tuple, object],
                 chips: Iterable[str], about: list[str]) -> None:
  """Writes `table` ({(chip, *key): value}) as `kernel`'s JSON table per chip of `chips`
  into `out_dir` (tuning_tables.write), naming `tuner_file` (its path) as their generator."""
  from tpu_kernels import tuning_tables
  command = Path(tuner_file).resolve().relative_to(ROOT).as_posix()
  paths = tuning_tables.write(Path(out_dir), kernel, key_type, value_fields, table,
                              chips=tuple(chips), about=about,
                              generated_by=f"python {command}")
  print(f"wrote {', '.join(str(p) for p in paths)} ({len(table)} entries)")
