"""benchmarks/ keeps the layout its package docstring describes (issue 58), read from the
source alone (an AST walk of every module's imports, in the module body and in functions;
no import, no jax; well under a second):

  * no import cycle among benchmarks' modules;
  * arrows point one way: a part imports only the parts listed before it in `PARTS`
    (cases and the estimator at the bottom, then the peers, the method, the reports and the
    tuners), and no module imports a command (a module of benchmarks/ itself, run as a
    script);
  * one import scheme: absolute `benchmarks.` imports (no relative imports, no flat
    `import headline` of a module found on a script's sys.path);
  * no module over MAX_LINES lines;
  * kernels/ is pure JAX: it imports nothing of benchmarks.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "benchmarks"
MAX_LINES = 600
# The parts in import order: each may import the parts before it (and itself). The package
# root (benchmarks/__init__.py: paths, the results files' reader) comes first; the commands
# (benchmarks/*.py) may import any part.
PARTS = ("", "cases", "estimator", "peers", "rating", "reports", "tuning", "probes")


def _module_name(path: Path) -> str:
  parts = list(path.relative_to(ROOT).with_suffix("").parts)
  if parts[-1] == "__init__":
    parts.pop()
  return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
STEMS = {name.rsplit(".", 1)[-1] for name in MODULES if name != "benchmarks"}


def _part(name: str) -> str:
  """The part of benchmarks a module belongs to ("" the root, "command" a script)."""
  rest = name.split(".")[1:]
  if not rest:
    return ""
  if len(rest) == 1 and not (PACKAGE / rest[0]).is_dir():
    return "command"
  return rest[0]


def _imports(path: Path) -> list[tuple[int, str, int]]:
  """(line, imported module or package of benchmarks, relative level) of every import."""
  out = []
  for node in ast.walk(ast.parse(path.read_text(), str(path))):
    if isinstance(node, ast.Import):
      out += [(node.lineno, alias.name, 0) for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        out.append((node.lineno, base, node.level))
        continue
      for alias in node.names:   # `from benchmarks.x import y`: the module y, if it is one
        full = f"{base}.{alias.name}"
        out.append((node.lineno, full if full in MODULES else base, 0))
  return out


def _graph() -> dict[str, set[str]]:
  graph = {}
  for name, path in MODULES.items():
    graph[name] = {target for _, target, level in _imports(path)
                   if not level and target in MODULES and target != name}
  return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return found


def test_the_walk_sees_the_parts():
  """A sanity check of the walk itself: it finds the known modules and their imports."""
  graph = _graph()
  assert {"benchmarks.estimate", "benchmarks.cases.headline", "benchmarks.peers.protocol",
          "benchmarks.rating.ragged_dot", "benchmarks.reports.estimates"} <= set(graph)
  assert "benchmarks.cases.headline" in graph["benchmarks.rating.ragged_dot"]
  assert {_part(n) for n in graph} == {*PARTS, "command"}
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
  assert _cycles(_graph()) == []


def test_arrows_point_one_way():
  upward = []
  for name, targets in _graph().items():
    part = _part(name)
    for target in targets:
      to = _part(target)
      if to == "command":
        upward.append(f"{name} imports the command {target}")
      elif part != "command" and PARTS.index(to) > PARTS.index(part):
        upward.append(f"{name} ({part or 'root'}) imports {target} ({to})")
  assert not upward, "\n".join(sorted(upward))


def test_one_import_scheme():
  """Absolute imports from the repository root only: `from benchmarks.cases import headline`,
  never `import headline` (the old flat scheme, which needed benchmarks/ on sys.path) nor a
  relative import."""
  wrong = []
  for name, path in MODULES.items():
    for line, target, level in _imports(path):
      if level:
        wrong.append(f"{path.relative_to(ROOT)}:{line}: relative import")
      elif target.split(".")[0] in STEMS:
        wrong.append(f"{path.relative_to(ROOT)}:{line}: import {target}")
  assert not wrong, "\n".join(wrong)


def _runs_as_a_script(tree: ast.Module) -> bool:
  return any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
             for node in tree.body)


def test_every_script_finds_the_package_first():
  """A module that runs as a script (`if __name__ == "__main__"`) puts the repository root in
  place of its own directory on sys.path (`sys.path[0] = ...`, before any `benchmarks`
  import), and imports `benchmarks` before `tpu_kernels` (the package puts kernels/ on
  sys.path)."""
  wrong = []
  for name, path in MODULES.items():
    tree = ast.parse(path.read_text())
    if not _runs_as_a_script(tree):
      continue
    source = path.read_text()
    boot = source.find("sys.path[0] = str(Path(__file__).resolve().parents[")
    lines = {t.split(".")[0]: line for line, t, _ in reversed(_imports(path))}   # first import
    if boot < 0 or source[:boot].count("\n") + 1 > lines.get("benchmarks", 10**9):
      wrong.append(f"{name}: no `sys.path[0] = <repository root>` before its benchmarks imports")
    if lines.get("tpu_kernels", 10**9) < lines.get("benchmarks", 10**9):
      wrong.append(f"{name}: imports tpu_kernels before benchmarks")
  assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_is_too_long(name):
  lines = MODULES[name].read_text().count("\n")
  assert lines <= MAX_LINES, f"{name}: {lines} lines (split it: a module of one concern)"


def test_kernels_import_nothing_of_benchmarks():
  found = [f"{path.relative_to(ROOT)}:{line}" for path in sorted((ROOT / "kernels").rglob("*.py"))
           for line, target, _ in _imports(path) if target.split(".")[0] == "benchmarks"]
  assert not found, found
