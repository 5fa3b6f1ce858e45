"""The kernels calibration rates at tokamax's timed cache entries: tokamax's grouped matmul
(`CalibrationGmm`, its megablox kernel at an entry's tiling, input_buffer_count and own group
sizes) and its splash fork (`CalibrationAttention`, at an entry's blocks, layouts, scheduler
and exp flavour), each as peers/tokamax_ops.py rates it at the headline shapes, extended to
an entry's shape and config (rating/calibration.py says how each family is rated).

Each truncation compiles in a child in tokamax's venv (`compile_in_child`: this file as a
script, `python benchmarks/rating/calibration_specs.py SPEC CHIP TRUNC`, one ROW line), the
spec passed as JSON (`spec_key`).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402

from benchmarks.estimator import children, static_estimate, visible  # noqa: E402  (no jax)
from benchmarks.peers import protocol  # noqa: E402
from benchmarks.peers.attention_geometry import triangle_col, triangle_row  # noqa: E402
from benchmarks.peers.tokamax_ops import TokamaxEnvironment, TokamaxGmmAnchor  # noqa: E402


@dataclasses.dataclass(frozen=True)
class MeasuredGroups:
  """megablox's group metadata for concrete group sizes (visit_empty_groups=False): visit v
  computes m tile `m_tiles[v]` for group `group_ids[v]`. Python ints index the real lists
  (HBM replay); traced values (the truncated compile) get a stand-in pattern in which every
  visit is a new group and a new m tile (per-visit work is the same full tile product)."""

  sizes: tuple[int, ...]
  tm: int

  @functools.cached_property
  def visits(self) -> tuple[tuple[int, int], ...]:
    out, start = [], 0
    for g, size in enumerate(self.sizes):
      if size:
        end = start + size
        out += [(g, t) for t in range(start // self.tm, (end - 1) // self.tm + 1)]
      start += size
    return tuple(out)

  @property
  def num_tiles(self) -> int:
    return len(self.visits)

  def group_offset(self, g):
    return g * (sum(self.sizes) // len(self.sizes))

  def group_id(self, v):
    return self.visits[v][0] if isinstance(v, int) else v

  def m_tile_id(self, v):
    return self.visits[v][1] if isinstance(v, int) else v

  def check(self, make_group_metadata) -> None:
    """Equals tokamax's make_group_metadata with these group sizes."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    m = sum(self.sizes)
    (offsets, gids, mtiles), num = jax.jit(lambda s: make_group_metadata(
        group_sizes=s, m=m, tm=self.tm, start_group=jnp.int32(0),
        num_nonzero_groups=len(self.sizes), visit_empty_groups=False))(
            jnp.asarray(self.sizes, jnp.int32))
    assert int(num) == self.num_tiles, (int(num), self.num_tiles)
    np.testing.assert_array_equal(np.asarray(gids)[:self.num_tiles],
                                  [g for g, _ in self.visits])
    np.testing.assert_array_equal(np.asarray(mtiles)[:self.num_tiles],
                                  [t for _, t in self.visits])


@dataclasses.dataclass(frozen=True)
class CalibrationGmm(TokamaxGmmAnchor):
  """TokamaxGmmAnchor at a cache entry's shape, group sizes and config."""

  k_dim: int = 0
  n_dim: int = 0
  group_sizes: tuple[int, ...] = ()
  tile: tuple[int, int, int] = (128, 128, 128)
  input_buffers: int = 2

  @property
  def case(self):
    return types.SimpleNamespace(k=self.k_dim, n_weight=self.n_dim)

  @property
  def tiling(self) -> tuple[int, int, int]:
    return self.tile

  @property
  def input_buffer_count(self) -> int:
    return self.input_buffers

  @property
  def closed_form(self) -> MeasuredGroups:
    return MeasuredGroups(self.group_sizes, self.tile[0])

  @property
  def note(self) -> str:
    return (f"tokamax's group sizes ({len(self.group_sizes)} groups, {self.closed_form.num_tiles} "
            "active m tiles); make_group_metadata's XLA ops not rated")

  def glue_bytes(self) -> int:
    return 0


