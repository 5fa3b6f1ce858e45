"""Shared test set-up. Imports neither torch nor jax: tests/jax must also run without torch."""

import os
import sys

# Before anything imports jax or torch: no TPU here, and nothing may reach the network.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Interpret mode compiles every new shape (0.2-1 s), so example counts set the run time.
_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow],
               print_blob=True)
# Sized so that CI (both legs, on two cores) stays well inside its 90 minutes: 25 and 10
# examples gave 82 minutes on 2026-12-01; 20 and 6 gave 70 minutes (4,197 s) on
# 2026-12-03, with leg 1's interpret-mode property tests about 1,650 s of its longest
# run. 12 keeps every strategy drawn in every run (derandomized, so the same cases each
# time) and pays for the serving, Diffusers and model-family tests added since.
# HYPOTHESIS_PROFILE=thorough (150) for depth.
settings.register_profile("ci", max_examples=12, derandomize=True, **_COMMON)
# The second CI leg (jax 0.12 stack) re-checks the same kernels: fewer examples there.
settings.register_profile("ci-second-stack", max_examples=6, derandomize=True, **_COMMON)
settings.register_profile("dev", max_examples=6, **_COMMON)
settings.register_profile("thorough", max_examples=150, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
  """The release gate's recorder (scripts/release_pytest.py): per kernel, the outcome of
  every test that judges it, for scripts/upload.py. Writes only under build-reports/."""
  import release_pytest

  if not config.pluginmanager.has_plugin("release_pytest"):
    config.pluginmanager.register(release_pytest, "release_pytest")


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
