"""Calibration: this project's static estimator against tokamax's times measured on real TPUs.

    .venv-jax012/bin/python benchmarks/calibration.py [--thorough] [--chips v5e v6e]
                                                      [--families ...] [--out benchmarks/results]

tokamax 0.0.17 (installed in .venv-tokamax-jax012) ships autotuning caches timed on real
chips: `tokamax/data/autotuning/<chip dir>/<op>.json`, keyed by the op's arguments (shapes,
mask, group sizes), each with the configs tried and their `evaluation_times_ms`. For every
timed (entry, config) of the families below, this rates the same kernel, at the same shape and
config, by the method every row of benchmarks/estimates.md uses (estimate.py's docstring):

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth) (+ the op's XLA glue)
    ratio        = measured_us / predicted_us      (measured = median of the timed runs)

  flash_attention   tokamax's `dot_product_attention` mosaic op (pallas_mosaic_tpu_flash_
                    attention.json): its splash fork on [H, T, D] per batch element, at the
                    entry's block sizes, layouts, scheduler and exp flavour. Rated like
                    anchors.TokamaxAttentionAnchor: the six SMEM block lists are closed forms
                    of the causal (or full) block list, checked against tokamax's own
                    process_mask; the whole grid of a head is compiled at 2 and 4 heads
                    (for GQA: g and 2g heads), extrapolated linearly to batch x heads (the op
                    vmaps the kernel over the batch: one more grid axis). The op also scales q
                    and moves q, k, v and the output between [B, T, H, D] and [B, H, T, D]
                    with XLA: those bytes (read + write of each) are added at HBM bandwidth.
  splash_attention  tokamax's experimental `splash_attention` op (splash_attention.json): the
                    same kernel on [H, T, D] (no glue), at the op's heuristic config (the
                    cache records the config as "{}": the op's own choice).
  ragged_dot        tokamax's `ragged_dot` mosaic op (pallas_mosaic_tpu_ragged_dot.json),
                    forward layout only (lhs [m, k] x rhs [G, k, n]): anchors.TokamaxGmmAnchor
                    at the entry's tiling and input_buffer_count, with the entry's own group
                    sizes (tokamax's seeded random draw for {num_groups, total_size} keys): the
                    active-tile count and the replayed HBM bytes come from them (checked
                    against tokamax's make_group_metadata), the kernel is compiled at 4 and 8
                    active tiles and extrapolated.
  ragged_dot_v2     pallas_mosaic_tpu_v2_ragged_dot.json: listed, not rated (see V2_NOT_RATED).

Entries that are not the plain forward kernel (bias / boolean masks, dropout, transposed
ragged dims, quantized or non-bf16 operands, ragged_dot's return_residuals keys, which time
more than the forward product) are listed with the reason and not rated.

Writes <out>/calibration.jsonl (one row per rated or skipped entry) and <out>/calibration.md
(per entry, and per family x chip: median ratio and spread). `expected_factor(chip, kernel)`
is the "expected on hardware" factor estimate.py's table applies to its static predictions.
Nothing here runs on a TPU: the measured times are tokamax's, the predictions are ours.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re
import statistics
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import anchors  # noqa: E402  (light import: jax only when rating)
import tuning  # noqa: E402

TOKAMAX_VERSION, TOKAMAX_VENV = anchors.TOKAMAX_ENVIRONMENTS["0.12"]
RESULTS = ROOT / "benchmarks" / "results"

# Our chip names -> tokamax's cache directories.
CHIP_DIRS = {"v5e": "tpu_v5_lite", "v6e": "tpu_v6_lite", "v5p": "tpu_v5", "v7": "tpu7x"}
FAMILY_FILES = {
    "flash_attention": "pallas_mosaic_tpu_flash_attention.json",
    "splash_attention": "splash_attention.json",
    "ragged_dot": "pallas_mosaic_tpu_ragged_dot.json",
    "ragged_dot_v2": "pallas_mosaic_tpu_v2_ragged_dot.json",
}
# Which calibration families stand for each kernel of estimate.py's table.
# (keys: headline.py's `kernel` of each case, the row's "kernel" in estimates.jsonl). Splash
# is reported, not used: its cache records no config ("{}") and its entries run 8-9x slower
# than predicted at the op's heuristic config, 2.7-3.6% of v6e's peak where tokamax's flash
# op reaches 30-64% at similar shapes: the timed config is likely not the one rated.
KERNEL_FAMILIES = {"flash-attention-tpu": ("flash_attention",),
                   "ragged-dot-tpu": ("ragged_dot",)}
V2_NOT_RATED = ("tokamax's gmm v2 kernel picks its tiles at trace time from the group sizes "
                "(its configs are recorded as all-null) and loops over SMEM tile lists; no "
                "visible-SMEM substitution for it exists here yet")
DEFAULT_PER_FAMILY = {"flash_attention": 8, "splash_attention": 3, "ragged_dot": 4}


# ------------------------------------------------------------------------ the caches


def cache_dir() -> Path:
  """tokamax's autotuning data in its venv (.venv-tokamax-jax012)."""
  found = sorted((ROOT / TOKAMAX_VENV / "lib").glob("python3.*/site-packages/tokamax/data/"
                                                     "autotuning"))
  if not found:
    raise RuntimeError(f"tokamax {TOKAMAX_VERSION} is not installed in {TOKAMAX_VENV} "
                       "(scripts/setup.sh makes it)")
  return found[0]


