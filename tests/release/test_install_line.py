"""scripts/check_install_line.py, the check README command 1 runs on the TPU-VM install line:
its verdict on pip reports, one that gives the tested stack and ones that drift from it
(the resolution itself needs the package index and runs in scripts/setup.sh)."""

import json

import check_install_line as check


def _report(versions: dict[str, str]) -> dict:
  """A pip `--report` that installs these {package: version}, plus a package outside the
  stack (ignored by the check)."""
  picks = {**versions, "numpy": "2.5.5"}
  return {"install": [{"metadata": {"name": name, "version": version}}
                      for name, version in picks.items()]}


def test_the_user_command_is_the_install_line_plus_transformers():
  words = check.user_command(check.install_line())
  assert words == check.install_line().split()[2:]      # the line pins transformers itself
  assert check.user_command("pip install kernels==0.19.1") == ["kernels==0.19.1", "transformers"]


def test_the_tested_stack_passes(tmp_path):
  tested = check.tested_versions()
  assert set(tested) == set(check.STACK)
  assert check.mismatches(check.picked_versions(_report(tested)), tested) == []
  # torch's local label (the CPU build here, CUDA's on PyPI) is the same release
  cpu_torch = _report({**tested, "torch": tested["torch"] + "+cpu"})
  assert check.mismatches(check.picked_versions(cpu_torch), tested) == []
  report = tmp_path / "report.json"
  report.write_text(json.dumps(_report(tested)))
  assert check.main(["--report", str(report)]) == 0


def test_a_drifted_or_missing_package_fails(tmp_path, capsys):
  tested = check.tested_versions()
  drifted = {**tested, "transformers": "5.26.0", "huggingface_hub": "9.9.9"}
  del drifted["huggingface-hub"], drifted["libtpu"]
  report = tmp_path / "report.json"
  report.write_text(json.dumps(_report(drifted)))
  assert check.mismatches(check.picked_versions(_report(drifted)), tested) == [
      ("libtpu", "(not installed)", tested["libtpu"]),
      ("transformers", "5.26.0", tested["transformers"]),
      ("huggingface-hub", "9.9.9", tested["huggingface-hub"])]
  assert check.main(["--report", str(report)]) == 1
  assert "transformers: pip picks 5.26.0" in capsys.readouterr().err
