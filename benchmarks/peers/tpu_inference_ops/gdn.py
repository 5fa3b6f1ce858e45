"""tpu-inference's fused conv + Gated DeltaNet kernel, `kernels/gdn/v3` (`GdnV3Spec`, on the
gated delta rule's prefill forward and decode cases): `wrapper.fused_conv1d_gdn` as vLLM's
GDN layer calls it, at the wrapper's own tile sizes (decode 4 sequences, prefill 64 tokens
a tile: its defaults), its metadata made visible (peers/fused_gdn.py, shared with tokamax's
fork)."""

from __future__ import annotations

import dataclasses

from benchmarks.peers.fused_gdn import FusedGdnSpec
from benchmarks.peers.tpu_inference_ops.common import STACK, VERSION, VENV, stand_ins

DECODE_TILE, MIXED_TILE = 4, 64   # fused_conv1d_gdn's defaults


@dataclasses.dataclass(frozen=True)
class GdnV3Spec(FusedGdnSpec):
  package = "tpu_inference.kernels.gdn.v3"
  python = VENV / "bin" / "python"

  def lowering(self, chip: str):
    return stand_ins(chip)

  @property
  def key(self) -> str:
    return f"tpu-inference-gdn-v3:{self.case.name}"

  @property
  def implementation(self) -> str:
    return (f"tpu-inference fused_conv1d_gdn v3 (tpu-inference {VERSION}, {STACK}, conv + "
            f"gdn fused, tiles {DECODE_TILE} / {MIXED_TILE})")

  def config(self) -> dict:
    return dict(decode_tile_size=DECODE_TILE, mixed_tile_size=MIXED_TILE)

  def tiles(self, chip: str) -> tuple[int, int]:
    return DECODE_TILE, MIXED_TILE

  def call(self, wrapper, **inputs):
    return wrapper.fused_conv1d_gdn(**inputs)
