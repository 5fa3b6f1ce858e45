"""Fixtures of the release tests (helpers in release_helpers.py)."""

import pytest
from release_helpers import make_repo


@pytest.fixture
def repo(tmp_path):
  """A clean clone: HEAD plus the work tree's release scripts, committed."""
  return make_repo(tmp_path / "repo")
