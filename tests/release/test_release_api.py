"""scripts/api_snapshot.py: static API extraction and the within-a-major-version rules."""

import json
import sys
import textwrap

import pytest
from release_helpers import ROOT, run

sys.path.insert(0, str(ROOT / "scripts"))
import api_snapshot  # noqa: E402
import release  # noqa: E402

INIT = """
from . import layers
from ._impl import helper as exported
__all__ = ["norm", "layers", "ACTS", "NAME", "exported"]
ACTS = ("silu", "gelu")
NAME = "tpu"
def norm(x, weight, eps: float = 1e-6, *, offset=0.0):
  pass
def _private(a):
  pass
"""
IMPL = "def helper(a, b=2):\n  pass\n"
LAYERS = """
from torch import nn
class RMSNorm(nn.Module):
  has_backward = True
  can_torch_compile = True
  def forward(self, hidden_states):
    pass
"""


def _api(tmp_path, init=INIT, layers=LAYERS, impl=IMPL, name="pkg"):
  pkg = tmp_path / name
  pkg.mkdir()
  (pkg / "__init__.py").write_text(textwrap.dedent(init))
  (pkg / "layers.py").write_text(textwrap.dedent(layers))
  (pkg / "_impl.py").write_text(impl)
  return api_snapshot.extract(pkg)


def test_extraction(tmp_path):
  api = _api(tmp_path)
  members = api["members"]
  assert set(members) == {"norm", "layers", "ACTS", "NAME", "exported"}
  assert members["norm"]["params"] == [
      {"name": "x", "kind": "positional_or_keyword", "default": None},
      {"name": "weight", "kind": "positional_or_keyword", "default": None},
      {"name": "eps", "kind": "positional_or_keyword", "default": "1e-06"},
      {"name": "offset", "kind": "keyword_only", "default": "0.0"}]
  assert members["exported"]["params"][1] == {"name": "b", "kind": "positional_or_keyword", "default": "2"}
  assert members["ACTS"] == {"type": "sequence", "elements": ["'silu'", "'gelu'"]}
  assert api["layers"]["RMSNorm"]["attributes"] == {"has_backward": "True", "can_torch_compile": "True"}


BREAKING = {
    "function removed": (INIT.replace('"norm", ', ""), LAYERS, IMPL, "norm: removed"),
    "parameter removed": (INIT.replace("*, offset=0.0", ""), LAYERS, IMPL, "parameter `offset` removed"),
    "default changed": (INIT.replace("1e-6", "1e-5"), LAYERS, IMPL, "default of `eps` changed"),
    "parameter renamed": (INIT.replace("weight, eps", "w, eps"), LAYERS, IMPL, "parameter `weight` removed"),
    "made keyword-only": (INIT.replace("eps: float = 1e-6, *,", "*, eps: float = 1e-6,"), LAYERS, IMPL,
                          "changed from positional_or_keyword to keyword_only"),
    "new required parameter": (INIT.replace("offset=0.0", "offset=0.0, scale"), LAYERS, IMPL,
                               "new parameter `scale` has no default"),
    "tuple element removed": (INIT.replace(', "gelu"', ","), LAYERS, IMPL, "ACTS: lost 'gelu'"),
    "constant changed": (INIT.replace('"tpu"', '"xla"'), LAYERS, IMPL, "NAME:"),
    "re-exported function changed": (INIT, LAYERS, IMPL.replace("b=2", "b=3"), "exported: default of `b`"),
    "layer removed": (INIT, LAYERS.replace("RMSNorm", "Norm"), IMPL, "layers.RMSNorm: removed"),
    "layer forward changed": (INIT, LAYERS.replace("hidden_states", "x"), IMPL,
                              "layers.RMSNorm.forward: signature changed"),
    "layer loses backward": (INIT, LAYERS.replace("has_backward = True", "has_backward = False"), IMPL,
                             "layers.RMSNorm.has_backward: turned off"),
}


@pytest.mark.parametrize("case", sorted(BREAKING))
def test_breaking_changes(tmp_path, case):
  init, layers, impl, needle = BREAKING[case]
  old = _api(tmp_path, name="old")
  new = _api(tmp_path, init, layers, impl, name="new")
  breaking, _ = api_snapshot.compare(old, new)
  assert any(needle in b for b in breaking), breaking


def test_additions_are_compatible(tmp_path):
  init = (INIT.replace("offset=0.0", "offset=0.0, scale=None")
          .replace('"gelu")', '"gelu", "relu")')
          .replace('"exported"]', '"exported", "extra"]') + "\ndef extra(a):\n  pass\n"
          .replace("def norm(x, weight,", "def norm(x, weight,"))
  old = _api(tmp_path, name="old")
  new = _api(tmp_path, init, LAYERS + "\nclass GemmaRMSNorm(nn.Module):\n  def forward(self, x):\n    pass\n",
             IMPL, name="new")
  breaking, added = api_snapshot.compare(old, new)
  assert breaking == []
  assert any("new parameter `scale`" in a for a in added)
  assert any("gained 'relu'" in a for a in added)
  assert "extra: new" in added and "layers.GemmaRMSNorm: new" in added


def test_sources_match_their_committed_snapshots():
  """Every committed snapshot still holds for the sources (a kernel without one has not
  been released yet: its first upload needs none)."""
  manifest = release.load_manifest()
  checked = []
  for name, kernel in manifest["kernel"].items():
    path = api_snapshot.snapshot_path(name, kernel["version"])
    if not path.is_file():
      continue
    breaking, _ = api_snapshot.compare(json.loads(path.read_text()),
                                       api_snapshot.extract(api_snapshot.source_package(name, manifest)))
    assert breaking == [], (name, breaking)
    checked.append(name)
  assert {"rms-norm-tpu", "ragged-dot-tpu", "flash-attention-tpu"} <= set(checked)
  snapshot = json.loads(api_snapshot.snapshot_path("rms-norm-tpu", 1).read_text())
  assert set(snapshot["members"]) == {"rms_norm", "fused_add_rms_norm", "layers"}
  assert set(snapshot["layers"]) == {"RMSNorm", "GemmaRMSNorm"}


def test_cli_check_and_update(repo):
  script = repo / "scripts" / "api_snapshot.py"
  # The sources keep the published API (additions since, such as RMSNormGated, are fine).
  result = run([sys.executable, str(script), "rms-norm-tpu"], cwd=repo)
  assert result.stdout.startswith("rms-norm-tpu v1: ") and "BREAKING" not in result.stdout
  init = repo / "torch-ext" / "rms_norm_tpu" / "__init__.py"
  text = init.read_text()
  init.write_text(text.replace("eps: float = 1e-6, *,\n             offset", "eps: float = 1e-5, *,\n             offset", 1))
  assert init.read_text() != text
  result = run([sys.executable, str(script), "rms-norm-tpu"], cwd=repo, check=False)
  assert result.returncode == 1 and "BREAKING rms_norm: default of `eps` changed from 1e-06 to 1e-05" in result.stdout
  run([sys.executable, str(script), "--update", "rms-norm-tpu"], cwd=repo)
  assert run([sys.executable, str(script), "rms-norm-tpu"], cwd=repo).returncode == 0
