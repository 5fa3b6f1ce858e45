"""Against whom: the peers rated beside our kernels, one module (or package) per peer.

    xla_ops.py            XLA's own ops (the XLA-native baseline of every case kind)
    jax_ops/              jax's Pallas TPU kernels (jax.experimental.pallas.ops.tpu): megablox
                          gmm, flash and splash attention, paged_attention, ragged paged attention
    tokamax_ops.py        tokamax's ragged_dot and dot_product_attention (in .venv-tokamax)
    tpu_inference_ops/    tpu-inference 0.32.0's (vLLM's TPU kernels, in .venv-tpu-inference)
and what several share, each in one place:
    protocol.py           what a peer is, and the driver that rates a peer's Pallas kernel
    child.py              the child process a peer's kernel is compiled in (its own venv)
    megablox.py           megablox's grouped matmul (jax's; tokamax's and tpu-inference's fork it)
    attention_geometry.py the block grid of an attention case (jax's and tokamax's attention)

A peer is found by code: every module or package here with `implementations(case)`
(protocol.py). So a new peer is one new module here, and a new case kind gets a peer's rows
by an entry in that peer's module. Each peer's kernels are its own, called as its users
call them (nothing copied); what the estimator is shown of them, and why, is in each
module's docstring.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil


@functools.cache
def peer_modules() -> tuple:
  """Every peer (a module or package of this package with `implementations`), by name."""
  modules = [importlib.import_module(f"{__name__}.{info.name}")
             for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_")]
  return tuple(m for m in modules if hasattr(m, "implementations"))


def implementations(case) -> list:
  """Every peer's rows for `case` (protocol.Implementation), peer by peer."""
  return [impl for peer in peer_modules() for impl in peer.implementations(case)]


def specs_for(case) -> list:
  """Every Pallas peer's specs for `case` (protocol.py's interface)."""
  return [s for peer in peer_modules() if hasattr(peer, "specs_for")
          for s in peer.specs_for(case)]


@functools.cache
def _specs_by_key() -> dict:
  from benchmarks import cases
  specs = [s for case in cases.all_cases() for s in specs_for(case)]
  by_key = {s.key: s for s in specs}
  if len(by_key) != len(specs):
    raise ValueError("two peer specs share a key")
  return by_key


def all_specs() -> list:
  """Every Pallas peer's spec over every case (`cases.all_cases()`)."""
  return list(_specs_by_key().values())


def spec_by_key(key: str):
  """The spec whose key is `key` (KeyError otherwise): how a child finds what to compile."""
  return _specs_by_key()[key]