_SHAPE = re.compile(r"^(\w+)\[([\d,]*)\]$")


def parse_shape(text: str) -> tuple[str, tuple[int, ...]]:
  """"bf16[32,512,32,64]" -> ("bf16", (32, 512, 32, 64))."""
  m = _SHAPE.match(text)
  if not m:
    raise ValueError(f"not a tokamax shape string: {text!r}")
  return m.group(1), tuple(int(d) for d in m.group(2).split(",") if d)


@dataclasses.dataclass(frozen=True)
class Entry:
  """One timed (arguments, config) of a tokamax cache file."""

  family: str
  chip: str
  key: str          # the cache's JSON key (the op's arguments)
  config: str       # the cache's JSON config ("{}": the op's own choice)
  times_ms: tuple[float, ...]

  @property
  def args(self) -> dict:
    return json.loads(self.key)

  @property
  def cfg(self) -> dict:
    return json.loads(self.config)

  @property
  def measured_us(self) -> float:
    return statistics.median(self.times_ms) * 1e3

  @property
  def name(self) -> str:
    a = self.args
    if self.family.startswith("ragged_dot"):
      groups = a["group_sizes"]
      g = groups["num_groups"] if isinstance(groups, dict) else len(groups)
      return f"{a['lhs']} x {a['rhs']} G={g}" + (" +res" if a.get("return_residuals") else "")
    mask = a["mask"]
    causal = bool(mask.get("causal_mask") or mask.get("is_causal"))
    return (f"q {a['q']} k {a['k']} v {a['v']} {'causal' if causal else 'full'}"
            + (" +res" if a.get("return_residuals") else ""))


def read_entries(chip: str, family: str, directory: Path | None = None) -> list[Entry]:
  """Every timed (key, config) of `family` on `chip`, sorted by key (deterministic)."""
  path = (directory or cache_dir()) / CHIP_DIRS[chip] / FAMILY_FILES[family]
  if not path.exists():
    return []
  data = json.loads(path.read_text())
  out = [Entry(family, chip, key, config, tuple(result["evaluation_times_ms"]))
         for key, configs in data.items() for config, result in configs.items()
         if result.get("evaluation_times_ms")]
  return sorted(out, key=lambda e: (e.key, e.config))


def subset(entries: list[Entry], n: int) -> list[Entry]:
  """n entries spread evenly over the sorted list (all of them if n >= len)."""
  if n >= len(entries):
    return list(entries)
  return [entries[round(i * (len(entries) - 1) / (n - 1))] if n > 1 else entries[0]
          for i in range(n)]


