"""scripts/build.py's release additions: digest, provenance, build report, Release notes,
and the test-file mapping that makes the gate pick up a new kernel by its names."""

import json
import sys

from release_helpers import ROOT, build, git, release_module
from kernels._rust import Digest, DigestAlgorithm, Metadata

sys.path.insert(0, str(ROOT / "scripts"))
import build as build_py  # noqa: E402
import release  # noqa: E402


def test_metadata_digest_and_provenance_are_kernels_own(repo):
  dist = build(repo, "rms-norm-tpu")
  manifest = release.load_manifest(repo)
  head = git(repo, "rev-parse", "HEAD")
  for backend in ("cpu", "tpu"):
    variant = dist / "rms-norm-tpu" / "build" / f"torch-{backend}"
    metadata = Metadata.read_from_file(variant / "metadata.json")   # kernels' parser
    assert metadata.digest is not None and metadata.digest.algorithm == DigestAlgorithm.SHA256
    actual = Digest.hash_variant(DigestAlgorithm.SHA256, variant)
    metadata.digest.validate(actual)                                  # raises on mismatch
    assert set(metadata.digest.files) == {p.relative_to(variant).as_posix()
                                         for p in variant.rglob("*") if p.is_file()} - {"metadata.json"}
    assert str(metadata.provenance.kernel.commit) == head      # an Oid in kernels 0.19
    assert metadata.provenance.kernel.dirty is False
    # `source` only when build.toml records a public URL (none is made up).
    assert metadata.source == manifest["collection"].get("source-repository")
    assert str(metadata.backend.backend_type).lower().endswith(backend)


def test_build_report_and_reproducibility(repo, tmp_path):
  dist = build(repo, "rms-norm-tpu")
  report = json.loads((dist / "rms-norm-tpu.build-report.json").read_text())
  manifest = release.load_manifest(repo)
  assert report["source_commit"] == git(repo, "rev-parse", "HEAD")
  assert report["dirty"] == []
  assert report["source_hash"] == release.source_hash("rms-norm-tpu", manifest, repo)
  assert report["namespace"].endswith(report["source_hash"][:10])   # the op namespace's hash
  assert report["tree_sha256"] == release.sha256_files(release.tree_files(dist / "rms-norm-tpu"))
  assert release.check_build("rms-norm-tpu", manifest, dist=dist, root=repo) == []
  first = {p.relative_to(dist): p.read_bytes() for p in dist.rglob("*") if p.is_file()}
  build(repo, "rms-norm-tpu")
  second = {p.relative_to(dist): p.read_bytes() for p in dist.rglob("*") if p.is_file()}
  assert first == second


def test_uncommitted_source_is_recorded_dirty(repo):
  init = repo / "torch-ext" / "rms_norm_tpu" / "__init__.py"
  init.write_text(init.read_text() + "\n# local edit\n")
  dist = build(repo, "rms-norm-tpu")
  report = json.loads((dist / "rms-norm-tpu.build-report.json").read_text())
  assert report["dirty"] == ["torch-ext/rms_norm_tpu/__init__.py"]
  metadata = Metadata.read_from_file(dist / "rms-norm-tpu/build/torch-cpu/metadata.json")
  assert metadata.provenance.kernel.dirty is True   # kernels' DirtyValidator warns on load
  problems = release.check_build("rms-norm-tpu", release.load_manifest(repo), dist=dist, root=repo)
  assert any("uncommitted" in p for p in problems)


def test_card_release_section(repo):
  dist = build(repo)
  manifest = release.load_manifest(repo)
  head = git(repo, "rev-parse", "HEAD")
  install = manifest["collection"]["tpu-vm-install"]
  assert install.startswith("pip install torch-tpu==") and "jax==" in install and "libtpu==" in install
  for name in ("rms-norm-tpu", "ragged-dot-tpu", "flash-attention-tpu"):
    card = (dist / name / "README.md").read_text()
    opening, notes = card[:card.index("## Release")], card[card.index("## Release"):]
    assert card.count("## Release") == 1
    assert f"branch `v1` of `tpu-kernels/{name}`" in notes
    assert f"get_kernel(\"tpu-kernels/{name}\", version=1)" in notes
    assert f"commit `{head}`" in notes and "uncommitted" not in notes
    assert "v5e, v6e" in notes
    for dtype in manifest["kernel"][name]["dtypes"]:
      assert dtype in notes
    assert release.changelog_entry(name, 1, repo) in notes
    # the install line and the chart open the card, before its details
    assert f"```\n{install}\n```" in opening and install not in notes
    assert opening.index(install) < opening.index("## Details")
    assert "static estimates, not measured" in notes
    assert "{" not in notes
    # the kernel's own chart, shipped at the repo root and shown near the card's top
    assert f"]({build_py.CARD_CHART})" in opening[:opening.index("## Details")]
    chart = (dist / name / build_py.CARD_CHART).read_bytes()
    assert chart[:8] == b"\x89PNG\r\n\x1a\n"
    assert chart == (repo / "benchmarks" / "results" /
                     f"estimates-{release.stem(name, manifest)}.png").read_bytes()
  rms = (dist / "rms-norm-tpu" / "README.md").read_text()
  assert "| rms_norm bf16[8192,4096] | pallas | v6e | 102,357 |" in rms
  ragged = (dist / "ragged-dot-tpu" / "README.md").read_text()
  assert "ragged_dot Qwen3-30B-A3B down bf16 m=8192 | pallas | v6e" in ragged
  assert "rms_norm bf16" not in ragged[ragged.index("## Release"):]
  flash = (dist / "flash-attention-tpu" / "README.md").read_text()
  flash_notes = flash[flash.index("## Release"):]
  assert "| flash_attention causal B=1 H=32/8 S=4096 D=128 bf16 | pallas | v6e |" in flash_notes
  assert "ragged_dot" not in flash_notes and "paged_attention decode" not in flash_notes
  # A kernel with no row in the table gets the explicit sentence instead.
  planned = {**manifest, "kernel": {**manifest["kernel"], "new-kernel-tpu": {
      **manifest["kernel"]["rms-norm-tpu"], "torch-package": "torch-ext/new_kernel_tpu"}}}
  notes = build_py.release_notes("new-kernel-tpu", planned, "_ns", None, None)
  assert "No static estimates recorded for this kernel yet" in notes
  assert build_py.CARD_CHART not in notes
  assert build_py.card_opening("new-kernel-tpu", planned)["chart"] == build_py.NO_ESTIMATES
  # The technical content of the card is untouched: the card, formatted, comes first.
  source_card = (repo / manifest["kernel"]["rms-norm-tpu"]["card"]).read_text()
  assert rms.startswith(source_card[:source_card.index("{version}")])


