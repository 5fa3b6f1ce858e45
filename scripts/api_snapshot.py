"""The public API of a kernel package, read statically, and whether a new build keeps it.

    python scripts/api_snapshot.py [KERNEL ...]            # check sources against the snapshots
    python scripts/api_snapshot.py --update [KERNEL ...]   # (re)write scripts/api-snapshots/

What counts as the API (read with `ast`, so neither torch nor jax is imported, and a
published variant can be read the same way as a source tree):

* the names a user gets from the package: `__all__` of `__init__.py` (or its public
  top-level names when it has none), followed through `from .mod import name`;
* functions: every parameter's name, kind (positional-only, positional-or-keyword,
  *args, keyword-only, **kwargs) and default (as source text);
* classes: bases, public methods' signatures, and `forward`;
* constants: their value (source text; tuples and lists element-wise);
* the `layers` module when the package has one (kernelize looks classes up there by
  name even when `__all__` does not list it): every class, its `forward` signature and
  its `has_backward` / `can_torch_compile`.

Rules within a major version (`compare`): adding is fine (a new name, a new parameter
with a default, a new element of a tuple constant, a default on a parameter that had
none). Everything else that changes is breaking: a removed name, parameter or element;
a renamed or reordered or re-kinded parameter; a changed default or constant; a new
parameter without a default; a layer's `forward` changed in any way (kernelize swaps
forwards: the arguments must be exactly the replaced layer's); `has_backward` or
`can_torch_compile` turned off. Return annotations and docstrings are not compared.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import release

SNAPSHOT_DIR = Path(__file__).resolve().parent / "api-snapshots"
LAYER_FLAGS = ("has_backward", "can_torch_compile")


def snapshot_path(hub_name: str, version: int, directory: Path = SNAPSHOT_DIR) -> Path:
  return directory / f"{hub_name}-v{version}.json"


def _signature(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[dict]:
  a = fn.args
  params = []
  positional = a.posonlyargs + a.args
  defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
  for i, (arg, default) in enumerate(zip(positional, defaults)):
    kind = "positional_only" if i < len(a.posonlyargs) else "positional_or_keyword"
    params.append({"name": arg.arg, "kind": kind,
                   "default": None if default is None else ast.unparse(default)})
  if a.vararg:
    params.append({"name": a.vararg.arg, "kind": "var_positional", "default": None})
  for arg, default in zip(a.kwonlyargs, a.kw_defaults):
    params.append({"name": arg.arg, "kind": "keyword_only",
                   "default": None if default is None else ast.unparse(default)})
  if a.kwarg:
    params.append({"name": a.kwarg.arg, "kind": "var_keyword", "default": None})
  return params


def _class(node: ast.ClassDef) -> dict:
  methods, attrs = {}, {}
  for item in node.body:
    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
      if not item.name.startswith("_") or item.name == "__init__":
        methods[item.name] = _signature(item)
    elif isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
      if not item.targets[0].id.startswith("_"):
        attrs[item.targets[0].id] = ast.unparse(item.value)
  return {"type": "class", "bases": [ast.unparse(b) for b in node.bases], "methods": methods,
          "attributes": attrs}


class _Module:
  def __init__(self, path: Path):
    self.path = path
    self.tree = ast.parse(path.read_text(), filename=str(path))
    self.defs: dict[str, ast.AST] = {}
    self.imports: dict[str, tuple[int, str | None, str]] = {}   # name -> (level, module, name)
    self.all: list[str] | None = None
    for node in self.tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        self.defs[node.name] = node
      elif isinstance(node, (ast.Assign, ast.AnnAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        for t in targets:
          if isinstance(t, ast.Name):
            if t.id == "__all__":
              self.all = list(ast.literal_eval(node.value))
            else:
              self.defs[t.id] = node
      elif isinstance(node, ast.ImportFrom):
        for alias in node.names:
          self.imports[alias.asname or alias.name] = (node.level, node.module, alias.name)

  def public(self) -> list[str]:
    if self.all is not None:
      return self.all
    return sorted(n for n in self.defs if not n.startswith("_"))


def _describe(package: Path, module: _Module, name: str, depth: int = 0) -> dict:
  if name in module.defs:
    node = module.defs[name]
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      return {"type": "function", "params": _signature(node)}
    if isinstance(node, ast.ClassDef):
      return _class(node)
    value = node.value
    if isinstance(value, (ast.Tuple, ast.List)):
      return {"type": "sequence", "elements": [ast.unparse(e) for e in value.elts]}
    return {"type": "constant", "value": ast.unparse(value) if value is not None else None}
  if name in module.imports and depth < 5:
    level, source, original = module.imports[name]
    if level == 1 and source is None:       # from . import submodule
      sub = package / f"{original}.py"
      if sub.is_file():
        return _module_api(package, _Module(sub), depth + 1)
    elif level == 1 and source is not None:
      sub = package / (source.replace(".", "/") + ".py")
      if sub.is_file():
        return _describe(package, _Module(sub), original, depth + 1)
    return {"type": "import", "from": f"{'.' * level}{source or ''}", "name": original}
  return {"type": "unresolved"}


def _module_api(package: Path, module: _Module, depth: int) -> dict:
  return {"type": "module",
          "members": {n: _describe(package, module, n, depth) for n in module.public()}}


def extract(package: Path) -> dict:
  """The API of the torch package in `package` (a source dir, a build's torch-ext/<pkg>,
  or a variant folder build/torch-<backend>)."""
  init = _Module(package / "__init__.py")
  api = {"members": {n: _describe(package, init, n) for n in init.public()}}
  layers = package / "layers.py"
  if layers.is_file():
    module = _Module(layers)
    api["layers"] = {n: _class(node) for n, node in module.defs.items()
                     if isinstance(node, ast.ClassDef) and not n.startswith("_")}
  return api


# ----------------------------------------------------------------------------- compare


def _compare_params(where: str, old: list[dict], new: list[dict]) -> tuple[list[str], list[str]]:
  breaking, added = [], []
  new_by_name = {p["name"]: (i, p) for i, p in enumerate(new)}
  for i, p in enumerate(old):
    if p["name"] not in new_by_name:
      breaking.append(f"{where}: parameter `{p['name']}` removed")
      continue
    j, q = new_by_name[p["name"]]
    if q["kind"] != p["kind"]:
      breaking.append(f"{where}: parameter `{p['name']}` changed from {p['kind']} to {q['kind']}")
    elif p["kind"] in ("positional_only", "positional_or_keyword") and i != j:
      breaking.append(f"{where}: parameter `{p['name']}` moved from position {i} to {j}")
    if p["default"] is not None and q["default"] != p["default"]:
      breaking.append(f"{where}: default of `{p['name']}` changed from {p['default']} to {q['default']}")
    elif p["default"] is None and q["default"] is not None and p["kind"] not in ("var_positional", "var_keyword"):
      added.append(f"{where}: `{p['name']}` gained a default ({q['default']})")
  old_names = {p["name"] for p in old}
  for q in new:
    if q["name"] in old_names:
      continue
    if q["default"] is None and q["kind"] not in ("var_positional", "var_keyword"):
      breaking.append(f"{where}: new parameter `{q['name']}` has no default")
    else:
      added.append(f"{where}: new parameter `{q['name']}`")
  return breaking, added


def _compare_member(where: str, old: dict, new: dict) -> tuple[list[str], list[str]]:
  if old["type"] != new["type"]:
    return [f"{where}: was a {old['type']}, now a {new['type']}"], []
  kind = old["type"]
  if kind == "function":
    return _compare_params(where, old["params"], new["params"])
  if kind == "module":
    return _compare_members(where + ".", old["members"], new["members"])
  if kind == "sequence":
    removed = [e for e in old["elements"] if e not in new["elements"]]
    extra = [e for e in new["elements"] if e not in old["elements"]]
    return ([f"{where}: lost {', '.join(removed)}"] if removed else [],
            [f"{where}: gained {', '.join(extra)}"] if extra else [])
  if kind == "class":
    breaking, added = [], []
    if old["bases"] != new["bases"]:
      breaking.append(f"{where}: bases changed from {old['bases']} to {new['bases']}")
    for m, params in old["methods"].items():
      if m not in new["methods"]:
        breaking.append(f"{where}.{m}: removed")
      else:
        b, a = _compare_params(f"{where}.{m}", params, new["methods"][m])
        breaking += b
        added += a
    added += [f"{where}.{m}: new method" for m in new["methods"] if m not in old["methods"]]
    for attr, value in old["attributes"].items():
      if new["attributes"].get(attr) != value:
        breaking.append(f"{where}.{attr}: {value} -> {new['attributes'].get(attr, '(removed)')}")
    return breaking, added
  if old != new:
    return [f"{where}: {old.get('value', old)} -> {new.get('value', new)}"], []
  return [], []


def _compare_members(prefix: str, old: dict, new: dict) -> tuple[list[str], list[str]]:
  breaking, added = [], []
  for name, member in old.items():
    if name not in new:
      breaking.append(f"{prefix}{name}: removed")
    else:
      b, a = _compare_member(prefix + name, member, new[name])
      breaking += b
      added += a
  added += [f"{prefix}{name}: new" for name in new if name not in old]
  return breaking, added


def compare(old: dict, new: dict) -> tuple[list[str], list[str]]:
  """(breaking changes, additions) from API `old` to API `new`."""
  breaking, added = _compare_members("", old["members"], new["members"])
  old_layers, new_layers = old.get("layers", {}), new.get("layers", {})
  for name, cls in old_layers.items():
    where = f"layers.{name}"
    if name not in new_layers:
      breaking.append(f"{where}: removed (kernelize looks it up by name)")
      continue
    now = new_layers[name]
    if cls["methods"].get("forward") != now["methods"].get("forward"):
      breaking.append(f"{where}.forward: signature changed (kernelize needs the replaced layer's exact arguments)")
    for flag in LAYER_FLAGS:
      if cls["attributes"].get(flag) == "True" and now["attributes"].get(flag) != "True":
        breaking.append(f"{where}.{flag}: turned off")
  added += [f"layers.{name}: new" for name in new_layers if name not in old_layers]
  return breaking, added


def source_package(hub_name: str, manifest: dict, root: Path = release.ROOT) -> Path:
  return root / manifest["kernel"][hub_name]["torch-package"]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("kernels", nargs="*", help="hub names (default: every ready kernel)")
  parser.add_argument("--update", action="store_true", help="write the snapshots from the sources")
  args = parser.parse_args(argv)
  manifest = release.load_manifest()
  names = args.kernels or [n for n, k in manifest["kernel"].items() if k.get("status") == "ready"]
  status = 0
  for name in names:
    version = manifest["kernel"][name]["version"]
    api = extract(source_package(name, manifest))
    path = snapshot_path(name, version)
    if args.update:
      path.parent.mkdir(parents=True, exist_ok=True)
      path.write_text(json.dumps(api, indent=1, sort_keys=True) + "\n")
      print(f"wrote {path.relative_to(release.ROOT)}")
      continue
    if not path.is_file():
      print(f"{name} v{version}: no snapshot ({path.name}); nothing published to keep compatible with")
      continue
    breaking, added = compare(json.loads(path.read_text()), api)
    for line in added:
      print(f"{name} v{version}: + {line}")
    for line in breaking:
      print(f"{name} v{version}: BREAKING {line}")
    if breaking:
      status = 1
    elif not added:
      print(f"{name} v{version}: API unchanged")
  return status


if __name__ == "__main__":
  sys.exit(main())
