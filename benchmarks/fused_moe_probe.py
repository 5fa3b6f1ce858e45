"""Why libtpu's static estimator cannot rate tpu-inference's fused_moe v1 (docs/performance.md,
tpu-inference): the kernel at a small Qwen3-30B-A3B-shaped case (4 tokens, 8 experts, top-8,
hidden 2048, width 768; its own block sizes), compiled ahead of time with the static
profile after each step of substitutions. Every step keeps the work of one chip:

  as-is         `anchors_tpu_inference.FusedMoeSpec`'s program (its routing scratch read as
                closed forms): the estimator returns 0 cycles.
  local-copies  + its remote copies (expert parallelism: rows for the mesh's other
                devices, 0 of them on a 1-chip mesh) made local copies on the same send
                semaphore, its barrier and `collective_id` dropped: the estimator now
                profiles the kernel, and aborts on the gating softmax's bf16 multiply.
  f32-softmax   + that softmax over the [bt, E] gating block in float32: it aborts on a DMA
                wait it cannot pair with a start (the kernel waits, with a size of 0, on
                copies it never started, e.g. `wait_send_bo(bt_id - 2)` at the first two
                token blocks).

Going further would change the kernel's DMA schedule, so the probe stops there.

    .venv-tpu-inference/bin/python benchmarks/fused_moe_probe.py [--chip v6e]

Each step compiles in a child (libtpu aborts the process); one line per step, in ~15 s.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "kernels"))

import tuning  # noqa: E402  (no jax)

STEPS = ("as-is", "local-copies", "f32-softmax")
CASE = dict(model="Qwen3-30B-A3B (reduced)", tokens=4, experts=8, top_k=8, hidden=2048,
            width=768)


@contextlib.contextmanager
def substitutions(step: str):
  """The mocks of `step` and of the steps before it, on fused_moe's kernel module."""
  import anchors_tpu_inference as TI
  M = TI.kernel_module("fused_moe.v1.kernel")
  with contextlib.ExitStack() as stack:
    patch = lambda target, name, new: stack.enter_context(mock.patch.object(target, name, new))
    if STEPS.index(step) >= STEPS.index("local-copies"):
      local_copy = M.pltpu.make_async_copy
      params = M.pltpu.CompilerParams
      patch(M.pltpu, "make_async_remote_copy", lambda src_ref, dst_ref, send_sem, recv_sem, **_:
            local_copy(src_ref, dst_ref, send_sem))
      patch(M.pl, "semaphore_signal", lambda *a, **k: None)
      patch(M.pl, "semaphore_wait", lambda *a, **k: None)
      patch(M.pltpu, "get_barrier_semaphore", lambda: None)
      patch(M.pltpu, "CompilerParams", lambda *a, collective_id=None, **k: params(*a, **k))
    if STEPS.index(step) >= STEPS.index("f32-softmax"):
      import jax.numpy as jnp
      scoring = M.apply_scoring_fn
      patch(M, "apply_scoring_fn",
            lambda fn, x: scoring(fn, x.astype(jnp.float32)).astype(x.dtype))
    yield


def child(step: str, chip: str) -> None:
  tuning.enable_static_profile()   # before jax loads
  import anchors
  import anchors_tpu_inference as TI
  import headline
  spec = TI.FusedMoeSpec(headline.ExpertsLayer(**CASE))
  with anchors.lowering(spec, chip), substitutions(step):
    fn, specs = spec.build([0], chip)   # at the block sizes the kernel picks (`choose`)
    cycles, kernels = anchors._kernel_cycles(anchors._compile(fn, specs, chip).as_text())
  tuning.print_row(dict(cycles=cycles, kernels=kernels))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chip", default="v6e", choices=("v5e", "v6e"))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.child:
    child(args.child, args.chip)
    return 0
  env = tuning.child_env()
  env.pop("TPU_LIBRARY_PATH", None)   # the venv's own libtpu 0.0.48
  for step in STEPS:
    rows, error = tuning.run_child(__file__, ["--chip", args.chip, "--child", step],
                                   timeout=600, env=env)
    result = error or f"{rows[-1]['cycles']:,} cycles in {rows[-1]['kernels']} kernel"
    print(f"{step:13s} {result}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
