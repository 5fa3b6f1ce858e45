"""tokamax's TPU kernels as a peer (tokamax 0.0.12 beside jax 0.10, 0.0.17 beside jax 0.12),
each at the config tokamax picks for the case and at a larger tiling:

  * `TokamaxGmmAnchor`: its `ragged_dot` (megablox run through one emit_pipeline kernel), as
    megablox's (peers/megablox.py: the active-tile count becomes a static grid size);
  * `TokamaxAttentionAnchor`: its `dot_product_attention` (its splash fork, compact causal
    grid): its six SMEM block lists become closed forms of the causal list
    (peers/attention_geometry.py);
  * `TokamaxGdnSpec`: 0.0.17's `causal_conv1d_gated_delta_rule`, conv + Gated DeltaNet fused
    (a fork of tpu-inference's gdn v3: peers/fused_gdn.py), always in
    `.venv-tokamax-jax012` (0.0.12 has no such op), on TPU v6 and later only (its op's
    `supported_on`).

tokamax needs packages outside the main lock, so its children run in `.venv-tokamax`
(requirements-tokamax.txt: the same jax 0.10.2 and libtpu 0.0.42.1), or
`.venv-tokamax-jax012` from the TorchTPU stack (`TOKAMAX_ENVIRONMENTS`);
rating/calibration_specs.py rates the same kernels at its timed caches' configs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from unittest import mock

from benchmarks import ROOT
from benchmarks.cases.diffusion import JointAttention
from benchmarks.cases.headline import HEADLINE, WEIGHT_TAG, Attention, GroupedMatmul
from benchmarks.estimator import visible
from benchmarks.peers import fused_gdn, protocol
from benchmarks.peers.attention_geometry import AttentionCase, triangle_col, triangle_row
from benchmarks.peers.megablox import QUANTIZED_TILING, GmmAnchor, jax_version


# The tokamax each JAX stack rates, and the environment it runs in: the main stack (jax 0.10)
# rates 0.0.12 (requirements-tokamax.txt); the TorchTPU stack (jax 0.12, estimate.py run from
# .venv-jax012) rates 0.0.17, the release that binds to TorchTPU and needs jax >= 0.11.1
# (requirements-tokamax-jax012.txt). The main stack's venv pins its stack's jax and libtpu;
# the TorchTPU one still pins jax 0.12.0.1 / libtpu 0.0.50.1 while .venv-jax012 moved to
# 0.12.1 / 0.0.52 (issue 57), so its rows name jax 0.12.0.1 (docs/performance/torchtpu-stack.md).
TOKAMAX_ENVIRONMENTS = {"0.10": ("0.0.12", ".venv-tokamax"),
                        "0.12": ("0.0.17", ".venv-tokamax-jax012")}


def tokamax_environment() -> tuple[str, Path]:
  """(tokamax version, its python) for this process's jax."""
  stack = ".".join(jax_version().split(".")[:2])
  if stack not in TOKAMAX_ENVIRONMENTS:
    raise RuntimeError(f"no tokamax environment for jax {jax_version()}")
  version, venv = TOKAMAX_ENVIRONMENTS[stack]
  return version, ROOT / venv / "bin" / "python"


class TokamaxEnvironment:
  """What the tokamax anchors share: the environment their children run in."""

  @property
  def python(self) -> Path:
    return tokamax_environment()[1]

  @property
  def tokamax_version(self) -> str:
    return tokamax_environment()[0]

  def check_tokamax_version(self) -> None:
    import tokamax
    assert tokamax.__version__ == self.tokamax_version, (tokamax.__version__,
                                                         self.tokamax_version)

  def lowering(self, chip: str):
    return visible.target_chip(chip)   # emit_pipeline / its lowering ask for the TPU generation


