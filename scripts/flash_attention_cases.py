"""The flash-attention (flash-attention-tpu) programs compiled ahead of time at real shapes.

Shared by tests/jax/test_flash_attention_aot.py and scripts/aot_summary.py (one definition
of the matrix). Torch / SDPA layout: q [B, Hq, S, D], k / v [B, Hkv, S, D], bf16, B = 1.

  * Defaults: Hq / Hkv = 32 / 8 (Llama-3-8B-like GQA), causal (the prefill / training
    default), S in {2048, 8192, 32768}, head_dim 128 (Llama, Qwen3, Mistral), 256
    (Gemma 2 / 3) and 80 (not a lane multiple: lane-padded in VMEM).
  * Features, S = 8192 unless said:
      - "all features": D 128, 32 / 8, causal, sliding_window=4096 (Gemma 2 / Mistral),
        soft_cap=50.0 (Gemma 2's attention cap), sinks, a (q, kv) segment-id pair;
      - "gpt-oss": D 64, Hq / Hkv 64 / 8, causal, sliding_window=128, sinks;
      - "MQA": D 128, Hq / Hkv 16 / 1 (one KV head: 16 query heads per K/V block);
      - "f32": the default configuration (D 128, 32 / 8, causal) in float32.

Every program is `bwd`: jax.grad of 0.5 * sum(out^2) w.r.t. q, k, v (and sinks). The
loss needs the output, so the program holds the forward kernel (the very pallas_call,
same tiling, that inference runs: `flash_attention`'s custom VJP calls one forward for
both) plus the dq and dkv kernels: one compile covers forward and backward. `fwd`
programs (the output alone) exist for the summary and for the test that checks that
claim. `tiling(chip)` asks `attention_tiling` with the arguments `flash_attention`
passes it (one Tiling for all three kernels).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, flash_attention as FA  # noqa: E402

S = jax.ShapeDtypeStruct
AOT_CHIPS = ["v5e", "v6e"]
SEQ_LENS = [2048, 8192, 32768]
HEAD_DIMS = [128, 256, 80]
FEATURE_SEQ = 8192


@dataclasses.dataclass(frozen=True)
class Config:
  """One attention configuration (shapes and options), B = 1, self-attention Sq = Skv.
  The name is a label: configurations with the same shapes and options are equal (and
  their programs compiled once, tests/jax/aot_pool.py)."""

  name: str = dataclasses.field(compare=False)
  seq: int
  head_dim: int = 128
  q_heads: int = 32
  kv_heads: int = 8
  dtype: str = "bfloat16"
  causal: bool = True
  sliding_window: int | None = None
  soft_cap: float | None = None
  sinks: bool = False
  segments: bool = False       # a (q_segment_ids, kv_segment_ids) pair
  batch: int = 1

  @property
  def group(self) -> int:
    return self.q_heads // self.kv_heads

  @property
  def options(self) -> str:
    parts = [f"{self.q_heads}/{self.kv_heads} heads", f"D={self.head_dim}", f"S={self.seq}"]
    if self.causal:
      parts.append("causal")
    if self.sliding_window is not None:
      parts.append(f"window={self.sliding_window}")
    if self.soft_cap is not None:
      parts.append(f"soft_cap={self.soft_cap:g}")
    if self.sinks:
      parts.append("sinks")
    if self.segments:
      parts.append("segments")
    if self.dtype != "bfloat16":
      parts.append(self.dtype)
    return " ".join(parts)


def default_config(seq: int, head_dim: int) -> Config:
  return Config("default", seq, head_dim)


FEATURE_CONFIGS = {c.name: c for c in (
    Config("all features", FEATURE_SEQ, sliding_window=4096, soft_cap=50.0, sinks=True,
           segments=True),
    Config("gpt-oss", FEATURE_SEQ, head_dim=64, q_heads=64, kv_heads=8, sliding_window=128,
           sinks=True),
    Config("MQA", FEATURE_SEQ, q_heads=16, kv_heads=1),
    Config("f32", FEATURE_SEQ, dtype="float32"),
    # DeepSeek-V3's multi-head latent attention in prefill / training: q and k head_dim
    # 192, v 128, 128 heads. flash-attention-tpu zero-pads v to 192 (its one head_dim), so
    # the program the kernel runs is this one.
    Config("DeepSeek-V3 MLA", FEATURE_SEQ, head_dim=192, q_heads=128, kv_heads=128),
)}


@dataclasses.dataclass(frozen=True)
class Program:
  """One program compiled for a chip: one configuration, forward or backward."""

  config: Config
  direction: str         # "fwd" (the output) or "bwd" (jax.grad: fwd + dq + dkv kernels)

  @property
  def label(self) -> str:
    return f"{self.config.name}: {self.config.options} {self.direction}"

  @property
  def kernels(self) -> tuple[str, ...]:
    """The pallas_call names the compiled program must hold, one Mosaic kernel each (in
    a grad program they come out prefixed, e.g. "transpose_jvp_flash_attention_dq__.1":
    match by substring)."""
    if self.direction == "fwd":
      return (FA.FORWARD_KERNEL,)
    return (FA.FORWARD_KERNEL, FA.DQ_KERNEL, FA.DKV_KERNEL)

  def _specs(self):
    c = self.config
    dt = jnp.dtype(c.dtype)
    specs = [S((c.batch, c.q_heads, c.seq, c.head_dim), dt),
             S((c.batch, c.kv_heads, c.seq, c.head_dim), dt),
             S((c.batch, c.kv_heads, c.seq, c.head_dim), dt)]
    if c.sinks:
      specs.append(S((c.q_heads,), jnp.float32))
    if c.segments:
      specs += [S((c.batch, c.seq), jnp.int32), S((c.batch, c.seq), jnp.int32)]
    return specs

  def function(self, chip: str, interpret: bool = False):
    """fn(q, k, v[, sinks][, q_segment_ids, kv_segment_ids]) -> out [B, Hq, S, D]."""
    c = self.config
    op = functools.partial(FA.flash_attention, causal=c.causal,
                           sliding_window=c.sliding_window, soft_cap=c.soft_cap, chip=chip,
                           interpret=interpret)

    def fn(q, k, v, *rest):
      rest = list(rest)
      sinks = rest.pop(0) if c.sinks else None
      segment_ids = (rest[0], rest[1]) if c.segments else None
      return op(q, k, v, sinks=sinks, segment_ids=segment_ids)

    return fn

  def build(self, chip: str):
    """(fn, arg specs) of the compiled program."""
    fn, specs = self.function(chip), self._specs()
    if self.direction == "fwd":
      return fn, specs
    argnums = (0, 1, 2, 3) if self.config.sinks else (0, 1, 2)

    def loss(*args):
      out = fn(*args).astype(jnp.float32)
      return 0.5 * jnp.sum(out * out)

    return jax.grad(loss, argnums=argnums), specs

  def tiling(self, chip: str) -> FA.Tiling:
    """The tiling of all three kernels, as `flash_attention` asks for it."""
    c = self.config
    return FA.attention_tiling(c.seq, c.seq, c.head_dim, group=c.group,
                               dtype=jnp.dtype(c.dtype), chip=chip, causal=c.causal,
                               sliding_window=c.sliding_window)

  def plan(self, chip: str) -> str:
    t = self.tiling(chip)
    return (f"block_q {t.block_q} x block_k {t.block_k} @{t.vmem_limit_bytes / 2**20:.0f} MiB "
            f"(plan {t.vmem_plan_bytes / 2**20:.1f})")


def default_programs(head_dim: int, directions=("bwd",)) -> list[Program]:
  return [Program(default_config(s, head_dim), d) for d in directions for s in SEQ_LENS]


def feature_programs(directions=("bwd",)) -> list[Program]:
  return [Program(c, d) for d in directions for c in FEATURE_CONFIGS.values()]


def tuned_programs(chip: str, directions=("bwd",)) -> list[Program]:
  """The tuning table's entries for `chip`: one program per distinct (head_dim, group,
  dtype, entry), 8 KV heads with G query heads each, at one sequence bucket that takes
  the entry: the longest default length (SEQ_LENS) if one does, else the shortest. The
  kernels compiled depend on the blocks, limit and group, not on the length or head
  count; this choice makes an entry the default shapes already use the very same program
  as theirs (32 / 8 heads, the longest default length of that tiling, as
  tests/jax/aot_pool.largest_per_kernel picks), compiled once."""
  buckets = {}
  for (c, dtype, head_dim, group, seq), blocks in FA.TUNED_BLOCKS.items():
    if c == chip:
      buckets.setdefault((head_dim, group, dtype, blocks), []).append(seq)
  out = []
  for (head_dim, group, dtype, _), seqs in sorted(buckets.items(), key=lambda kv: min(kv[1])):
    seq = max([s for s in seqs if s in SEQ_LENS] or [min(seqs)])
    config = Config("tuned", seq, head_dim, q_heads=8 * group, kv_heads=8, dtype=dtype)
    out += [Program(config, d) for d in directions]
  return out


def all_programs(directions=("bwd",)) -> list[Program]:
  """The AOT matrix: every default and feature configuration, backward (fwd + dq + dkv)
  by default; scripts/aot_summary.py also compiles the forward-only programs."""
  return [p for d in HEAD_DIMS for p in default_programs(d, directions)] + \
      feature_programs(directions)


def compile_case(program: Program, chip: str) -> aot.CompileReport:
  fn, specs = program.build(chip)
  return aot.compile_for_chip(fn, specs, chip)
