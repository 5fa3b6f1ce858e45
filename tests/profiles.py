"""How deep a test run goes: the Hypothesis profiles and the `thorough` switch.

One home for both, imported by tests/conftest.py (which loads the profile) and by any test
module whose matrix is wider under the thorough profile. Imports neither torch nor jax.

HYPOTHESIS_PROFILE picks the profile; `thorough` also turns on the long sweeps: the
columns of a matrix marked `@pytest.mark.thorough` (tests/conftest.py deselects them
otherwise) and the wider case lists modules build from THOROUGH.
"""

import os

from hypothesis import HealthCheck, settings

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
THOROUGH = PROFILE == "thorough"

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
settings.load_profile(PROFILE)