@dataclasses.dataclass(frozen=True)
class TokamaxGmmAnchor(TokamaxEnvironment, GmmAnchor):
  """tokamax's `ragged_dot` on TPU: `pallas_mosaic_tpu_kernel.gmm`, megablox's algorithm
  run as one kernel whose body is an `emit_pipeline` over (n tiles, active m tiles, k
  tiles), the active-tile count read from SMEM. Rated in its own environment (tokamax needs
  packages outside the main lock) on the same jax and libtpu as everything else.

  tiling_name "heuristic" is what `tokamax.ragged_dot` picks for these shapes: its
  `Config()` default, (128, 128, 128) with double-buffered lhs. 0.0.12: none of the cases
  is in its tuned table (checked in the child); 0.0.17 has heuristics for TPU7x only and
  returns `Config()` below it (`_get_heuristics_config`)."""

  input_buffer_count = 2   # tokamax's Config default (benchmarks/calibration.py sets others)

  @property
  def key(self) -> str:
    return "tokamax-" + GmmAnchor.key.fget(self)

  @property
  def tiling(self) -> tuple[int, int, int]:
    if self.tiling_name == "heuristic":   # tm clipped to m below 128 rows (see `note`)
      return (min(128, self.m), 128, 128)
    return GmmAnchor(self.m, self.part, self.tiling_name, self.groups, self.model,
                     self.weight_dtype).tiling

  @property
  def implementation(self) -> str:
    tm, tk, tn = self.tiling
    label = "heuristic config" if self.tiling_name == "heuristic" else "tiling"
    quant = "" if self.weight_dtype == "bfloat16" else \
        f", {WEIGHT_TAG[self.weight_dtype]} weights (qwix QArray)"
    return (f"tokamax ragged_dot mosaic_tpu (tokamax {self.tokamax_version}, jax "
            f"{jax_version()}, {label} {tm}x{tk}x{tn}{quant})")

  @property
  def method(self) -> str:
    return super().method.replace("gmm kernel", "tokamax gmm kernel").replace(
        "static grid", "static pipeline grid")

  @property
  def note(self) -> str:
    return super().note.replace("gmm's [G, k, n] layout", "tokamax's [G, k, n] layout").replace(
        "not fused in gmm", "not fused in tokamax's ragged_dot (its `activation` is ungated)") + (
        " On v6e the estimator rates this kernel 0 cycles whenever tk or tn exceeds 128 "
        "(seen at 128x256x128, 128x128x256, 256x256x256, 512x768x1024; 512x128x128 and "
        "1024x128x128 rate normally, and every tiling rates on v5e).") + self.quant_note

  @property
  def quant_note(self) -> str:
    note = ""
    if self.case.quantized:
      note += (" Quantized: rhs is a qwix QArray (int8 / float8_e4m3fn values, a float32 "
               "(G, 1, n) per-output-channel scale: tokamax's full-channel 'STRATEGY 1'), "
               "lhs bf16 (not quantized): the kernel multiplies bf16 x 1-byte values and "
               "scales each k tile's product; its scale, repeated to an (8, tn) block by "
               "quant_block_spec (an XLA op, not rated), is counted in hbm_bytes.")
    if self.m < 128:
      note += (f" m={self.m} < 128: tokamax.ragged_dot refuses it (NotImplementedError: "
               "'inputs must be >= 128', so the op falls back to another implementation); "
               f"this row is its kernel called directly with tm={self.m}.")
    return note

  def validate(self) -> None:
    """Checked in the child, where tokamax imports (`build`)."""

  def build(self, trunc, chip: str = "v6e"):
    (visits,) = trunc
    import jax
    import jax.numpy as jnp
    from tokamax._src import mosaic_tpu as common
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu as tpu_op
    from tokamax._src.ops.ragged_dot import pallas_mosaic_tpu_kernel as B
    self.check_tokamax_version()
    c, cf = self.case, self.closed_form
    m, k, n = self.m, c.k, c.n_weight
    if self.tiling_name == "heuristic":   # (0.0.17 has no such table below TPU7x)
      assert (m, k, n, self.groups, c.quantized) not in getattr(tpu_op, "GMM_TILING_TUNED_LUT",
                                                                 {})
      default = tpu_op.Config()
      assert (min(default.tile_m, m), default.tile_k, default.tile_n,
              default.input_buffer_count) == (*self.tiling, 2), default
    cf.check(B.make_group_metadata)
    num_meta = m // self.tiling[0] + self.groups - 1
    forms = ((cf.group_offset, cf.group_id, cf.m_tile_id), None)
    buffered_call = common.custom_buffered_pallas_call

    def visible_buffered_call(kernel, out_shape, grid_spec, compiler_params, **kw):
      kernel, grid_spec = visible.visible_grid_spec(kernel, grid_spec, forms)
      return buffered_call(kernel, out_shape, grid_spec, compiler_params, **kw)

    def fn(lhs, rhs, *rest):
      *scale, offsets, gids, mtiles = rest
      if scale:   # the quantized weights as tokamax takes them
        import qwix
        rhs = qwix.QArray(qvalue=rhs, scale=scale[0])
      metadata = lambda **kw: ((offsets, gids, mtiles), visits)
      with mock.patch.object(common, "custom_buffered_pallas_call", visible_buffered_call), \
          mock.patch.object(B, "make_group_metadata", metadata):
        return B.gmm(lhs, rhs, jnp.zeros((self.groups,), jnp.int32),
                     precision=(jax.lax.Precision.DEFAULT,) * 2, out_dtype=jnp.bfloat16,
                     tiling=self.tiling, input_buffer_count=self.input_buffer_count)

    S = jax.ShapeDtypeStruct
    scale = [S((self.groups, 1, n), jnp.float32)] if c.quantized else []
    return fn, [S((m, k), jnp.bfloat16), S((self.groups, k, n), jnp.dtype(c.weight_dtype)),
                *scale, S((self.groups + 1,), jnp.int32), S((num_meta,), jnp.int32),
                S((num_meta,), jnp.int32)]


