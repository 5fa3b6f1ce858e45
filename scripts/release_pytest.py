"""pytest plugin: records, per kernel, the outcome of every test that judges it.

Registered by tests/conftest.py (`from release_pytest import *`), or `-p release_pytest`.
For each kernel of build.toml whose mapped test files (see scripts/release.py) were
collected in this session, it merges the outcomes into
`build-reports/tests/<kernel>.<stack>.json`. `scripts/upload.py` reads these as the
release gate. Sessions that collect none of a kernel's files leave its report alone.

An item's outcome is "failed" if any phase (setup, call, teardown) failed, "skipped"
if it was skipped (the gate does not accept skips: a skipped compile is not a compile),
else "passed". xfail counts as skipped. Imports neither torch nor jax.
"""

from __future__ import annotations

import release


class _State:
  def __init__(self):
    self.manifest = release.load_manifest()
    self.items: dict[str, dict[str, dict]] = {}     # kernel -> nodeid -> record
    self.collected: dict[str, dict[str, set]] = {}   # kernel -> file -> nodeids
    self.meta: dict[str, list] = {}                   # nodeid -> [(kernel, kind, file, chip)]
    self.by_path: dict[str, tuple] = {}

  def classify(self, path) -> tuple[str, list]:
    key = str(path)
    if key not in self.by_path:
      try:
        rel = path.resolve().relative_to(release.ROOT).as_posix()
      except ValueError:
        rel = "tests/" + "/".join(path.parts[-2:])
      self.by_path[key] = (rel, release.kernel_of_test_path(path, self.manifest))
    return self.by_path[key]


_SESSION: dict = {}


def pytest_sessionstart(session):
  _SESSION["state"] = _State()


def pytest_collectreport(report):
  """Every item collected in a mapped file, before -k / -m deselection."""
  state = _SESSION.get("state")
  if state is None or report.failed or not getattr(report, "result", None):
    return
  import pytest

  items = [x for x in report.result if isinstance(x, pytest.Item)]
  if not items:
    return
  rel, mapped = state.classify(items[0].path)
  for kernel, kind in mapped:
    ids = state.collected.setdefault(kernel, {}).setdefault(rel, set())
    for item in items:
      ids.add(item.nodeid)
      callspec = getattr(item, "callspec", None)
      chip = callspec.params.get("chip") if callspec is not None else None
      state.meta.setdefault(item.nodeid, []).append(
          (kernel, kind, rel, chip if isinstance(chip, str) else None))


def pytest_runtest_logreport(report):
  state = _SESSION.get("state")
  if state is None or report.nodeid not in state.meta:
    return
  if report.failed:
    outcome = "failed"
  elif report.skipped:
    outcome = "skipped"
  elif report.when == "call":
    outcome = "passed"
  else:
    outcome = None          # a passing setup or teardown says nothing on its own
  for kernel, kind, rel, chip in state.meta[report.nodeid]:
    record = state.items.setdefault(kernel, {}).setdefault(
        report.nodeid, {"file": rel, "kind": kind, "chip": chip, "outcome": "not run"})
    if outcome == "failed" or (outcome and record["outcome"] != "failed"):
      record["outcome"] = outcome


def pytest_sessionfinish(session, exitstatus):
  state = _SESSION.pop("state", None)
  if state is None:
    return
  directory = release.report_dir()
  stack = release.stack_id()
  reporter = session.config.pluginmanager.get_plugin("terminalreporter")
  for kernel, files in sorted(state.collected.items()):
    key = {"source_hash": release.source_hash(kernel, state.manifest),
           "tests_hash": release.tests_hash(kernel, state.manifest)}
    items = {i: r for i, r in state.items.get(kernel, {}).items() if r["outcome"] != "not run"}
    path = release.record_test_outcomes(kernel, stack=stack, directory=directory, key=key,
                                        items=items, collected=files)
    if reporter is not None:
      reporter.write_line(f"release report: {kernel}: {len(items)} outcomes -> {path}")
