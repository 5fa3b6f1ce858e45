"""The seed's six models at their real shapes (issue 60 item 1): every attention, norm and
experts call each makes, as the case that rates it, with its calls per forward.

A call whose case another family holds (SD3.5's joint attention, Qwen3.5-9B's Gated
DeltaNet rows, Qwen3-30B-A3B's decode experts) is that very case, so its rating is shared;
the others are this family's CASES, which `benchmarks/estimate.py` rates like any family's
(`--cases <name> --merge` for a few). `reports/tables.py`'s `seed_models_table` reads every
call's rows from estimates.jsonl: ours, the best peer rated, or "not rated yet"; a call
with no case kind says why. The derivation of every shape, with its source lines in Transformers
5.25.0 and Diffusers 0.42.1, is docs/performance/seed-models.md.

Choices the libraries leave open (stated once, here):
  * LLM prefill at 4096 and 32768 tokens (batch 1), decode at batch 64 with a 4096-token
    context in pages of 64 (Gemma 4: 32768 in pages of 16, its serving test's);
  * norms at prefill 4096 and at decode; at 32768 they scale linearly in rows;
  * a diffusion prompt of TEXT_TOKENS = 128 tokens where the text length is the prompt's
    (Qwen-Image, Qwen-Image-2.1, MiniMax-H3; SD3.5 pads every prompt to 77 + 256 = 333);
  * Qwen3-30B-A3B at its released head_dim 128 and 48 layers (Qwen3MoeConfig's defaults,
    head_dim 64 and 24 layers, are a smaller model's).
"""

from __future__ import annotations

import dataclasses

from benchmarks.cases import (causal_conv1d, diffusion, experts_layer, gated_delta_rule,
                              headline, quantized_decode, serving)
from benchmarks.cases.causal_conv1d import ConvPrefill, ConvUpdate
from benchmarks.cases.diffusion import DIFFUSION_ATTENTION, JointAttention
from benchmarks.cases.gated_delta_rule import GdnChunked, GdnDecode
from benchmarks.cases.headline import (Attention, GroupedMatmul, PagedDecode, RmsNorm,
                                       RmsNormGated)

PREFILL = (4096, 32768)
DECODE_BATCH, DECODE_CONTEXT, PAGE = 64, 4096, 64
TEXT_TOKENS = 128


@dataclasses.dataclass(frozen=True)
class Call:
  """One call of a model: `case` rates it (None: no case kind yet, `why` says so);
  `per_forward` is how many times one forward (one denoising step) makes it."""

  model: str
  call: str
  per_forward: int | None
  case: object | None = None
  why: str = ""


def _qwen35_9b() -> list[Call]:
  m, full, gdn, layers = "Qwen3.5-9B", 8, 24, 32
  calls = [Call(m, f"full attention, prefill {s}", full, Attention(s, 1, 16, 4, 256))
           for s in PREFILL]
  calls += [Call(m, "full attention, decode", full,
                 PagedDecode(DECODE_CONTEXT, DECODE_BATCH, 16, 4, 256, PAGE)),
            Call(m, "gated delta rule, prefill 4096", gdn, GdnChunked()),
            Call(m, "gated delta rule, prefill 32768", gdn, GdnChunked(tokens=32768)),
            Call(m, "gated delta rule, decode", gdn, GdnDecode()),
            Call(m, "causal conv1d, prefill 4096", gdn, ConvPrefill()),
            Call(m, "causal conv1d, decode", gdn, ConvUpdate())]
  for rows, when in ((4096, "prefill 4096"), (DECODE_BATCH, "decode")):
    calls += [Call(m, f"RMSNorm (1 + w), {when}", 2 * layers + 1, RmsNorm(rows, 4096)),
              Call(m, f"q_norm (1 + w), {when}", full, RmsNorm(rows * 16, 256)),
              Call(m, f"k_norm (1 + w), {when}", full, RmsNorm(rows * 4, 256)),
              Call(m, f"gated RMSNorm, {when}", gdn, RmsNormGated(rows * 32, 128))]
  return calls


