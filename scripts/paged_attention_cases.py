"""The paged-attention (paged-attention-tpu) programs compiled ahead of time at serving shapes.

Shared by tests/jax/test_paged_attention_aot.py and scripts/aot_summary.py (one definition
of the matrix). Layout: q [T, Hq, D], k / v pages [num_pages, Hkv, page_size, D], bf16.

  * Defaults (decode: one new token per sequence, page size 16, the smallest vLLM uses):
    batch S in {1, 64, 256} x context in {2k, 32k, 128k} x heads Hq / Hkv in {32 / 8
    (Llama-3-8B), 64 / 8 (Llama-3-70B), 16 / 1 (MQA)} x head_dim in {64, 128, 256}.
    The page table is S x context / 16 (up to 256 x 8192 words: 8 MiB, eight times SMEM),
    so the biggest cases run the SMEM-chunked path. The cache holds min(S x context / 16,
    pages that fit a quarter of the chip's HBM) pages: at batch 256 and 128k tokens the
    sequences could not all be resident, but the page table and the grid are full size.
  * Features (32 / 8 heads, D 128, S 64, context 32k unless said):
      - "mixed": 56 decodes + 8 prefill chunks of 512 tokens in one call, window 4096,
        soft_cap 50, sinks;
      - "prefill": one sequence, 8192 new tokens, no cache before them;
      - "int8" / "fp8": int8 and float8_e4m3fn caches with per-KV-head scales;
      - "page 256": page size 256; "f32": q and cache in float32, page size 64.

Each program is the forward (serving has no backward). `tiling(chip)` asks `paged_tiling`
with the arguments `ragged_paged_attention` passes it.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import aot, chips, paged_attention as PA  # noqa: E402

S = jax.ShapeDtypeStruct
AOT_CHIPS = ["v5e", "v6e"]
BATCHES = [1, 64, 256]
CONTEXTS = [2048, 32768, 131072]
HEADS = [(32, 8), (64, 8), (16, 1)]
HEAD_DIMS = [64, 128, 256]
# The cache may fill this share of HBM (the rest: weights, activations).
CACHE_HBM_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class Config:
  """One paged-attention call shape and its options."""

  name: str
  batch: int                  # sequences S
  context: int                # KV length of every sequence
  q_heads: int = 32
  kv_heads: int = 8
  head_dim: int = 128
  page_size: int = 16
  new_tokens: int | None = None   # T; default: one per sequence (decode)
  dtype: str = "bfloat16"
  kv_dtype: str | None = None     # default: dtype
  sliding_window: int | None = None
  soft_cap: float | None = None
  sinks: bool = False

  @property
  def num_tokens(self) -> int:
    return self.batch if self.new_tokens is None else self.new_tokens

  @property
  def cache_dtype(self) -> str:
    return self.kv_dtype or self.dtype

  @property
  def pages_per_seq(self) -> int:
    return -(-self.context // self.page_size)

  def num_pages(self, chip: str) -> int:
    per_page = 2 * self.kv_heads * self.page_size * self.head_dim * jnp.dtype(
        self.cache_dtype).itemsize
    fit = int(chips.get_chip(chip).hbm_bytes * CACHE_HBM_FRACTION) // per_page
    return max(1, min(self.batch * self.pages_per_seq, fit))

  @property
  def options(self) -> str:
    parts = [f"S={self.batch}", f"ctx={self.context}", f"T={self.num_tokens}",
             f"{self.q_heads}/{self.kv_heads} heads", f"D={self.head_dim}",
             f"page={self.page_size}"]
    if self.sliding_window is not None:
      parts.append(f"window={self.sliding_window}")
    if self.soft_cap is not None:
      parts.append(f"soft_cap={self.soft_cap:g}")
    if self.sinks:
      parts.append("sinks")
    if self.cache_dtype != "bfloat16" or self.dtype != "bfloat16":
      parts.append(f"q {self.dtype} cache {self.cache_dtype}")
    return " ".join(parts)


def default_config(batch: int, context: int, heads: tuple[int, int], head_dim: int) -> Config:
  return Config("decode", batch, context, heads[0], heads[1], head_dim)


FEATURE_CONFIGS = {c.name: c for c in (
    Config("mixed", 64, 32768, new_tokens=56 + 8 * 512, sliding_window=4096, soft_cap=50.0,
           sinks=True),
    Config("prefill", 1, 8192, new_tokens=8192),
    Config("int8", 64, 32768, kv_dtype="int8"),
    Config("fp8", 64, 32768, kv_dtype="float8_e4m3fn"),
    Config("page 256", 64, 32768, page_size=256),
    Config("f32", 64, 32768, page_size=64, dtype="float32"),
)}


@dataclasses.dataclass(frozen=True)
class Program:
  """One forward program compiled for a chip."""

  config: Config

  @property
  def label(self) -> str:
    return f"{self.config.name}: {self.config.options}"

  @property
  def kernels(self) -> tuple[str, ...]:
    return (PA.KERNEL_NAME,)

  @property
  def quantized(self) -> bool:
    return jnp.dtype(self.config.cache_dtype) in PA.QUANTIZED_DTYPES

  def specs(self, chip: str):
    c = self.config
    dt, kv_dt = jnp.dtype(c.dtype), jnp.dtype(c.cache_dtype)
    pages = (c.num_pages(chip), c.kv_heads, c.page_size, c.head_dim)
    specs = [S((c.num_tokens, c.q_heads, c.head_dim), dt), S(pages, kv_dt), S(pages, kv_dt),
             S((c.batch,), jnp.int32), S((c.batch, c.pages_per_seq), jnp.int32),
             S((c.batch + 1,), jnp.int32)]
    if c.sinks:
      specs.append(S((c.q_heads,), jnp.float32))
    if self.quantized:
      specs += [S((c.kv_heads,), jnp.float32), S((c.kv_heads,), jnp.float32)]
    return specs

  def function(self, chip: str, interpret: bool = False):
    """fn(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens[, sinks][, k_scale,
    v_scale]) -> out [T, Hq, D]."""
    c = self.config
    op = functools.partial(PA.ragged_paged_attention, sliding_window=c.sliding_window,
                           soft_cap=c.soft_cap, chip=chip, interpret=interpret)

    def fn(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, *rest):
      rest = list(rest)
      sinks = rest.pop(0) if c.sinks else None
      k_scale, v_scale = rest if self.quantized else (None, None)
      return op(q, k_pages, v_pages, kv_lens, page_indices, cu_q_lens, sinks=sinks,
                k_scale=k_scale, v_scale=v_scale)

    return fn

  def build(self, chip: str):
    """(fn, arg specs) of the compiled program."""
    return self.function(chip), self.specs(chip)

  def tiling(self, chip: str) -> PA.Tiling:
    c = self.config
    return PA.paged_tiling(c.num_tokens, c.batch, c.pages_per_seq, c.page_size, c.head_dim,
                           num_kv_heads=c.kv_heads, group=c.q_heads // c.kv_heads,
                           q_dtype=jnp.dtype(c.dtype), kv_dtype=jnp.dtype(c.cache_dtype),
                           chip=chip)

  def plan(self, chip: str) -> str:
    t = self.tiling(chip)
    items = PA.num_work_items(self.config.num_tokens, self.config.batch, t.block_q)
    chunks = -(-items // t.items_per_call)
    return (f"block_q {t.block_q} x block_kv {t.block_kv} ({t.pages_per_block} pages) "
            f"@{t.vmem_limit_bytes / 2**20:.0f} MiB (plan {t.vmem_plan_bytes / 2**20:.1f}); "
            f"{items} items in {chunks} chunk(s), SMEM {t.smem_plan_words * 4 / 1024:.0f} KiB")


def default_programs(heads: tuple[int, int], head_dim: int) -> list[Program]:
  return [Program(default_config(b, ctx, heads, head_dim)) for b in BATCHES for ctx in CONTEXTS]


def feature_programs() -> list[Program]:
  return [Program(c) for c in FEATURE_CONFIGS.values()]


def all_programs() -> list[Program]:
  return [p for h in HEADS for d in HEAD_DIMS for p in default_programs(h, d)] + \
      feature_programs()


def compile_case(program: Program, chip: str) -> aot.CompileReport:
  fn, specs = program.build(chip)
  return aot.compile_for_chip(fn, specs, chip)
