"""Shared test set-up. Imports neither torch nor jax: tests/jax must also run without torch."""

import os
import sys

# Before anything imports jax or torch: no TPU here, and nothing may reach the network.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402

from profiles import THOROUGH  # noqa: E402  (registers and loads the Hypothesis profile)


def pytest_configure(config):
  """The release gate's recorder (scripts/release_pytest.py): per kernel, the outcome of
  every test that judges it, for scripts/upload.py. Writes only under build-reports/."""
  import release_pytest

  if not config.pluginmanager.has_plugin("release_pytest"):
    config.pluginmanager.register(release_pytest, "release_pytest")


def pytest_collection_modifyitems(config, items):
  """Deselects the tests marked `thorough` (a long sweep's extra columns) unless
  HYPOTHESIS_PROFILE=thorough: they show as deselected, never as skipped."""
  if THOROUGH:
    return
  deep = [item for item in items if item.get_closest_marker("thorough")]
  if deep:
    config.hook.pytest_deselected(items=deep)
    items[:] = [item for item in items if not item.get_closest_marker("thorough")]


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_programs():
  """After each test module, drop jax's compiled programs (if jax was imported at all).

  Why: XLA:CPU maps every compiled program's code and data into memory (about three maps
  per object, about six per small jitted program, thousands per test module), and jax
  keeps each program as long as its jitted function lives. A process may hold at most vm.max_map_count maps (65,530 by
  default); past it the next compile segfaults. CI's leg 1b (tests/torch and tests/release
  in one process) reached 64,930 maps on 2026-12-07 and crashed in the next compile.
  Modules rarely share a program, so clearing costs little; it also keeps RSS flat.
  """
  yield
  jax = sys.modules.get("jax")  # never import it here: tests/torch checks imports stay lazy
  if jax is not None:
    jax.clear_caches()
