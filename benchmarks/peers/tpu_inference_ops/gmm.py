"""tpu-inference's megablox `gmm` (`GmmSpec`, on grouped-matmul cases): jax's megablox
algorithm; its metadata and active-tile count made visible exactly as jax's megablox anchor's
(peers/megablox.py; the closed form checked against tpu-inference's own make_group_metadata),
at its `get_tuned_block_sizes`. int8 / fp8 weights through its `rhs_scale`."""

from __future__ import annotations

import dataclasses
from unittest import mock

from benchmarks.cases import ITEMSIZE
from benchmarks.estimator import visible
from benchmarks.peers.megablox import (GMM_TRUNCATED_VISITS, GmmClosedForm, extrapolate_visits,
                                       grid_bytes)
from benchmarks.peers.tpu_inference_ops.common import (VERSION, STACK, TpuInferenceSpec,
                                                        frozen_config, kernel_module)


@dataclasses.dataclass(frozen=True)
class GmmSpec(TpuInferenceSpec):
  """megablox gmm on a grouped-matmul case (attributes m, part, groups, k, n_weight, n_out,
  and optionally weight_dtype: int8 / float8_e4m3fn weights go in with gmm's rhs_scale, one
  f32 scale per output channel ([G, 1, 1, n]), its own dequantising path). Balanced routing
  (GmmClosedForm, checked against tpu-inference's make_group_metadata in the child).
  bf16 output."""

  case: object
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-gmm:{self.case.name}"

  @property
  def weight_dtype(self) -> str:
    return getattr(self.case, "weight_dtype", "bfloat16")

  @property
  def quantized(self) -> bool:
    return self.weight_dtype != "bfloat16"

  @property
  def implementation(self) -> str:
    scale = ", per-channel rhs_scale" if self.quantized else ""
    # "its tiling": the kernel's own choice (its tuned table, else its default; the
    # headline shapes have no table entry in 0.32.0, so the default).
    return (f"tpu-inference megablox gmm (tpu-inference {VERSION}, {STACK}, its tiling"
            f"{scale})")

  @property
  def tiling(self) -> tuple[int, int, int]:
    return tuple(self.get("tiling"))

  @property
  def closed_form(self) -> GmmClosedForm:
    """Balanced routing; with fewer rows than experts (Qwen3-30B-A3B at m=64), the first m
    experts get one row each and the rest none (not visited), as for jax's megablox."""
    c = self.case
    if c.active_groups < c.groups:
      return GmmClosedForm(c.m, c.active_groups, self.tiling[0], c.groups)
    return GmmClosedForm(c.m, c.groups, self.tiling[0])

  truncations = tuple([v] for v in GMM_TRUNCATED_VISITS)

  @property
  def method(self) -> str:
    (v1, v2) = GMM_TRUNCATED_VISITS
    tiles = self.closed_form.num_tiles if self.chosen else "all"
    return (f"static estimate of the gmm kernel at {v1} and {v2} active m-tiles (static grid, "
            f"metadata made visible as for jax's megablox), extrapolated linearly to {tiles}")

  @property
  def note(self) -> str:
    gate = (" gate_up: plain matmul to [m, 2 * width]; the gated unit is not fused in this "
            "gmm (tpu-inference fuses it in fused_moe), its extra pass not counted."
            if self.case.part.startswith("gate_up") else "")
    return ("Balanced routing (m / experts rows each; with fewer rows than experts, m experts "
            "of one row and the rest empty, not visited); rhs in gmm's [G, k, n] layout; bf16 "
            "output; the XLA ops of "
            "make_group_metadata are not rated (the metadata is an input). Tiling: its "
            "get_tuned_block_sizes (config says whether the case has a tuned entry or took "
            "its default; `tiling` is what gmm runs: tk = k where tk and k do not divide one "
            "another). A last n tile past the edge (gpt-oss down: n 2880 at tn 2048) is "
            "counted whole in hbm_bytes, as for jax's megablox anchor." + gate)

  def choose(self, chip: str) -> dict:
    c = self.case
    T = kernel_module("megablox.tuned_block_sizes")
    key = (c.m, c.k, c.n_weight, c.groups, c.groups, "bfloat16", self.weight_dtype, c.k)
    picked = T.get_tuned_block_sizes(*key)
    tm, tk, tn = picked
    # gmm then takes tk = k (its one quantization block: k // scale blocks, 1 here, with or
    # without rhs_scale) unless tk and k divide one another (gpt-oss: k 2880, tk 2048 -> 2880).
    if tk % c.k and c.k % tk:
      tk = c.k
    return dict(tiling=[tm, tk, tn], picked=list(picked), tuned_entry=key in T.TUNED_BLOCK_SIZES,
                m=c.m, k=c.k, n=c.n_weight, groups=c.groups, weight_dtype=self.weight_dtype)

  def build(self, trunc, chip: str = "v6e"):
    (visits,) = trunc
    import jax
    import jax.numpy as jnp
    G = kernel_module("megablox.gmm")
    spec = dataclasses.replace(self, chosen=frozen_config(self.config_for(chip)))
    cf = spec.closed_form

    def as_tuple(metadata, num_tiles):   # (its GroupMetadata is a dataclass, not a tuple)
      return (metadata.group_offsets, metadata.group_ids, metadata.m_tile_ids), num_tiles
    cf.check(lambda **kw: as_tuple(*G.make_group_metadata(**kw)))
    c = self.case
    num_meta = c.m // cf.tm + c.groups - 1
    forms = (G.GroupMetadata(cf.group_offset, cf.group_id, cf.m_tile_id), None)

    def fn(lhs, rhs, offsets, gids, mtiles, *scale):
      metadata = lambda **kw: (G.GroupMetadata(offsets, gids, mtiles), visits)
      with visible.visible_prefetch(G, forms), mock.patch.object(G, "make_group_metadata",
                                                                 metadata):
        return G.gmm(lhs, rhs, jnp.zeros((c.groups,), jnp.int32),
                     preferred_element_type=jnp.bfloat16, tiling=spec.tiling,
                     rhs_scale=scale[0] if scale else None)
    S = jax.ShapeDtypeStruct
    specs = [S((c.m, c.k), jnp.bfloat16), S((c.groups, c.k, c.n_weight), self.weight_dtype),
             S((c.groups + 1,), jnp.int32), S((num_meta,), jnp.int32),
             S((num_meta,), jnp.int32)]
    if self.quantized:
      specs.append(S((c.groups, 1, 1, c.n_weight), jnp.float32))
    return fn, specs

  def extrapolate(self, cycles: dict) -> float:
    return extrapolate_visits(cycles, self.closed_form.num_tiles)

  def hbm_bytes(self) -> int:
    """Replay of the grid (n tiles, active m tiles, k tiles) through its index maps (the same
    as jax's megablox: lhs by m tile, rhs and its (1, tn) scale row by group, out by m tile)."""
    c = self.case
    return grid_bytes(self.closed_form, self.tiling, c.k, c.n_weight,
                      ITEMSIZE[self.weight_dtype], scale_rows=1 if self.quantized else 0)

  def hand(self, chip) -> dict:
    c, cf = self.case, self.closed_form
    flops = 2 * self.tiling[0] * c.k * c.n_weight * cf.num_tiles
    return dict(hand_mxu_flops=flops, hand_us=max(flops / chip.bf16_flops_per_s,
                                                  self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6,
                hand_count=f"{cf.num_tiles} tiles x 2*tm*k*n flops at bf16 peak vs replayed "
                           "bytes at HBM bandwidth")
