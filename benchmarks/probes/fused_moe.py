"""Why libtpu's static estimator cannot rate tpu-inference's fused_moe v1
(docs/performance/tpu-inference.md): the kernel at a small Qwen3-30B-A3B-shaped case
(4 tokens, 8 experts, top-8, hidden 2048, width 768; its own block sizes), compiled ahead
of time with the static profile after each step of substitutions. Every step keeps the
work of one chip:

  as-is         `FusedMoeSpec`'s program (peers/tpu_inference_ops/fused_moe.py; its routing
                scratch read as closed forms): the estimator returns 0 cycles.
  local-copies  + its remote copies (expert parallelism: rows for the mesh's other
                devices, 0 of them on a 1-chip mesh) made local copies on the same send
                semaphore, its barrier and `collective_id` dropped: the estimator now
                profiles the kernel, and aborts on the gating softmax's bf16 multiply.
  f32-softmax   + that softmax over the [bt, E] gating block in float32: it aborts on a DMA
                wait it cannot pair with a start (the kernel waits, with a size of 0, on
                copies it never started, e.g. `wait_send_bo(bt_id - 2)` at the first two
                token blocks).

Going further would change the kernel's DMA schedule, so the probe stops there.

    .venv-tpu-inference/bin/python benchmarks/probes/fused_moe.py [--chip v6e]

Each step compiles in a child (libtpu aborts the process); one line per step, in ~15 s.
"""

from __future__ import annotations

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import os  # noqa: E402
from unittest import mock  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)

STEPS = ("as-is", "local-copies", "f32-softmax")
CASE = dict(model="Qwen3-30B-A3B (reduced)", tokens=4, experts=8, top_k=8, hidden=2048,
            width=768)


@contextlib.contextmanager
def substitutions(step: str):
  """The mocks of `step` and of the steps before it, on fused_moe's kernel module."""
  from benchmarks.peers.tpu_inference_ops.common import kernel_module
  M = kernel_module("fused_moe.v1.kernel")
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
  children.enable_static_profile()   # before jax loads
  from benchmarks.cases.experts_layer import ExpertsLayer
  from benchmarks.estimator import static_estimate
  from benchmarks.peers import protocol
  from benchmarks.peers.tpu_inference_ops.fused_moe import FusedMoeSpec
  spec = FusedMoeSpec(ExpertsLayer(**CASE))
  with protocol.lowering(spec, chip), substitutions(step):
    fn, specs = spec.build([0], chip)   # at the block sizes the kernel picks (`choose`)
    compiled = static_estimate.compile_on_chip(fn, specs, chip)
    cycles, kernels = static_estimate.kernel_cycles(compiled.as_text())
  children.print_row(dict(cycles=cycles, kernels=kernels))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chip", default="v6e", choices=("v5e", "v6e"))
  parser.add_argument("--child", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  if args.child:
    child(args.child, args.chip)
    return 0
  env = children.child_env()
  env.pop("TPU_LIBRARY_PATH", None)   # the venv's own libtpu 0.0.48
  for step in STEPS:
    rows, error = children.run_child(__file__, ["--chip", args.chip, "--child", step],
                                   timeout=600, env=env)
    result = error or f"{rows[-1]['cycles']:,} cycles in {rows[-1]['kernels']} kernel"
    print(f"{step:13s} {result}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
