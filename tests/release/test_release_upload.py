"""scripts/upload.py: the dry run's exact calls, and every refusal of the gate."""

import inspect
import json
import re
import shutil
import sys

from release_helpers import ROOT, build, git, pass_all_tests, run

sys.path.insert(0, str(ROOT / "scripts"))
import release  # noqa: E402
import upload  # noqa: E402

KERNEL = "rms-norm-tpu"


def _upload(repo, *args):
  return run([sys.executable, str(repo / "scripts" / "upload.py"), "--dry-run", *args], cwd=repo,
             check=False, env={"TPU_KERNELS_REPORT_DIR": str(repo / "build-reports")})


def _ready(repo):
  dist = build(repo, KERNEL)
  pass_all_tests(repo, KERNEL)
  return dist


def test_dry_run_prints_exactly_the_calls(repo):
  dist = _ready(repo)
  head = git(repo, "rev-parse", "HEAD")
  result = _upload(repo, KERNEL)
  assert result.returncode == 0, result.stdout + result.stderr
  calls = [l[len("DRY RUN "):] for l in result.stdout.splitlines()
           if l.startswith("DRY RUN ") and not l.startswith("DRY RUN  ")]
  assert [c.split("(")[0] for c in calls] == ["create_repo", "create_branch", "create_commit", "create_commit"]
  assert calls[0] == "create_repo(repo_id='tpu-kernels/rms-norm-tpu', repo_type='kernel', exist_ok=True)"
  assert "branch='v1'" in calls[1]
  assert "revision='v1'" in calls[2] and head in calls[2]   # message names the source commit
  assert "revision='main'" in calls[3]
  out = result.stdout
  v1 = out[out.index("revision='v1'"):out.index("revision='main'")]
  added = re.findall(r"    add    (\S+)", v1)
  assert added == sorted(release.tree_files(dist / KERNEL))               # the whole repo folder
  assert {"build/torch-cpu/metadata.json", "build/torch-tpu/__init__.py", "README.md"} <= set(added)
  main = out[out.index("revision='main'"):]
  assert re.findall(r"    add    (\S+)", main) == ["README.md"]


def test_the_real_path_runs_the_same_calls_on_huggingface_hub(repo):
  """execute() hands each planned call to HfApi; every call binds to HfApi's signature."""
  from huggingface_hub import HfApi

  dist = _ready(repo)
  manifest = release.load_manifest(repo)
  report = json.loads(release.build_report_path(dist, KERNEL).read_text())
  calls = upload.plan(KERNEL, manifest, dist, upload.Remote(), report)
  seen = []

  class Recorder:
    def __getattr__(self, name):
      method = getattr(HfApi, name)
      def call(**kwargs):
        inspect.signature(method).bind(HfApi(), **kwargs)   # a wrong keyword would raise
        seen.append((name, kwargs))
      return call

  upload.execute(calls, Recorder())
  assert seen == [(c.method, c.kwargs) for c in calls]
  assert all(kw["repo_type"] == "kernel" for _, kw in seen)
  commit = [kw for name, kw in seen if name == "create_commit" and kw["revision"] == "v1"]
  assert len(commit) == 1 and len(commit[0]["operations"]) == len(release.tree_files(dist / KERNEL))


def test_refuses_without_test_report(repo):
  build(repo, KERNEL)
  result = _upload(repo, KERNEL)
  assert result.returncode == 1
  assert "REFUSED: tests: test report missing" in result.stdout
  assert "DRY RUN" not in result.stdout


def test_refuses_a_failing_test(repo):
  build(repo, KERNEL)
  pass_all_tests(repo, KERNEL, failing="tests/jax/test_aot_compile.py::test_v6e[v6e]")
  result = _upload(repo, KERNEL)
  assert result.returncode == 1
  assert "test_aot_compile.py: 1 not passed" in result.stdout
  assert "no ahead-of-time compile for v6e passed" in result.stdout


