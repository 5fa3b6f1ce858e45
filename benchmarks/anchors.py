"""Anchors: jax's and tokamax's Pallas TPU kernels, rated by the same static estimator as ours.

    python benchmarks/anchors.py [--chips v5e v6e] [--cases SUBSTR] [--out FILE]

prints one JSON row per (anchor, chip). `anchors()` is what benchmarks/estimate.py wires in:
each `Anchor.rate(chip)` returns compiled / error / estimated_cycles / hbm_bytes / method /
note / config (+ hand counts); the caller turns them into predicted = max(cycles / clock,
hbm_bytes / bandwidth) and the efficiency against the headline roofline.

Anchors (jax's own kernels, `jax.experimental.pallas.ops.tpu`, nothing copied):

  * grouped matmul: megablox `gmm`, lhs [m, k] x rhs [G, k, n] (its natural layout), bf16
    out, balanced group sizes, at its default tiling (128, 128, 128) and at (512, 1024,
    1024) clipped to divisors of the case. gate_up is the plain [m, 2048] x [2048, 1536]
    matmul: silu(gate) * up is NOT fused in gmm (its extra pass is not counted).
  * attention: `flash_attention` (q / k / v [B, H, S, D]; it has no GQA, so a caller
    repeats k / v to 32 heads first: the repeat's HBM traffic is in hbm_bytes, its cycles
    are not. The kernel is rated on k / v that already have every head, as ours is rated
    on its MHA program: with the repeat in the same program XLA fuses it into the kernel's
    operands and the estimate of the kernel alone drops by a fifth, while the program's
    total rises) and splash attention (`make_splash_mha`, GQA by k / v with 8 heads,
    causal mask).
  * paged decode: `paged_attention` (k / v pages [Hkv, pages, page, D], its default
    inline_seq_dim=True) and `ragged_paged_attention` (fused K/V pages).
  * RMSNorm: jax ships no Pallas RMSNorm; there is no anchor (estimate.py rates the XLA
    jnp version). tokamax has none for TPU either (its normalization is Triton or XLA).

tokamax 0.0.12 (`TokamaxGmmAnchor`, `TokamaxAttentionAnchor`): its `ragged_dot` (megablox
run through one emit_pipeline kernel) and its `dot_product_attention` (its splash fork,
compact causal grid), each at the config tokamax picks for the case and at a larger tiling.
tokamax needs packages outside the main lock, so those children run in `.venv-tokamax`
(requirements-tokamax.txt: the same jax 0.10.2 and libtpu 0.0.42.1).

What the estimator is shown (it reads every SMEM / scalar-prefetch value as 0):

  * gmm: group metadata (group_offsets, group_ids, m_tile_ids) and the number of active
    tiles come from `make_group_metadata` at run time. Here the tile count is a static grid
    size and every read of the metadata, in the kernel body and the index maps, yields
    max(value, closed form of balanced routing) (equal on hardware; `gmm_closed_form` is
    checked against megablox's own make_group_metadata with concrete group sizes).
  * splash: its mask info (data_next, block_mask) is scalar prefetch: reads yield
    max(value, closed form of the causal mask) (checked against `process_mask`).
  * paged_attention: its loop count is lax.div(length + bk - 1, bk) of an SMEM length,
    which the estimator mis-evaluates for any run-time value, so the length is made static
    (the kernel reads the case's context length as a constant: a static-length variant);
    page-table reads yield max(value, identity table).
  * ragged_paged_attention: its loops run over SMEM values (num_seqs, cu_q_lens,
    kv_lens), so they become static loops with the batch's trip counts (a static-length
    variant, see `RaggedPagedAnchor`).
  * tokamax gmm: as megablox's, through its emit_pipeline call (the active-tile count
    becomes a static grid size).
  * tokamax attention: its six SMEM block lists become closed forms of the causal list
    (see `TokamaxAttentionAnchor`).

All substitutions patch the kernel module's `pl` (its pallas_call) while tracing, in a
subprocess (`--child`) that sets the profile flag for itself; nothing here sets
LIBTPU_INIT_ARGS at import. Big grids are rated truncated and extrapolated (see each
anchor's `method`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import types
from pathlib import Path
from typing import Callable
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "kernels"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import headline  # noqa: E402
import tuning  # noqa: E402

JAX_VERSION = None   # filled lazily (jax is imported only when needed)


def _module(name: str):
  """jax.experimental.pallas.ops.tpu.<name> as a module (packages re-export functions under
  their modules' names, e.g. megablox.gmm)."""
  import importlib
  return importlib.import_module(f"jax.experimental.pallas.ops.tpu.{name}")


def _jax():
  import jax
  global JAX_VERSION
  JAX_VERSION = jax.__version__
  return jax


@dataclasses.dataclass(frozen=True)
class Anchor:
  case: str            # headline case name, exactly headline.HEADLINE[i].name
  implementation: str  # e.g. "jax megablox gmm (jax 0.10.2, tiling 512x1024x1024)"
  rate: Callable[[str], dict]   # chip -> partial row


# ----------------------------------------------------------------------------------------
# Generic pieces: HBM replay, visible scalar prefetch, compiling in a child process.


def replay(steps, blocks) -> int:
  """Bytes moved by a grid: for each (name, index_fn, nbytes) in blocks, a block is
  fetched (or written back) whenever index_fn(step) differs from the previous step's."""
  moved, last = 0, {}
  for step in steps:
    for name, index_fn, nbytes in blocks:
      index = index_fn(*step)
      if last.get(name, None) != index:
        moved += nbytes
        last[name] = index
  return moved


class Visible:
  """A scalar-prefetch ref whose reads yield max(ref[idx], closed_form(idx)) ("max") or
  the closed form alone ("const", a static-value variant)."""

  def __init__(self, ref, closed_form, mode="max"):
    self.ref, self.closed_form, self.mode = ref, closed_form, mode

  @property
  def shape(self):
    return self.ref.shape

  @property
  def dtype(self):
    return self.ref.dtype

  def __getitem__(self, idx):
    import jax.numpy as jnp
    want = self.closed_form(*(idx if isinstance(idx, tuple) else (idx,)))
    if self.mode == "const":
      return want
    return jnp.maximum(self.ref[idx].astype(jnp.int32), jnp.asarray(want, jnp.int32))


def _visible_grid_spec(kernel, grid_spec, closed_forms, grid=None):
  """(kernel, grid_spec) whose scalar-prefetch refs (a pytree matching the first
  num_scalar_prefetch operands; a leaf is None (untouched), a function (max(value, f(idx)))
  or ("const", f)) are wrapped in the kernel body and in every index map. `grid`, if given,
  replaces the grid (e.g. a static visit count)."""
  jax = _jax()
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import tpu as pltpu

  def wrap(prefetch):
    def leaf(ref, form):
      if form is None:
        return ref
      if isinstance(form, tuple):
        return Visible(ref, form[1], form[0])
      return Visible(ref, form)
    return [jax.tree.map(leaf, r, f, is_leaf=lambda x: x is None or callable(x)
                         or isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str))
            if f is not None else r for r, f in zip(prefetch, closed_forms)]

  nsp = grid_spec.num_scalar_prefetch
  assert nsp == len(closed_forms), (nsp, len(closed_forms))
  new_grid = tuple(grid) if grid is not None else tuple(grid_spec.grid)
  n_grid = len(new_grid)

  def new_spec(spec):
    if not isinstance(spec, pl.BlockSpec) or spec.index_map is None:
      return spec
    index_map = spec.index_map

    def visible_map(*a):
      return index_map(*a[:n_grid], *wrap(a[n_grid:n_grid + nsp]), *a[n_grid + nsp:])
    return dataclasses.replace(spec, index_map=visible_map)

  is_spec = lambda x: isinstance(x, pl.BlockSpec)
  in_specs = jax.tree.map(new_spec, grid_spec.in_specs, is_leaf=is_spec)
  out_specs = jax.tree.map(new_spec, grid_spec.out_specs, is_leaf=is_spec)

  def visible_kernel(*refs, **kw):
    return kernel(*wrap(refs[:nsp]), *refs[nsp:], **kw)
  functools.update_wrapper(visible_kernel, getattr(kernel, "func", kernel))
  spec = pltpu.PrefetchScalarGridSpec(num_scalar_prefetch=nsp, grid=new_grid,
                                      in_specs=in_specs, out_specs=out_specs,
                                      scratch_shapes=grid_spec.scratch_shapes)
  return visible_kernel, spec