def model_flops(entry: Entry) -> int | None:
  """The entry's useful flops (2 per multiply-add): attention's QK^T and PV over the visible
  (causal: on-or-below-diagonal) pairs, or the ragged dot's m x k x n; None if not plain."""
  a = entry.args
  try:
    if entry.family.startswith("ragged_dot"):
      (_, (m, k)), (_, (_, _, n)) = parse_shape(a["lhs"]), parse_shape(a["rhs"])
      return 2 * m * k * n
    if entry.family == "flash_attention":
      _, (*batch, tq, hq, d) = parse_shape(a["q"])
      _, (*_, tk, _, dv) = parse_shape(a["v"])
      causal = bool(a["mask"].get("causal_mask"))
    else:
      _, (hq, tq, d) = parse_shape(a["q"])
      _, (_, tk, dv) = parse_shape(a["v"])
      batch, causal = [], bool(a["mask"].get("is_causal"))
  except (TypeError, ValueError):   # quantized operands: not plain shape strings
    return None
  visible = tq * (tq + 1) // 2 if causal else tq * tk
  return 2 * math.prod(batch) * hq * visible * (d + dv)


def peak_fraction(entry: Entry) -> float | None:
  """Measured fraction of the chip's bf16 peak (chips.py): model_flops / measured time / peak."""
  from tpu_kernels import chips
  flops = model_flops(entry)
  if flops is None:
    return None
  return flops / (entry.measured_us * 1e-6) / chips.get_chip(entry.chip).bf16_flops_per_s


def measured_ceilings(chips_: tuple[str, ...] = ("v5e", "v6e", "v5p", "v7")) -> list[dict]:
  """Per chip x attention family x head_dim x mask: the best and worst measured fraction of
  the bf16 peak over every plain bf16 timed entry (no estimator: tokamax's times alone)."""
  groups: dict[tuple, list[tuple[float, str]]] = {}
  for chip in chips_:
    for family in ("flash_attention", "splash_attention"):
      for e in read_entries(chip, family):
        if why_not_rated(e) is not None:
          continue
        a = e.args
        d = parse_shape(a["q"])[1][-1]
        causal = bool(a["mask"].get("causal_mask") or a["mask"].get("is_causal"))
        groups.setdefault((chip, family, d, causal), []).append((peak_fraction(e), e.name))
  out = []
  for (chip, family, d, causal), values in groups.items():
    best, worst = max(values), min(values)
    out.append(dict(chip=chip, family=family, head_dim=d, causal=causal, entries=len(values),
                    best=best[0], best_entry=best[1], worst=worst[0]))
  return out


# ------------------------------------------------------------------------ entry -> spec


def why_not_rated(entry: Entry) -> str | None:
  """None if the entry is the plain forward kernel rated here, else why it is not."""
  a = entry.args
  if entry.family == "ragged_dot_v2":
    return V2_NOT_RATED
  if entry.family == "ragged_dot":
    dims = a["ragged_dot_dimension_numbers"]
    if dims != {"dot_dimension_numbers": [[[1], [1]], [[], []]], "lhs_ragged_dimensions": [0],
                "rhs_group_dimensions": [0]}:
      return "not the forward layout (a backward-pass ragged dot)"
    if not all(isinstance(a[x], str) and parse_shape(a[x])[0] == "bf16" for x in ("lhs", "rhs")):
      return "operands not plain bf16 (quantized)"
    if a.get("return_residuals"):
      return "return_residuals keys time more than the forward product (1.4x the same shape)"
    if a.get("activation") or a.get("fuse_gateup_activation") or a.get("group_offset"):
      return "fused activation / group offset"
    return None
  if not all(isinstance(a[x], str) and parse_shape(a[x])[0] == "bf16" for x in ("q", "k", "v")):
    return "operands not plain bf16"
  if a.get("bias") or a.get("dropout_rate") or a.get("segment_ids") or a.get("sinks") \
      or a.get("logits_soft_cap") or a.get("attn_logits_soft_cap") or a.get("paging_info") \
      or a.get("q_indices") or a.get("k_indices"):
    return "bias / dropout / segments / sinks / soft-cap / paging: not the plain kernel"
  mask = a["mask"]
  if mask.get("bool_mask") or mask.get("q_start") or mask.get("q_end") or mask.get("k_start") \
      or mask.get("k_end"):
    return "a boolean or ranged mask"
  causal = mask.get("causal_mask")
  if causal and (causal.get("offset") or causal.get("window_size")):
    return "offset / windowed causal mask"
  if entry.family == "flash_attention" and not a.get("normalize_output", True):
    return "unnormalized output"
  return None


