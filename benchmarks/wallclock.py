"""Wall-clock benchmarks on a TPU: headline kernels vs. XLA, and MoE decode throughput.

The headline cases, each next to its XLA baseline, and the greedy decode throughput of a
MoE model whose experts run through ragged-dot-tpu, timed on the device.

    python benchmarks/wallclock.py [--smoke] [--cases [SUBSTR ...]] [--e2e]
                                   [--repeats N] [--warmup N] [--out DIR]

What it measures. Every case of `headline.HEADLINE` (RMSNorm, the Qwen3-30B-A3B grouped
matmuls, causal GQA attention, paged decode) is run on the device at its headline shape,
once through our Pallas kernel and once through the XLA baseline on the same inputs:

    rms-norm-tpu         rms_norm.rms_norm_reference (plain jnp, f32 math)
    ragged-dot-tpu       jax.lax.ragged_dot (f32 accumulation; silu(gate) * up in XLA)
    flash-attention-tpu  jax.nn.dot_product_attention (is_causal=True, its [B, S, H, D] layout)
    paged-attention-tpu  paged_attention.paged_attention_xla (gathers every sequence's pages)

Inputs are random with a fixed seed; the grouped matmul routes its rows evenly over the
experts (balanced group_sizes); the paged cache takes its pages from a shuffled pool, so
no sequence's pages are contiguous.

Method. Each call is jitted. `warmup` calls (compile, caches) are made and discarded, then
`repeats` calls are timed one by one with time.perf_counter, each ended by
`jax.block_until_ready` on its result, so a time covers dispatch plus device execution of
one call (for the smallest cases, e.g. RMSNorm of 8 rows, dispatch dominates). Rows
report the median, the minimum and every repeat in µs, and the achieved TFLOP/s and GB/s
from the case's flops() / min_bytes() at the median; on a TPU also the roofline of the
chip table (max(flops / peak, min_bytes / HBM bandwidth)) and roofline / median. The
kernel's output is checked against the baseline's (tolerances in TOLERANCE). A baseline
that cannot run at a shape (XLA attention at 32768 tokens materialises the whole
[B, H, S, S] logits and runs out of HBM) is recorded with its error, not skipped silently.

End to end (`--e2e`): a Qwen3-MoE model (`--model`, default Qwen/Qwen3-30B-A3B: 61 GB in
bf16, so one device needs that much HBM) is loaded to TorchTPU's "tpu" device and decodes
`--new-tokens` tokens greedily from a seeded random prompt, once with its experts run by
ragged-dot-tpu's `experts_forward` (registered as Transformers' "tpu_ragged_dot"
experts implementation, the kernel repo built from this checkout and loaded with
get_kernel) and once per stock implementation (`--stock-experts`, default Transformers'
default "grouped_mm" and the per-expert "eager" loop). Rows report tokens / s over the
whole generate (prefill included) and the decode rate with the prefill taken out,
(new_tokens - 1) * batch / (t(new_tokens) - t(1 token)), and whether the greedy tokens
match. (Assumption, untested: JAX and TorchTPU share the TPU in one process. If they do
not, run the kernels and the end-to-end part as two commands: `--cases` and `--e2e`.)

Smoke mode (`--smoke`): the same harness on CPU. Every case is scaled down to a tiny case
of the same kind (`smoke_case`: GQA ratio, causality, pages and balanced groups kept), the
kernels run in Pallas interpret mode, warmup 1 and repeats 2 by default, and rows are
labelled SMOKE_MODE: those times say nothing about a TPU. Each kernel's output must match
its XLA baseline's, and the end-to-end part decodes with a tiny random Qwen3-MoE
(scripts/demo.py's `tiny_qwen3_moe`) on CPU and requires the kernel's greedy tokens to
equal every stock implementation's. `tests/torch/test_wallclock.py` runs it.

Sections: with neither `--cases` nor `--e2e` both run; `--cases` alone (no substring: all
cases) runs only the kernels, `--e2e` alone only the model. Writes
`<out>/wallclock-<mode>.jsonl` (mode "smoke" or "tpu-<chip>") and prints markdown tables.
Exits non-zero if a kernel fails or disagrees with its baseline (smoke mode: also if a
baseline fails or the tokens differ).

Nothing in this repository has been run on a TPU yet: the real mode is written for one
and refuses to run anywhere else; only the smoke mode has been run.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import atexit  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any, Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import RESULTS, ROOT  # noqa: E402  (first: it puts kernels/ on sys.path)
from benchmarks.cases import headline  # noqa: E402
from tpu_kernels import chips, flash_attention, paged_attention, ragged_dot, rms_norm  # noqa: E402
from benchmarks.rating.roofline import roofline_us  # noqa: E402
from benchmarks.reports import wallclock as report  # noqa: E402

SMOKE_MODE = "smoke (CPU, interpret mode: not a performance number)"
TPU_MODE = "tpu"
SEED = 0
DEFAULT_MODEL = "Qwen/Qwen3-30B-A3B"
KERNEL_EXPERTS = "tpu_ragged_dot"            # the README's name for ragged-dot-tpu's experts
STOCK_EXPERTS = ("grouped_mm", "eager")      # Transformers' default, and its per-expert loop
KERNEL_REPO = "ragged-dot-tpu"

# (warmup, repeats) when not given.
DEFAULT_COUNTS = {"smoke": (1, 2), "tpu": (3, 20)}
# End-to-end shape when not given: (batch, prompt_len, new_tokens).
DEFAULT_DECODE = {"smoke": (2, 8, 8), "tpu": (8, 128, 64)}

# Kernel vs XLA baseline, both bf16 in and out, compared in f32 element by element:
# |kernel - xla| <= atol * max|xla| + rtol * |xla|, and every kernel element finite.
TOLERANCE = {
    # Both compute in f32 and round once to bf16: at most one bf16 ulp apart (2^-7 relative).
    "rms-norm-tpu": dict(rtol=1e-2, atol=1e-2),
    # f32 accumulation in another order, the epilogue in f32, one rounding to bf16 each.
    "ragged-dot-tpu": dict(rtol=1e-2, atol=1e-2),
    # Both round the softmax probabilities to bf16 before P @ V, at different points
    # (online softmax vs. one pass): a few bf16 ulps of the output.
    "flash-attention-tpu": dict(rtol=2e-2, atol=2e-2),
    # The baseline is f32 throughout; the kernel feeds bf16 probabilities to the MXU.
    "paged-attention-tpu": dict(rtol=2e-2, atol=2e-2),
}


# ----------------------------------------------------------------------------- timing


@dataclasses.dataclass(frozen=True)
class Timing:
  """Wall-clock times of the timed repeats of one callable, in µs, in call order."""

  times_us: tuple[float, ...]

  @property
  def median_us(self) -> float:
    return statistics.median(self.times_us)

  @property
  def min_us(self) -> float:
    return min(self.times_us)


def time_calls(fn: Callable[[], Any], *, warmup: int, repeats: int,
               block: Callable[[Any], Any] = jax.block_until_ready,
               clock: Callable[[], float] = time.perf_counter) -> tuple[Timing, Any]:
  """Calls fn() `warmup` times untimed, then `repeats` times timed, each call ended by
  block(result) (the device has finished when it returns). Returns (Timing, the last
  result as block returned it)."""
  if warmup < 0 or repeats < 1:
    raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
  result = None
  for _ in range(warmup):
    result = block(fn())
  times = []
  for _ in range(repeats):
    start = clock()
    result = block(fn())
    times.append((clock() - start) * 1e6)
  return Timing(tuple(times)), result


# ----------------------------------------------------------------------------- device


def tpu_chip(devices, chip: str | None = None) -> str:
  """The chip name ("v5e", ...) of the first of jax's `devices`, which must be a TPU.

  The device kind is looked up in the chip table (`chips.chip_from_device_kind`: "TPU v5
  lite" -> v5e, "TPU v6 lite" / "TPU v6e" -> v6e, ...); `chip` overrides it. Anything but
  a TPU is a SystemExit telling the user to pass --smoke: real mode never produces
  numbers on another platform.
  """
  device = devices[0]
  if device.platform != "tpu":
    raise SystemExit(
        f"wallclock.py: no TPU here (jax's first device is {device.platform!r}, kind "
        f"{device.device_kind!r}). Real timings need a TPU; pass --smoke to check the "
        "harness on CPU (interpret mode, not a performance number).")
  if chip is not None:
    return chips.get_chip(chip).name
  try:
    return chips.chip_from_device_kind(device.device_kind).name
  except ValueError as e:
    raise SystemExit(f"wallclock.py: {e}. Pass --chip to name its generation.") from None


# ----------------------------------------------------------------------------- cases


def smoke_case(case):
  """The tiny case of the same kind that smoke mode runs in place of `case`.

  Kept: dtypes, the GQA ratio and causality (attention), one query token per sequence,
  full-length contexts and a paged cache (paged decode), balanced groups with the same
  rows per group (grouped matmul), head_dim 128 (one lane tile). Shrunk: everything else.
  Long cases stay longer than short ones (sizes / 32; contexts / 64, since interpret mode
  pays per page), so the long attention case covers several blocks with causal block
  skipping and the long paged case 32 pages per sequence.
  """
  if isinstance(case, headline.RmsNorm):
    return dataclasses.replace(case, rows=max(8, case.rows // 32), hidden=256)
  if isinstance(case, headline.GroupedMatmul):
    groups = 4
    return dataclasses.replace(case, m=groups * max(1, case.m // case.groups), groups=groups,
                               hidden=256, width=128)
  if isinstance(case, headline.Attention):
    group = case.q_heads // case.kv_heads
    return dataclasses.replace(case, seq=max(128, case.seq // 32), batch=1, kv_heads=2,
                               q_heads=2 * group)
  if isinstance(case, headline.PagedDecode):
    group = case.q_heads // case.kv_heads
    return dataclasses.replace(case, context=max(64, case.context // 64), batch=4,
                               kv_heads=2, q_heads=2 * group, page_size=16)
  raise TypeError(f"no smoke shape for {type(case).__name__}")


@dataclasses.dataclass(frozen=True)
class Impl:
  """One implementation of a case, ready to time: fn(*args) (jitted) on device arrays;
  `to_common` (untimed) brings its output to the layout the baseline's output has."""

  name: str
  fn: Callable
  args: tuple
  to_common: Callable = lambda out: out


def _balanced_group_sizes(m: int, groups: int) -> np.ndarray:
  sizes = np.full(groups, m // groups, np.int32)
  sizes[:m % groups] += 1
  return sizes


def _random(key, shape, dtype, scale=1.0):
  return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)


def run_shape(case) -> str:
  """What is actually run, spelled out (the case's own name describes the headline shape)."""
  if isinstance(case, headline.RmsNorm):
    return f"x bf16[{case.rows},{case.hidden}]"
  if isinstance(case, headline.GroupedMatmul):
    return (f"lhs bf16[{case.m},{case.k}] rhs bf16[{case.groups},{case.k},{case.n_weight}] "
            f"{case.m // case.groups} rows/group -> [{case.m},{case.n_out}]")
  if isinstance(case, headline.Attention):
    return (f"q bf16[{case.batch},{case.seq},{case.q_heads},{case.head_dim}] "
            f"kv [{case.batch},{case.seq},{case.kv_heads},{case.head_dim}] causal")
  if isinstance(case, headline.PagedDecode):
    return (f"q bf16[{case.batch},{case.q_heads},{case.head_dim}] kv {case.kv_heads} heads "
            f"ctx {case.context} page {case.page_size}")
  raise TypeError(type(case).__name__)


def implementations(case, *, chip: str, interpret: bool) -> list[Impl]:
  """[our kernel, its XLA baseline] for `case`, on the same random inputs (seed SEED)."""
  keys = jax.random.split(jax.random.key(SEED), 4)
  kernel_args = dict(chip=chip, interpret=interpret)

  if isinstance(case, headline.RmsNorm):
    x = _random(keys[0], (case.rows, case.hidden), jnp.bfloat16)
    w = _random(keys[1], (case.hidden,), jnp.bfloat16, 0.1) + 1
    return [Impl("pallas", jax.jit(functools.partial(rms_norm.rms_norm, **kernel_args)), (x, w)),
            Impl("xla (jnp)", jax.jit(rms_norm.rms_norm_reference), (x, w))]

  if isinstance(case, headline.GroupedMatmul):
    lhs = _random(keys[0], (case.m, case.k), jnp.bfloat16)
    # Weights scaled by 1/sqrt(k): outputs of order one, as in a trained layer.
    rhs = _random(keys[1], (case.groups, case.k, case.n_weight), jnp.bfloat16,
                  case.k ** -0.5)
    sizes = jnp.asarray(_balanced_group_sizes(case.m, case.groups))
    if case.part == "gate_up+silu":
      kernel = functools.partial(ragged_dot.gated_ragged_dot, activation="silu", **kernel_args)

      def xla(lhs, rhs, sizes):
        z = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
        gate, up = z[:, :case.width], z[:, case.width:]
        return (ragged_dot.activation("silu", gate) * up).astype(lhs.dtype)
    else:
      kernel = functools.partial(ragged_dot.ragged_dot, **kernel_args)

      def xla(lhs, rhs, sizes):
        z = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32)
        return z.astype(lhs.dtype)
    args = (lhs, rhs, sizes)
    return [Impl("pallas", jax.jit(kernel), args),
            Impl("xla (lax.ragged_dot)", jax.jit(xla), args)]

  if isinstance(case, headline.Attention):
    q = _random(keys[0], (case.batch, case.seq, case.q_heads, case.head_dim), jnp.bfloat16)
    k = _random(keys[1], (case.batch, case.seq, case.kv_heads, case.head_dim), jnp.bfloat16)
    v = _random(keys[2], (case.batch, case.seq, case.kv_heads, case.head_dim), jnp.bfloat16)
    # The kernel takes the SDPA layout [B, H, S, D]: transposed once here, not timed.
    sdpa = tuple(jax.block_until_ready(a.transpose(0, 2, 1, 3)) for a in (q, k, v))
    kernel = functools.partial(flash_attention.flash_attention, causal=True, **kernel_args)
    xla = functools.partial(jax.nn.dot_product_attention, is_causal=True)
    return [Impl("pallas", jax.jit(kernel), sdpa, lambda out: out.transpose(0, 2, 1, 3)),
            Impl("xla (jax.nn.dot_product_attention)", jax.jit(xla), (q, k, v))]

  if isinstance(case, headline.PagedDecode):
    pages_per_seq = -(-case.context // case.page_size)
    # A pool with a spare page per sequence, handed out in shuffled order.
    num_pages = case.batch * pages_per_seq + case.batch
    pool = np.random.default_rng(SEED).permutation(num_pages).astype(np.int32)
    page_indices = jnp.asarray(pool[:case.batch * pages_per_seq].reshape(case.batch, -1))
    cache_shape = (num_pages, case.kv_heads, case.page_size, case.head_dim)
    k_pages = _random(keys[0], cache_shape, jnp.bfloat16)
    v_pages = _random(keys[1], cache_shape, jnp.bfloat16)
    q = _random(keys[2], (case.batch, case.q_heads, case.head_dim), jnp.bfloat16)
    kv_lens = jnp.full((case.batch,), case.context, jnp.int32)
    cu_q_lens = jnp.arange(case.batch + 1, dtype=jnp.int32)   # one new token per sequence
    args = (q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens)
    kernel = functools.partial(paged_attention.ragged_paged_attention, **kernel_args)
    return [Impl("pallas", jax.jit(kernel), args),
            Impl("xla (paged_attention_xla)", jax.jit(paged_attention.paged_attention_xla),
                 args)]

  raise TypeError(f"no implementations for {type(case).__name__}")


def check_against(kernel_out, xla_out, tolerance: dict) -> dict:
  """Whether the kernel's output is within `tolerance` of the baseline's (see TOLERANCE)."""
  got = np.asarray(kernel_out, np.float32)
  ref = np.asarray(xla_out, np.float32)
  if got.shape != ref.shape:
    return dict(passed=False, reason=f"shape {got.shape} != {ref.shape}")
  scale = float(np.max(np.abs(ref))) if ref.size else 0.0
  err = np.abs(got - ref)
  bound = tolerance["atol"] * scale + tolerance["rtol"] * np.abs(ref)
  finite = bool(np.all(np.isfinite(got)))
  return dict(passed=finite and bool(np.all(err <= bound)), finite=finite,
              max_abs_err=float(np.max(err)) if err.size else 0.0, max_abs_ref=scale,
              **tolerance)


def select_cases(patterns: list[str] | None) -> list:
  """The headline cases whose name contains any of `patterns` (all for None or [])."""
  if not patterns:
    return list(headline.HEADLINE)
  chosen = [c for c in headline.HEADLINE if any(p in c.name for p in patterns)]
  if not chosen:
    raise SystemExit(f"wallclock.py: no headline case matches {patterns}; cases: "
                     + "; ".join(c.name for c in headline.HEADLINE))
  return chosen


def bench_case(case, *, smoke: bool, chip: str, warmup: int, repeats: int,
               platform: dict) -> list[dict]:
  """Timing rows (kernel first, then baseline) for one headline case."""
  run = smoke_case(case) if smoke else case
  impls = implementations(run, chip=chip, interpret=smoke)
  peak = None if smoke else chips.get_chip(chip)
  rows, outputs = [], {}
  for impl in impls:
    row = dict(platform, kernel=case.kernel, case=case.name, implementation=impl.name,
               shape=run_shape(run), flops=run.flops(), min_bytes=run.min_bytes(),
               warmup=warmup, repeats=repeats, error=None)
    try:
      timing, out = time_calls(lambda: impl.fn(*impl.args), warmup=warmup, repeats=repeats)
    except Exception as e:   # e.g. the XLA baseline out of HBM at 32k tokens: recorded
      row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
      rows.append(row)
      continue
    outputs[impl.name] = impl.to_common(out)
    seconds = timing.median_us * 1e-6
    row.update(median_us=timing.median_us, min_us=timing.min_us,
               times_us=[round(t, 3) for t in timing.times_us],
               tflops_per_s=run.flops() / seconds / 1e12, gb_per_s=run.min_bytes() / seconds / 1e9)
    if peak is not None:
      roofline = roofline_us(run, peak)
      row.update(roofline_us=roofline, roofline_fraction=roofline / timing.median_us)
    rows.append(row)
  kernel_row, baseline = rows[0], impls[1].name
  if "pallas" in outputs and baseline in outputs:
    kernel_row["check"] = dict(against=baseline, **check_against(
        outputs["pallas"], outputs[baseline], TOLERANCE[case.kernel]))
  else:
    kernel_row["check"] = dict(against=baseline, passed=None,
                               reason="an implementation failed to run")
  return rows


# ----------------------------------------------------------------------------- end to end


def load_kernel_experts(dist: Path):
  """Builds ragged-dot-tpu from this checkout into `dist`, loads it with get_kernel (as a
  user would; LOCAL_KERNELS points the repo id at the build) and registers its
  experts_forward as Transformers' KERNEL_EXPERTS experts implementation."""
  sys.path.insert(0, str(ROOT / "scripts"))
  import build
  import transformers_integration as ti

  manifest = build.load_manifest()
  repo_id = f"{manifest['collection']['hub-org']}/{KERNEL_REPO}"
  repo = build.build_kernel(KERNEL_REPO, manifest, dist)
  # Only for this load: the caller's LOCAL_KERNELS (e.g. the test suite's) is put back.
  previous = os.environ.get("LOCAL_KERNELS")
  os.environ["LOCAL_KERNELS"] = f"{repo_id}={repo}"
  try:
    kernel = ti.register_ragged_experts(repo_id, KERNEL_EXPERTS)
  finally:
    if previous is None:
      os.environ.pop("LOCAL_KERNELS")
    else:
      os.environ["LOCAL_KERNELS"] = previous
  return repo_id, kernel


def _decode_model(smoke: bool, model_id: str):
  """(model, its label, torch device): the tiny random Qwen3-MoE of scripts/demo.py on CPU
  (f32) in smoke mode, else `model_id` in bf16 on TorchTPU's "tpu" device."""
  import torch

  if smoke:
    sys.path.insert(0, str(ROOT / "scripts"))
    import demo

    return demo.tiny_qwen3_moe(torch.float32), "tiny Qwen3-MoE (random, scripts/demo.py)", "cpu"
  if not hasattr(torch, "tpu"):
    raise RuntimeError("TorchTPU is not loaded (pip install torch-tpu, and leave "
                       "TORCH_DEVICE_BACKEND_AUTOLOAD unset so that torch loads it)")
  from transformers import AutoModelForCausalLM

  model = AutoModelForCausalLM.from_pretrained(model_id, dtype=torch.bfloat16)
  return model.to("tpu").eval(), model_id, "tpu"


def bench_decode(*, smoke: bool, model_id: str, stock: tuple[str, ...], batch: int,
                 prompt_len: int, new_tokens: int, warmup: int, repeats: int, dist: Path,
                 platform: dict) -> list[dict]:
  """Greedy decode throughput with the kernel's experts and with each stock implementation.

  The same model object switches implementation (set_experts_implementation), so every
  row decodes with the same weights from the same prompt. Each generate is timed whole
  and ended by copying its tokens to the host (which waits for the device)."""
  import torch
  import transformers

  repo_id, _ = load_kernel_experts(dist)
  model, label, device = _decode_model(smoke, model_id)
  vocab = model.config.vocab_size
  generator = torch.Generator().manual_seed(SEED)
  # Ids from 3 up: clear of the usual pad / bos / eos ids, so no sequence stops early.
  prompt = torch.randint(3, vocab, (batch, prompt_len), generator=generator).to(device)
  mask = torch.ones_like(prompt)

  def generate(n):
    return model.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                          do_sample=False)

  rows, tokens = [], {}
  for impl in (KERNEL_EXPERTS,) + tuple(stock):
    model.set_experts_implementation(impl)
    with torch.no_grad():
      full, out = time_calls(lambda: generate(new_tokens), warmup=warmup, repeats=repeats,
                             block=lambda t: t.cpu())
      first, _ = time_calls(lambda: generate(1), warmup=warmup, repeats=repeats,
                            block=lambda t: t.cpu())
    tokens[impl] = out[:, prompt_len:]
    decode_s = (full.median_us - first.median_us) * 1e-6
    rows.append(dict(
        platform, kernel=KERNEL_REPO if impl == KERNEL_EXPERTS else None,
        case=f"decode {label}", implementation=(f"experts={impl} ({repo_id})"
                                                if impl == KERNEL_EXPERTS else
                                                f"experts={impl} (stock)"),
        experts=impl, shape=f"batch {batch} prompt {prompt_len} new {new_tokens} "
                            f"{str(model.dtype).removeprefix('torch.')}",
        torch_device=device, torch_version=torch.__version__,
        transformers_version=transformers.__version__, warmup=warmup, repeats=repeats,
        median_us=full.median_us, min_us=full.min_us,
        times_us=[round(t, 3) for t in full.times_us],
        first_token_median_us=first.median_us,
        tokens_per_s=batch * new_tokens / (full.median_us * 1e-6),
        # Prefill taken out; None if noise swallowed the difference.
        decode_tokens_per_s=(batch * (new_tokens - 1) / decode_s
                             if new_tokens > 1 and decode_s > 0 else None),
        tokens=tokens[impl].tolist(), error=None))
  rows[0]["tokens_match"] = {impl: bool(torch.equal(tokens[KERNEL_EXPERTS], tokens[impl]))
                             for impl in stock}
  return rows


