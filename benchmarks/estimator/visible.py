"""Showing the static estimator what it cannot see, and counting the bytes a grid moves.

libtpu's estimator reads every SMEM / scalar-prefetch value as 0, so a kernel whose grid,
index maps or loops depend on such values (group metadata, mask block lists, page tables,
lengths) is estimated for empty data. A rating makes the case's values visible at compile
time: every read of a scalar-prefetch ref yields max(value, closed form of the case)
(`Visible`; equal on hardware, where the ref holds exactly those values: each user checks
its closed form against the kernel's own metadata builder) or the closed form alone (a
static-value variant). `visible_prefetch` applies that to a kernel module's
`pl.pallas_call` while it is traced; `visible_grid_spec` to one call's (kernel, grid_spec)
(also for kernels that wrap pallas_call, as tokamax's buffered call does).

The estimator's DMA model does not cap HBM bandwidth, so bytes are counted by hand:
`replay` walks a grid through its index maps; a block is fetched (or written back) whenever
its block index changes between consecutive steps.

`target_chip`: Pallas asks the local device for the TPU generation while lowering some
kernels; the host here is a CPU, so it answers for the chip compiled for.
Nothing here imports jax at import time.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from unittest import mock


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


def visible_grid_spec(kernel, grid_spec, closed_forms, grid=None):
  """(kernel, grid_spec) whose scalar-prefetch refs (a pytree matching the first
  num_scalar_prefetch operands; a leaf is None (untouched), a function (max(value, f(idx)))
  or ("const", f)) are wrapped in the kernel body and in every index map. `grid`, if given,
  replaces the grid (e.g. a static visit count)."""
  import jax
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
  `visible_grid_spec(..., closed_forms, grid)`."""
  from jax.experimental import pallas as pl

  def pallas_call(kernel, *args, grid_spec=None, **kwargs):
    kernel, grid_spec = visible_grid_spec(kernel, grid_spec, closed_forms, grid)
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
             "v5p": tpu_info.ChipVersion.TPU_V5P}[chip]   # v5p: calibration's tokamax rows
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