def spec_for(entry: Entry):
  a = entry.args
  if entry.family == "ragged_dot":
    _, (m, k) = parse_shape(a["lhs"])
    _, (groups, k2, n) = parse_shape(a["rhs"])
    assert k == k2, (k, k2)
    sizes = a["group_sizes"]
    sizes = tuple(group_sizes_of(sizes["total_size"], sizes["num_groups"])
                  if isinstance(sizes, dict) else sizes)
    c = entry.cfg
    return CalibrationGmm(m=m, part="calibration", tiling_name="tokamax cache",
                          groups=groups, k_dim=k, n_dim=n, group_sizes=sizes,
                          tile=(c["tile_m"], c["tile_k"], c["tile_n"]),
                          input_buffers=c["input_buffer_count"])
  if entry.family == "flash_attention":   # [*B, T, H, D]
    _, (*batch, tq, hq, d) = parse_shape(a["q"])
    _, (*_, tk, hk, _) = parse_shape(a["k"])
    _, (*_, _, _, dv) = parse_shape(a["v"])
    config = entry.cfg
    glue = True
    causal = bool(a["mask"].get("causal_mask"))
  else:                                  # splash: [H, T, D]
    _, (hq, tq, d) = parse_shape(a["q"])
    _, (hk, tk, _) = parse_shape(a["k"])
    _, (_, _, dv) = parse_shape(a["v"])
    batch = []
    config = splash_heuristic_config(tq, tk)
    glue = False
    causal = bool(a["mask"].get("is_causal"))
  return CalibrationAttention(
      batch=math.prod(batch), q_heads=hq, kv_heads=hk, seq_q=tq, seq_kv=tk, head_dim=d,
      head_dim_v=dv, causal=causal, residuals=bool(a.get("return_residuals")),
      config=tuple(sorted(config.items())), glue=glue)


def splash_heuristic_config(seq_q: int, seq_kv: int) -> dict:
  """tokamax 0.0.17 experimental splash op's `_get_heuristics_config` (what "{}" means in its
  cache), restated so the parent needs no tokamax; the child checks it against tokamax's."""
  bq = 1024 if seq_q >= 1024 and seq_q % 1024 == 0 else 128
  bkv, bkvc = (1024, 512) if seq_kv >= 1024 and seq_kv % 1024 == 0 else (128, 128)
  return dict(block_q=bq, block_kv=bkv, block_kv_compute=bkvc, q_layout=1, k_layout=1,
              v_layout=1, use_experimental_scheduler=True)


def group_sizes_of(total: int, groups: int) -> list[int]:
  """tokamax's representative group sizes for {num_groups, total_size}: its
  base.generate_group_sizes (uniform multinomial draw, seed 0)."""
  import numpy as np
  rng = np.random.default_rng(0)
  ids = rng.choice(groups, (total,), p=None, replace=True)
  return [int(x) for x in np.bincount(ids, minlength=groups)]


# ------------------------------------------------------------------------ ragged dot


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
class CalibrationGmm(anchors.TokamaxGmmAnchor):
  """anchors.TokamaxGmmAnchor at a cache entry's shape, group sizes and config."""

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


# ------------------------------------------------------------------------ attention