def test_refuses_a_stale_build(repo):
  _ready(repo)
  init = repo / "torch-ext" / "rms_norm_tpu" / "__init__.py"
  init.write_text(init.read_text() + "\n# changed after the build\n")
  git(repo, "commit", "-qam", "change")
  result = _upload(repo, KERNEL)
  assert result.returncode == 1
  assert "stale: the sources changed since the build" in result.stdout
  assert "stale: built from commit" in result.stdout
  assert "test report stale" in result.stdout


def test_refuses_a_dirty_build(repo):
  init = repo / "torch-ext" / "rms_norm_tpu" / "__init__.py"
  init.write_text(init.read_text() + "\n# uncommitted\n")
  _ready(repo)
  result = _upload(repo, KERNEL)
  assert result.returncode == 1
  assert "built from uncommitted changes: torch-ext/rms_norm_tpu/__init__.py" in result.stdout


def test_refuses_an_edited_build(repo):
  dist = _ready(repo)
  (dist / KERNEL / "build" / "torch-cpu" / "layers.py").write_text("# tampered\n")
  result = _upload(repo, KERNEL)
  assert result.returncode == 1
  assert "differs from what its build report records" in result.stdout
  assert "integrity: torch-cpu:" in result.stdout and "layers.py" in result.stdout


def test_refuses_a_breaking_api_change_unless_allowed(repo):
  _ready(repo)
  snapshot = repo / "scripts" / "api-snapshots" / "rms-norm-tpu-v1.json"
  api = json.loads(snapshot.read_text())
  api["members"]["rms_norm"]["params"][2]["default"] = "1e-05"   # as if v1 had shipped eps=1e-5
  api["members"]["gone"] = {"type": "function", "params": []}
  snapshot.write_text(json.dumps(api))
  git(repo, "commit", "-qam", "snapshot of an older v1")
  _ready(repo)   # rebuild at the new HEAD
  result = _upload(repo, KERNEL)
  assert result.returncode == 1
  assert "BREAKING rms_norm: default of `eps` changed from 1e-05 to 1e-06" in result.stdout
  assert "BREAKING gone: removed" in result.stdout
  result = _upload(repo, KERNEL, "--allow-breaking")
  assert result.returncode == 0, result.stdout
  assert "BREAKING (allowed by --allow-breaking)" in result.stdout


def test_against_a_published_copy(repo, tmp_path):
  """--published: the branch exists (no create_branch), a file of the old release that this
  build no longer has is deleted in the same commit, and the API is checked against it."""
  dist = _ready(repo)
  published = tmp_path / "published"
  shutil.copytree(dist / KERNEL, published)
  (published / "build" / "torch-cpu" / "old_module.py").write_text("x = 1\n")
  result = _upload(repo, KERNEL, "--published", f"{KERNEL}={published}")
  assert result.returncode == 0, result.stdout
  assert "create_branch" not in result.stdout
  assert "    delete build/torch-cpu/old_module.py" in result.stdout
  init = published / "build" / "torch-cpu" / "__init__.py"
  init.write_text(init.read_text() + "\ndef published_only(x):\n  return x\n")
  text = init.read_text().replace('__all__ = [', '__all__ = ["published_only", ', 1)
  assert '"published_only", ' in text
  init.write_text(text)
  result = _upload(repo, KERNEL, "--published", f"{KERNEL}={published}")
  assert result.returncode == 1
  assert "API vs published v1: BREAKING published_only: removed" in result.stdout


def test_refuses_a_kernel_that_is_not_ready(repo):
  """A kernel that build.toml lists as planned (not "ready") is never uploaded."""
  manifest = repo / "build.toml"
  manifest.write_text(manifest.read_text() + '\n[kernel.planned-tpu]\nstatus = "planned"\n'
                      'version = 1\nbackends = ["tpu", "cpu"]\n')
  git(repo, "commit", "-qam", "a planned kernel")
  result = _upload(repo, "planned-tpu")
  assert result.returncode == 1 and "not ready" in result.stdout