@dataclasses.dataclass(frozen=True)
class CalibrationAttention(TokamaxEnvironment):
  """tokamax's splash fork (its dynamic grid over on-or-below-diagonal blocks) at a cache
  entry's shape and config, rated as TokamaxAttentionAnchor rates it, but compiling
  a head's whole grid (these configs use blocks of 512-2048: at most 16 block rows)."""

  batch: int
  q_heads: int
  kv_heads: int
  seq_q: int
  seq_kv: int
  head_dim: int
  head_dim_v: int
  causal: bool
  residuals: bool
  config: tuple             # sorted (name, value) of tokamax's Config / SplashConfig fields
  glue: bool                # the op transposes q, k, v, out (flash_attention's op)

  @property
  def cfg(self) -> dict:
    return dict(self.config)

  @property
  def nq(self) -> int:
    return self.seq_q // self.cfg["block_q"]

  @property
  def nk(self) -> int:
    return self.seq_kv // self.cfg["block_kv"]

  @property
  def group(self) -> int:
    return self.q_heads // self.kv_heads

  # Heads of the truncated compiles (the estimator's time grows with the grid's steps). GQA
  # keeps its index map h // group: 2 and 4 query heads then share 1 kv head, each head still
  # walking its own kv blocks (its replay restarts per head), as in the full program.
  # A full mask's grid is uniform (every step a whole block, no lists): it is rated at its
  # first FULL_ROWS q-block rows and scaled linearly in rows x heads.
  FULL_ROWS = 2

  @property
  def rows(self) -> int:
    return self.nq if self.causal else min(self.nq, self.FULL_ROWS)

  @property
  def truncations(self):
    return ([2, self.rows], [4, self.rows])

  @property
  def method(self) -> str:
    grid = "the whole causal grid" if self.causal else f"the first {self.rows} q-block rows"
    return (f"static estimate of {grid} at 2 and 4 heads, extrapolated "
            f"linearly to {self.batch} x {self.q_heads} heads" + (" x rows" if not self.causal
                                                                   else "")
            + ("; SMEM block lists as closed forms" if self.causal else "") + ("; + the op's transposes / q scaling at HBM bandwidth" if self.glue
                       else ""))

  note = ("on v6e rated with use_base2_exp=False (the estimator aborts on the base-2 exp; "
          "tokamax's timed config used it)")

  # The block list of one head (row-major over on-or-below-diagonal blocks if causal).
  def _check_shape(self) -> None:
    b = self.cfg
    if self.seq_q % b["block_q"] or self.seq_kv % b["block_kv"]:
      raise ValueError(f"blocks {b['block_q']}/{b['block_kv']} do not divide "
                       f"{self.seq_q}/{self.seq_kv}")
    if self.causal and (self.seq_q != self.seq_kv or b["block_q"] != b["block_kv"]):
      raise ValueError("causal closed forms need square blocks and seq_q == seq_kv")
    if not self.causal and self.nk & (self.nk - 1):
      raise ValueError(f"full-mask closed forms need a power-of-two kv block count ({self.nk})")

  def row(self, g):
    if not self.causal:
      return g // self.nk if isinstance(g, int) else g >> int(math.log2(self.nk))
    return triangle_row(g, self.nq - 1)

  def col(self, g):
    if not self.causal:
      return g % self.nk if isinstance(g, int) else g & (self.nk - 1)
    return triangle_col(g, self.row(g))

  def last_col(self, g):
    return self.row(g) if self.causal else self.nk - 1

  @property
  def active(self) -> int:
    return self.nq * (self.nq + 1) // 2 if self.causal else self.nq * self.nk

  def forms(self, prng_key: bool):
    import jax.numpy as jnp
    on_last = lambda g: self.col(g) == self.last_col(g)
    diagonal = (lambda g: jnp.where(self.col(g) == self.row(g), 1, 2)) if self.causal \
        else (lambda g: jnp.int32(2) + 0 * g)
    return (("const", self.row), ("const", self.col), None,
            ("const", lambda g: (self.col(g) == 0).astype(jnp.int32)),
            ("const", lambda g: on_last(g).astype(jnp.int32)),
            ("const", diagonal)) + ((None,) if prng_key else ())

  def _check_forms(self, MI, M, block) -> None:
    import numpy as np
    mask = (M.CausalMask((self.seq_q, self.seq_kv)) if self.causal
            else M.FullMask((self.seq_q, self.seq_kv)))
    info, _ = MI.process_mask(mask, block)
    if not self.causal:   # a full mask has no block lists: a static (heads, nq * nk) grid
      assert all(x is None for x in info), info
      return
    start, end = MI.find_bounds(np.asarray(info.active_rows))
    g = range(self.active)
    assert int(info.num_active_blocks[0]) == self.active, (info.num_active_blocks, self.active)
    assert info.mask_next is None and info.partial_mask_blocks is None
    want = dict(active_rows=[self.row(x) for x in g], active_cols=[self.col(x) for x in g],
                block_mask=[1 if self.causal and self.col(x) == self.row(x) else 2 for x in g])
    for name, values in want.items():
      np.testing.assert_array_equal(np.asarray(getattr(info, name))[:self.active], values,
                                    err_msg=name)
    np.testing.assert_array_equal(np.asarray(start)[:self.active],
                                  [int(self.col(x) == 0) for x in g])
    np.testing.assert_array_equal(np.asarray(end)[:self.active],
                                  [int(self.col(x) == self.last_col(x)) for x in g])

  def validate(self) -> None:
    self._check_shape()

  def build(self, trunc, chip: str = "v6e"):
    heads, rows = trunc
    import inspect
    import jax
    import jax.numpy as jnp
    from tokamax._src.ops.experimental.tpu.splash_attention import (
        splash_attention_kernel as K, splash_attention_mask as M,
        splash_attention_mask_info as MI)
    self.check_tokamax_version()
    self._check_shape()
    config = dict(self.cfg)
    if not self.glue:   # the experimental splash op's own choice: check our restatement
      from tokamax._src.ops.experimental.tpu.splash_attention import pallas_mosaic_tpu as SP
      S = jax.ShapeDtypeStruct
      ba = types.SimpleNamespace(arguments=dict(
          q=S((self.q_heads, self.seq_q, self.head_dim), jnp.bfloat16),
          k=S((self.kv_heads, self.seq_kv, self.head_dim), jnp.bfloat16)))
      theirs = dataclasses.asdict(SP.PallasMosaicTpuSplashAttention()._get_heuristics_config(ba))
      for name, value in config.items():
        assert int(theirs[name]) == int(value), (name, theirs[name], value)
      config = {k: v for k, v in theirs.items() if v is not None}
    if chip == "v6e" and config.get("use_base2_exp", True):
      # libtpu's estimator aborts on v6e on the base-2 exp's bf16 q * log2(e) multiply
      # ("Expected vector-bf16packed, got vector-int32"; plain AOT compiles): rated with exp,
      # as TokamaxAttentionAnchor does on v6e.
      config["use_base2_exp"] = False
    self._check_forms(MI, M, (config["block_q"], config["block_kv"]))
    layouts = {n: K.QKVLayout(config[n]) for n in ("q_layout", "k_layout", "v_layout")
               if n in config}
    extra = dict(block_q_dkv=None, block_kv_dkv=None, block_kv_dkv_compute=None) \
        if not self.glue else {}
    splash_config = dataclasses.replace(K.SplashConfig.get_default(), attn_logits_soft_cap=None,
                                        **{**config, **layouts, **extra})
    seq_q = rows * config["block_q"]
    mask = (M.CausalMask((self.seq_q, self.seq_kv)) if self.causal
            else M.FullMask((seq_q, self.seq_kv)))
    kernel = K.make_splash_mha(mask, config=splash_config, save_residuals=self.residuals,
                               q_seq_shards=1)
    forms = self.forms("prng_key_ref" in inspect.signature(K.flash_attention_kernel).parameters)

    def fn(q, k, v):
      if not self.causal:
        return kernel(q, k, v)
      with visible.visible_prefetch(K, forms, grid=(heads, self.active)):
        return kernel(q, k, v)
    S = jax.ShapeDtypeStruct
    kv = max(1, heads // self.group)
    return fn, [S((heads, seq_q, self.head_dim), jnp.bfloat16),
                S((kv, self.seq_kv, self.head_dim), jnp.bfloat16),
                S((kv, self.seq_kv, self.head_dim_v), jnp.bfloat16)]

  def extrapolate(self, cycles: dict) -> float:
    """c(h) = c_a + per_head * (h - a) at the rated rows; a full mask's per-head cost then
    scales with its rows (nq / rows), causal grids are whole."""
    (a, rows), (b, _) = self.truncations
    ca, cb = cycles[json.dumps([a, rows])], cycles[json.dumps([b, rows])]
    per_head = (cb - ca) / (b - a)
    return ca + per_head * (self.batch * self.q_heads * self.nq / rows - a)

  def hbm_bytes(self) -> int:
    """Replay of one head's compact grid (q, k, v, out and the [bq, 128] int32 q_sequence
    block change with the row / column; residuals: two f32 [bq] rows per q block), times
    batch x q heads (each restarts its kv walk)."""
    c = self.cfg
    bq, bkv = c["block_q"], c["block_kv"]
    steps = ((self.row(g), self.col(g)) for g in range(self.active))
    per_head = visible.replay(steps, [
        ("q", lambda i, j: i, bq * self.head_dim * 2), ("k", lambda i, j: j, bkv * self.head_dim * 2),
        ("v", lambda i, j: j, bkv * self.head_dim_v * 2),
        ("o", lambda i, j: i, bq * self.head_dim_v * 2),
        ("q_sequence", lambda i, j: i, bq * 128 * 4)])
    if self.residuals:
      per_head += self.nq * bq * 4 * 2
    return self.batch * self.q_heads * per_head

  def glue_bytes(self) -> int:
    """flash_attention's op around the kernel: q * scale, and q, k, v in / out swapped between
    [B, T, H, D] and [B, H, T, D] (each read once and written once)."""
    if not self.glue:
      return 0
    q = self.batch * self.q_heads * self.seq_q * self.head_dim * 2
    k = self.batch * self.kv_heads * self.seq_kv * self.head_dim * 2
    v = self.batch * self.kv_heads * self.seq_kv * self.head_dim_v * 2
    o = self.batch * self.q_heads * self.seq_q * self.head_dim_v * 2
    return 2 * (q + k + v + o)

  def hand(self, chip) -> dict:
    c = self.cfg
    flops = 2 * self.batch * self.q_heads * self.active * c["block_q"] * c["block_kv"] * (
        self.head_dim + self.head_dim_v)
    return dict(hand_mxu_flops=flops)


def spec_key(spec) -> str:
  """A spec as JSON (every field): how the parent names it to its child."""
  kind = "gmm" if isinstance(spec, CalibrationGmm) else "attn"
  fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
  return json.dumps(dict(kind=kind, **fields))


def spec_from_key(key: str):
  """The spec `spec_key` names."""
  fields = json.loads(key)
  kind = fields.pop("kind")
  if kind == "gmm":
    fields.update(group_sizes=tuple(fields["group_sizes"]), tile=tuple(fields["tile"]))
    return CalibrationGmm(**fields)
  fields["config"] = tuple(tuple(x) for x in fields["config"])
  return CalibrationAttention(**fields)


def compile_in_child(spec, chip: str, trunc) -> dict:
  """One truncation of `spec` compiled for `chip` with the static profile, in a child in
  tokamax's venv (this file as a script)."""
  rows, error = children.run_child(__file__, [spec_key(spec), chip, json.dumps(trunc)],
                                   timeout=protocol.CHILD_TIMEOUT_S,
                                   env=children.child_env(), python=spec.python)
  if error:
    raise RuntimeError(f"child {error} ({chip} {trunc})")
  return rows[-1]


def child_main(key: str, chip: str, trunc_json: str) -> None:
  spec = spec_from_key(key)
  trunc = json.loads(trunc_json)
  start = time.time()
  with protocol.lowering(spec, chip):
    fn, specs = spec.build(trunc, chip)
    compiled = static_estimate.compile_on_chip(fn, specs, chip)
  cycles, count = static_estimate.kernel_cycles(compiled.as_text())
  children.print_row(dict(cycles=cycles, kernels=count, seconds=round(time.time() - start, 1)))


if __name__ == "__main__":   # a child of `compile_in_child`: SPEC CHIP TRUNC, one ROW line
  children.enable_static_profile()   # before jax loads
  child_main(*sys.argv[1:])
