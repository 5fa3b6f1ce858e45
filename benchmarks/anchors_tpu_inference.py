"""Anchors from tpu-inference 0.32.0 (vLLM's TPU kernels, `tpu_inference/kernels/`), rated by
anchors.py's machinery (children compiled ahead of time with libtpu's static profile).

    python benchmarks/anchors.py --cases tpu-inference        (these rows alone)

`specs_for(case)` maps a headline case (by its class) to the specs rated on it; anchors.py's
`_specs_list()` adds them for every case of headline.ALL_CASES. Every child runs in
`.venv-tpu-inference` (requirements-tpu-inference.txt: tpu-inference 0.32.0 --no-deps on the jax
0.11.2 / libtpu 0.0.48 it pins; scripts/setup.sh makes it), whichever stack runs anchors.py.

The block sizes are the kernel's own choice for the whole case on the target chip (its tuned
table or its heuristic), asked in a child first (`--choose`) and named in each row's config.

Stand-ins (`stand_ins`): the kernels import tpu_inference.logger and tpu_inference.utils, which
import vllm and torch; the package's __init__ imports vllm too. The children register the
package without running its __init__, a logger module (logging, with the *_once methods), and a
utils module holding the real `get_device_name` and `align_to` (their source, read from the
installed utils.py). Kernels ask `jax.devices()[0].device_kind` for the TPU generation: it
answers with the AOT target device.

  * megablox `gmm` (`GmmSpec`, GroupedMatmul cases): jax's megablox algorithm; its metadata
    and active-tile count made visible exactly as anchors.GmmAnchor's (closed form checked
    against tpu-inference's own make_group_metadata), at its `get_tuned_block_sizes`.
  * `flash_attention` (`FlashSpec`, Attention cases): no GQA (k / v repeated to every head,
    as for jax's flash anchor), no scalar prefetch: rated at 2 and 4 heads, extrapolated.
  * ragged paged attention v3 (`RpaV3Spec`, PagedDecode cases and the decode-only PagedBatch
    ones): grid (1,), loops over the sequences and kv blocks bounded by SMEM values
    (distribution, kv_lens, cu_q_lens), so they read the batch's values as constants
    (static-length variant, like anchors.RaggedPagedAnchor). The other serving batches say
    why not (`not_rated_why`).

  * fused_moe v1 (`FusedMoeSpec`, experts-layer cases): see there.

quantized_matmul does not apply (`NOT_RATED`). Where the estimator aborts or a compile runs
out of time, the row says so (docs/performance.md, tpu-inference: RPA v3 and fused_moe).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import types
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))

import anchors  # noqa: E402
import headline  # noqa: E402
import tuning  # noqa: E402

VERSION = "0.32.0"
STACK = "jax 0.11.2, libtpu 0.0.48"          # what requirements-tpu-inference.txt pins with it
VENV = anchors.ROOT / ".venv-tpu-inference"


# ----------------------------------------------------------------------------------------
# Stand-ins for the serving stack (in the children only)


class _OnceLogger(logging.LoggerAdapter):
  """vllm's logger interface as the kernels use it (info_once, warning_once, ...)."""

  def __getattr__(self, name):
    if name.endswith("_once"):
      return getattr(self, name[:-len("_once")])
    raise AttributeError(name)


def _functions_from(path: Path, names: tuple[str, ...], namespace: dict) -> dict:
  """The named top-level functions of the Python file at `path`, defined in `namespace`
  (their source as installed: nothing copied here)."""
  tree = ast.parse(path.read_text())
  body = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in names]
  assert {f.name for f in body} == set(names), (path, names)
  exec(compile(ast.Module(body=body, type_ignores=[]), str(path), "exec"), namespace)
  return {n: namespace[n] for n in names}


