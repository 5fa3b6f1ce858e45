"""What every peer follows, and the driver that rates a peer's Pallas kernel.

A peer is a module (or package) of `benchmarks/peers/` with

    implementations(case) -> list[Implementation]   its rows for `case` ([] where it has no
                                                     kernel for it)

and, where its rows are Pallas kernels rated through truncated compiles (jax, tokamax,
tpu-inference),

    specs_for(case) -> list[spec]                    one spec per row (the interface below);
                                                     the child finds a spec by its `key`

`benchmarks/peers/__init__.py` finds the peers by code; `benchmarks/estimate.py` rates every
peer's rows beside ours. An `Implementation` is one row to rate: ours (`rating/ours.py`),
XLA's (rated in estimate.py's child process, with or without the static profile) or an
anchor (a peer kernel: its `rate` runs its own children).

A spec (the interface `rate` drives):
    key             unique over every peer's specs (the child finds the spec by it)
    case            the case it rates (a benchmarks.cases object)
    implementation  the row's name: the peer, its version, its config
    method, note    how it was rated, and what is not counted (both go into the row)
    config()        the config it runs at (into the row)
    truncations     the smaller programs compiled (the estimator's time and memory grow
                    faster than linearly with grid steps), each a JSON-able list
    validate()      checks its closed forms (in the parent; a spec whose peer imports only
                    in its own venv checks them in `build`, in the child)
    build(trunc, chip) -> (fn, specs)   the truncated program, its SMEM values made visible
    extrapolate({json(trunc): cycles}) -> cycles of the whole case
    hbm_bytes()     the bytes the whole case's grid moves (replayed through its index maps)
    hand(chip)      a hand count to set beside the estimate (into the row)
  optionally
    python          the venv's interpreter its children run in (None: this one)
    lowering(chip)  a context the program is built and compiled in (stand-ins, the chip)
    rate(chip)      its own rating (tpu-inference's: it asks its child for its config first)
    choose(chip)    its kernel's own config for the case (run in the child, `child.py choose`)

Each truncation compiles in a child (`child.py`, in the spec's venv) with the static profile
on; nothing here sets LIBTPU_INIT_ARGS at import. A failed rating is a row with its error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Callable

from benchmarks.estimator import children

OURS, XLA, ANCHOR = "ours", "xla", "anchor"
CHILD_SCRIPT = Path(__file__).resolve().parent / "child.py"


@dataclasses.dataclass(frozen=True)
class Implementation:
  """One implementation of one case: a row to rate. `rate(chip)` returns the partial row:
  compiled, error, estimated_cycles (None for cost_analysis rows), hbm_bytes, method, and
  optionally compute_us (cost_analysis), note, tiling / config. OURS and XLA rows are rated
  in benchmarks/estimate.py's child process (`static_profile`: whether it needs the profile
  flag); ANCHOR rows rate themselves (their `rate` runs their own children)."""

  case: str                        # the case's name (benchmarks.cases)
  implementation: str              # e.g. "jax megablox gmm (jax 0.10.2, tiling 512x1024x1024)"
  source: str                      # OURS, XLA or ANCHOR
  rate: Callable[[str], dict]
  static_profile: bool = True


def implementation(spec) -> Implementation:
  """The ANCHOR row of a Pallas peer's spec, rated by its own `rate` or by `rate` here."""
  return Implementation(spec.case.name, spec.implementation, ANCHOR,
                        getattr(spec, "rate", None) or (lambda chip: rate(spec, chip)))


# Per child (one truncation of one anchor); ANCHOR_CHILD_TIMEOUT_S raises it. jax's RPA at
# ctx 32768 on v5e, retried with VMEM memory-space assignment off (children.run_child), timed
# out at 600 s; given 2400 it runs a 24 GB machine out of memory instead (2026-12-05).
CHILD_TIMEOUT_S = int(os.environ.get("ANCHOR_CHILD_TIMEOUT_S", "600"))


def lowering(spec, chip: str):
  """The context an anchor is built and compiled in (most need none)."""
  return spec.lowering(chip) if hasattr(spec, "lowering") else contextlib.nullcontext()


def child_environment(spec, **extra: str) -> tuple[dict, Path | None]:
  """(env, python) of the spec's children: its venv's interpreter, if it has one, loads its
  own libtpu, not the one this process's jax set (TPU_LIBRARY_PATH)."""
  python = getattr(spec, "python", None)
  if python is not None and not Path(python).exists():
    raise RuntimeError(f"{python} is missing: scripts/setup.sh makes it")
  env = children.child_env(**extra)
  if python is not None:
    env.pop("TPU_LIBRARY_PATH", None)
  return env, python


def compile_in_child(spec, chip: str, trunc, profile: bool = True) -> dict:
  """Compiles `spec` truncated to `trunc` for `chip` with the static profile on (unless not
  `profile`), in a subprocess (the estimator may abort the process). Returns {cycles,
  kernels, seconds, peak_rss_mb, wall_s}."""
  start = time.time()
  env, python = child_environment(spec, ANCHOR_STATIC_PROFILE="1" if profile else "0")
  rows, error = children.run_child(
      CHILD_SCRIPT, ["compile", spec.key, chip, json.dumps(trunc)], timeout=CHILD_TIMEOUT_S,
      env=env, python=python)
  if error:
    raise RuntimeError(f"child {error} ({spec.key} {chip} {trunc})")
  out = rows[-1]
  out["wall_s"] = round(time.time() - start, 1)
  return out


def row_base(spec) -> dict:
  """The partial row of a spec before any rating: its method, note and config."""
  return dict(compiled=False, error=None, estimated_cycles=None, hbm_bytes=None,
              method=spec.method, note=spec.note, config=spec.config())


def method_with_retries(method: str, truncated: list[dict]) -> str:
  """`method`, plus the note of `children.run_child`'s v5e retry where a truncation needed it
  (its cycles then come from a compile with XLA's VMEM memory-space assignment off)."""
  retried = [t for t in truncated if "estimator_retry" in t]
  if not retried:
    return method
  where = "" if len(retried) == len(truncated) else \
      f" (at {len(retried)} of its {len(truncated)} truncations)"
  return f"{method}; {retried[0]['estimator_retry']}{where}"


def rate(spec, chip: str) -> dict:
  """The shared driver: validate, compile the truncations in children, extrapolate."""
  from tpu_kernels import chips
  row = row_base(spec)
  try:
    row["hbm_bytes"] = spec.hbm_bytes()
    c = chips.get_chip(chip)
    row.update(spec.hand(c))
    spec.validate()
    results = {json.dumps(t): compile_in_child(spec, chip, t) for t in spec.truncations}
  except Exception as e:  # noqa: BLE001  (a failed anchor is a row, not a crash)
    msg = str(e).strip().splitlines()
    row["error"] = f"{type(e).__name__}: {msg[0][:400] if msg else ''}"
    if "child exit" in str(e):   # did the plain compile (no static profile) succeed?
      try:
        compile_in_child(spec, chip, spec.truncations[0], profile=False)
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
