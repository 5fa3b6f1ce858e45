"""The autotuned tiling tables: one JSON file per kernel and chip, and the one reader.

`tuned/<kernel>.<chip>.json` (e.g. `tuned/ragged_dot.v6e.json`), written by the kernel's
tuner in benchmarks/ (`write`), read by the kernel at import (`load`):

    {"kernel": "ragged_dot", "chip": "v6e",
     "generated_by": "python benchmarks/tuning/ragged_dot.py",
     "key": ["dtype", "weight_dtype", "num_rhs", "m_bucket", "k", "n", "num_groups",
             "interleaved", "f32_out"],
     "value": ["block_m", "block_k", "block_n"],
     "about": ["what the entries are and how they were chosen", ...],
     "entries": [
       [["bfloat16", "bfloat16", 1, 512, 768, 2048, 128, false, false], [64, 768, 2048]],
       ...]}

`key` names the fields of the kernel's `TuningKey` after `chip` (the file's chip), in
order; `load` checks them against the dataclass, so a table and the lookup that reads it
cannot drift apart silently. One entry per line, sorted by key, so a re-tune diffs
entry by entry. The build copies a kernel's files into its Hub repo beside this module.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

TABLES_DIR = Path(__file__).resolve().parent / "tuned"


def path(kernel: str, chip: str, directory: Path = TABLES_DIR) -> Path:
  return Path(directory) / f"{kernel}.{chip}.json"


def _key_fields(key_type) -> list[str]:
  names = [f.name for f in dataclasses.fields(key_type)]
  if names[0] != "chip":
    raise TypeError(f"{key_type.__name__}'s first field must be chip, not {names[0]}")
  return names[1:]


def load(kernel: str, key_type, value_fields: tuple[str, ...],
         directory: Path = TABLES_DIR) -> dict[tuple, object]:
  """Every chip's table of `kernel`, as {(chip, *key): value}: value a tuple in the order
  of `value_fields`, or the bare value when there is one field. Raises ValueError when a
  file's chip, kernel, key or value fields are not what the caller reads."""
  table = {}
  for file in sorted(Path(directory).glob(f"{kernel}.*.json")):
    doc = json.loads(file.read_text())
    expected = dict(kernel=kernel, key=_key_fields(key_type), value=list(value_fields))
    found = {name: doc.get(name) for name in expected}
    if found != expected or file.name != path(kernel, doc.get("chip", "?")).name:
      raise ValueError(f"{file}: expected {expected} in a file named "
                       f"{kernel}.<chip>.json, found {found} and chip {doc.get('chip')!r}")
    for key, value in doc["entries"]:
      table[(doc["chip"], *key)] = value[0] if len(value_fields) == 1 else tuple(value)
  return table


def write(directory: Path, kernel: str, key_type, value_fields: tuple[str, ...],
          entries: dict[tuple, object], *, chips: tuple[str, ...], generated_by: str,
          about: list[str]) -> list[Path]:
  """Writes `entries` ({(chip, *key): value}, as `load` returns them) as one file per chip
  of `chips` (a chip without entries gets an empty table), and returns the paths."""
  written = []
  for chip in chips:
    mine = sorted((key[1:], value) for key, value in entries.items() if key[0] == chip)
    values = [list(value) if isinstance(value, tuple) else [value] for _, value in mine]
    if any(len(v) != len(value_fields) for v in values):
      raise ValueError(f"{kernel}: every value must have the fields {value_fields}")
    lines = [json.dumps([list(key), value]) for (key, _), value in zip(mine, values)]
    fields = [("kernel", kernel), ("chip", chip), ("generated_by", generated_by),
              ("key", _key_fields(key_type)), ("value", list(value_fields))]
    text = "{\n" + "".join(f' "{name}": {json.dumps(v)},\n' for name, v in fields)
    text += ' "about": [\n' + ",\n".join(f"  {json.dumps(line)}" for line in about) + "\n ],\n"
    text += ' "entries": [' + ("\n  " + ",\n  ".join(lines) + "\n ]" if lines else "]") + "\n}\n"
    out = path(kernel, chip, directory)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    written.append(out)
  return written
