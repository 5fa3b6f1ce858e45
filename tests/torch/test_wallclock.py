"""benchmarks/wallclock.py: the timing helper, the device check, and one smoke run.

The smoke run (CPU, every headline case at a tiny shape in interpret mode, plus greedy
decoding with a tiny random Qwen3-MoE) goes through `main` in-process once per module;
the tests then read what it wrote. The kernel-vs-XLA tolerances are wallclock.TOLERANCE
(documented there); nothing here loosens them.
"""

import json
import subprocess
import sys
import types

import pytest

from benchmarks import ROOT, wallclock
from benchmarks.cases import headline

KERNELS = ("rms-norm-tpu", "ragged-dot-tpu", "flash-attention-tpu", "paged-attention-tpu")


# ----------------------------------------------------------------------------- timing


class FakeDevice:
  """A callable whose n-th call takes durations[n] seconds of a fake clock, and a
  block_until_ready stand-in that records what it was given."""

  def __init__(self, durations):
    self.durations = list(durations)
    self.now = 100.0
    self.calls = 0
    self.blocked = []

  def clock(self):
    return self.now

  def fn(self):
    self.now += self.durations[self.calls]
    self.calls += 1
    return f"result {self.calls}"

  def block(self, result):
    self.blocked.append(result)
    return f"ready {result}"


@pytest.mark.parametrize("timed, median", [
    ([5e-6, 1e-6, 3e-6], 3.0),           # odd: the middle one
    ([4e-6, 1e-6, 3e-6, 2e-6], 2.5),     # even: the mean of the middle two
    ([7e-6], 7.0),
])
def test_time_calls_warms_up_then_times_each_blocked_call(timed, median):
  warmup = 2
  device = FakeDevice([60.0] * warmup + timed)   # warm-up calls are slow and not counted
  timing, last = wallclock.time_calls(device.fn, warmup=warmup, repeats=len(timed),
                                      block=device.block, clock=device.clock)
  assert device.calls == warmup + len(timed)
  assert device.blocked == [f"result {i + 1}" for i in range(warmup + len(timed))]
  assert last == f"ready result {warmup + len(timed)}"
  assert timing.times_us == pytest.approx([t * 1e6 for t in timed])
  assert timing.median_us == pytest.approx(median)
  assert timing.min_us == pytest.approx(min(timed) * 1e6)


def test_time_calls_without_warmup_and_bad_counts():
  device = FakeDevice([2e-6, 4e-6])
  timing, _ = wallclock.time_calls(device.fn, warmup=0, repeats=2, block=device.block,
                                   clock=device.clock)
  assert device.calls == 2 and timing.median_us == pytest.approx(3.0)
  with pytest.raises(ValueError, match="repeats >= 1"):
    wallclock.time_calls(device.fn, warmup=1, repeats=0)
  with pytest.raises(ValueError, match="warmup >= 0"):
    wallclock.time_calls(device.fn, warmup=-1, repeats=1)


# ----------------------------------------------------------------------------- device


@pytest.mark.parametrize("kind, chip", [
    ("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v6 lite", "v6e"), ("TPU v6e", "v6e"),
    ("TPU v5p", "v5p"), ("TPU v5", "v5p"), ("TPU7x", "v7"),
])
def test_device_kind_to_chip(kind, chip):
  tpu = types.SimpleNamespace(platform="tpu", device_kind=kind)
  assert wallclock.tpu_chip([tpu]) == chip


def test_chip_override_and_unknown_kind():
  tpu = types.SimpleNamespace(platform="tpu", device_kind="TPU v9 imaginary")
  assert wallclock.tpu_chip([tpu], "v5e") == "v5e"
  with pytest.raises(SystemExit, match="not supported.*--chip"):
    wallclock.tpu_chip([tpu])


def test_real_mode_refuses_cpu():
  cpu = types.SimpleNamespace(platform="cpu", device_kind="cpu")
  with pytest.raises(SystemExit, match="no TPU here.*pass --smoke"):
    wallclock.tpu_chip([cpu])
  # And through the command itself, on this CPU-only machine: nothing is timed.
  with pytest.raises(SystemExit, match="no TPU here.*pass --smoke"):
    wallclock.main(["--cases", "rms_norm"])


def test_case_selection():
  assert wallclock.select_cases(None) == list(headline.HEADLINE)
  assert {c.kernel for c in wallclock.select_cases(["rms_norm"])} == {"rms-norm-tpu"}
  with pytest.raises(SystemExit, match="no headline case matches"):
    wallclock.select_cases(["no such case"])


