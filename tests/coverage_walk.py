"""scripts/coverage.py (the model-family coverage walk), for the tests that use it.

Loaded by path under its own name, transformers_coverage: `coverage` is also the name of a
PyPI package (pytest-cov's), which `import coverage` could find first.
"""

import importlib.util
import sys
from pathlib import Path

_NAME = "transformers_coverage"
if _NAME not in sys.modules:
  _spec = importlib.util.spec_from_file_location(
      _NAME, Path(__file__).resolve().parents[1] / "scripts" / "coverage.py")
  sys.modules[_NAME] = importlib.util.module_from_spec(_spec)
  _spec.loader.exec_module(sys.modules[_NAME])
coverage = sys.modules[_NAME]
