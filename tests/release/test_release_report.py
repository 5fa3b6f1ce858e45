"""The pytest plugin that writes test reports, on real pytest runs, and the gate reading them.

The runs collect small stand-in test files named like the real ones (one for each file
the gate lists for rms-norm-tpu: tests/jax/test_rms_norm_kernel.py,
tests/jax/test_aot_compile.py, tests/torch/test_rms_norm_op.py, ...), so the plugin maps
them to rms-norm-tpu exactly as it maps the real files, without paying for the real
kernels' tests.
"""

import json
import sys
import textwrap

from release_helpers import ROOT, run

sys.path.insert(0, str(ROOT / "scripts"))
import release  # noqa: E402

KERNEL_TEST = """
import pytest

@pytest.mark.parametrize("n", [1, 2])
def test_property(n):
  assert n > 0
"""
AOT_TEST = """
import os
import pytest

@pytest.mark.parametrize("chip", {chips!r})
def test_compiles(chip):
  assert os.environ.get("FAIL_CHIP") != chip

def test_no_chip():
  pass
"""
OP_TEST = """
import os
import pytest

def test_op():
  if os.environ.get("SKIP_OP"):
    pytest.skip("no reason")
"""


# rms-norm-tpu's test files as the gate lists them from the real tree: a stand-in for each.
RMS_FILES = release.test_files("rms-norm-tpu", release.load_manifest())
OP_FILE = "tests/torch/test_rms_norm_op.py"          # the one SKIP_OP skips
AOT_FILE = "tests/jax/test_aot_compile.py"           # the one FAIL_CHIP fails
assert OP_FILE in RMS_FILES["property"] and RMS_FILES["aot"] == [AOT_FILE]
# Items the stand-ins hold: 2 per kernel-test file, 1 op test, 2 chips + 1 chip-less AOT test.
ITEMS = 2 * (len(RMS_FILES["property"]) - 1) + 1 + 3


def _tree(tmp_path, chips=("v5e", "v6e")):
  suite = tmp_path / "suite"
  for rel in RMS_FILES["property"]:
    (suite / rel).parent.mkdir(parents=True, exist_ok=True)
    (suite / rel).write_text(OP_TEST if rel == OP_FILE else KERNEL_TEST)
  (suite / AOT_FILE).write_text(AOT_TEST.format(chips=list(chips)))
  (suite / "tests" / "jax" / "test_unrelated.py").write_text("def test_x():\n  pass\n")
  return suite / "tests"


def _pytest(tmp_path, tests, *args, **env):
  reports = tmp_path / "reports"
  result = run([sys.executable, "-m", "pytest", "-p", "release_pytest", "-q", "-p", "no:cacheprovider",
                str(tests), *args], cwd=tests.parent, check=False,
               env={"PYTHONPATH": str(ROOT / "scripts"), "TPU_KERNELS_REPORT_DIR": str(reports), **env})
  return result, reports


def _gate(reports):
  return release.test_gate("rms-norm-tpu", release.load_manifest(), directory=reports)


def test_plugin_records_every_item_and_the_gate_passes(tmp_path):
  tests = _tree(tmp_path)
  result, reports = _pytest(tmp_path, tests)
  assert result.returncode == 0, result.stdout + result.stderr
  paths = list((reports / "tests").glob("*.json"))
  assert [p.name for p in paths] == [f"rms-norm-tpu.{release.stack_id()}.json"]   # nothing for others
  report = json.loads(paths[0].read_text())
  manifest = release.load_manifest()
  assert report["key"] == {"source_hash": release.source_hash("rms-norm-tpu", manifest),
                           "tests_hash": release.tests_hash("rms-norm-tpu", manifest)}
  items = report["items"]
  assert len(items) == ITEMS and all(i["outcome"] == "passed" for i in items.values())
  chips = {i["chip"] for i in items.values() if i["kind"] == "aot"}
  assert chips == {"v5e", "v6e", None}
  assert {i["file"] for i in items.values()} == {*RMS_FILES["property"], AOT_FILE}
  gate = _gate(reports)
  assert gate.ok, gate.problems
  assert gate.summary["aot:v5e"] == 1 and gate.summary["aot:v6e"] == 1


def test_a_failure_on_one_chip_blocks_and_a_rerun_clears_it(tmp_path):
  tests = _tree(tmp_path)
  result, reports = _pytest(tmp_path, tests, FAIL_CHIP="v6e")
  assert result.returncode == 1
  gate = _gate(reports)
  assert not gate.ok
  assert any("test_aot_compile.py: 1 not passed" in p and "v6e" in p for p in gate.problems)
  assert any("no ahead-of-time compile for v6e passed" in p for p in gate.problems)
  # re-running only the failed item (-k) merges into the same report
  result, reports = _pytest(tmp_path, tests, "-k", "v6e")
  assert result.returncode == 0
  assert _gate(reports).ok


def test_partial_runs_and_skips_do_not_pass(tmp_path):
  tests = _tree(tmp_path)
  result, reports = _pytest(tmp_path, tests, "-k", "v5e or property or op")
  assert result.returncode == 0
  gate = _gate(reports)
  assert any("collected but never run" in p for p in gate.problems), gate.problems
  result, reports = _pytest(tmp_path, tests, SKIP_OP="1")
  gate = _gate(reports)
  assert any("test_rms_norm_op.py: 1 not passed" in p and "skipped" in p for p in gate.problems)


def test_a_missing_chip_blocks(tmp_path):
  tests = _tree(tmp_path, chips=("v5e",))
  result, reports = _pytest(tmp_path, tests)
  assert result.returncode == 0
  assert _gate(reports).problems == ["no ahead-of-time compile for v6e passed"]


def test_missing_and_stale_reports_block(tmp_path):
  assert _gate(tmp_path / "none").problems[-1].startswith("test report missing")
  tests = _tree(tmp_path)
  _, reports = _pytest(tmp_path, tests)
  path = next((reports / "tests").glob("*.json"))
  report = json.loads(path.read_text())
  report["key"]["source_hash"] = "0" * 64          # as if recorded for other sources
  path.write_text(json.dumps(report))
  problems = _gate(reports).problems
  assert len(problems) == 1 and problems[0].startswith("test report stale")
  # and the plugin starts over instead of merging into a report of other sources
  result, reports = _pytest(tmp_path, tests, "-k", "property")
  report = json.loads(path.read_text())
  assert set(i["file"] for i in report["items"].values()) == set(RMS_FILES["property"]) - {OP_FILE}


def test_the_real_conftest_registers_the_plugin():
  """tests/conftest.py registers it for every run of the suite (both legs of test.sh)."""
  result = run([sys.executable, "-m", "pytest", "--trace-config", "--co", "-q", "-p", "no:cacheprovider",
                "tests/release/test_release_report.py"], cwd=ROOT, check=False)
  assert result.returncode == 0, result.stderr
  assert "release_pytest" in result.stdout