@contextlib.contextmanager
def stand_ins(chip: str):
  """tpu_inference importable without vllm / torch, answering for `chip` (see the docstring)."""
  import importlib.util
  import jax
  from tpu_kernels import aot
  found = importlib.util.find_spec("tpu_inference")
  if found is None:
    raise RuntimeError(f"tpu_inference is not installed in {sys.executable}")
  import importlib.metadata
  assert importlib.metadata.version("tpu-inference") == VERSION
  assert f"jax {jax.__version__}" in STACK, jax.__version__
  library = os.environ.get("TPU_LIBRARY_PATH")
  if library and not library.startswith(sys.prefix):   # libtpu 0.0.48 or nothing
    raise RuntimeError(f"TPU_LIBRARY_PATH={library} is another environment's libtpu")
  package_dir = Path(found.submodule_search_locations[0])
  if "tpu_inference" not in sys.modules:
    package = types.ModuleType("tpu_inference")
    package.__path__ = [str(package_dir)]
    logger = types.ModuleType("tpu_inference.logger")
    logger.init_logger = lambda name: _OnceLogger(logging.getLogger(name), {})
    utils = types.ModuleType("tpu_inference.utils")
    utils.__dict__.update(_functions_from(package_dir / "utils.py",
                                          ("get_device_name", "align_to"), {"jax": jax}))
    sys.modules.update({"tpu_inference": package, "tpu_inference.logger": logger,
                        "tpu_inference.utils": utils})
  device = aot.topology_device(chip)
  with mock.patch.object(jax, "devices", lambda *a, **k: [device]), anchors.target_chip(chip):
    yield


def kernel_module(name: str):
  import importlib
  return importlib.import_module(f"tpu_inference.kernels.{name}")


# ----------------------------------------------------------------------------------------
# What every spec shares


class _TpuInference:
  """A spec anchors.py's `_rate` drives; `chosen` is the kernel's own config for the case
  (None until `resolved`: the parent cannot import tpu_inference)."""

  python = VENV / "bin" / "python"

  def lowering(self, chip: str):
    return stand_ins(chip)

  def validate(self) -> None:
    """Checked in the child, where tpu_inference imports (`build`)."""

  def config(self) -> dict:
    return dict(self.chosen or {})

  def get(self, name: str):
    if not self.chosen:
      raise RuntimeError(f"{self.key}: config not resolved (resolve(chip) in the parent)")
    return dict(self.chosen)[name]

  def rate(self, chip: str) -> dict:
    return rate_resolved(self, chip)

  def config_for(self, chip: str) -> dict:
    """The child's copy of `chosen` (same function as the parent asked through --choose)."""
    return dict(self.chosen) if self.chosen else self.choose(chip)


def _frozen(config: dict) -> tuple:
  return tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in config.items()))


@functools.cache
def _chosen_in_child(key: str, chip: str) -> tuple:
  if not _TpuInference.python.exists():
    raise RuntimeError(f"{_TpuInference.python} is missing: scripts/setup.sh makes it")
  env = tuning.child_env()
  env.pop("TPU_LIBRARY_PATH", None)   # set by this process's jax: its libtpu, not the venv's
  rows, error = tuning.run_child(__file__, ["--choose", key, chip], timeout=300, env=env,
                                 python=_TpuInference.python)
  if error:
    raise RuntimeError(f"--choose {key} {chip}: {error}")
  return _frozen(rows[-1])


def resolved(spec, chip: str):
  return dataclasses.replace(spec, chosen=_chosen_in_child(spec.key, chip))


def rate_resolved(spec, chip: str) -> dict:
  """anchors._rate on the spec with the kernel's own config for `chip`."""
  try:
    spec = resolved(spec, chip)
  except Exception as e:  # noqa: BLE001  (a failed anchor is a row)
    row = anchors._row_base(spec)
    row["error"] = f"{type(e).__name__}: {str(e).strip()[:400]}"
    return row
  return anchors._rate(spec, chip)


# ----------------------------------------------------------------------------------------
# megablox gmm


