"""Tiny randomly initialised Diffusers transformers (SD3.5-style, Flux, Wan, Qwen-Image),
built from their own model classes' configs, and inputs for them. Shared by
tests/torch/test_flash_attention_diffusers.py and the main job (scripts/demo.py).

Each keeps its real model's attention shape: head_dim 64 for SD3, 128 for the others
(2 heads), and joint text + image attention over 64 image tokens and 13 text tokens
(77 in all, not a multiple of 8: a partial last block). Wan attends over a 3-frame video
(60 tokens) and cross-attends to 13 text tokens. Qwen-Image's inputs may carry a text
padding mask (its pipeline passes one for prompts of different lengths): row 1 then has a
hole at text token 3 and padding from token 9 on.
"""

from __future__ import annotations

FAMILIES = ("sd3", "flux", "wan", "qwen_image")
# A float32 model on the kernel against the same model on Diffusers' native attention
# (SDPA): |got - want| <= atol * max|want| + rtol * |want|. Both compute attention in f32
# on the same tensors; only the order of the sums and the kernel's online softmax differ (a
# few 2^-24 per logit and output, tests/reference.py's ATTENTION_TOLERANCE analysis), and
# these 1-2 block networks carry that with O(1) gain. Measured: <= 3e-7 of max|want|.
F32_TOLERANCE = dict(rtol=2e-5, atol=2e-5)
IMAGE_SIDE = 8           # image tokens: 8 x 8 (after patching)
TEXT_TOKENS = 13
BATCH = 2


def tiny_transformer(family: str, seed: int = 0):
  """The family's transformer, float32, random weights (torch.manual_seed(seed)), eval."""
  import torch
  from diffusers import (FluxTransformer2DModel, QwenImageTransformer2DModel,
                         SD3Transformer2DModel, WanTransformer3DModel)

  torch.manual_seed(seed)
  if family == "sd3":        # SD3.5: q/k RMSNorm and a second (image-only) attention
    model = SD3Transformer2DModel(
        sample_size=2 * IMAGE_SIDE, patch_size=2, in_channels=4, num_layers=2,
        attention_head_dim=64, num_attention_heads=2, joint_attention_dim=32,
        caption_projection_dim=128, pooled_projection_dim=16, out_channels=4,
        pos_embed_max_size=2 * IMAGE_SIDE, dual_attention_layers=(0,), qk_norm="rms_norm")
  elif family == "flux":     # one double-stream and one single-stream block
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=8, num_layers=1, num_single_layers=1,
        attention_head_dim=128, num_attention_heads=2, joint_attention_dim=32,
        pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(16, 56, 56))
  elif family == "wan":
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=128, in_channels=4,
        out_channels=4, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=1,
        rope_max_seq_len=32)
  elif family == "qwen_image":
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(16, 56, 56))
  else:
    raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
  return model.eval()


def tiny_inputs(family: str, padded: bool = False, seed: int = 1) -> dict:
  """Keyword inputs of the family's forward, float32, batch 2. padded: Qwen-Image's text
  padding mask (only Qwen-Image takes one)."""
  import torch

  gen = torch.Generator().manual_seed(seed)
  randn = lambda *shape: torch.randn(*shape, generator=gen)
  text = randn(BATCH, TEXT_TOKENS, 32)
  side = IMAGE_SIDE
  if padded and family != "qwen_image":
    raise ValueError(f"{family} takes no text padding mask")
  if family == "sd3":
    return dict(hidden_states=randn(BATCH, 4, 2 * side, 2 * side), encoder_hidden_states=text,
                pooled_projections=randn(BATCH, 16), timestep=torch.tensor([3.0, 500.0]))
  if family == "flux":
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], -1).reshape(-1, 3).float()
    return dict(hidden_states=randn(BATCH, side * side, 8), encoder_hidden_states=text,
                pooled_projections=randn(BATCH, 16), timestep=torch.tensor([0.1, 0.9]),
                img_ids=img_ids, txt_ids=torch.zeros(TEXT_TOKENS, 3),
                guidance=torch.tensor([3.5, 3.5]))
  if family == "wan":
    return dict(hidden_states=randn(BATCH, 4, 3, side, side + 2),
                timestep=torch.tensor([10, 900]), encoder_hidden_states=text)
  if family == "qwen_image":
    inputs = dict(hidden_states=randn(BATCH, side * side, 16), encoder_hidden_states=text,
                  timestep=torch.tensor([0.1, 0.9]), img_shapes=[[(1, side, side)]] * BATCH)
    if padded:
      mask = torch.ones(BATCH, TEXT_TOKENS, dtype=torch.long)
      mask[1, 3] = 0
      mask[1, 9:] = 0
      inputs["encoder_hidden_states_mask"] = mask
    return inputs
  raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")


def cast_inputs(inputs: dict, dtype) -> dict:
  """The floating-point tensors of `inputs` in `dtype` (timesteps, ids, masks kept)."""
  import torch

  keep = {"timestep", "img_ids", "txt_ids", "encoder_hidden_states_mask"}
  return {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() and k not in keep
              else v) for k, v in inputs.items()}


def matches_native(got, want, tolerance=F32_TOLERANCE) -> tuple[bool, float]:
  """(every element finite and within `tolerance` of want, max|got - want| / max|want|)."""
  import torch

  got, want = got.double(), want.double()
  scale = float(want.abs().max())
  error = (got - want).abs()
  bound = tolerance["atol"] * scale + tolerance["rtol"] * want.abs()
  ok = bool(torch.isfinite(got).all()) and bool((error <= bound).all())
  return ok, float(error.max()) / max(scale, 1e-30)
