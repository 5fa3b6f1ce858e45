"""benchmarks/estimator/children.py and benchmarks/tuning/: the child runner that every rating
shares, the rating log and the table writer of the tuners, and the shipped tables against
their logs (fast; no jax, no estimator)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpu_kernels import tuning_tables

from benchmarks import ROOT, read_rows, tuning, write_rows
from benchmarks.estimator import children


def _script(tmp_path, body: str) -> Path:
  path = tmp_path / "child.py"
  path.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n"
                  "from benchmarks.estimator import children\n" + textwrap.dedent(body))
  return path


def test_run_child_collects_rows_and_ignores_other_output(tmp_path):
  child = _script(tmp_path, """
      print("some log line")
      children.print_row({"a": 1})
      children.print_row({"a": 2, "b": [1, 2]})
      print(sys.argv[1:])
  """)
  rows, error = children.run_child(child, ["x", "y"])
  assert error is None
  assert rows == [{"a": 1}, {"a": 2, "b": [1, 2]}]


def test_run_child_reports_libtpu_fatal_line(tmp_path):
  # libtpu's LLO_CHECK: a fatal log line on stderr, then an abort.
  child = _script(tmp_path, """
      children.print_row({"partial": True})
      print("W1130 12:00:00.000 1 x.cc:1] a warning", file=sys.stderr)
      print("F1130 12:00:00.000 1 llo.cc:9] Check failed: type", file=sys.stderr)
      print("*** Check failure stack trace: ***", file=sys.stderr)
      sys.exit(134)
  """)
  rows, error = children.run_child(child, [])
  assert rows == [{"partial": True}]
  assert error.startswith("exit 134: F1130") and "Check failed: type" in error


def test_run_child_reports_an_allocation_failure(tmp_path):
  # The estimator out of memory: no fatal log line, libtpu's startup "Error" line earlier.
  child = _script(tmp_path, """
      print("E0000 common_lib.cc:554] INVALID_ARGUMENT: Error: unexpected worker hostname",
            file=sys.stderr)
      print("libc++abi: terminating due to uncaught exception of type std::bad_alloc",
            file=sys.stderr)
      sys.exit(134)
  """)
  rows, error = children.run_child(child, [])
  assert rows == [] and error.startswith("exit 134: libc++abi") and "bad_alloc" in error


def test_run_child_without_a_row_is_an_error(tmp_path):
  child = _script(tmp_path, """
      print("Traceback ...", file=sys.stderr)
      print("ValueError: bad tile", file=sys.stderr)
  """)
  rows, error = children.run_child(child, [])
  assert rows == [] and error == "no result: ValueError: bad tile"


_V5E_ABORTING_CHILD = """
    import os
    if children.V5E_VMEM_MSA_OFF not in os.environ.get("LIBTPU_INIT_ARGS", "").split():
      print("F1204 21:29:53.074693 2378 llo_dumper.cc:1585] Static LLO profiling of "
            "ragged_dot.1 failed: INVALID_ARGUMENT: " + children.V5E_DMA_ABORT, file=sys.stderr)
      sys.exit(-6)
    children.print_row({"cycles": 1, "method": "static estimate"})
    children.print_row({"cycles": 2})
