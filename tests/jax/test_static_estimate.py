"""Level 3 of verification: the compiler's static cycle estimate, on the decode-size case.

Runs benchmarks/estimate.py --quick in a subprocess (the profile flag must be set before
libtpu loads, i.e. before this process's jax import).
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.aot
def test_quick_estimate(tmp_path):
  result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "estimate.py"), "--quick",
                           "--chips", "v6e", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  rows = [json.loads(line) for line in (tmp_path / "estimates.jsonl").read_text().splitlines()]
  assert {r["implementation"] for r in rows} == {"pallas", "xla (jnp)"}
  for r in rows:
    assert r["compiled"] and r["estimated_cycles"] > 0
    # The prediction can never beat the roofline: it is max(compute, bytes moved).
    assert r["predicted_us"] >= r["roofline_us"] > 0
    assert 0 < r["efficiency"] <= 1
  table = (tmp_path / "estimates.md").read_text()
  assert "not a TPU measurement" in table and "Targets (issue 6" in table
  assert (tmp_path / "estimates.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