@contextlib.contextmanager
def visible_prefetch(module, closed_forms, grid=None):
  """While active, `module.pl.pallas_call` sees its scalar prefetch through
  `_visible_grid_spec(..., closed_forms, grid)`."""
  from jax.experimental import pallas as pl

  def pallas_call(kernel, *args, grid_spec=None, **kwargs):
    kernel, grid_spec = _visible_grid_spec(kernel, grid_spec, closed_forms, grid)
    return pl.pallas_call(kernel, *args, grid_spec=grid_spec, **kwargs)

  view = types.SimpleNamespace(**{n: getattr(pl, n) for n in dir(pl) if not n.startswith("__")})
  view.pallas_call = pallas_call
  with mock.patch.object(module, "pl", view):
    yield


@contextlib.contextmanager
def target_chip(chip: str):
  """Pallas asks the local device for the TPU generation while lowering some kernels
  (`pl.cdiv` of a traced value lowers through lax.sign, whose rule does; emit_pipeline's
  DMA tiling does); the host here is a CPU: answer for the target chip."""
  import importlib
  from jax._src.pallas.mosaic import tpu_info
  version = {"v5e": tpu_info.ChipVersion.TPU_V5E, "v6e": tpu_info.ChipVersion.TPU_V6E,
             "v5p": tpu_info.ChipVersion.TPU_V5P}[chip]   # v5p: calibration.py's tokamax rows
  # jax 0.10: _get_tpu_info_impl; jax 0.12 names it get_tpu_info_for_chip.
  for_chip = getattr(tpu_info, "get_tpu_info_for_chip", None) or tpu_info._get_tpu_info_impl
  modules = [tpu_info]
  try:   # jax 0.12 also has jax._src.tpu_info, which pipeline tiling asks directly
    modules.append(importlib.import_module("jax._src.tpu_info"))
  except ImportError:
    pass
  with contextlib.ExitStack() as stack:
    for module in modules:
      stack.enter_context(mock.patch.object(module, "get_tpu_info",
                                            lambda: for_chip(version, 1)))
    yield


def _kernel_cycles(hlo_text: str) -> tuple[int, int]:
  """(sum of the Mosaic kernels' estimated cycles, number of Mosaic kernels)."""
  from tpu_kernels import aot
  cycles = aot.mosaic_kernel_cycles(hlo_text)
  return sum(cycles), len(cycles)


def _compile(fn, specs, chip: str):
  jax = _jax()
  from tpu_kernels import aot
  device = aot.topology_device(chip)
  specs = [aot._on_device(s, device) for s in specs]
  return jax.jit(fn).trace(*specs).lower().compile()


# Per child (one truncation of one anchor); ANCHOR_CHILD_TIMEOUT_S raises it. jax's RPA at
# ctx 32768 on v5e, retried with VMEM memory-space assignment off (tuning.run_child), timed
# out at 600 s; given 2400 it runs a 24 GB machine out of memory instead (2026-12-05).
CHILD_TIMEOUT_S = int(os.environ.get("ANCHOR_CHILD_TIMEOUT_S", "600"))


def _child(key: str, chip: str, trunc, profile: bool = True) -> dict:
  """Compiles anchor `key` truncated to `trunc` for `chip` with the static profile on, in a
  subprocess (the estimator may abort the process). Returns {cycles, kernels, seconds,
  peak_rss_mb}."""
  start = time.time()
  python = getattr(_SPECS()[key], "python", None)
  if python is not None and not Path(python).exists():
    raise RuntimeError(f"{python} is missing: scripts/setup.sh makes it")
  env = tuning.child_env(ANCHOR_STATIC_PROFILE="1" if profile else "0")
  if python is not None:   # another environment loads its own libtpu, not the one jax set here
    env.pop("TPU_LIBRARY_PATH", None)
  rows, error = tuning.run_child(
      __file__, ["--child", key, chip, json.dumps(trunc)], timeout=CHILD_TIMEOUT_S,
      env=env, python=python)
  if error:
    raise RuntimeError(f"child {error} ({key} {chip} {trunc})")
  out = rows[-1]
  out["wall_s"] = round(time.time() - start, 1)
  return out


def _child_main(key: str, chip: str, trunc_json: str) -> None:
  import resource
  spec = _SPECS()[key]
  trunc = json.loads(trunc_json)
  start = time.time()
  with lowering(spec, chip):
    fn, specs = spec.build(trunc, chip)
    compiled = _compile(fn, specs, chip)
  text = compiled.as_text()
  if os.environ.get("ANCHOR_STATIC_PROFILE", "1") == "1":
    cycles, count = _kernel_cycles(text)
  else:
    cycles, count = None, text.count('custom_call_target="tpu_custom_call"')
  tuning.print_row(dict(cycles=cycles, kernels=count, seconds=round(time.time() - start, 1),
                        peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))


def lowering(spec, chip: str):
  """The context an anchor is built and compiled in (most need none)."""
  return spec.lowering(chip) if hasattr(spec, "lowering") else contextlib.nullcontext()


def _row_base(spec) -> dict:
  return dict(compiled=False, error=None, estimated_cycles=None, hbm_bytes=None,
              method=spec.method, note=spec.note, config=spec.config())


def method_with_retries(method: str, truncated: list[dict]) -> str:
  """`method`, plus the note of `tuning.run_child`'s v5e retry where a truncation needed it
  (its cycles then come from a compile with XLA's VMEM memory-space assignment off)."""
  retried = [t for t in truncated if "estimator_retry" in t]
  if not retried:
    return method
  where = "" if len(retried) == len(truncated) else \
      f" (at {len(retried)} of its {len(truncated)} truncations)"
  return f"{method}; {retried[0]['estimator_retry']}{where}"


def _rate(spec, chip: str) -> dict:
  """Shared driver: validate, compile the truncations in children, extrapolate."""
  from tpu_kernels import chips
  row = _row_base(spec)
  try:
    row["hbm_bytes"] = spec.hbm_bytes()
    c = chips.get_chip(chip)
    row.update(spec.hand(c))
    spec.validate()
    results = {json.dumps(t): _child(spec.key, chip, t) for t in spec.truncations}
  except Exception as e:  # noqa: BLE001  (a failed anchor is a row, not a crash)
    msg = str(e).strip().splitlines()
    row["error"] = f"{type(e).__name__}: {msg[0][:400] if msg else ''}"
    if "child exit" in str(e):   # did the plain compile (no static profile) succeed?
      try:
        _child(spec.key, chip, spec.truncations[0], profile=False)
        row["compiled"] = True
        row["error"] = "plain AOT compile succeeds; the static estimator aborts: " + row["error"]
      except Exception:  # noqa: BLE001
        pass
    return row
  row["truncated"] = [dict(trunc=json.loads(t), **r) for t, r in results.items()]
  row["method"] = method_with_retries(row["method"], row["truncated"])
  row["compiled"] = True
  if any(r["kernels"] == 0 for r in results.values()):
    row["error"] = "no Mosaic kernel in the compiled program"
    return row
  if any(r["cycles"] == 0 for r in results.values()):
    row["error"] = "the estimator rated the kernel 0 cycles"
    return row
  cycles = spec.extrapolate({t: r["cycles"] for t, r in results.items()})
  row["estimated_cycles"] = int(round(cycles))
  return row


# ----------------------------------------------------------------------------------------
# megablox gmm


def _log2(x: int) -> int:
  assert x > 0 and x & (x - 1) == 0, f"{x} is not a power of two"
  return x.bit_length() - 1


def _divisor_tile(dim: int, target: int) -> int:
  """The largest multiple of 128 <= target that divides dim (dim itself if dim <= target)."""
  if dim <= target:
    return dim
  for t in range(target - target % 128, 127, -128):
    if dim % t == 0:
      return t
  raise ValueError(f"no 128-multiple tile <= {target} divides {dim}")