@dataclasses.dataclass(frozen=True)
class CalibrationAttention(anchors._Tokamax):
  """tokamax's splash fork (its dynamic grid over on-or-below-diagonal blocks) at a cache
  entry's shape and config, rated as anchors.TokamaxAttentionAnchor rates it, but compiling
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
    return anchors.triangle_row(g, self.nq - 1)

  def col(self, g):
    if not self.causal:
      return g % self.nk if isinstance(g, int) else g & (self.nk - 1)
    return anchors.triangle_col(g, self.row(g))

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
    jax = anchors._jax()
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
      # as anchors.TokamaxAttentionAnchor does on v6e.
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
      with anchors.visible_prefetch(K, forms, grid=(heads, self.active)):
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
    per_head = anchors.replay(steps, [
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


# ------------------------------------------------------------------------ rating


def _spec_key(spec) -> str:
  kind = "gmm" if isinstance(spec, CalibrationGmm) else "attn"
  fields = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
  return json.dumps(dict(kind=kind, **fields))


def _spec_from_key(key: str):
  fields = json.loads(key)
  kind = fields.pop("kind")
  if kind == "gmm":
    fields.update(group_sizes=tuple(fields["group_sizes"]), tile=tuple(fields["tile"]))
    return CalibrationGmm(**fields)
  fields["config"] = tuple(tuple(x) for x in fields["config"])
  return CalibrationAttention(**fields)


def _compile_in_child(spec, chip: str, trunc) -> dict:
  rows, error = tuning.run_child(__file__, ["--child", _spec_key(spec), chip, json.dumps(trunc)],
                                 timeout=anchors.CHILD_TIMEOUT_S,
                                 env=tuning.child_env(), python=spec.python)
  if error:
    raise RuntimeError(f"child {error} ({chip} {trunc})")
  return rows[-1]


def _child_main(key: str, chip: str, trunc_json: str) -> None:
  tuning.enable_static_profile()
  spec = _spec_from_key(key)
  trunc = json.loads(trunc_json)
  start = time.time()
  with anchors.lowering(spec, chip):
    fn, specs = spec.build(trunc, chip)
    compiled = anchors._compile(fn, specs, chip)
  cycles, count = anchors._kernel_cycles(compiled.as_text())
  tuning.print_row(dict(cycles=cycles, kernels=count, seconds=round(time.time() - start, 1)))


def rate(entry: Entry) -> dict:
  """One row: the entry, its measured time, our prediction and the ratio (or why not)."""
  from tpu_kernels import chips
  start = time.time()
  row = dict(family=entry.family, chip=entry.chip, entry=entry.name, config=entry.cfg,
             measured_us=entry.measured_us, times_ms=list(entry.times_ms),
             measured_peak_fraction=peak_fraction(entry), tokamax=TOKAMAX_VERSION)
  reason = why_not_rated(entry)
  if reason:
    return dict(row, rated=False, error=f"not rated: {reason}")
  try:
    spec = spec_for(entry)
    spec.validate()
    c = chips.get_chip(entry.chip)
    hbm, glue = spec.hbm_bytes(), spec.glue_bytes()
    results = {json.dumps(t): _compile_in_child(spec, entry.chip, t) for t in spec.truncations}
    if any(r["cycles"] == 0 for r in results.values()):
      raise RuntimeError("the estimator rated the kernel 0 cycles")
    cycles = spec.extrapolate({t: r["cycles"] for t, r in results.items()})
  except Exception as e:  # noqa: BLE001  (a failed rating is a row)
    msg = str(e).strip().splitlines()
    return dict(row, rated=False, error=f"{type(e).__name__}: {msg[0][:300] if msg else ''}",
                rate_seconds=round(time.time() - start, 1))
  row.update(rated=True, error=None, method=spec.method, note=spec.note,
             estimated_cycles=int(round(cycles)), hbm_bytes=hbm, glue_bytes=glue,
             truncated=[dict(trunc=json.loads(t), **r) for t, r in results.items()])
  row.update(predicted(row, c))
  row["rate_seconds"] = round(time.time() - start, 1)
  return row


def predicted(row: dict, chip) -> dict:
  """compute / HBM / glue / predicted microseconds and the measured / predicted ratio."""
  compute_us = row["estimated_cycles"] / chip.clock_hz * 1e6
  hbm_us = row["hbm_bytes"] / chip.hbm_bytes_per_s * 1e6
  glue_us = row.get("glue_bytes", 0) / chip.hbm_bytes_per_s * 1e6
  predicted_us = max(compute_us, hbm_us) + glue_us
  return dict(compute_us=compute_us, hbm_us=hbm_us, glue_us=glue_us, predicted_us=predicted_us,
              ratio=row["measured_us"] / predicted_us,
              kernel_only_ratio=row["measured_us"] / max(compute_us, hbm_us))


# ------------------------------------------------------------------------ summaries


def summary(rows: list[dict]) -> list[dict]:
  """Per (family, chip): count, median ratio, spread (min, max, and the 25-75% range)."""
  out = []
  for family, chip in dict.fromkeys((r["family"], r["chip"]) for r in rows):
    ratios = sorted(r["ratio"] for r in rows if r["family"] == family and r["chip"] == chip
                    and r.get("rated"))
    listed = sum(1 for r in rows if r["family"] == family and r["chip"] == chip)
    s = dict(family=family, chip=chip, rated=len(ratios), listed=listed)
    if ratios:
      q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else [ratios[0]] * 3
      s.update(median=statistics.median(ratios), min=ratios[0], max=ratios[-1],
               q25=q[0], q75=q[2],
               kernel_only_median=statistics.median(
                   r.get("kernel_only_ratio", r["ratio"]) for r in rows
                   if r["family"] == family and r["chip"] == chip and r.get("rated")))
    out.append(s)
  return out


@functools.cache
def _summary_of(path: str) -> tuple:
  rows = tuning.read_log(path)
  return tuple(tuple(sorted(s.items())) for s in summary(rows))


def expected_factor(chip: str, kernel: str, path: Path | None = None) -> tuple[float, str] | None:
  """The "expected on hardware" factor for estimate.py's rows of `kernel` on `chip`: the median
  measured / predicted ratio of the calibration families that stand for that kernel
  (KERNEL_FAMILIES), read from calibration.jsonl. Returns
  (factor, what it rests on), or None where no tokamax timing calibrates that kernel / chip."""
  path = path or RESULTS / "calibration.jsonl"
  if kernel not in KERNEL_FAMILIES or not Path(path).exists():
    return None
  rows = [r for r in tuning.read_log(path) if r.get("rated") and r["chip"] == chip
          and r["family"] in KERNEL_FAMILIES[kernel]]
  if not rows:
    return None
  factor = statistics.median(r["ratio"] for r in rows)
  families = "+".join(dict.fromkeys(r["family"] for r in rows))
  return factor, f"median of {len(rows)} {families} entries on {chip}"


def markdown(rows: list[dict]) -> str:
  lines = [f"Measured: tokamax {TOKAMAX_VERSION}'s autotuning caches (real chips, median of "
           "each entry's timed runs). Predicted: this project's static estimator "
           "(benchmarks/calibration.py's docstring). ratio = measured / predicted.", "",
           "| family | chip | rated / listed | median ratio | 25-75% | min - max "
           "| median kernel-only ratio |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for s in summary(rows):
    if not s["rated"]:
      lines.append(f"| {s['family']} | {s['chip']} | 0 / {s['listed']} | not rated | | | |")
      continue
    lines.append(f"| {s['family']} | {s['chip']} | {s['rated']} / {s['listed']} "
                 f"| {s['median']:.2f} | {s['q25']:.2f} - {s['q75']:.2f} "
                 f"| {s['min']:.2f} - {s['max']:.2f} | {s['kernel_only_median']:.2f} |")
  lines += ["", "Measured ceilings (tokamax's own times, no estimator): fraction of the chip's "
            "bf16 peak (chips.py) reached by plain bf16 attention entries, best and worst per "
            "head_dim and mask.", "",
            "| chip | family | head_dim | mask | entries | best | worst | best entry |",
            "|---|---|---:|---|---:|---:|---:|---|"]
  for c in measured_ceilings():
    lines.append(f"| {c['chip']} | {c['family']} | {c['head_dim']} "
                 f"| {'causal' if c['causal'] else 'full'} | {c['entries']} | {c['best']:.2f} "
                 f"| {c['worst']:.2f} | {c['best_entry']} |")
  lines += ["", "Per entry (kernel-only ratio: measured / the kernel's prediction without the op's "
            "XLA glue):", "",
            "| family | chip | entry | config | measured µs | compute µs | HBM µs | glue µs "
            "| predicted µs | ratio | kernel-only ratio |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items()) or "op's own"
    if not r.get("rated"):
      lines.append(f"| {r['family']} | {r['chip']} | {r['entry']} | {cfg} "
                   f"| {r['measured_us']:,.1f} | {r['error'][:140]} ||||||")
      continue
    lines.append(f"| {r['family']} | {r['chip']} | {r['entry']} | {cfg} "
                 f"| {r['measured_us']:,.1f} | {r['compute_us']:,.1f} | {r['hbm_us']:,.1f} "
                 f"| {r['glue_us']:,.1f} | {r['predicted_us']:,.1f} | {r['ratio']:.2f} "
                 f"| {r['kernel_only_ratio']:.2f} |")
  return "\n".join(lines) + "\n"


MAX_DEFAULT_STEPS = 10   # per head: the estimator's time and memory grow with grid steps
                         # (a 36-step head of 2048^2 blocks took over 600 s at 4 heads, 8 GB)


def cheap(entry: Entry) -> bool:
  """In the default subset: attention whose rated grid has at most MAX_DEFAULT_STEPS steps
  a head (every ragged dot: rated at 4 and 8 visits)."""
  if entry.family.startswith("ragged_dot"):
    return True
  spec = spec_for(entry)
  return spec.rows * (spec.nk if not spec.causal else (spec.nq + 1) / 2) <= MAX_DEFAULT_STEPS


def chosen_entries(chips: list[str], families: list[str], thorough: bool) -> list[Entry]:
  out = []
  for chip in chips:
    for family in families:
      entries = read_entries(chip, family)
      if thorough or family == "ragged_dot_v2":
        out += entries
        continue
      ratable = [e for e in entries if why_not_rated(e) is None and cheap(e)]
      out += subset(ratable, DEFAULT_PER_FAMILY.get(family, 4))
  return out


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--families", nargs="+", default=list(FAMILY_FILES))
  parser.add_argument("--thorough", action="store_true", help="every entry (hours)")
  parser.add_argument("--out", type=Path, default=RESULTS)
  parser.add_argument("--retry-failed", action="store_true",
                      help="keep --out's rated rows, re-rate only the entries whose rating failed")
  parser.add_argument("--markdown-only", action="store_true",
                      help="recompute the arithmetic of --out's calibration.jsonl and rewrite "
                           "calibration.md (no rating)")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    _child_main(*args.child)
    return 0
  if args.markdown_only:   # recompute each rated row's arithmetic, rewrite the outputs
    from tpu_kernels import chips
    rows = [dict(r, **predicted(r, chips.get_chip(r["chip"]))) if r.get("rated") else r
            for r in tuning.read_log(args.out / "calibration.jsonl")]
    tuning.write_log(args.out / "calibration.jsonl", rows)
    (args.out / "calibration.md").write_text(markdown(rows))
    return 0
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  old = {(r["family"], r["chip"], r["entry"], json.dumps(r["config"])): r
         for r in tuning.read_log(args.out / "calibration.jsonl")} if args.retry_failed else {}
  rows = []
  for entry in chosen_entries(args.chips, args.families, args.thorough):
    kept = old.get((entry.family, entry.chip, entry.name, json.dumps(entry.cfg)))
    if kept and (kept.get("rated") or kept["error"].startswith("not rated:")):
      rows.append(kept)
      continue
    rows.append(rate(entry))
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "truncated"}), file=sys.stderr,
          flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  tuning.write_log(args.out / "calibration.jsonl", rows)
  table = markdown(rows)
  (args.out / "calibration.md").write_text(table)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
