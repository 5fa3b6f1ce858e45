"""What tpu-inference's specs share: the stack they run on, the stand-ins that let its kernels
import without vllm and torch, and asking a child for the config its kernel picks.

Every child runs in `.venv-tpu-inference` (requirements-tpu-inference.txt: tpu-inference
0.32.0 --no-deps on the jax 0.11.2 / libtpu 0.0.48 it pins; scripts/setup.sh makes it),
whichever stack rates it.

Stand-ins (`stand_ins`): the kernels import tpu_inference.logger and tpu_inference.utils, which
import vllm and torch; the package's __init__ imports vllm too. The children register the
package without running its __init__, a logger module (logging, with the *_once methods), and a
utils module holding the real `get_device_name` and `align_to` (their source, read from the
installed utils.py). Kernels ask `jax.devices()[0].device_kind` for the TPU generation: it
answers with the AOT target device.

The block sizes are the kernel's own choice for the whole case on the target chip (its tuned
table or its heuristic), asked in a child first (`child.py choose`, `chosen_in_child`) and
named in each row's config.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import logging
import os
import sys
import types
from pathlib import Path
from unittest import mock

from benchmarks import ROOT
from benchmarks.estimator import children, visible
from benchmarks.peers import protocol


VERSION = "0.32.0"
STACK = "jax 0.11.2, libtpu 0.0.48"          # what requirements-tpu-inference.txt pins with it
VENV = ROOT / ".venv-tpu-inference"


class _OnceLogger(logging.LoggerAdapter):
  """vllm's logger interface as the kernels use it (info_once, warning_once, ...)."""

  def __getattr__(self, name):
    if name.endswith("_once"):
      return getattr(self, name[:-len("_once")])
    raise AttributeError(name)


def _functions_from(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
  """The named top-level functions of the Python file at `path`, defined in `namespace`
  (their source as installed: nothing copied here)."""
  tree = ast.parse(path.read_text())
  body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
  assert {f.name for f in body} == set(names), (path, names)
  exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
  return {n: namespace[n] for n in names}


@contextlib.contextmanager
def stand_ins(chip: str):
  """tpu_inference importable without vllm / torch, answering for `chip` (see the docstring)."""
  import importlib.util
  import jax
  from tpu_kernels import aot
  found = importlib.util.find_spec("tpu_inference")
  if found is None:
    raise RuntimeError(f"tpu_inference is not installed in {sys.executable}")
  import importlib.metadata
  assert importlib.metadata.version("tpu-inference") == VERSION
  assert f"jax {jax.__version__}" in STACK, jax.__version__
  library = os.environ.get("TPU_LIBRARY_PATH")
  if library and not library.startswith(sys.prefix):   # libtpu 0.0.48 or nothing
    raise RuntimeError(f"TPU_LIBRARY_PATH={library} is another environment's libtpu")
  package_dir = Path(found.submodule_search_locations[0])
  if "tpu_inference" not in sys.modules:
    package = types.ModuleType("tpu_inference")
    package.__path__ = [str(package_dir)]
    logger = types.ModuleType("tpu_inference.logger")
    logger.init_logger = lambda name: _OnceLogger(logging.getLogger(name), {})
    utils = types.ModuleType("tpu_inference.utils")
    utils.__dict__.update(_functions_from(package_dir / "utils.py",
                                          ("get_device_name", "align_to"), {"jax": jax}))
    sys.modules.update({"tpu_inference": package, "tpu_inference.logger": logger,
                        "tpu_inference.utils": utils})
  device = aot.topology_device(chip)
  with mock.patch.object(jax, "devices", lambda *a, **k: [device]), visible.target_chip(chip):
    yield


def kernel_module(name: str):
  import importlib
  return importlib.import_module(f"tpu_inference.kernels.{name}")


class TpuInferenceSpec:
  """A spec protocol.rate drives (protocol.py's interface); `chosen` is the kernel's own
  config for the case (None until `resolved`: the parent cannot import tpu_inference)."""

  python = VENV / "bin" / "python"

  def lowering(self, chip: str):
    return stand_ins(chip)

  def validate(self) -> None:
    """Checked in the child, where tpu_inference imports (`build`)."""

  def config(self) -> dict:
    return dict(self.chosen or {})

  def get(self, name: str):
    if not self.chosen:
      raise RuntimeError(f"{self.key}: config not resolved (resolve(chip) in the parent)")
    return dict(self.chosen)[name]

  def rate(self, chip: str) -> dict:
    return rate_resolved(self, chip)

  def config_for(self, chip: str) -> dict:
    """The child's copy of `chosen` (the function the parent asked through `child.py choose`)."""
    return dict(self.chosen) if self.chosen else self.choose(chip)


def frozen_config(config: dict) -> tuple:
  """A config dict as a hashable, sorted tuple (a spec's `chosen`)."""
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


@functools.cache
def chosen_in_child(key: str, chip: str) -> tuple:
  """The config the kernel of spec `key` picks for its whole case on `chip`, asked in a child
  in its venv (the parent cannot import tpu_inference)."""
  if not TpuInferenceSpec.python.exists():
    raise RuntimeError(f"{TpuInferenceSpec.python} is missing: scripts/setup.sh makes it")
  env = children.child_env()
  env.pop("TPU_LIBRARY_PATH", None)   # set by this process's jax: its libtpu, not the venv's
  rows, error = children.run_child(protocol.CHILD_SCRIPT, ["choose", key, chip], timeout=300,
                                   env=env, python=TpuInferenceSpec.python)
  if error:
    raise RuntimeError(f"choose {key} {chip}: {error}")
  return frozen_config(rows[-1])


def resolved(spec, chip: str):
  return dataclasses.replace(spec, chosen=chosen_in_child(spec.key, chip))


def rate_resolved(spec, chip: str) -> dict:
  """protocol.rate on the spec with the kernel's own config for `chip`."""
  try:
    spec = resolved(spec, chip)
  except Exception as e:  # noqa: BLE001  (a failed anchor is a row)
    row = protocol.row_base(spec)
    row["error"] = f"{type(e).__name__}: {str(e).strip()[:400]}"
    return row
  return protocol.rate(spec, chip)