# ----------------------------------------------------------------------------- verdict


def failures(rows: list[dict], smoke: bool) -> list[str]:
  """What makes the run fail: kernel errors and check failures always; in smoke mode also
  baseline errors and greedy tokens that differ (on a TPU a bf16 model may legitimately
  flip a near-tie token, and an XLA baseline may run out of HBM)."""
  bad = []
  for r in rows:
    if r["error"] and (r["implementation"] == "pallas" or smoke):
      bad.append(f"{r['case']} / {r['implementation']}: {r['error']}")
    if r.get("check") and r["check"]["passed"] is False:
      bad.append(f"{r['case']}: kernel output differs from {r['check']['against']}")
    if smoke and not all(r.get("tokens_match", {}).values()):
      bad.append(f"{r['case']}: greedy tokens differ {r['tokens_match']}")
  return bad


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--smoke", action="store_true",
                      help="CPU, tiny shapes, interpret mode: checks the harness, times nothing")
  parser.add_argument("--cases", nargs="*", metavar="SUBSTR",
                      help="time the headline cases whose name contains one of these "
                           "(none given: all); without --e2e, skips the model")
  parser.add_argument("--e2e", action="store_true",
                      help="decode with a MoE model; without --cases, skips the kernels")
  parser.add_argument("--repeats", type=int, help="timed calls (default 20; smoke 2)")
  parser.add_argument("--warmup", type=int, help="untimed calls first (default 3; smoke 1)")
  parser.add_argument("--out", type=Path, default=RESULTS)
  parser.add_argument("--chip", choices=list(chips.CHIPS),
                      help="override the generation read from the device kind")
  parser.add_argument("--model", default=DEFAULT_MODEL, help="Qwen3-MoE model id (TPU only)")
  parser.add_argument("--stock-experts", nargs="+", default=list(STOCK_EXPERTS))
  parser.add_argument("--batch", type=int)
  parser.add_argument("--prompt-len", type=int)
  parser.add_argument("--new-tokens", type=int)
  parser.add_argument("--dist", type=Path,
                      help="where to build ragged-dot-tpu for --e2e (default: a temp dir)")
  args = parser.parse_args(argv)

  kind = "smoke" if args.smoke else "tpu"
  if args.smoke:
    # Before any backend starts: the smoke mode runs on the CPU even on a TPU host.
    jax.config.update("jax_platforms", "cpu")
    chip, mode, file_mode = chips.DEFAULT_CHIP, SMOKE_MODE, "smoke"
  else:
    chip = tpu_chip(jax.devices(), args.chip)
    mode, file_mode = TPU_MODE, f"tpu-{chip}"
  warmup, repeats = DEFAULT_COUNTS[kind]
  warmup = warmup if args.warmup is None else args.warmup
  repeats = repeats if args.repeats is None else args.repeats
  run_kernels = args.cases is not None or not args.e2e
  run_e2e = args.e2e or args.cases is None
  cases = select_cases(args.cases) if run_kernels else []

  device = jax.devices()[0]
  platform = dict(mode=mode, platform=device.platform, device_kind=device.device_kind,
                  chip=chip, jax_version=jax.__version__)
  print(f"# wall clock, {mode}: {device.platform} ({device.device_kind}), chip {chip}, "
        f"jax {jax.__version__}, warmup {warmup}, repeats {repeats}", flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  path = args.out / f"wallclock-{file_mode}.jsonl"
  rows = []
  # Rows are written as they come: a crash late in a long TPU run keeps the earlier ones.
  with path.open("w") as jsonl:
    def record(new_rows):
      rows.extend(new_rows)
      jsonl.write("".join(json.dumps(r) + "\n" for r in new_rows))
      jsonl.flush()

    for case in cases:
      record(bench_case(case, smoke=args.smoke, chip=chip, warmup=warmup, repeats=repeats,
                        platform=platform))
      print(f"  {case.name}: " + ", ".join(
          f"{r['implementation']} " + ("failed" if r["error"] else f"{r['median_us']:,.1f} µs")
          for r in rows[-2:]), flush=True)
    if run_e2e:
      dist = args.dist
      if dist is None:
        dist = Path(tempfile.mkdtemp(prefix="wallclock-dist-"))
        atexit.register(shutil.rmtree, dist, ignore_errors=True)
      batch, prompt_len, new_tokens = DEFAULT_DECODE[kind]
      try:
        record(bench_decode(
            smoke=args.smoke, model_id=args.model, stock=tuple(args.stock_experts),
            batch=args.batch or batch, prompt_len=args.prompt_len or prompt_len,
            new_tokens=args.new_tokens or new_tokens, warmup=warmup, repeats=repeats,
            dist=dist, platform=platform))
      except Exception as e:   # e.g. the model does not fit the device: recorded, and fails
        record([dict(platform, kernel=KERNEL_REPO, case=f"decode {args.model}",
                     implementation="end to end", experts=None,
                     error=f"{type(e).__name__}: {e}"[:300])])
  print(f"\nmode: {mode}\n")
  print(report.markdown(rows, KERNEL_EXPERTS))
  print(f"rows written to {path}")
  bad = failures(rows, args.smoke)
  for line in bad:
    print(f"FAILED: {line}", file=sys.stderr)
  return 1 if bad else 0


if __name__ == "__main__":
  sys.exit(main())