def _qwen3_30b_a3b() -> list[Call]:
  m, layers = "Qwen3-30B-A3B", 48
  calls = [Call(m, f"attention, prefill {s}", layers, Attention(s, 1, 32, 4, 128))
           for s in PREFILL]
  calls.append(Call(m, "attention, decode", layers,
                    PagedDecode(DECODE_CONTEXT, DECODE_BATCH, 32, 4, 128, PAGE)))
  for rows, when in ((4096, "prefill 4096"), (32768, "prefill 32768"),
                     (DECODE_BATCH, "decode")):
    for part in ("gate_up+silu", "down"):
      calls.append(Call(m, f"experts {part}, {when}", layers,
                        GroupedMatmul.of(m, rows * 8, part)))
  for rows, when in ((4096, "prefill 4096"), (DECODE_BATCH, "decode")):
    calls += [Call(m, f"RMSNorm, {when}", 2 * layers + 1, RmsNorm(rows, 2048)),
              Call(m, f"q_norm, {when}", layers, RmsNorm(rows * 32, 128)),
              Call(m, f"k_norm, {when}", layers, RmsNorm(rows * 4, 128))]
  return calls


GEMMA4_MISSING = ("26B-A4B's hidden size, layer count, sliding window, sliding-layer KV "
                  "heads and expert shapes are in no installed file (Gemma4TextConfig's "
                  "defaults are gemma-4-e2b's)")


def _gemma4_26b_a4b() -> list[Call]:
  m = "Gemma 4 26B-A4B"
  calls = [Call(m, f"full attention (K = V, 512), prefill {s}", None,
                Attention(s, 1, 16, 2, 512)) for s in PREFILL]
  calls += [Call(m, "full attention (K = V, 512), decode", None,
                 PagedDecode(32768, DECODE_BATCH, 16, 2, 512, 16)),
            Call(m, "sliding attention (256)", None, None, GEMMA4_MISSING),
            Call(m, "experts", None, None, GEMMA4_MISSING),
            Call(m, "Gemma4RMSNorm", None, None, GEMMA4_MISSING)]
  return calls


def _sd35_medium() -> list[Call]:
  m = "SD3.5-medium 1024x1024"
  joint = next(c for c in DIFFUSION_ATTENTION if c.model == m)
  image, text, heads = 4096, 333, 24
  return [
      Call(m, "joint attention (4096 image + 333 text)", None, joint,
           "per layer; SD3.5-medium's layer count is in no installed file"),
      Call(m, "image-only attention (attn2, layers 0-12)", 13,
           JointAttention(m + " attn2", image, heads, 64, batch=2)),
      Call(m, "norm_q / norm_k (image)", None, RmsNorm(2 * image * heads, 64)),
      Call(m, "norm_added_q / norm_added_k (text)", None, RmsNorm(2 * text * heads, 64)),
  ]


def _qwen_image() -> list[Call]:
  m, t = "Qwen-Image 1024x1024", TEXT_TOKENS
  m21 = "Qwen-Image-2.1 1024x1024"
  return [
      Call(m, f"joint attention (4096 image + {t} text)", 60,
           JointAttention(f"{m} T={t}", 4096 + t, 24, 128)),
      Call(m, "norm_q / norm_k (image)", 120, RmsNorm(4096 * 24, 128)),
      Call(m21, "target attention, cached steps (4096 queries over T + 4096 keys)", 32,
           None, "no case kind for a query shorter than its keys yet"),
      Call(m21, "block-causal prefill (step 0)", 32, None,
           "no case kind for segment-causal prefill yet"),
      Call(m21, "norm_q / norm_k, cached steps", 64, RmsNorm(4096 * 32, 128)),
  ]


def _minimax_h3() -> list[Call]:
  m, t = "MiniMax-H3 768x1344 124 frames", TEXT_TOKENS
  seq = t + 414 + 37296   # text + stereo audio (2 x 207) + video (37 x 24 x 42)
  return [
      Call(m, f"joint attention (text {t} + audio 414 + video 37,296)", 50,
           JointAttention(f"{m} T={t}", seq, 56, 128)),
      Call(m, "norm1 / norm2", 100, RmsNorm(seq, 5376)),
      Call(m, "norm_q / norm_k", 100, RmsNorm(seq * 56, 128)),
  ]


SEED_MODELS: tuple[Call, ...] = tuple(
    _qwen35_9b() + _qwen3_30b_a3b() + _gemma4_26b_a4b() + _sd35_medium() + _qwen_image()
    + _minimax_h3())

# The other families' cases (a shared call is rated there, once).
_OTHER_FAMILIES = {c.name for m in (causal_conv1d, diffusion, experts_layer, gated_delta_rule,
                                    headline, quantized_decode, serving) for c in m.CASES}
CASES = tuple({c.case.name: c.case for c in SEED_MODELS
               if c.case is not None and c.case.name not in _OTHER_FAMILIES}.values())