def test_smoke_cases_keep_the_structure():
  for case in headline.HEADLINE:
    small = wallclock.smoke_case(case)
    assert type(small) is type(case) and small.flops() < case.flops()
    if isinstance(case, headline.Attention):
      assert small.q_heads // small.kv_heads == case.q_heads // case.kv_heads
      assert small.kv_heads > 1
    if isinstance(case, headline.PagedDecode):
      assert small.q_heads // small.kv_heads == case.q_heads // case.kv_heads
      assert small.context // small.page_size > 1   # several pages per sequence
    if isinstance(case, headline.GroupedMatmul):
      assert small.m // small.groups == case.m // case.groups and small.m % small.groups == 0


def test_check_against_catches_wrong_outputs():
  import numpy as np

  ref = np.linspace(-3, 3, 64, dtype=np.float32)
  tol = wallclock.TOLERANCE["rms-norm-tpu"]
  one_ulp = ref * (1 + 2.0 ** -8)
  assert wallclock.check_against(one_ulp, ref, tol)["passed"]
  assert not wallclock.check_against(ref * 1.05, ref, tol)["passed"]
  with_nan = ref.copy()
  with_nan[3] = np.nan
  assert not wallclock.check_against(with_nan, ref, tol)["passed"]


# ----------------------------------------------------------------------------- smoke run


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
  """`python benchmarks/wallclock.py --smoke` over every headline case and the decode
  benchmark, as a user runs it: (exit code, JSONL rows, stdout + stderr). In a process of
  its own: once (CI, 2026-11-30), XLA's CPU compiler segfaulted on one of its programs
  inside the long-lived test process (which had compiled some thousand programs before);
  alone, the same run passes."""
  out = tmp_path_factory.mktemp("wallclock")
  result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "wallclock.py"), "--smoke",
                           "--out", str(out), "--dist", str(out / "dist")],
                          capture_output=True, text=True, timeout=1200)
  rows = []
  if (out / "wallclock-smoke.jsonl").exists():
    rows = [json.loads(line) for line in (out / "wallclock-smoke.jsonl").read_text().splitlines()]
  return result.returncode, rows, result.stdout + result.stderr


def test_smoke_run_succeeds(smoke_run):
  code, rows, stdout = smoke_run
  assert code == 0, stdout
  assert wallclock.SMOKE_MODE in stdout
  for case in headline.HEADLINE:
    assert case.name in stdout


def test_smoke_rows_time_every_case_with_kernel_and_baseline(smoke_run):
  _, rows, _ = smoke_run
  kernel_rows = [r for r in rows if "experts" not in r]
  assert {r["case"] for r in kernel_rows} == {c.name for c in headline.HEADLINE}
  assert {r["kernel"] for r in kernel_rows} == set(KERNELS)
  for case in headline.HEADLINE:
    impls = [r["implementation"] for r in kernel_rows if r["case"] == case.name]
    assert impls[0] == "pallas" and len(impls) == 2 and impls[1].startswith("xla")
  for r in kernel_rows:
    assert r["mode"] == wallclock.SMOKE_MODE
    assert r["platform"] == "cpu" and r["device_kind"] and r["jax_version"]
    assert r["error"] is None
    assert r["warmup"] == 1 and r["repeats"] == 2 and len(r["times_us"]) == 2
    assert r["median_us"] > 0 and 0 < r["min_us"] <= r["median_us"]
    assert r["tflops_per_s"] > 0 and r["gb_per_s"] > 0 and r["shape"]


def test_smoke_kernels_match_their_xla_baselines(smoke_run):
  _, rows, _ = smoke_run
  checks = [r for r in rows if r.get("implementation") == "pallas"]
  assert len(checks) == len(headline.HEADLINE)
  for r in checks:
    assert r["check"]["passed"] is True, (r["case"], r["check"])
    assert r["check"]["finite"] and r["check"]["against"].startswith("xla")


def test_smoke_decode_throughput_and_identical_tokens(smoke_run):
  _, rows, _ = smoke_run
  decode = [r for r in rows if "experts" in r]
  assert [r["experts"] for r in decode] == [wallclock.KERNEL_EXPERTS, *wallclock.STOCK_EXPERTS]
  for r in decode:
    assert r["error"] is None and r["torch_device"] == "cpu"
    assert r["tokens_per_s"] > 0 and r["median_us"] > 0
    batch, prompt_len, new_tokens = wallclock.DEFAULT_DECODE["smoke"]
    assert len(r["tokens"]) == batch and all(len(t) == new_tokens for t in r["tokens"])
  assert decode[0]["tokens_match"] == {impl: True for impl in wallclock.STOCK_EXPERTS}
  assert all(r["tokens"] == decode[0]["tokens"] for r in decode)
