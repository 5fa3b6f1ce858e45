"""kernels/tpu_kernels/tuning_tables.py: the per-chip JSON tables' writer and reader
(fast; no jax). The shipped tables themselves are checked against their tuners' logs in
test_tuning.py, and against their kernels' lookups in test_<kernel>_tiling.py."""

import dataclasses
import json

import pytest

from tpu_kernels import tuning_tables


@dataclasses.dataclass(frozen=True)
class _Key:
  chip: str
  dtype: str
  head_dim: int


def test_tables_round_trip_one_file_per_chip_one_entry_per_line(tmp_path):
  entries = {("v6e", "bfloat16", 128): (512, 1024, 33554432), ("v5e", "int8", 64): (256, 256, 0),
             ("v6e", "bfloat16", 64): (256, 512, 0)}
  fields = ("block_q", "block_k", "vmem_limit_bytes")
  paths = tuning_tables.write(tmp_path, "toy", _Key, fields, entries, chips=("v5e", "v6e", "v7"),
                              generated_by="hand", about=["a test table"])
  assert [p.name for p in paths] == ["toy.v5e.json", "toy.v6e.json", "toy.v7.json"]
  v6e = json.loads(paths[1].read_text())
  assert v6e["key"] == ["dtype", "head_dim"] and v6e["value"] == list(fields)
  assert v6e["entries"] == [[["bfloat16", 64], [256, 512, 0]], [["bfloat16", 128], [512, 1024, 33554432]]]
  assert paths[1].read_text().count("\n  [[") == 2                 # one entry per line, sorted
  assert json.loads(paths[2].read_text())["entries"] == []         # a chip with no entries
  assert tuning_tables.load("toy", _Key, fields, tmp_path) == entries
  single = {("v5e", "int8", 64): 512}
  tuning_tables.write(tmp_path, "one", _Key, ("block_kv",), single, chips=("v5e",),
                      generated_by="hand", about=[])
  assert tuning_tables.load("one", _Key, ("block_kv",), tmp_path) == single


def test_a_table_that_does_not_match_its_reader_is_refused(tmp_path):
  fields = ("block_q", "block_k", "vmem_limit_bytes")
  [path] = tuning_tables.write(tmp_path, "toy", _Key, fields, {}, chips=("v6e",),
                               generated_by="hand", about=[])
  with pytest.raises(ValueError, match="expected"):
    tuning_tables.load("toy", _Key, ("block_q", "block_k"), tmp_path)      # value fields
  doc = json.loads(path.read_text())
  path.write_text(json.dumps(dict(doc, key=["head_dim", "dtype"])))
  with pytest.raises(ValueError, match="expected"):
    tuning_tables.load("toy", _Key, fields, tmp_path)                      # key order
  path.write_text(json.dumps(dict(doc, chip="v5e")))
  with pytest.raises(ValueError, match="named"):
    tuning_tables.load("toy", _Key, fields, tmp_path)                      # chip vs file name
  with pytest.raises(ValueError, match="fields"):
    tuning_tables.write(tmp_path, "toy", _Key, fields, {("v6e", "bf16", 64): (1, 2)},
                        chips=("v6e",), generated_by="hand", about=[])