@dataclasses.dataclass(frozen=True)
class GmmSpec(_TpuInference):
  """megablox gmm on a grouped-matmul case (attributes m, part, groups, k, n_weight, n_out,
  and optionally weight_dtype: int8 / float8_e4m3fn weights go in with gmm's rhs_scale, one
  f32 scale per output channel ([G, 1, 1, n]), its own dequantising path). Balanced routing
  (anchors.GmmClosedForm, checked against tpu-inference's make_group_metadata in the child).
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
  def closed_form(self) -> anchors.GmmClosedForm:
    """Balanced routing; with fewer rows than experts (Qwen3-30B-A3B at m=64), the first m
    experts get one row each and the rest none (not visited), as for jax's megablox."""
    c = self.case
    if c.active_groups < c.groups:
      return anchors.GmmClosedForm(c.m, c.active_groups, self.tiling[0], c.groups)
    return anchors.GmmClosedForm(c.m, c.groups, self.tiling[0])

  truncations = anchors.GmmAnchor.truncations

  @property
  def method(self) -> str:
    (v1, v2) = anchors.GMM_TRUNCATED_VISITS
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
    spec = dataclasses.replace(self, chosen=_frozen(self.config_for(chip)))
    cf = spec.closed_form

    def as_tuple(metadata, num_tiles):   # (its GroupMetadata is a dataclass, not a tuple)
      return (metadata.group_offsets, metadata.group_ids, metadata.m_tile_ids), num_tiles
    cf.check(lambda **kw: as_tuple(*G.make_group_metadata(**kw)))
    c = self.case
    num_meta = c.m // cf.tm + c.groups - 1
    forms = (G.GroupMetadata(cf.group_offset, cf.group_id, cf.m_tile_id), None)

    def fn(lhs, rhs, offsets, gids, mtiles, *scale):
      metadata = lambda **kw: (G.GroupMetadata(offsets, gids, mtiles), visits)
      with anchors.visible_prefetch(G, forms), mock.patch.object(G, "make_group_metadata",
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
    (v1, v2) = anchors.GMM_TRUNCATED_VISITS
    k1, k2 = cycles[json.dumps([v1])], cycles[json.dumps([v2])]
    return k1 + (k2 - k1) / (v2 - v1) * (self.closed_form.num_tiles - v1)

  def hbm_bytes(self) -> int:
    """Replay of the grid (n tiles, active m tiles, k tiles) through its index maps (the same
    as jax's megablox: lhs by m tile, rhs and its scale by group, out by m tile)."""
    c, cf = self.case, self.closed_form
    tm, tk, tn = self.tiling
    w = headline.ITEMSIZE[self.weight_dtype]
    n_tiles, k_tiles = -(-c.n_weight // tn), -(-c.k // tk)
    steps = ((j, v, kk) for j in range(n_tiles) for v in range(cf.num_tiles)
             for kk in range(k_tiles))
    blocks = [("lhs", lambda j, v, kk: (cf.m_tile_id(v), kk), tm * tk * 2),
              ("rhs", lambda j, v, kk: (cf.group_id(v), kk, j), tk * tn * w),
              ("out", lambda j, v, kk: (cf.m_tile_id(v), j), tm * tn * 2)]
    if self.quantized:
      blocks.append(("scale", lambda j, v, kk: (cf.group_id(v), j), tn * 4))
    return anchors.replay(steps, blocks)

  def hand(self, chip) -> dict:
    c, cf = self.case, self.closed_form
    flops = 2 * self.tiling[0] * c.k * c.n_weight * cf.num_tiles
    return dict(hand_mxu_flops=flops, hand_us=max(flops / chip.bf16_flops_per_s,
                                                  self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6,
                hand_count=f"{cf.num_tiles} tiles x 2*tm*k*n flops at bf16 peak vs replayed "
                           "bytes at HBM bandwidth")


# ----------------------------------------------------------------------------------------
# flash attention


FLASH_HEADS = (2, 4)


@dataclasses.dataclass(frozen=True)
class FlashSpec(_TpuInference):
  case: headline.Attention
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-flash:{self.case.name}"

  @property
  def implementation(self) -> str:
    return (f"tpu-inference flash_attention (tpu-inference {VERSION}, {STACK}, its block "
            f"sizes, k/v repeated to {self.case.q_heads} heads)")

  truncations = tuple([h] for h in FLASH_HEADS)

  @property
  def method(self) -> str:
    return (f"static estimate at {FLASH_HEADS[0]} and {FLASH_HEADS[1]} heads (the whole "
            f"sequence), extrapolated linearly to {self.case.q_heads} heads")

  @property
  def note(self) -> str:
    return ("flash_attention has no GQA ('Head count mismatch'): rated on k/v with every "
            "head (a caller repeats them; the repeat's bytes, read Hkv heads + write Hq, are "
            "in hbm_bytes, its cycles are not); [B, H, S, D] layout (transposes not counted). "
            "Block sizes: no tuned entry for these shapes, so its heuristic (128 blocks) and "
            "its single-step override (block_k = the whole kv length when its VMEM estimate "
            "fits 0.9 of the chip's VMEM); vmem_limit_bytes left at its default (None)")

  def _shape(self, heads: int) -> tuple[int, int, int, int]:
    c = self.case
    return (c.batch, heads, c.seq, c.head_dim)

  def choose(self, chip: str) -> dict:
    """What flash_attention picks for the whole case (its own code path, stopped before the
    kernel)."""
    import jax
    import jax.numpy as jnp
    F = kernel_module("flash_attention.kernel")
    c = self.case
    x = jax.ShapeDtypeStruct(self._shape(c.q_heads), jnp.bfloat16)
    picked = {}

    def capture(q, k, v, ab, segment_ids, save_residuals, causal, sm_scale, block_sizes,
                vmem_limit_bytes, debug):
      picked.update(dataclasses.asdict(block_sizes), vmem_limit_bytes=vmem_limit_bytes)
    with mock.patch.object(F, "_flash_attention", capture):
      F.flash_attention(x, x, x, causal=True, sm_scale=c.head_dim ** -0.5)
    return picked

  def build(self, trunc, chip: str = "v6e"):
    (heads,) = trunc
    import jax
    import jax.numpy as jnp
    F = kernel_module("flash_attention.kernel")
    chosen = self.config_for(chip)
    blocks = F.BlockSizes(**{k: chosen[k] for k in ("block_q", "block_k_major", "block_k",
                                                    "block_b")})
    c = self.case

    def fn(q, k, v):
      return F.flash_attention(q, k, v, causal=True, sm_scale=c.head_dim ** -0.5,
                               block_sizes=blocks, vmem_limit_bytes=chosen["vmem_limit_bytes"])
    return fn, [jax.ShapeDtypeStruct(self._shape(heads), jnp.bfloat16)] * 3

  def extrapolate(self, cycles: dict) -> float:
    (h1, h2) = FLASH_HEADS
    c1, c2 = cycles[json.dumps([h1])], cycles[json.dumps([h2])]
    return c1 + (c2 - c1) / (h2 - h1) * (self.case.q_heads - h1)

  def hbm_bytes(self) -> int:
    """Replay of one (batch, head)'s grid (q row i, kv column j; the kv index is j on or
    below the diagonal, else 0, its below_or_on_diag), times batch x heads (each restarts),
    plus the k / v repeat."""
    c = self.case
    bq, bk = self.get("block_q"), self.get("block_k_major")
    nq, nk = -(-c.seq // bq), c.seq // bk
    below = lambda i, j: (i + 1) * bq - 1 > j * bk
    kv = lambda i, j: j if below(i, j) else 0
    steps = ((i, j) for i in range(nq) for j in range(nk))
    per_head = anchors.replay(steps, [
        ("q", lambda i, j: i, bq * c.head_dim * 2), ("k", kv, bk * c.head_dim * 2),
        ("v", kv, bk * c.head_dim * 2), ("o", lambda i, j: i, bq * c.head_dim * 2)])
    repeat = 2 * c.batch * (c.kv_heads + c.q_heads) * c.seq * c.head_dim * 2
    return c.batch * c.q_heads * per_head + repeat

  def hand(self, chip) -> dict:
    c = self.case
    hbm_us = self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6
    return dict(hand_us=max(c.flops() / chip.bf16_flops_per_s * 1e6, hbm_us),
                hand_count="causal flops at bf16 peak vs replayed bytes at HBM bandwidth")


# ----------------------------------------------------------------------------------------
# ragged paged attention v3


@dataclasses.dataclass(frozen=True)
class RpaV3Spec(_TpuInference):
  """A decode batch as RPA v3 sees it (a PagedDecode case, or a PagedBatch with no prefill
  chunks): `batch` sequences of one query token and `context` cached tokens (distribution =
  (batch, batch, batch): all decode; its mixed kernel runs over an empty range). Its kernel
  has grid (1,) and loops over the sequences (pl.loop between SMEM values of `distribution`)
  and each sequence's kv blocks (up to cdiv(kv_lens[s], bkv_sz)), which the estimator reads
  as 0; here those reads are constants of the batch ("const": distribution -> batch, kv_lens
  -> context); cu_q_lens[i] and page-table reads yield max(value, i) (the batch's values: one
  token a sequence, pages in order). Its SMEM state carried between iterations (semaphore /
  buffer ids) is left alone (read as 0 by the estimator).

  fp8 cache: its per-tensor k_scale / v_scale (1.0; it has no per-head scale). The plain
  compile succeeds; libtpu's static estimator aborts on the kernel (docs/performance.md,
  tpu-inference: what was tried), so its rows are error rows."""

  case: object
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-rpa-v3:{self.case.name}"

  @property
  def batch(self) -> int:
    return getattr(self.case, "batch", None) or self.case.decode

  @property
  def kv_dtype(self) -> str:
    return self.case.kv_dtype

  @property
  def implementation(self) -> str:
    return (f"tpu-inference ragged_paged_attention v3 (tpu-inference {VERSION}, {STACK}, its "
            f"decode block sizes, static-length variant)")

  @property
  def truncations(self):
    """The case itself up to two kv blocks a sequence, else contexts of one and two blocks
    (the estimator's memory grows with the loop iterations it walks)."""
    bkv = self.get("d_block_sizes")[1]
    if self.kv_blocks() <= 2:
      return ([self.case.context],)
    return ([bkv], [2 * bkv])

  @property
  def method(self) -> str:
    how = "static estimate at the full batch (static-length variant: SMEM loop bounds as constants)"
    if self.chosen and len(self.truncations) == 2:
      how += (f", rated at contexts {self.truncations[0][0]} and {self.truncations[1][0]} (one "
              f"and two kv blocks) and extrapolated linearly in kv blocks to {self.case.context}")
    return how

  @property
  def note(self) -> str:
    scale = (f" {self.kv_dtype} cache with its per-tensor k_scale / v_scale (1.0)."
             if self.kv_dtype != "bfloat16" else "")
    return ("Static-length variant (see RpaV3Spec). update_kv_cache=False: it attends to the "
            "cached tokens without writing this step's K/V (its fused cache write, as served, "
            "adds 2*B*Hkv*D*2 bytes). K/V in its fused [pages, page, 2*Hkv/packing, packing, "
            "D] layout. Block sizes: ragged_paged_attention's decode default "
            "(get_default_block_sizes; its 4,463-line tuned table is only read by the hd64 "
            "variant in 0.32.0, and vLLM passes none unless RPA_V3_DECODE_BLOCK_SIZES is set); "
            "vmem_limit_bytes its default (the chip's VMEM capacity)." + scale)

  def choose(self, chip: str) -> dict:
    import jax.numpy as jnp
    K = kernel_module("ragged_paged_attention.v3.kernel")
    c = self.case
    sizes = K.get_default_block_sizes(jnp.bfloat16, jnp.dtype(self.kv_dtype), c.q_heads,
                                      c.kv_heads, c.head_dim, c.page_size, self.batch,
                                      self.batch, c.context // c.page_size,
                                      case=K.RpaCase.DECODE)
    return dict(d_block_sizes=[sizes[k] for k in ("bq_sz", "bkv_sz", "bq_csz", "bkv_csz")],
                page_size=c.page_size)

  def validate_shapes(self) -> None:
    c = self.case
    if c.context % c.page_size:
      raise ValueError("the static kv lengths assume whole pages")
    if getattr(c, "prefill", 0) or getattr(c, "sliding_window", None) is not None:
      raise ValueError("decode batches without a window only")

  def kv_blocks(self, context: int | None = None) -> int:
    c = self.case
    context = c.context if context is None else context
    return -(-context // self.get("d_block_sizes")[1])

  def build(self, trunc, chip: str = "v6e"):
    (context,) = trunc
    import jax
    import jax.numpy as jnp
    import numpy as np
    self.validate_shapes()
    K = kernel_module("ragged_paged_attention.v3.kernel")
    chosen = self.config_for(chip)
    c, batch = self.case, self.batch
    pages_per_seq = context // c.page_size
    # Loop bounds (kv_lens, distribution) as constants; cu_q_lens as max(value, i): a constant
    # would make the never-taken prefetch of sequence `batch` a static out-of-bounds slice.
    forms = (("const", lambda s: np.int32(context)), lambda i: i, lambda i: i,
             ("const", lambda i: np.int32(batch)), None, None, None)
    kv_dtype = jnp.dtype(self.kv_dtype)
    kv_cache_shape = K.get_kv_cache_shape(batch * pages_per_seq, c.page_size, c.kv_heads,
                                          c.head_dim, kv_dtype)
    scales = {} if self.kv_dtype == "bfloat16" else dict(k_scale=1.0, v_scale=1.0)

    def fn(q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution):
      with anchors.visible_prefetch(K, forms):
        return K.ragged_paged_attention(
            q, k, v, kv_cache, kv_lens, page_indices, cu_q_lens, distribution,
            sm_scale=c.head_dim ** -0.5, update_kv_cache=False,
            d_block_sizes=tuple(chosen["d_block_sizes"]), **scales)
    S = jax.ShapeDtypeStruct
    return fn, [S((batch, c.q_heads, c.head_dim), jnp.bfloat16),
                S((batch, c.kv_heads, c.head_dim), kv_dtype),
                S((batch, c.kv_heads, c.head_dim), kv_dtype),
                S(kv_cache_shape, kv_dtype), S((batch,), jnp.int32),
                S((batch * pages_per_seq,), jnp.int32), S((batch + 1,), jnp.int32),
                S((3,), jnp.int32)]

  def extrapolate(self, cycles: dict) -> float:
    points = [(self.kv_blocks(t[0]), cycles[json.dumps(t)]) for t in self.truncations]
    if len(points) == 1:
      return points[0][1]
    (b0, c0), (b1, c1) = points
    return c1 + (c1 - c0) / (b1 - b0) * (self.kv_blocks() - b1)

  def hbm_bytes(self) -> int:
    """Each sequence's K/V pages once (whole kv blocks); q read and o written once."""
    c = self.case
    kv = 2 * self.batch * c.kv_heads * self.kv_blocks() * self.get("d_block_sizes")[1] \
        * c.head_dim * headline.ITEMSIZE[self.kv_dtype]
    return kv + 2 * self.batch * c.q_heads * c.head_dim * 2

  def hand(self, chip) -> dict:
    return dict(hand_us=self.hbm_bytes() / chip.hbm_bytes_per_s * 1e6,
                hand_count="k/v pages once at HBM bandwidth")


# ----------------------------------------------------------------------------------------
# fused_moe v1 (the whole experts layer: routing, gather, gate/up, act, down, combine)


class _ScratchView:
  """An SMEM scratch ref whose element reads yield `closed_form(*idx)` (a constant of the
  batch); everything else (.at for DMAs, writes, shape) is the ref's own."""

  def __init__(self, ref, closed_form):
    self._ref, self._closed_form = ref, closed_form

  def __getitem__(self, idx):
    return self._closed_form(*(idx if isinstance(idx, tuple) else (idx,)))

  def __setitem__(self, idx, value):
    self._ref[idx] = value

  def __getattr__(self, name):
    return getattr(self._ref, name)


@dataclasses.dataclass(frozen=True)
class FusedMoeSpec(_TpuInference):
  """fused_ep_moe on one chip (a 1 x 1 mesh, expert parallelism of 1) for an experts-layer
  case (attributes tokens, experts, top_k, hidden, width): gating [T, E] in, top-k routing,
  scatter, gate/up + silu, down and the weighted combine in one kernel.

  It computes the routing in the kernel and keeps it in SMEM scratch, which the estimator
  reads as 0 (every expert empty: no matmul rated). Here the reads of that scratch yield the
  batch's values under round-robin routing (token t's k-th expert (t * top_k + k) % E, so
  each expert gets ceil(T * top_k / E) rows: exact when E divides T * top_k, an upper bound
  otherwise): t2e_routing, expert_starts (e * rows), expert_sizes and d2e_count (rows). Its
  own writes still happen; a2a_s_sends (remote sends: 0 on one chip) is left alone.

  libtpu 0.0.48's estimator rates the program 0 cycles (a row error); T = 1 and gpt-oss's
  2880-wide layers are refused by the kernel. `fused_moe_probe.py` shows where the
  estimator gives up."""

  case: object
  chosen: tuple | None = None

  @property
  def key(self) -> str:
    return f"tpu-inference-fused-moe:{self.case.name}"

  @property
  def implementation(self) -> str:
    return (f"tpu-inference fused_moe v1 (tpu-inference {VERSION}, {STACK}, its block sizes, "
            f"1-chip mesh, round-robin routing)")

  truncations = ([0],)

  method = "static estimate of the whole kernel (one compile, no extrapolation)"

  @property
  def note(self) -> str:
    return ("Routing read from SMEM as round-robin closed forms (see FusedMoeSpec); gating "
            "[T, E] bf16 in, softmax scoring; no renormalisation of the top-k weights; "
            "every expert's weights are fetched whether routed to or not (the kernel's loop "
            "over local experts fetches unconditionally)")

  @property
  def rows_per_expert(self) -> int:
    c = self.case
    return -(-c.tokens * c.top_k // c.experts)

  def _specs(self):
    import jax
    import jax.numpy as jnp
    c = self.case
    S = jax.ShapeDtypeStruct
    return [S((c.tokens, c.hidden), jnp.bfloat16),
            S((c.experts, 2, c.hidden, c.width), jnp.bfloat16),
            S((c.experts, c.width, c.hidden), jnp.bfloat16),
            S((c.tokens, c.experts), jnp.bfloat16)]

  def _mesh(self, chip: str):
    import jax
    import numpy as np
    from tpu_kernels import aot
    return jax.sharding.Mesh(np.array([[aot.topology_device(chip)]]), ("data", "model"))

  def choose(self, chip: str) -> dict:
    """The block sizes fused_ep_moe settles on for the case (its tuned table or default, then
    its overrides), read from the kernel it builds (traced, not compiled)."""
    import jax
    M = kernel_module("fused_moe.v1.kernel")
    picked = {}
    real = M._fused_ep_moe_kernel

    def capture(*args, **kw):
      picked.update({k: kw[k] for k in ("bt", "bf", "bd1", "bd2", "btc", "bfc", "bd1c", "bd2c")})
      return real(*args, **kw)
    with mock.patch.object(M, "_fused_ep_moe_kernel", capture):
      jax.jit(lambda *a: M.fused_ep_moe(self._mesh(chip), *a, self.case.top_k)).trace(
          *self._specs())
    return picked

  def build(self, trunc, chip: str = "v6e"):
    import inspect
    import jax
    import jax.numpy as jnp
    M = kernel_module("fused_moe.v1.kernel")
    c, rows = self.case, self.rows_per_expert
    chosen = self.config_for(chip)
    forms = {
        "t2e_routing_x2_smem": lambda b, t, k: (t * c.top_k + k) % c.experts,
        "expert_starts_x2_smem": lambda b, z, e: e * rows,
        "expert_sizes_x2_smem": lambda b, z, e: jnp.int32(rows),
        "d2e_count_x2_smem": lambda b, d, z, e: jnp.int32(rows),
    }
    real = M._fused_ep_moe_kernel
    signature = inspect.signature(real)

    def visible_kernel(*args, **kw):
      bound = signature.bind(*args, **kw)
      for name, form in forms.items():
        bound.arguments[name] = _ScratchView(bound.arguments[name], form)
      return real(*bound.args, **bound.kwargs)

    def fn(tokens, w1, w2, gating):
      with mock.patch.object(M, "_fused_ep_moe_kernel", visible_kernel):
        return M.fused_ep_moe(self._mesh(chip), tokens, w1, w2, gating, c.top_k, **chosen)
    return fn, self._specs()

  def extrapolate(self, cycles: dict) -> float:
    (value,) = cycles.values()
    return value

  def hbm_bytes(self) -> int:
    """Per block of bt tokens: every expert's w1 (gate and up) and w2; the block's gating;
    each routed row read from the tokens (scatter), written to and read back from its HBM
    staging buffer (gather); the output written once."""
    c = self.case
    blocks = -(-c.tokens // self.get("bt"))
    weights = blocks * c.experts * 3 * c.hidden * c.width * 2
    routed = c.tokens * c.top_k * c.hidden * 2
    return weights + c.tokens * c.experts * 2 + 3 * routed + c.tokens * c.hidden * 2

  def hand(self, chip) -> dict:
    c = self.case
    flops = 2 * c.experts * self.rows_per_expert * 3 * c.hidden * c.width
    return dict(hand_us=max(flops / chip.bf16_flops_per_s,
                            self.hbm_bytes() / chip.hbm_bytes_per_s) * 1e6,
                hand_count="every expert's weights per token block at HBM bandwidth vs the "
                           "routed rows' flops at bf16 peak")


# ----------------------------------------------------------------------------------------
# The map from cases to specs


NOT_RATED = {
    "quantized_matmul": "a dense [m, k] x [n, k] int8/fp8 matmul with per-channel scales: it "
                        "has no expert (group) dimension, so it does not apply to the grouped "
                        "expert projections; tpu-inference's quantized experts go through "
                        "gmm's rhs_scale or fused_moe",
}


def not_rated_why(case) -> str | None:
  """Why a case of a kind tpu-inference has a kernel for gets no row (None: it gets one)."""
  if isinstance(case, headline.PagedBatch):
    if case.kv_dtype == "int8":
      return ("RPA v3 refuses an int8 cache (static_validate_inputs: 'Expected "
              "kv_cache.dtype=int8 to be a floating point'); its 1-byte cache is fp8")
    if case.prefill:
      return ("mixed batch (decode + chunked prefill): not expressed yet (its mixed kernel "
              "loops over q blocks of SMEM-dependent length)")
    if case.sliding_window is not None:
      return ("sliding window: not expressed yet (its first kv block per sequence is "
              "(kv_len - q_len - window) // bkv_sz, a run-time signed division, the pattern "
              "the estimator is known to read as 0: it would rate the whole context)")
  return None


def specs_for(case) -> list:
  """The tpu-inference specs rated on `case` (by its class; [] if none applies)."""
  if isinstance(case, headline.GroupedMatmul):
    # its gmm takes bf16 activations only (no activation quantization): the int8 row's
    # anchor is the comparison for a w8a8 row
    return [] if case.lhs_quant else [GmmSpec(case)]
  if isinstance(case, headline.Attention):
    return [FlashSpec(case)]
  if isinstance(case, headline.PagedDecode):
    return [RpaV3Spec(case)]
  if isinstance(case, headline.PagedBatch):
    return [] if not_rated_why(case) else [RpaV3Spec(case)]
  if all(hasattr(case, a) for a in EXPERTS_LAYER_FIELDS):   # the whole experts layer
    return [FusedMoeSpec(case)]
  return []


# What an experts-layer case (headline.EXPERTS_LAYER's class) offers fused_moe.
EXPERTS_LAYER_FIELDS = ("tokens", "experts", "top_k", "hidden", "width")


def specs() -> list:
  return [s for case in headline.ALL_CASES for s in specs_for(case)]


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--choose", nargs=2, metavar=("KEY", "CHIP"), required=True,
                      help="print the config the kernel picks for the case (in the venv)")
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  key, chip = args.choose
  spec = next(s for s in specs() if s.key == key)
  with stand_ins(chip):
    tuning.print_row(spec.choose(chip))
  return 0


if __name__ == "__main__":
  sys.exit(main())