@dataclasses.dataclass(frozen=True)
class GmmClosedForm:
  """megablox make_group_metadata for balanced routing: m = groups * rows, powers of two;
  with total_groups > groups, the groups past the first `groups` are empty (not visited)."""

  m: int
  groups: int
  tm: int
  total_groups: int | None = None

  @property
  def rows(self) -> int:
    return self.m // self.groups

  @property
  def num_tiles(self) -> int:
    return self.groups if self.rows <= self.tm else self.m // self.tm

  def group_offset(self, g):
    if not self.total_groups:
      return g * self.rows
    import jax.numpy as jnp   # g: int, numpy or traced
    return jnp.minimum(g, self.groups) * self.rows

  def group_id(self, v):
    return v if self.rows <= self.tm else v >> _log2(self.rows // self.tm)

  def m_tile_id(self, v):
    return (v * self.rows) >> _log2(self.tm) if self.rows <= self.tm else v

  def check(self, make_group_metadata=None) -> None:
    """Equals megablox's make_group_metadata (or the given one, of the same signature) with
    concrete balanced group sizes."""
    import numpy as np
    jax = _jax()
    import jax.numpy as jnp
    make_group_metadata = make_group_metadata or _module("megablox.gmm").make_group_metadata
    assert self.rows * self.groups == self.m
    _log2(self.rows), _log2(self.tm)
    total = self.total_groups or self.groups
    sizes = jnp.zeros((total,), jnp.int32).at[:self.groups].set(self.rows)
    (offsets, gids, mtiles), num = jax.jit(lambda s: make_group_metadata(
        group_sizes=s, m=self.m, tm=self.tm, start_group=jnp.int32(0),
        num_nonzero_groups=total, visit_empty_groups=False))(sizes)
    v, g = np.arange(self.num_tiles), np.arange(total + 1)
    assert int(num) == self.num_tiles, (int(num), self.num_tiles)
    np.testing.assert_array_equal(np.asarray(offsets), self.group_offset(g))
    np.testing.assert_array_equal(np.asarray(gids)[:self.num_tiles], self.group_id(v))
    np.testing.assert_array_equal(np.asarray(mtiles)[:self.num_tiles], self.m_tile_id(v))


GMM_TRUNCATED_VISITS = (4, 8)


def _tile(dim: int, target: int) -> int:
  """_divisor_tile, or `target` (a masked last block) when no 128-multiple divides dim
  (gpt-oss's 2880 = 2^6 * 45)."""
  try:
    return _divisor_tile(dim, target)
  except ValueError:
    return target


@dataclasses.dataclass(frozen=True)
class GmmAnchor:
  m: int
  part: str
  tiling_name: str          # "default" or "512x1024x1024"
  groups: int = 128
  model: str = "Qwen3-30B-A3B"        # one of headline.MOE_MODELS (groups: its experts)
  weight_dtype: str = "bfloat16"      # tokamax only: int8 / float8_e4m3fn weights

  @property
  def case(self):
    if (self.model, self.weight_dtype) == ("Qwen3-30B-A3B", "bfloat16"):
      return headline.GroupedMatmul(self.m, self.part, groups=self.groups)
    case = headline.GroupedMatmul.of(self.model, self.m, self.part, self.weight_dtype)
    assert case.groups == self.groups, (case, self.groups)
    return case

  @property
  def key(self) -> str:
    extra = "" if (self.model, self.weight_dtype) == ("Qwen3-30B-A3B", "bfloat16") else \
        f":{self.model}:{self.weight_dtype}"
    return f"gmm:{self.m}:{self.part}:{self.tiling_name}:{self.groups}{extra}"

  @property
  def tiling(self) -> tuple[int, int, int]:
    c = self.case
    if self.tiling_name == "default":
      return (128, 128, 128)   # gmm's default tiling argument
    tm, tk, tn = (int(x) for x in self.tiling_name.split("x"))
    return (min(tm, self.m), _tile(c.k, tk), _tile(c.n_weight, tn))

  @property
  def closed_form(self) -> GmmClosedForm:
    c = self.case
    if c.active_groups < self.groups:   # decode: fewer rows than experts
      return GmmClosedForm(self.m, c.active_groups, self.tiling[0], self.groups)
    return GmmClosedForm(self.m, self.groups, self.tiling[0])

  @property
  def implementation(self) -> str:
    tm, tk, tn = self.tiling
    label = "default tiling" if self.tiling_name == "default" else "tiling"
    return f"jax megablox gmm (jax {_jax().__version__}, {label} {tm}x{tk}x{tn})"

  truncations = tuple([v] for v in GMM_TRUNCATED_VISITS)

  @property
  def method(self) -> str:
    return (f"static estimate of the gmm kernel at {GMM_TRUNCATED_VISITS[0]} and "
            f"{GMM_TRUNCATED_VISITS[1]} active m-tiles (static grid, metadata made visible), "
            f"extrapolated linearly to {self.closed_form.num_tiles}")

  @property
  def note(self) -> str:
    extra = (" gate_up: plain matmul to [m, 1536]; silu(gate) * up is not fused in gmm "
             "(its extra elementwise pass, ~m*1536*2*2 + m*768*2 bytes, is not counted)."
             if self.part.startswith("gate_up") else "")
    return ("Balanced routing (m / 128 rows per expert); rhs in gmm's [G, k, n] layout; "
            "bf16 output (preferred_element_type=bf16); the XLA ops of make_group_metadata "
            "are not rated (the metadata is an input)." + extra)

  def config(self) -> dict:
    tm, tk, tn = self.tiling
    cf = self.closed_form
    return dict(tm=tm, tk=tk, tn=tn, m=self.m, k=self.case.k, n=self.case.n_weight,
                groups=self.groups, active_tiles=cf.num_tiles, transpose_rhs=False)

  def validate(self) -> None:
    self.closed_form.check()

  def build(self, trunc, chip: str = "v6e"):
    (visits,) = trunc
    jax = _jax()
    import jax.numpy as jnp
    G = _module("megablox.gmm")
    c, cf = self.case, self.closed_form
    m, k, n = self.m, c.k, c.n_weight
    num_meta = m // self.tiling[0] + self.groups - 1
    forms = ((cf.group_offset, cf.group_id, cf.m_tile_id), None)

    def fn(lhs, rhs, offsets, gids, mtiles):
      metadata = lambda **kw: ((offsets, gids, mtiles), visits)
      with visible_prefetch(G, forms), mock.patch.object(G, "make_group_metadata", metadata):
        return G.gmm(lhs, rhs, jnp.zeros((self.groups,), jnp.int32),
                     preferred_element_type=jnp.bfloat16, tiling=self.tiling)

    S = jax.ShapeDtypeStruct
    return fn, [S((m, k), jnp.bfloat16), S((self.groups, k, n), jnp.bfloat16),
                S((self.groups + 1,), jnp.int32), S((num_meta,), jnp.int32),
                S((num_meta,), jnp.int32)]

  def extrapolate(self, cycles: dict) -> float:
    (v1, v2) = GMM_TRUNCATED_VISITS
    k1, k2 = cycles[json.dumps([v1])], cycles[json.dumps([v2])]
    return k1 + (k2 - k1) / (v2 - v1) * (self.closed_form.num_tiles - v1)

  def hbm_bytes(self, visits: int | None = None) -> int:
    c, cf = self.case, self.closed_form
    tm, tk, tn = self.tiling
    n_tiles, k_tiles = -(-c.n_weight // tn), -(-c.k // tk)
    visits = cf.num_tiles if visits is None else visits
    steps = ((j, v, kk) for j in range(n_tiles) for v in range(visits) for kk in range(k_tiles))
    blocks = [
        ("lhs", lambda j, v, kk: (cf.m_tile_id(v), kk), tm * tk * 2),
        ("rhs", lambda j, v, kk: (cf.group_id(v), kk, j),
         tk * tn * headline.ITEMSIZE[c.weight_dtype]),
        ("out", lambda j, v, kk: (cf.m_tile_id(v), j), tm * tn * 2)]
    if c.quantized:   # its (G, 1, n) scale, repeated to an (8, tn) f32 block (quant_block_spec)
      blocks.append(("scale", lambda j, v, kk: (cf.group_id(v), j), 8 * tn * 4))
    return replay(steps, blocks)

  def hand(self, chip) -> dict:
    """Every active tile is a full tm-row matmul over all of k and n (rows of other groups
    are computed and masked); weights of a new group are fetched per visit."""
    c, cf = self.case, self.closed_form
    tm = self.tiling[0]
    mxu_flops = 2 * tm * c.k * c.n_weight * cf.num_tiles
    hand_us = max(mxu_flops / chip.bf16_flops_per_s,
                  self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6
    return dict(hand_mxu_flops=mxu_flops, hand_us=hand_us,
                hand_count=f"{cf.num_tiles} tiles x 2*{tm}*{c.k}*{c.n_weight} flops at peak "
                           f"vs replayed bytes at HBM bandwidth")


# ----------------------------------------------------------------------------------------
# tokamax ragged_dot (its Pallas Mosaic TPU megablox), in its own environment


# The tokamax each JAX stack rates, and the environment it runs in: the main stack (jax 0.10)
# rates 0.0.12 (requirements-tokamax.txt); the TorchTPU stack (jax 0.12, anchors.py run from
# .venv-jax012) rates 0.0.17, the release that binds to TorchTPU and needs jax >= 0.11.1
# (requirements-tokamax-jax012.txt). Both pin the same jax and libtpu as their stack.
TOKAMAX_ENVIRONMENTS = {"0.10": ("0.0.12", ".venv-tokamax"),
                        "0.12": ("0.0.17", ".venv-tokamax-jax012")}


def tokamax_environment() -> tuple[str, Path]:
  """(tokamax version, its python) for this process's jax."""
  stack = ".".join(_jax().__version__.split(".")[:2])
  if stack not in TOKAMAX_ENVIRONMENTS:
    raise RuntimeError(f"no tokamax environment for jax {_jax().__version__}")
  version, venv = TOKAMAX_ENVIRONMENTS[stack]
  return version, ROOT / venv / "bin" / "python"


class _Tokamax:
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
    return target_chip(chip)   # emit_pipeline / its lowering ask for the TPU generation


@dataclasses.dataclass(frozen=True)
class TokamaxGmmAnchor(_Tokamax, GmmAnchor):
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
        f", {headline.WEIGHT_TAG[self.weight_dtype]} weights (qwix QArray)"
    return (f"tokamax ragged_dot mosaic_tpu (tokamax {self.tokamax_version}, jax "
            f"{_jax().__version__}, {label} {tm}x{tk}x{tn}{quant})")

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
    jax = _jax()
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
      kernel, grid_spec = _visible_grid_spec(kernel, grid_spec, forms)
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


# ----------------------------------------------------------------------------------------
# flash attention (jax) and splash attention


def _causal_rows(nq_rows: int, nk: int, first_row: int = 0) -> tuple[int, int]:
  """(blocks on or below the diagonal, steps) of rows first_row.. of a square causal grid."""
  run = sum(min(i + 1, nk) for i in range(first_row, first_row + nq_rows))
  return run, nq_rows * nk


class _AttentionCase:
  """What the attention anchors share: the case they rate (the causal headline case of
  length `seq`, or `joint`, a non-causal headline.JointAttention), and the length their
  kernels run at. jax's flash and splash and tokamax all need a block multiple, so a
  caller pads S to `padded_seq` and the anchor is rated on the padded full grid: the
  padded rows and keys count as work, the mask that would hide the padded keys (one
  partial kv block a row) is not rated (a lower bound on their cost), and the pad / slice
  copies' bytes are counted (`pad_copy_bytes`, as for ours)."""

  @property
  def case(self):
    return self.joint if self.joint is not None else headline.Attention(self.seq)

  @property
  def causal(self) -> bool:
    return self.case.causal

  @property
  def padded_seq(self) -> int:
    return -(-self.case.seq // self.block) * self.block

  @property
  def nq(self) -> int:
    return self.padded_seq // self.block

  @property
  def total_heads(self) -> int:
    return self.case.batch * self.case.q_heads

  @property
  def key_suffix(self) -> str:
    return "" if self.joint is None else f":joint:{self.joint.model}"

  def pad_copy_bytes(self) -> int:
    """q padded and out sliced back (each reads one length, writes the other), k and v
    padded: 0 when S is a block multiple."""
    c, s = self.case, self.padded_seq
    if s == c.seq:
      return 0
    return 2 * (c.seq + s) * c.batch * (c.q_heads + c.kv_heads) * c.head_dim * 2

  @property
  def ragged_note(self) -> str:
    if self.padded_seq == self.case.seq:
      return ""
    return (f" S={self.case.seq} is not a multiple of {self.block} (the kernel needs one): "
            f"rated padded to {self.padded_seq} with a full mask (padded rows and keys "
            "computed; the mask hiding the padded keys, one partial kv block a row, not "
            "rated: a lower bound), pad / slice copies' bytes counted.")

  def heads_text(self) -> str:
    c = self.case
    return f"{self.total_heads} heads" if c.batch == 1 else \
        f"{self.total_heads} heads (B={c.batch} x {c.q_heads})"


@dataclasses.dataclass(frozen=True)
class AttentionAnchor(_AttentionCase):
  seq: int
  kind: str                 # "flash" or "splash"
  block: int = 128          # block_q = block_k(v) (both anchors' defaults: 128)
  joint: headline.JointAttention | None = None   # a non-causal case instead of Attention(seq)

  @property
  def key(self) -> str:
    return f"attn:{self.kind}:{self.seq}:{self.block}{self.key_suffix}"

  @property
  def implementation(self) -> str:
    b, c = self.block, self.case
    if self.kind == "flash":
      repeat = (f", k/v repeated to {c.q_heads} heads" if c.kv_heads != c.q_heads else "")
      return (f"jax flash_attention (jax {_jax().__version__}, blocks q/k_major/k "
              f"{b}/{b}/{b}{repeat})")
    mha = "MHA-GQA" if c.kv_heads != c.q_heads else "MHA"
    return f"jax splash attention {mha} (jax {_jax().__version__}, block_q/kv {b}/{b})"

  # Truncations: [heads, blocks]: the causal self-attention of `blocks` blocks (q and kv
  # both blocks * block long, the full square grid). One head rates differently from
  # several (flash v6e at S=4096: 1 head 500,252 cycles, 2 heads 863,510, 4 heads 1,726,486 =
  # exactly twice 2 heads; v5e: 588,210 / 759,966 / 1,519,390), so heads are extrapolated
  # from 2 and 4. Small grids (<= 1024 steps a head): the case itself at 2 and 4 heads.
  # Large (S=32768): 2 heads at SHORT_BLOCKS blocks (S = 8, 16, 32 blocks), fitted as
  # a + b * n + c * n^2 in the block count n (one row per q block, n steps a row, of which
  # n (n + 1) / 2 compute), evaluated at the case's n, times 16 for 32 heads. An earlier fit
  # of the first 2, 4 and 8 q-block rows against the full kv length rated splash at half
  # its cycles: the first rows' few computed tiles rate cheaper than later rows' (jax 0.12
  # splash, blocks 512, S=16384, 2 heads, v6e: 1,207,602 fitted vs 1,626,135 direct).
  SHORT_BLOCKS = (8, 16, 32)

  @property
  def small(self) -> bool:
    return self.nq * self.nq <= 1024

  @property
  def truncations(self):
    if self.small:
      return ([2, self.nq], [4, self.nq])
    return tuple([2, n] for n in self.SHORT_BLOCKS)

  @property
  def method(self) -> str:
    heads = self.heads_text()
    if self.small:
      return ("static estimate at 2 and 4 heads (all q blocks), extrapolated linearly to "
              f"{heads}")
    lengths = "/".join(str(n * self.block) for n in self.SHORT_BLOCKS)
    grid = "causal" if self.causal else "non-causal (full)"
    return (f"static estimate of 2 heads at S={lengths} (the whole {grid} grid of 8, 16 and "
            f"32 blocks), fitted as a + b*n + c*n^2 in the block count n, evaluated at "
            f"n={self.nq}, times {self.total_heads // 2} for {heads} (checked for jax 0.12 "
            "splash, blocks 512, v6e: 6,408,721 fitted vs 6,406,161 cycles rated directly at "
            "S=32768, 2 heads)")

  @property
  def note(self) -> str:
    if not self.causal:   # the Diffusers shapes: MHA, full mask
      if self.kind == "flash":
        return ("[B, H, S, D] layout (the transposes from [B, S, H, D] are not counted); "
                "causal=False: every grid step computes." + self.ragged_note)
      return ("splash MHA kernel with a full mask (FullMask); mask info (data_next, "
              "block_mask) made visible as max(value, closed form: j, 2); the kernel "
              "computes p @ v in f32 (its own choice); [H, S, D] layout (transposes not "
              "counted)." + self.ragged_note)
    if self.kind == "flash":
      return ("flash_attention has no GQA: rated on k/v with all 32 heads (a caller repeats "
              "them first; the repeat's bytes, read 8 heads + write 32, are in hbm_bytes, its "
              "cycles are not); "
              "[B, H, S, D] layout (the transposes from the headline's [B, S, H, D] are not "
              "counted); blocks above the diagonal are grid steps with the compute skipped.")
    return ("splash MHA kernel with 8 kv heads (GQA through its h // 4 index map); mask info "
            "(data_next, block_mask) made visible as max(value, causal closed form); the "
            "kernel computes p @ v in f32 (its own choice); [H, S, D] layout (transposes not "
            "counted); blocks above the diagonal are grid steps with the compute skipped.")

  def config(self) -> dict:
    b, c = self.block, self.case
    if self.kind == "flash":   # k / v repeated to every query head
      return dict(block_q=b, block_k_major=b, block_k=b, block_b=1, layout="BHSD",
                  kv_heads_in_kernel=c.q_heads)
    return dict(block_q=b, block_kv=b, block_kv_compute=b, layout="HSD",
                kv_heads_in_kernel=c.kv_heads, downcast_smem_data=True)

  # Splash's mask info for a causal mask (rows = the first `rows` q blocks, full kv), or
  # for a full mask (non-causal: every block full, data_next = j):
  def block_mask(self, i, j):
    import jax.numpy as jnp
    if not self.causal:
      return 2 if isinstance(i, int) else jnp.full(jnp.shape(i), 2, jnp.int32)
    return jnp.where(j < i, 2, jnp.where(j == i, 1, 0)) if not isinstance(i, int) else \
        (2 if j < i else 1 if j == i else 0)

  def data_next(self, i, j):
    import jax.numpy as jnp
    if not self.causal:
      return j
    return jnp.where(j <= i, j, 0) if not isinstance(i, int) else (j if j <= i else 0)

  def splash_mask(self, sq: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as M
    return (M.CausalMask if self.causal else M.FullMask)((sq, sq))

  def _splash_mask_info(self, blocks: int):
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as M, splash_attention_mask_info as MI)
    mask = M.MultiHeadMask([self.splash_mask(blocks * self.block)])
    info, _ = MI.process_mask(mask, (self.block, self.block), shrink_grid=False)
    return info

  def validate(self) -> None:
    if self.kind != "splash":
      return
    for blocks in sorted({t[1] for t in self.truncations}):   # every grid the child builds
      self._check_mask_info(blocks)

  def _check_mask_info(self, blocks: int) -> None:
    import numpy as np
    info = self._splash_mask_info(blocks)
    i, j = np.meshgrid(np.arange(blocks), np.arange(blocks), indexing="ij")
    want_mask = np.vectorize(self.block_mask)(i, j)
    want_next = np.vectorize(self.data_next)(i, j)
    np.testing.assert_array_equal(np.asarray(info.block_mask)[0], want_mask)
    np.testing.assert_array_equal(np.asarray(info.data_next)[0], want_next)
    assert info.mask_next is None and info.partial_mask_blocks is None

  def build(self, trunc, chip: str = "v6e"):
    heads, blocks = trunc
    jax = _jax()
    import jax.numpy as jnp
    c, b = self.case, self.block
    sq = blocks * b
    S = jax.ShapeDtypeStruct
    scale = 1.0 / math.sqrt(c.head_dim)
    if self.kind == "flash":
      F = _module("flash_attention")

      def fn(q, k, v):   # k / v already repeated to every head (see the module docstring)
        return F.flash_attention(q, k, v, causal=self.causal, sm_scale=scale,
                                 block_sizes=F.BlockSizes(block_q=b, block_k_major=b,
                                                          block_k=b, block_b=1))
      return fn, [S((1, heads, sq, c.head_dim), jnp.bfloat16)] * 3
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as K, splash_attention_mask as M,
        splash_attention_mask_info as MI)
    kv_heads = max(1, heads * c.kv_heads // c.q_heads)
    mask = M.MultiHeadMask([self.splash_mask(sq)] * heads)
    # The square causal grid keeps its skipped steps (above the diagonal), as the case's does.
    process = functools.partial(MI.process_mask, shrink_grid=False)
    with mock.patch.object(K.mask_info_lib, "process_mask", process):
      kernel = K.make_splash_mha(mask, head_shards=1, q_seq_shards=1,
                                 downcast_smem_data=os.environ.get("SPLASH_DOWNCAST", "1") == "1",
                                 block_sizes=K.BlockSizes(block_q=b, block_kv=b,
                                                          block_kv_compute=b))
    forms = (lambda h, i, j: self.data_next(i, j), lambda h, i, j: self.block_mask(i, j), None)

    def fn(q, k, v):
      with visible_prefetch(K, forms):
        return kernel(q, k, v)   # (1/sqrt(D) folded into q by the caller: not rated)
    return fn, [S((heads, sq, c.head_dim), jnp.bfloat16),
                S((kv_heads, sq, c.head_dim), jnp.bfloat16),
                S((kv_heads, sq, c.head_dim), jnp.bfloat16)]

  def extrapolate(self, cycles: dict) -> float:
    H = self.total_heads
    if self.small:
      c2, c4 = cycles[json.dumps([2, self.nq])], cycles[json.dumps([4, self.nq])]
      return c2 + (c4 - c2) / 2 * (H - 2)
    return H / 2 * self.fit_blocks(cycles)

  def fit_blocks(self, cycles: dict) -> float:
    """Solve a + b*n + c*n^2 through the three short lengths (one head count); evaluate at
    the case's block count."""
    import numpy as np
    ns = [json.loads(t)[1] for t in cycles]
    A = np.array([[1.0, n, n * n] for n in ns])
    y = np.array([cycles[json.dumps([2, n])] for n in ns], dtype=float)
    coef = np.linalg.solve(A, y)
    return float(coef @ [1.0, self.nq, self.nq ** 2])

  def hbm_bytes_head(self, nq_rows: int | None = None) -> int:
    """Bytes one head's grid moves (replay of (q row, kv col) through the index maps)."""
    b, d = self.block, self.case.head_dim
    nq = self.nq if nq_rows is None else nq_rows
    blk = b * d * 2
    steps = ((i, j) for i in range(nq) for j in range(self.nq))
    if self.kind == "flash":   # kv index: j on or below the diagonal, else 0 (causal)
      kv = lambda i, j: j if j <= i or not self.causal else 0
    else:                      # splash: data_next
      kv = lambda i, j: self.data_next(i, j)
    return replay(steps, [("q", lambda i, j: i, blk), ("k", kv, blk), ("v", kv, blk),
                          ("o", lambda i, j: i, blk)])

  def hbm_bytes(self) -> int:
    """All heads: every head starts with new q / o / kv blocks (the head is part of each
    block index, and j restarts at 0), so heads x one head's replay."""
    c = self.case
    total = self.total_heads * self.hbm_bytes_head()
    if self.kind == "flash" and c.kv_heads != c.q_heads:   # the k / v repeat: read 8 heads,
      total += 2 * (c.kv_heads + c.q_heads) * self.seq * c.head_dim * 2   # write 32, k and v
    return total + self.pad_copy_bytes()

  def hand(self, chip) -> dict:
    c = self.case
    run, steps = (_causal_rows(self.nq, self.nq) if self.causal else
                  (self.nq * self.nq,) * 2)
    heads = self.total_heads
    mxu = heads * run * 4 * self.block * self.block * c.head_dim
    if self.kind == "splash":   # p @ v in f32: count it at 1/3 of bf16 MXU rate (3 passes)
      mxu_equiv = heads * run * 2 * self.block ** 2 * c.head_dim * (1 + 3)
    else:
      mxu_equiv = mxu
    hand_us = max(mxu_equiv / chip.bf16_flops_per_s,
                  self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6
    blocks = "diagonal-or-below" if self.causal else "(all)"
    return dict(hand_mxu_flops=mxu, hand_us=hand_us,
                hand_count=f"{heads} heads x {run} {blocks} {self.block}^2 blocks x "
                           f"4*{self.block}^2*{c.head_dim} flops at bf16 peak"
                           + (" (p@v in f32 counted as 3 bf16 passes)"
                              if self.kind == "splash" else "")
                           + f"; {steps} grid steps per head")


# ----------------------------------------------------------------------------------------
# tokamax attention (its splash fork, compact causal grid), in its own environment


TOKAMAX_ROWS = (2, 4, 8)        # q-block rows of the truncated grids (2 heads each)
TOKAMAX_ROW_COMPARES = 7        # every truncation's row closed form does this many compares


def triangle_row(g, compares: int):
  """The row of grid index g (jnp or int) in a row-major list of a square grid's
  on-or-below-diagonal blocks (row i holds i + 1 blocks and starts at i (i + 1) / 2), by
  `compares` threshold tests (rows - 1 suffice): no division, which SMEM index maps lack."""
  import jax.numpy as jnp
  thresholds = [t * (t + 1) // 2 for t in range(1, compares + 1)]
  if isinstance(g, int):
    return sum(g >= t for t in thresholds)
  i = jnp.int32(0)
  for t in thresholds:
    i = i + (g >= t).astype(jnp.int32)
  return i


def triangle_col(g, row):
  """The column of grid index g in that list, given its row (triangle_row)."""
  return g - ((row * (row + 1)) >> 1)


@dataclasses.dataclass(frozen=True)
class TokamaxAttentionAnchor(_AttentionCase, _Tokamax):
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
  joint: headline.JointAttention | None = None   # a non-causal case instead of Attention(seq)

  @property
  def key(self) -> str:
    return f"tokamax-attn:{self.seq}:{self.block}{self.key_suffix}"

  @property
  def implementation(self) -> str:
    b = self.block
    config = "heuristic config" if b == 128 else f"heuristic config with blocks {b}/{b}/{b}"
    return (f"tokamax dot_product_attention mosaic_tpu (tokamax {self.tokamax_version}, jax "
            f"{_jax().__version__}, {config})")

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
    jax = _jax()
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
      with visible_prefetch(K, forms, grid=(heads, active)):
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
      per_head = replay(steps, [("q", lambda i, j: i, blk), ("k", lambda i, j: j, blk),
                                ("v", lambda i, j: j, blk), ("o", lambda i, j: i, blk)])
      return self.total_heads * per_head + self.pad_copy_bytes()
    steps = ((i, j) for i in range(self.nq) for j in range(i + 1))
    per_head = replay(steps, [("q", lambda i, j: i, blk), ("k", lambda i, j: j, blk),
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


# ----------------------------------------------------------------------------------------
# paged attention (jax)


PAGED_TRUNCATED_BATCH = (2, 4)


@dataclasses.dataclass(frozen=True)
class PagedAnchor:
  context: int
  pages_per_compute_block: int = 8

  @property
  def case(self):
    return headline.PagedDecode(self.context)

  @property
  def key(self) -> str:
    return f"paged:{self.context}:{self.pages_per_compute_block}"

  @property
  def implementation(self) -> str:
    return (f"jax paged_attention (jax {_jax().__version__}, pages_per_compute_block "
            f"{self.pages_per_compute_block}, inline_seq_dim)")

  truncations = tuple([b] for b in PAGED_TRUNCATED_BATCH)

  @property
  def method(self) -> str:
    return (f"static estimate at batch {PAGED_TRUNCATED_BATCH[0]} and "
            f"{PAGED_TRUNCATED_BATCH[1]} (static-length variant), extrapolated linearly to 64")

  @property
  def note(self) -> str:
    return ("Static-length variant: the kernel reads the context length as a constant (its "
            "loop count lax.div(length + bk - 1, bk) of an SMEM value is mis-evaluated by the "
            "estimator); page-table reads max(value, identity). Its double-buffer index and "
            "init flag live in SMEM scratch carried across grid steps (the estimator loses "
            "them: each step sees 0). q, k computed in f32 (its own choice). "
            "k/v pages in its [Hkv, pages, page, D] layout.")

  def config(self) -> dict:
    return dict(pages_per_compute_block=self.pages_per_compute_block,
                page_size=self.case.page_size, megacore_mode=None, inline_seq_dim=True,
                block_tokens=self.pages_per_compute_block * self.case.page_size)

  def validate(self) -> None:
    pass

  def build(self, trunc, chip: str = "v6e"):
    (batch,) = trunc
    jax = _jax()
    import jax.numpy as jnp
    import numpy as np
    P = _module("paged_attention.paged_attention_kernel")
    c = self.case
    pages_per_seq = c.context // c.page_size
    total_pages = batch * pages_per_seq
    length = np.int32(c.context)
    forms = (("const", lambda b: length), lambda idx: idx, None, None)

    def fn(q, k_pages, v_pages, page_indices):
      with visible_prefetch(P, forms):
        return P.paged_attention(q, k_pages, v_pages, jnp.full((batch,), c.context, jnp.int32),
                                 page_indices,
                                 pages_per_compute_block=self.pages_per_compute_block)
    S = jax.ShapeDtypeStruct
    return fn, [S((batch, c.q_heads, c.head_dim), jnp.bfloat16),
                S((c.kv_heads, total_pages, c.page_size, c.head_dim), jnp.bfloat16),
                S((c.kv_heads, total_pages, c.page_size, c.head_dim), jnp.bfloat16),
                S((batch, pages_per_seq), jnp.int32)]

  def extrapolate(self, cycles: dict) -> float:
    (b1, b2) = PAGED_TRUNCATED_BATCH
    k1, k2 = cycles[json.dumps([b1])], cycles[json.dumps([b2])]
    return k1 + (k2 - k1) / (b2 - b1) * (self.case.batch - b1)

  def hbm_bytes(self, batch: int | None = None) -> int:
    """Every (sequence, kv head) loads ceil(L / bk) blocks of k and v pages (the next block is
    prefetched once, never twice); q read and o written once; m, l (f32 [B, Hq, 1]) written."""
    c = self.case
    batch = c.batch if batch is None else batch
    bk = self.pages_per_compute_block * c.page_size
    blocks = -(-c.context // bk)
    kv = 2 * batch * c.kv_heads * blocks * bk * c.head_dim * 2
    return kv + 2 * batch * c.q_heads * c.head_dim * 2 + 2 * batch * c.q_heads * 4

  def hand(self, chip) -> dict:
    c = self.case
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=hbm_us, hand_count="k/v pages once at HBM bandwidth (decode is "
                "memory bound: 4*B*Hq*L*D flops are tiny)")


@dataclasses.dataclass(frozen=True)
class RaggedPagedAnchor:
  """jax's ragged_paged_attention on the uniform decode batch, static-length variant.

  The kernel walks the batch with two lax.while_loops whose conditions read SMEM
  (num_seqs, cu_q_lens, kv_lens), which the estimator reads as 0: it would rate one
  empty pass. Here both loops become fori_loops with the trip counts this batch has on
  hardware (outer: the num_queries_per_block sequences of a full q block, one token
  each; inner: ceil(context / (num_kv_pages_per_block * page_size)) kv blocks), and the
  SMEM reads yield the batch's values (kv_lens: the context, cu_q_lens[i]: i, num_seqs:
  the batch; page-table reads max(value, identity)). Rated at the full batch (with static
  loops the grid is only (head blocks, q blocks)); past RPA_MAX_RATED_CONTEXT at two
  shorter contexts, extrapolated linearly in kv blocks (the estimator's memory grows with
  the loop iterations it walks: 32k context passed 21 GB)."""

  context: int
  num_kv_pages_per_block: int = 32
  num_queries_per_block: int = 32

  def vmem_limit_bytes(self, chip: str) -> int | None:
    """The kernel's default (None) where it compiles (v6e); on v5e, whose default scoped
    limit (16 MiB) cannot hold its double-buffered 16 MiB of K/V pages, 64 MiB."""
    return 64 * 2**20 if chip == "v5e" else None

  @property
  def case(self):
    return headline.PagedDecode(self.context)

  @property
  def key(self) -> str:
    return f"rpa:{self.context}:{self.num_kv_pages_per_block}:{self.num_queries_per_block}"

  @property
  def implementation(self) -> str:
    return (f"jax ragged_paged_attention (jax {_jax().__version__}, kv pages / queries per "
            f"block {self.num_kv_pages_per_block} / {self.num_queries_per_block}, static-length "
            f"variant)")

  @property
  def truncations(self):
    c = self.case
    if c.context <= RPA_MAX_RATED_CONTEXT:
      return ([c.batch, c.context],)
    return tuple([c.batch, ctx] for ctx in (RPA_MAX_RATED_CONTEXT // 2, RPA_MAX_RATED_CONTEXT))

  @property
  def method(self) -> str:
    how = "static estimate at the full batch (static-length variant: loops with static trip counts)"
    if self.case.context > RPA_MAX_RATED_CONTEXT:
      how += (f", rated at contexts {RPA_MAX_RATED_CONTEXT // 2} and {RPA_MAX_RATED_CONTEXT} and "
              f"extrapolated linearly in kv blocks to {self.case.context}")
    return how

  @property
  def note(self) -> str:
    return ("Static-length variant: its two while loops over SMEM values become fori loops "
            "with this batch's trip counts, SMEM reads yield the batch's values. K/V fused in "
            "its [pages, page, 2*Hkv, D] layout. Block sizes: jax's tuned table (v5e and "
            "v6e) gives 32 queries and 32 kv pages at 2k context, used at both contexts; at "
            "32k it gives 128 pages, which cannot fit: 64 pages already need 158 MiB of VMEM "
            "with all 32/8 heads on one chip (compile at 4k context). 16 pages rate 1.4x "
            "slower at 2k on v6e.")

  def config(self) -> dict:
    return dict(num_kv_pages_per_block=self.num_kv_pages_per_block,
                num_queries_per_block=self.num_queries_per_block,
                page_size=self.case.page_size,
                vmem_limit_bytes="kernel default on v6e, 64 MiB on v5e")

  def validate(self) -> None:
    c = self.case
    if c.batch % self.num_queries_per_block or c.context % c.page_size:
      raise ValueError("the static trip counts assume full q blocks and whole pages")

  def loop_counts(self, context: int | None = None) -> tuple[int, int]:
    """(outer, inner) trip counts of the kernel's while loops on this batch (at `context`
    tokens, default the case's)."""
    c = self.case
    context = c.context if context is None else context
    return (self.num_queries_per_block,
            -(-context // (self.num_kv_pages_per_block * c.page_size)))

  def build(self, trunc, chip: str = "v6e"):
    batch, context = trunc
    return _rpa_program(self.case, batch, 1, context, self.num_kv_pages_per_block,
                        self.num_queries_per_block, self.vmem_limit_bytes(chip))

  def lowering(self, chip: str):
    """Around tracing and compiling (see `target_chip`)."""
    return target_chip(chip)

  def extrapolate(self, cycles: dict) -> float:
    points = [(self.loop_counts(t[1])[1], cycles[json.dumps(t)]) for t in self.truncations]
    if len(points) == 1:
      return points[0][1]
    (b0, c0), (b1, c1) = points
    return c1 + (c1 - c0) / (b1 - b0) * (self.loop_counts()[1] - b1)

  def hbm_bytes(self) -> int:
    """Each sequence's K/V pages once (its blocks are whole: the context is a multiple of
    the block); q read and o written once."""
    c = self.case
    blocks = self.loop_counts()[1]
    kv = 2 * c.batch * c.kv_heads * blocks * self.num_kv_pages_per_block * c.page_size \
        * c.head_dim * 2
    return kv + 2 * c.batch * c.q_heads * c.head_dim * 2

  def hand(self, chip) -> dict:
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=hbm_us, hand_count="k/v pages once at HBM bandwidth")


RPA_MAX_RATED_CONTEXT = 4096


def _rpa_program(c, num_seqs: int, q_len: int, context: int, pages_per_block: int,
                 queries_per_block: int, vmem_limit_bytes: int | None):
  """(fn, specs): jax's ragged_paged_attention, static-length variant (see
  `RaggedPagedAnchor`), on `num_seqs` sequences of `q_len` new tokens and `context` keys
  each, with `c`'s heads, page size, cache dtype (quantized: scales 1.0) and sliding window.
  Its outer while loop runs once per sequence a q block touches (queries_per_block // q_len
  sequences, at least 1), its inner one over every kv block of the sequence (it skips
  neither causally invisible blocks nor keys before a window)."""
  jax = _jax()
  import jax.numpy as jnp
  import numpy as np
  from jax import lax
  K = _module("ragged_paged_attention.kernel")
  pages_per_seq = context // c.page_size
  counts = (max(1, queries_per_block // q_len),
            -(-context // (pages_per_block * c.page_size)))
  depth = [0]

  def static_while_loop(cond, body, init):
    del cond   # true for exactly counts[depth] iterations on this batch
    n = counts[depth[0]]
    depth[0] += 1
    try:
      return lax.fori_loop(0, n, lambda i, state: body(state), init)
    finally:
      depth[0] -= 1
  lax_view = types.SimpleNamespace(**{n: getattr(lax, n) for n in dir(lax)
                                      if not n.startswith("__")})
  lax_view.while_loop = static_while_loop
  forms = (("const", lambda s: np.int32(context)), lambda s, p: s * pages_per_seq + p,
           ("const", (lambda i: i) if q_len == 1 else (lambda i: i * q_len)), None, ("const", lambda i: np.int32(num_seqs)))
  kv_dtype = jnp.dtype(getattr(c, "kv_dtype", "bfloat16"))
  scale = None if kv_dtype == jnp.bfloat16 else 1.0
  window = getattr(c, "sliding_window", None)
  extra = {} if window is None else dict(sliding_window=window)

  def fn(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs_):
    with visible_prefetch(K, forms), mock.patch.object(K, "lax", lax_view):
      return K.ragged_paged_attention(
          q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs_,
          sm_scale=c.head_dim ** -0.5, num_kv_pages_per_block=pages_per_block,
          num_queries_per_block=queries_per_block, vmem_limit_bytes=vmem_limit_bytes,
          k_scale=scale, v_scale=scale, **extra)
  S = jax.ShapeDtypeStruct
  return fn, [S((num_seqs * q_len, c.q_heads, c.head_dim), jnp.bfloat16),
              S((num_seqs * pages_per_seq, c.page_size, 2 * c.kv_heads, c.head_dim), kv_dtype),
              S((num_seqs,), jnp.int32), S((num_seqs, pages_per_seq), jnp.int32),
              S((num_seqs + 1,), jnp.int32), S((1,), jnp.int32)]


@dataclasses.dataclass(frozen=True)
class RaggedPagedServingAnchor:
  """jax's ragged_paged_attention on a serving step (`headline.PagedBatch`): the same
  static-length variant as `RaggedPagedAnchor` (`_rpa_program`), rated per part of the
  batch and summed: the decode sequences (rated at a whole number of q blocks, scaled to
  the real count) and the prefill chunks (each q block of a chunk is one sequence's
  queries). Block sizes: `kv_tokens_per_block` keys (2048, the existing rows' 32 pages of
  64) in whole pages and 32 queries; jax's tuned table has no key for these shapes (its
  32/8-head keys stop at 1280 tokens of context, and its default of 128 pages does not fit
  VMEM at page 64)."""

  serving: headline.PagedBatch
  num_queries_per_block: int = 32
  kv_tokens_per_block: int = 2048

  @property
  def case(self):
    return self.serving

  @property
  def key(self) -> str:
    return (f"rpa-serving:{self.serving.name}:{self.num_queries_per_block}:"
            f"{self.kv_tokens_per_block}")

  @property
  def pages_per_block(self) -> int:
    c = self.serving
    longest = max(kv for _, kv in c.sequences())
    return max(1, min(self.kv_tokens_per_block // c.page_size, longest // c.page_size))

  @property
  def implementation(self) -> str:
    return (f"jax ragged_paged_attention (jax {_jax().__version__}, kv pages / queries per "
            f"block {self.pages_per_block} / {self.num_queries_per_block}, static-length "
            f"variant)")

  def parts(self) -> list[tuple[str, int, int, int, int]]:
    """[(part, sequences, rated sequences, q_len, context)] of the batch."""
    c, qb = self.serving, self.num_queries_per_block
    out = []
    if c.decode:
      out.append(("decode", c.decode, -(-c.decode // qb) * qb, 1, c.context))
    if c.prefill:
      out.append(("prefill", c.prefill, c.prefill, c.chunk, c.prefill_context))
    return out

  def _contexts(self, context: int) -> tuple[int, ...]:
    if context <= RPA_MAX_RATED_CONTEXT:
      return (context,)
    return (RPA_MAX_RATED_CONTEXT // 2, RPA_MAX_RATED_CONTEXT)

  @property
  def truncations(self):
    return tuple([part, rated, q_len, ctx] for part, _, rated, q_len, context in self.parts()
                 for ctx in self._contexts(context))

  @property
  def method(self) -> str:
    how = ("static estimate per part (static-length variant: loops with static trip counts), "
           "summed: " + ", ".join(f"{part} at {rated} sequences" + (
               f" scaled to {n}" if rated != n else "") for part, n, rated, _, _ in
               self.parts()))
    if any(len(self._contexts(p[4])) > 1 for p in self.parts()):
      how += (f"; contexts past {RPA_MAX_RATED_CONTEXT} rated at {RPA_MAX_RATED_CONTEXT // 2} "
              f"and {RPA_MAX_RATED_CONTEXT} and extrapolated linearly in kv blocks")
    return how

  @property
  def note(self) -> str:
    return ("Static-length variant as for the headline rows. Each part is its own kernel "
            "here (one launch's fixed cycles counted once per part). It reads every kv block "
            "of a sequence for every q block (no causal or window skipping), as on hardware; "
            "quantized caches with scales 1.0 (its k_scale / v_scale are floats).")

  def config(self) -> dict:
    return dict(num_kv_pages_per_block=self.pages_per_block,
                num_queries_per_block=self.num_queries_per_block,
                page_size=self.serving.page_size,
                vmem_limit_bytes="kernel default on v6e, 64 MiB on v5e")

  def vmem_limit_bytes(self, chip: str) -> int | None:
    return 64 * 2**20 if chip == "v5e" else None

  def validate(self) -> None:
    c, qb = self.serving, self.num_queries_per_block
    if c.prefill and c.chunk % qb:
      raise ValueError("the static trip counts assume chunks of whole q blocks")
    for _, _, _, _, context in self.parts():
      if context % c.page_size:
        raise ValueError("the static trip counts assume whole pages")

  def build(self, trunc, chip: str = "v6e"):
    _, seqs, q_len, context = trunc
    return _rpa_program(self.serving, seqs, q_len, context, self.pages_per_block,
                        self.num_queries_per_block, self.vmem_limit_bytes(chip))

  def lowering(self, chip: str):
    return target_chip(chip)

  def kv_blocks(self, context: int) -> int:
    return -(-context // (self.pages_per_block * self.serving.page_size))

  def extrapolate(self, cycles: dict) -> float:
    total = 0.0
    for part, n, rated, q_len, context in self.parts():
      points = [(self.kv_blocks(ctx), cycles[json.dumps([part, rated, q_len, ctx])])
                for ctx in self._contexts(context)]
      value = points[0][1]
      if len(points) == 2:
        (b0, c0), (b1, c1) = points
        value = c1 + (c1 - c0) / (b1 - b0) * (self.kv_blocks(context) - b1)
      total += value * n / rated
    return total

  def hbm_bytes(self) -> int:
    """Per sequence, every q block it spans fetches the pages of its kv_len (the last block
    only the pages it needs); q read and out written once."""
    c, qb = self.serving, self.num_queries_per_block
    token_bytes = 2 * c.kv_heads * c.head_dim * headline.ITEMSIZE[c.kv_dtype]
    kv = 0
    for _, n, _, q_len, context in self.parts():
      pages = -(-context // c.page_size)
      kv += n * -(-q_len // qb) * pages * c.page_size * token_bytes
    return kv + 2 * c.num_tokens * c.q_heads * c.head_dim * headline.ITEMSIZE[c.q_dtype]

  def hand(self, chip) -> dict:
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=hbm_us, hand_count="k/v pages it fetches at HBM bandwidth")


# ----------------------------------------------------------------------------------------
# The list.


def _specs_list():
  out = []
  for m in (512, 8192):
    for part in ("gate_up+silu", "down"):
      for tiling in ("default", "512x1024x1024"):
        out.append(GmmAnchor(m, part, tiling))
      for tiling in ("heuristic", "512x1024x1024"):
        out.append(TokamaxGmmAnchor(m, part, tiling))
  for seq in (4096, 32768):
    for block in (128, 512):
      out += [AttentionAnchor(seq, "flash", block), AttentionAnchor(seq, "splash", block)]
    out += [TokamaxAttentionAnchor(seq, 128), TokamaxAttentionAnchor(seq, 512)]
  for case in headline.DIFFUSION_ATTENTION:   # non-causal, Diffusers' shapes
    for block in (128, 512):
      out += [AttentionAnchor(case.seq, "flash", block, joint=case),
              AttentionAnchor(case.seq, "splash", block, joint=case),
              TokamaxAttentionAnchor(case.seq, block, joint=case)]
  for ctx in (2048, 32768):
    out += [PagedAnchor(ctx), RaggedPagedAnchor(ctx)]
  out += [RaggedPagedServingAnchor(c) for c in headline.SERVING_PAGED]
  out += quantized_decode_anchors()
  import anchors_tpu_inference   # (here: it imports this module) tpu-inference 0.32.0's kernels
  return out + anchors_tpu_inference.specs()


# jax's megablox gmm has no quantized path (bf16 / f32 operands only): beside the quantized
# rows only tokamax's ragged_dot is rated (tpu-inference's quantized gmm: anchors_tpu_inference.py).
# One tiling each: the large one, the faster of the two tilings at every bf16 headline row.
# tokamax's heuristic config (128x128x128) at Qwen3-30B-A3B gate_up int8 m=64 rated
# 6,408 µs on v5e (vs 338 µs at the large tiling) and aborts the estimator on v6e
# ("Unsupported DMA direction"), as it does on v5e at Mixtral-8x7B: not rated here.
QUANTIZED_TILING = "512x1024x1024"


def quantized_decode_anchors() -> list:
  """Anchors of headline.QUANTIZED_DECODE (issue 28): tokamax's quantized ragged_dot beside
  each int8 / fp8 row, megablox gmm beside each added bf16 row."""
  out = []
  for case in headline.QUANTIZED_DECODE:
    common = dict(groups=case.groups, model=case.model, weight_dtype=case.weight_dtype)
    if case.quantized:
      out.append(TokamaxGmmAnchor(case.m, case.part, QUANTIZED_TILING, **common))
    else:
      out.append(GmmAnchor(case.m, case.part, QUANTIZED_TILING, **common))
  return out


@functools.cache
def _SPECS():
  return {s.key: s for s in _specs_list()}


def anchors() -> list[Anchor]:
  """Every anchor; a spec with its own `rate` (tpu-inference's: it asks its child for its
  config first) is rated by it, the others by `_rate`."""
  return [Anchor(s.case.name, s.implementation, getattr(s, "rate", functools.partial(_rate, s)))
          for s in _specs_list()]


NO_ANCHOR = {
    "rms_norm": "jax ships no Pallas RMSNorm kernel (jax.experimental.pallas.ops.tpu has none); "
                "the XLA jnp baseline is rated by estimate.py",
}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--cases", help="only anchors whose case or implementation contains this")
  parser.add_argument("--out", type=Path, help="also write the rows here (jsonl)")
  parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.child:
    if os.environ.get("ANCHOR_STATIC_PROFILE", "1") == "1":
      tuning.enable_static_profile()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    _child_main(*args.child)
    return 0
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  from tpu_kernels import chips
  rows = []
  for anchor in anchors():
    if args.cases and args.cases not in anchor.case and args.cases not in anchor.implementation:
      continue
    for chip in args.chips:
      start = time.time()
      row = dict(case=anchor.case, implementation=anchor.implementation, chip=chip,
                 **anchor.rate(chip))
      c = chips.get_chip(chip)
      if row.get("estimated_cycles"):
        row["compute_us"] = row["estimated_cycles"] / c.clock_hz * 1e6
        row["hbm_us"] = row["hbm_bytes"] / c.hbm_bytes_per_s * 1e6
        row["predicted_us"] = max(row["compute_us"], row["hbm_us"])
      row["rate_seconds"] = round(time.time() - start, 1)
      rows.append(row)
      print(json.dumps(row), flush=True)
      if args.out:
        with open(args.out, "a") as f:
          f.write(json.dumps(row) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