def test_release_notes_for_a_kernel_with_no_changelog_yet():
  """paged-attention-tpu (being written) gets a Release section from build.toml alone."""
  manifest = release.load_manifest()
  notes = build_py.release_notes("paged-attention-tpu", manifest, "_ns", None, None)
  assert "branch `v1` of `tpu-kernels/paged-attention-tpu`" in notes
  assert "v5e, v6e" in notes and "no commit recorded" in notes


def test_test_mapping_follows_build_toml_and_names():
  manifest = release.load_manifest()
  own = {name: release.own_modules(name, manifest) for name in manifest["kernel"]}
  assert own["rms-norm-tpu"] == ["rms_norm"]
  assert own["ragged-dot-tpu"] == ["ragged_dot", "moe_combine", "moe_route", "moe"]
  assert own["flash-attention-tpu"] == ["flash_attention"]
  assert own["paged-attention-tpu"] == ["paged_attention"]
  cases = {
      "tests/jax/test_rms_norm_kernel.py": [("rms-norm-tpu", "property")],
      "tests/torch/test_rms_norm_op.py": [("rms-norm-tpu", "property")],
      "tests/torch/test_rms_norm_all_families.py": [("rms-norm-tpu", "property")],
      "tests/jax/test_flash_attention_diffusers_aot.py": [("flash-attention-tpu", "aot")],
      "tests/jax/test_aot_compile.py": [("rms-norm-tpu", "aot")],
      "tests/jax/test_ragged_dot_aot.py": [("ragged-dot-tpu", "aot")],
      "tests/torch/test_moe_experts.py": [("ragged-dot-tpu", "property")],
      "tests/jax/test_moe.py": [("ragged-dot-tpu", "property")],
      "tests/jax/test_moe_combine.py": [("ragged-dot-tpu", "property")],
      "tests/jax/test_moe_route.py": [("ragged-dot-tpu", "property")],
      "tests/jax/test_flash_attention_aot.py": [("flash-attention-tpu", "aot")],
      "tests/torch/test_flash_attention_models.py": [("flash-attention-tpu", "property")],
      # the fourth kernel, by naming alone:
      "tests/jax/test_paged_attention_kernel.py": [("paged-attention-tpu", "property")],
      "tests/jax/test_paged_attention_aot.py": [("paged-attention-tpu", "aot")],
      "tests/torch/test_paged_attention_op.py": [("paged-attention-tpu", "property")],
      # not any one kernel's
      "tests/jax/test_static_estimate.py": [],
      "tests/jax/test_ragged_estimate.py": [],
      "tests/torch/test_packaging.py": [],
      "tests/release/test_release_build.py": [],
  }
  for rel, expected in cases.items():
    assert release.kernel_of_test_path(ROOT / rel, manifest) == expected, rel
  files = release.test_files("rms-norm-tpu", manifest)
  assert files == {"property": ["tests/jax/test_rms_norm_gated_kernel.py",
                                "tests/jax/test_rms_norm_kernel.py",
                                "tests/torch/test_rms_norm_all_families.py",
                                "tests/torch/test_rms_norm_gated_op.py",
                                "tests/torch/test_rms_norm_op.py"],
                   "aot": ["tests/jax/test_aot_compile.py"]}
  extra_aot = {"flash-attention-tpu": ["tests/jax/test_flash_attention_diffusers_aot.py"]}
  for name in ("ragged-dot-tpu", "flash-attention-tpu"):
    files = release.test_files(name, manifest)
    assert files["aot"] == sorted([f"tests/jax/test_{release.stem(name, manifest)}_aot.py",
                                   *extra_aot.get(name, [])])
    assert f"tests/torch/test_{release.stem(name, manifest)}_op.py" in files["property"]


def test_source_hash_is_the_package_content_hash(repo):
  dist = build(repo, "ragged-dot-tpu")
  manifest = release.load_manifest(repo)
  package = dist / "ragged-dot-tpu" / "torch-ext" / "ragged_dot_tpu"
  built = {rel: p for rel, p in release.tree_files(package).items() if rel != "_ops.py"}
  assert set(built) == set(release.package_sources("ragged-dot-tpu", manifest, repo))
  # the kernel's tuning tables travel with it, one per chip (tpu_kernels/tuning_tables.py)
  assert {"tpu_kernels/tuned/ragged_dot.v5e.json", "tpu_kernels/tuned/ragged_dot.v6e.json",
          "tpu_kernels/tuning_tables.py"} <= set(built)
  assert release.sha256_files(built) == release.source_hash("ragged-dot-tpu", manifest, repo)