TOKAMAX_ROWS = (2, 4, 8)        # q-block rows of the truncated grids (2 heads each)
TOKAMAX_ROW_COMPARES = 7        # every truncation's row closed form does this many compares


@dataclasses.dataclass(frozen=True)
class TokamaxAttentionAnchor(AttentionCase, TokamaxEnvironment):
  """tokamax's `dot_product_attention` on TPU (implementation "mosaic"): its fork of splash
  attention, called as tokamax calls it, with its heuristic config (block_q / block_kv /
  block_kv_compute 128, head-dim-minor layouts, its experimental LLO scheduler, base-2 exp),
  and the same config with blocks of 512 (what its autotuner would reach for).
  Unlike jax's splash its grid is (heads, active blocks): a causal mask visits only the
  blocks on or below the diagonal, listed in six SMEM arrays (active_rows, active_cols,
  mask_next (None for causal), bounds_start, bounds_end, block_mask).

  The estimator reads SMEM as 0, so every read yields a closed form of the causal list
  instead ("const": no SMEM load; checked against tokamax's own process_mask in the
  child): row(g) = #{t : g >= t(t+1)/2} over TOKAMAX_ROW_COMPARES thresholds (unused ones
  unreachable, so every truncation does the same scalar work), col(g) = g - row(row+1)/2,
  bounds_start = col == 0, bounds_end = col == row, block_mask = 1 on the diagonal (masked)
  else 2. That scalar work is not in tokamax's kernel: 4 more compares cost 16 cycles a grid
  step (S=4096, 2 heads, 4 rows, v6e: 18,399 -> 18,719 cycles over 20 steps), so tokamax
  may be rated up to ~3% slow.

  Long cases are fitted from the first 2, 4 and 8 rows, which rates the grid fast (see
  `method`). jax's splash anchor moved to whole grids at shorter lengths (`AttentionAnchor`);
  here a whole grid of 32 rows needs 31 threshold compares a step, whose scalar work (~4
  cycles each) would skew the rating the other way, so that move is not made yet.

  Non-causal (`joint`, Diffusers' shapes): tokamax's op passes a FullMask, whose mask info
  is empty (no block lists, no SMEM reads): the grid is (heads, q blocks x kv blocks) and
  every step computes. Truncated to the first 2, 4 and 8 q-block rows over the whole
  (padded) kv length; every row does the same work, so a + b*rows is fitted."""

  seq: int
  block: int = 128
  joint: JointAttention | None = None   # a non-causal case instead of Attention(seq)

  @property
  def key(self) -> str:
    return f"tokamax-attn:{self.seq}:{self.block}{self.key_suffix}"

  @property
  def implementation(self) -> str:
    b = self.block
    config = "heuristic config" if b == 128 else f"heuristic config with blocks {b}/{b}/{b}"
    return (f"tokamax dot_product_attention mosaic_tpu (tokamax {self.tokamax_version}, jax "
            f"{jax_version()}, {config})")

  truncations = tuple([2, rows] for rows in TOKAMAX_ROWS)

  @property
  def method(self) -> str:
    if not self.causal:
      return ("static estimate of 2 heads at the first 2, 4 and 8 q-block rows of its full "
              f"grid (every kv block of the {self.padded_seq} keys), fitted as a + b*rows "
              f"(least squares), extrapolated to {self.nq} rows, times {self.total_heads // 2} "
              f"for {self.heads_text()}; no SMEM reads (a full mask has no block lists)")
    return ("static estimate of 2 heads at the first 2, 4 and 8 q-block rows (its compact grid "
            "of on-or-below-diagonal blocks), fitted as a + b*rows + c*blocks, extrapolated to "
            f"{self.nq} rows, times 16 for 32 heads; SMEM reads answered by closed forms of the "
            "causal block list (their scalar work may rate it up to ~3% slow). The row fit "
            "rates it fast: at S=16384, blocks 512, v6e, tokamax 0.0.17 it gave 1,193,023 "
            "cycles against 1,356,420 rated on the whole grid (-12%); longer grids are "
            "likely further off (jax's splash: -26% at S=16384, -51% at S=32768)")

  @property
  def note(self) -> str:
    if not self.causal:
      return ("tokamax's splash fork, MHA, FullMask (what its op passes when there is no "
              "mask), called as tokamax's op calls it (q [H, S, D], 1/sqrt(D) folded into q "
              "by the caller: not rated; transposes from [B, S, H, D] not counted). On v6e "
              "use_base2_exp=False (the estimator aborts on its base-2 exp; see the causal "
              "rows)." + self.ragged_note)
    return ("tokamax's splash fork with 8 kv heads (GQA by its h // 4 index map), called as "
            "tokamax's op calls it (q [H, S, D], 1/sqrt(D) folded into q by the caller: not "
            "rated; transposes from [B, S, H, D] not counted). On v6e the estimator aborts on "
            "its base-2 exp (the bf16 q * log2(e) multiply: 'Expected vector-bf16packed, got "
            "vector-int32'; plain AOT compile succeeds), so v6e rates use_base2_exp=False "
            "(exp instead of exp2 on the logits); v5e rates its config as is.")

  def config(self) -> dict:
    b = self.block
    return dict(block_q=b, block_kv=b, block_kv_compute=b, layout="HEAD_DIM_MINOR",
                kv_heads_in_kernel=self.case.kv_heads, use_experimental_scheduler=True,
                use_base2_exp="True (v5e) / False (v6e, see note)")

  # The causal block list (one head), as functions of the grid index g (jnp or int):
  def row(self, g):
    return triangle_row(g, TOKAMAX_ROW_COMPARES)

  def col(self, g):
    return triangle_col(g, self.row(g))

  def forms(self, prng_key: bool = False):
    """Closed forms of the scalar prefetch: active_rows, active_cols, mask_next (None),
    bounds_start, bounds_end, block_mask (+ prng_key, None: 0.0.17's dropout key)."""
    import jax.numpy as jnp
    on_diagonal = lambda g: self.col(g) == self.row(g)
    return (("const", self.row), ("const", self.col), None,
            ("const", lambda g: (self.col(g) == 0).astype(jnp.int32)),
            ("const", lambda g: on_diagonal(g).astype(jnp.int32)),
            ("const", lambda g: jnp.where(on_diagonal(g), 1, 2))) + ((None,) if prng_key else ())

  def validate(self) -> None:
    """Checked in the child, where tokamax imports (`build`)."""

  def _check_forms(self, MI, M) -> None:
    import numpy as np
    rows = max(TOKAMAX_ROWS)
    assert rows - 1 <= TOKAMAX_ROW_COMPARES
    info, _ = MI.process_mask(M.CausalMask((rows * self.block, self.seq)),
                              (self.block, self.block))
    start, end = MI.find_bounds(np.asarray(info.active_rows))
    g = range(rows * (rows + 1) // 2)
    assert int(info.num_active_blocks[0]) == len(g)
    assert info.mask_next is None and info.partial_mask_blocks is None
    want = dict(active_rows=[self.row(x) for x in g], active_cols=[self.col(x) for x in g],
                block_mask=[1 if self.col(x) == self.row(x) else 2 for x in g])
    for name, values in want.items():
      np.testing.assert_array_equal(np.asarray(getattr(info, name)), values, err_msg=name)
    np.testing.assert_array_equal(np.asarray(start), [int(self.col(x) == 0) for x in g])
    np.testing.assert_array_equal(np.asarray(end), [int(self.col(x) == self.row(x)) for x in g])

  def build(self, trunc, chip: str = "v6e"):
    heads, rows = trunc
    import jax
    import inspect
    import jax.numpy as jnp
    from tokamax._src.ops.attention import pallas_mosaic_tpu as A
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as K, splash_attention_mask as M,
        splash_attention_mask_info as MI)
    self.check_tokamax_version()
    assert rows <= max(TOKAMAX_ROWS)
    if self.causal:
      self._check_forms(MI, M)
    c, b = self.case, self.block
    config = dataclasses.asdict(A.PallasMosaicTpuFlashAttention()._get_heuristics_config(None))
    assert (config["block_q"], config["block_kv"], config["block_kv_compute"]) == (128,) * 3
    config.update(block_q=b, block_kv=b, block_kv_compute=b)
    if chip == "v6e":
      config["use_base2_exp"] = False     # see `note`
    splash_config = dataclasses.replace(K.SplashConfig.get_default(), attn_logits_soft_cap=None,
                                        **config)
    sq = rows * b
    S = jax.ShapeDtypeStruct
    if not self.causal:   # full mask: no block lists, the grid is every (q, kv) block pair
      mask = M.FullMask((sq, self.padded_seq))
      info, _ = MI.process_mask(mask, (b, b))
      assert info.block_mask is None and info.active_rows is None, info
      kernel = K.make_splash_mha(mask, config=splash_config, save_residuals=False,
                                 q_seq_shards=1)
      kv = S((c.kv_heads * heads // c.q_heads, self.padded_seq, c.head_dim), jnp.bfloat16)
      return (lambda q, k, v: kernel(q, k, v)), [S((heads, sq, c.head_dim), jnp.bfloat16),
                                                  kv, kv]
    kernel = K.make_splash_mha(M.CausalMask((sq, self.seq)), config=splash_config,
                               save_residuals=False, q_seq_shards=1)
    active = rows * (rows + 1) // 2

    forms = self.forms(prng_key="prng_key_ref" in
                       inspect.signature(K.flash_attention_kernel).parameters)

    def fn(q, k, v):
      with visible.visible_prefetch(K, forms, grid=(heads, active)):
        return kernel(q, k, v)
    kv_heads = max(1, heads * c.kv_heads // c.q_heads)
    return fn, [S((heads, sq, c.head_dim), jnp.bfloat16),
                S((kv_heads, sq, c.head_dim), jnp.bfloat16),
                S((kv_heads, sq, c.head_dim), jnp.bfloat16)]

  def extrapolate(self, cycles: dict) -> float:
    """Solve a + b*rows + c*blocks for the three truncations; all rows, times 16 heads."""
    import numpy as np
    pts = [json.loads(t)[1] for t in cycles]
    y = np.array([cycles[json.dumps([2, r])] for r in pts], dtype=float)
    if not self.causal:   # identical rows: a + b*rows
      coef = np.linalg.lstsq(np.array([[1.0, r] for r in pts]), y, rcond=None)[0]
      return self.total_heads / 2 * float(coef @ [1.0, self.nq])
    A = np.array([[1.0, r, r * (r + 1) / 2] for r in pts])
    coef = np.linalg.solve(A, y)
    return self.case.q_heads / 2 * float(coef @ [1.0, self.nq, self.nq * (self.nq + 1) / 2])

  def hbm_bytes(self) -> int:
    """Replay of one head's compact grid (q, k, v, out and its q_sequence block, a
    [bq, 128] int32 copy of the query positions, change with the row / column), times the
    32 query heads (each restarts its kv walk)."""
    b, d = self.block, self.case.head_dim
    blk = b * d * 2
    if not self.causal:   # full grid, no q_sequence block (a full mask has no mask function)
      steps = ((i, j) for i in range(self.nq) for j in range(self.nq))
      per_head = visible.replay(steps, [("q", lambda i, j: i, blk), ("k", lambda i, j: j, blk),
                                ("v", lambda i, j: j, blk), ("o", lambda i, j: i, blk)])
      return self.total_heads * per_head + self.pad_copy_bytes()
    steps = ((i, j) for i in range(self.nq) for j in range(i + 1))
    per_head = visible.replay(steps, [("q", lambda i, j: i, blk), ("k", lambda i, j: j, blk),
                              ("v", lambda i, j: j, blk), ("o", lambda i, j: i, blk),
                              ("q_sequence", lambda i, j: i, b * 128 * 4)])
    return self.case.q_heads * per_head

  def hand(self, chip) -> dict:
    c = self.case
    run = self.nq * (self.nq + 1) // 2 if self.causal else self.nq * self.nq
    mxu = self.total_heads * run * 4 * self.block * self.block * c.head_dim
    hand_us = max(mxu / chip.bf16_flops_per_s, self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6
    blocks = "diagonal-or-below" if self.causal else "(all)"
    return dict(hand_mxu_flops=mxu, hand_us=hand_us,
                hand_count=f"{self.total_heads} heads x {run} {blocks} {self.block}^2 blocks "
                           f"x 4*{self.block}^2*{c.head_dim} flops at bf16 peak")


GDN_TOKAMAX = ("0.0.17", ".venv-tokamax-jax012", "jax 0.12.0.1, libtpu 0.0.50.1")


@dataclasses.dataclass(frozen=True)
class TokamaxGdnSpec(fused_gdn.FusedGdnSpec):
  """tokamax 0.0.17's `causal_conv1d_gated_delta_rule` ("mosaic_tpu"): its op's `_fwd` calls
  `wrapper.fused_conv1d_gdn` (GDN mode), called here the same way with its tile sizes left
  to the wrapper's VMEM heuristic (the op's heuristic config). Its op runs it on TPU v6 and
  later only (`supported_on`: generation >= 6): no v5e row."""

  package = "tokamax._src.ops.causal_conv1d_gated_delta_rule"
  python = ROOT / GDN_TOKAMAX[1] / "bin" / "python"

  def lowering(self, chip: str):
    return visible.target_chip(chip)

  @property
  def key(self) -> str:
    return f"tokamax-gdn:{self.case.name}"

  @property
  def implementation(self) -> str:
    return (f"tokamax causal_conv1d_gated_delta_rule mosaic_tpu (tokamax {GDN_TOKAMAX[0]}, "
            f"{GDN_TOKAMAX[2]}, conv + gdn fused, heuristic tiles)")

  def config(self) -> dict:
    return dict(decode_tile_size="its VMEM heuristic", mixed_tile_size="its VMEM heuristic")

  def tiles(self, chip: str) -> tuple[None, None]:
    return None, None

  def call(self, wrapper, **inputs):
    import tokamax
    assert tokamax.__version__ == GDN_TOKAMAX[0], tokamax.__version__
    return wrapper.fused_conv1d_gdn(**inputs)

  def rate(self, chip: str) -> dict:
    if chip == "v5e":
      row = protocol.row_base(self)
      row["error"] = ("not run on v5e: tokamax's op runs this kernel on TPU v6 and later only "
                      "(supported_on: generation >= 6)")
      return row
    return protocol.rate(self, chip)


# The headline's grouped matmuls at tokamax's own config and at the large megablox tiling.
HEADLINE_GMM_TILINGS = ("heuristic", "512x1024x1024")
ATTENTION_BLOCKS = (128, 512)   # its heuristic config's blocks, and blocks of 512


def specs_for(case) -> list:
  if isinstance(case, GroupedMatmul) and not case.lhs_quant:
    if case in HEADLINE:
      tilings = HEADLINE_GMM_TILINGS
    else:   # beside the quantized-decode rows: its quantized ragged_dot, one tiling
      tilings = (QUANTIZED_TILING,) if case.quantized else ()
    specs = [TokamaxGmmAnchor(case.m, case.part, tiling, groups=case.groups, model=case.model,
                              weight_dtype=case.weight_dtype) for tiling in tilings]
  elif isinstance(case, Attention):
    specs = [TokamaxAttentionAnchor(case.seq, block) for block in ATTENTION_BLOCKS]
  elif isinstance(case, JointAttention):   # non-causal, Diffusers' shapes
    specs = [TokamaxAttentionAnchor(case.seq, block, joint=case) for block in ATTENTION_BLOCKS]
  elif fused_gdn.applies(case):
    return [TokamaxGdnSpec(case)]
  else:
    specs = []
  return [s for s in specs if s.case == case]


def implementations(case) -> list[protocol.Implementation]:
  return [protocol.implementation(s) for s in specs_for(case)]