"""


def test_run_child_retries_v5es_vmem_dma_abort_with_the_assignment_off(tmp_path):
  rows, error = children.run_child(_script(tmp_path, _V5E_ABORTING_CHILD), [],
                                 env={**os.environ, "LIBTPU_INIT_ARGS": "--some_flag=1"})
  assert error is None
  assert rows == [{"cycles": 1, "method": f"static estimate; {children.V5E_RETRY_NOTE}"},
                  {"cycles": 2, "estimator_retry": children.V5E_RETRY_NOTE}]


def test_run_child_reports_both_errors_when_the_retry_fails_too(tmp_path):
  child = _script(tmp_path, """
      print("F1204 llo_dumper.cc:1585] failed: " + children.V5E_DMA_ABORT, file=sys.stderr)
      sys.exit(-6)
  """)
  rows, error = children.run_child(child, [])
  assert rows == [] and error.count(children.V5E_DMA_ABORT) == 2
  assert f"with {children.V5E_VMEM_MSA_OFF}" in error


def test_run_child_timeout(tmp_path):
  child = _script(tmp_path, "import time\ntime.sleep(30)\n")
  rows, error = children.run_child(child, [], timeout=1)
  assert rows == [] and "over 1 s" in error


def test_child_env_drops_the_parents_profile_directory(monkeypatch):
  monkeypatch.setenv("LIBTPU_INIT_ARGS",
                     "--a=1 --xla_jf_dump_static_llo_profile_to=/tmp/x --b=2")
  env = children.child_env(EXTRA="1")
  assert "static_llo_profile" not in env["LIBTPU_INIT_ARGS"]
  assert "--a=1" in env["LIBTPU_INIT_ARGS"] and "--b=2" in env["LIBTPU_INIT_ARGS"]
  assert env["EXTRA"] == "1" and env["JAX_PLATFORMS"] == "cpu"


def test_enable_static_profile_adds_the_flag_once(monkeypatch):
  monkeypatch.setenv("LIBTPU_INIT_ARGS", "--a=1")
  children.enable_static_profile()
  first = os.environ["LIBTPU_INIT_ARGS"]
  directory = children.PROFILE_FLAG.search(first).group(0).split("=", 1)[1]
  assert Path(directory).is_dir() and first.startswith("--a=1 ")
  children.enable_static_profile()
  assert os.environ["LIBTPU_INIT_ARGS"] == first


def test_static_profile_directory_is_removed_at_exit(tmp_path):
  child = _script(tmp_path, "import os\n"
                  "children.enable_static_profile()\n"
                  "d = children.PROFILE_FLAG.search(os.environ['LIBTPU_INIT_ARGS']).group(0)\n"
                  "d = d.split('=', 1)[1]\nassert os.path.isdir(d)\n"
                  "children.print_row({'dir': d})\n")
  rows, error = children.run_child(child, [], env={**os.environ, "LIBTPU_INIT_ARGS": ""})
  assert error is None and rows[0]["dir"] and not Path(rows[0]["dir"]).exists()


def test_static_profile_directory_is_removed_when_the_child_aborts(tmp_path):
  child = _script(tmp_path, "import os\n"
                  "children.enable_static_profile()\n"
                  "d = children.PROFILE_FLAG.search(os.environ['LIBTPU_INIT_ARGS']).group(0)\n"
                  "children.print_row({'dir': d.split('=', 1)[1]})\n"
                  "os.abort()\n")   # as libtpu's fatal errors do: no exit handlers run
  rows, error = children.run_child(child, [], env={**os.environ, "LIBTPU_INIT_ARGS": ""})
  assert error.startswith("exit -6") and rows[0]["dir"]
  assert not Path(rows[0]["dir"]).exists()


def test_log_round_trip_and_kept_rows(tmp_path):
  log = tmp_path / "ratings.jsonl"
  assert read_rows(log) == []
  rows = [dict(chip="v5e", cycles=1), dict(chip="v6e", cycles=2), dict(chip="v5e", cycles=None)]
  write_rows(log, rows)
  assert read_rows(log) == rows
  assert tuning.kept_rows(log, lambda r: r["chip"] == "v5e") == [rows[1]]


@pytest.mark.parametrize("kernel", ["flash_attention", "paged_attention", "ragged_dot"])
def test_tables_are_reproduced_from_their_logs(kernel, tmp_path):
  """The shipped tables are exactly what their tuner builds from the shipped rating log."""
  result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "tuning" / f"{kernel}.py"),
                           "--from-log", "--out", str(tmp_path)], capture_output=True, text=True,
                          env=children.child_env())
  assert result.returncode == 0, result.stderr[-2000:]
  shipped = sorted(tuning_tables.TABLES_DIR.glob(f"{kernel}.*.json"))
  assert [p.name for p in shipped] == [f"{kernel}.v5e.json", f"{kernel}.v6e.json"]
  assert [p.name for p in sorted(tmp_path.iterdir())] == [p.name for p in shipped]
  for path in shipped:
    assert (tmp_path / path.name).read_text() == path.read_text()


def test_paged_attention_card_shows_its_tuning_log():
  """paged-attention-tpu's card quotes the tuner's table of winners as the shipped log makes
  it (`benchmarks/tuning/paged_attention.py --markdown`), so the card cannot drift from the
  table."""
  result = subprocess.run([sys.executable,
                           str(ROOT / "benchmarks" / "tuning" / "paged_attention.py"),
                           "--markdown"], capture_output=True, text=True, env=children.child_env())
  assert result.returncode == 0, result.stderr[-2000:]
  assert result.stdout.count("\n") == 2 + 18   # header, rule, one row per key of the grid
  card = (ROOT / "torch-ext" / "paged_attention_tpu" / "CARD.md").read_text()
  assert result.stdout in card
