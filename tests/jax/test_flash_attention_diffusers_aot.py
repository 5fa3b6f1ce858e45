"""flash-attention-tpu compiles ahead of time for v5e and v6e at Diffusers' real shapes
(the kernel's Diffusers backend: torch-ext/flash_attention_tpu/diffusers_backend.py).

Non-causal (image and video transformers attend both ways), bf16, B = 1, Hq = Hkv, the
kernel's layout [B, H, S, D] and its default tiling:

  * SD3.5-medium at 1024 x 1024: 4096 image + 333 text tokens (joint attention), 24 heads
    x 64 (the 333 are a prompt's CLIP + T5 tokens as the issue gives them; not a multiple
    of any block: a partial last block in both directions);
  * Flux.1 at 1024 x 1024: 4096 + 512 tokens, 24 heads x 128;
  * Wan 2.1 14B (WanTransformer3DModel's config defaults: 40 heads x 128) at 480 x 832,
    81 frames: 21 x 30 x 52 = 32760 latent tokens after the (1, 2, 2) patches, self-
    attention, and its cross-attention from those 32760 queries to 512 text keys;
  * Qwen-Image at 1024 x 1024 (24 heads x 128): 4096 + 333 tokens with a (q, kv)
    segment-id pair, which is how the backend applies its text padding mask.

Every program is the backward (jax.grad of 0.5 * sum(out^2) w.r.t. q, k, v): it holds the
forward kernel (the same pallas_call inference runs) plus the dq and dkv kernels, so one
compile covers forward and backward (tests/jax/test_flash_attention_aot.py checks that
claim). Checked per program: it compiles; it holds exactly one forward, one dq and one
dkv Mosaic kernel; it compiled under the scoped-VMEM limit `attention_tiling` asked for,
within the chip's allowance. The compiles are queued at once on up to two workers
(tests/jax/aot_pool.py).

Compile times measured here (libtpu 0.0.42.1, one program at a time on this shared
machine; seconds, v6e / v5e): SD3.5 5.4 / 4.2, Flux 4.8 / 1.8, Wan self 5.5 / 3.4, Wan
cross 3.5 / 1.9, Qwen-Image 5.4 / 3.7: 40 s for both chips, so the default run compiles
both (the suite's second stack, scripts/test.sh leg 2, skips v5e AOT ids by its -k).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import pytest

from aot_pool import check_compiled, module_compiles
from flash_attention_cases import AOT_CHIPS, Config, Program, compile_case
from tpu_kernels import chips, flash_attention as FA

pytestmark = pytest.mark.aot


@dataclasses.dataclass(frozen=True)
class CrossProgram(Program):
  """Program with kv_len keys instead of config.seq (cross-attention: Sq != Skv)."""

  kv_len: int = 0

  @property
  def label(self) -> str:
    return f"{self.config.name}: {self.config.options} Skv={self.kv_len} {self.direction}"

  def _specs(self):
    import jax

    c, dt = self.config, jnp.dtype(self.config.dtype)
    return [jax.ShapeDtypeStruct((c.batch, c.q_heads, c.seq, c.head_dim), dt),
            jax.ShapeDtypeStruct((c.batch, c.kv_heads, self.kv_len, c.head_dim), dt),
            jax.ShapeDtypeStruct((c.batch, c.kv_heads, self.kv_len, c.head_dim), dt)]

  def tiling(self, chip: str) -> FA.Tiling:
    c = self.config
    return FA.attention_tiling(c.seq, self.kv_len, c.head_dim, group=c.group,
                               dtype=jnp.dtype(c.dtype), chip=chip, causal=c.causal)


def _joint(name, seq, heads, head_dim, **kwargs):
  return Program(Config(name, seq, head_dim, q_heads=heads, kv_heads=heads, causal=False,
                        **kwargs), "bwd")


WAN_TOKENS = 21 * 30 * 52          # 81 frames -> 21 latent frames; 480 x 832 -> 60 x 104 / 2
PROGRAMS = {
    "sd3.5-medium": _joint("SD3.5-medium 1024px", 4096 + 333, 24, 64),
    "flux": _joint("Flux.1 1024px", 4096 + 512, 24, 128),
    "wan2.1-self": _joint("Wan 2.1 480p 81 frames", WAN_TOKENS, 40, 128),
    "wan2.1-cross": CrossProgram(Config("Wan 2.1 cross-attention", WAN_TOKENS, 128,
                                        q_heads=40, kv_heads=40, causal=False), "bwd",
                                 kv_len=512),
    "qwen-image": _joint("Qwen-Image 1024px, text padding", 4096 + 333, 24, 128,
                         segments=True),
}


def _check(program, report, chip):
  what = f"{program.label} on {chip}"
  assert report.ok, f"{what}: {report.error}"
  names = report.kernel_names
  assert len(names) == len(program.kernels) == report.num_kernels, (what, names)
  for want in program.kernels:
    assert sum(want in n for n in names) == 1, f"{what}: Mosaic kernels {names}"
  t = program.tiling(chip)
  assert report.scoped_vmem_bytes == t.vmem_limit_bytes, (what, report, t)
  assert t.vmem_plan_bytes <= t.vmem_limit_bytes <= chips.get_chip(chip).max_vmem_limit_bytes


def _group(item):
  params = getattr(getattr(item, "callspec", None), "params", {})
  return (params["shape"], params["chip"]) if "chip" in params else None


@pytest.fixture(scope="module")
def compiles(request):
  with module_compiles(request, _group, lambda g: [PROGRAMS[g[0]]], compile_case,
                       chip_of=lambda g: g[1]) as futures:
    yield futures


@pytest.mark.parametrize("chip", AOT_CHIPS)
@pytest.mark.parametrize("shape", list(PROGRAMS))
def test_diffusers_shape_compiles(compiles, shape, chip, record_property):
  check_compiled(compiles[(shape, chip)], chip, _check, record_property)
