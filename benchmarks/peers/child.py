"""The child process a peer's kernel is compiled in, in the peer's own venv (protocol.py):

    python benchmarks/peers/child.py compile KEY CHIP TRUNC   one truncation, compiled for CHIP
        with the static profile (ANCHOR_STATIC_PROFILE=0: without), one ROW line
        {cycles, kernels, seconds, peak_rss_mb}
    python benchmarks/peers/child.py choose KEY CHIP          the config the peer's kernel picks
        for the whole case on CHIP (tpu-inference's), one ROW line

KEY is a spec's key (`benchmarks.peers.spec_by_key`). The profile flag is set here, before
jax loads; the parent never sets it for its children.
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[2])

import json  # noqa: E402
import os  # noqa: E402
import resource  # noqa: E402
import time  # noqa: E402

from benchmarks.estimator import children  # noqa: E402  (no jax)


def compile_truncation(key: str, chip: str, trunc_json: str) -> None:
  from benchmarks import peers
  from benchmarks.estimator import static_estimate
  from benchmarks.peers import protocol
  spec = peers.spec_by_key(key)
  trunc = json.loads(trunc_json)
  start = time.time()
  with protocol.lowering(spec, chip):
    fn, specs = spec.build(trunc, chip)
    compiled = static_estimate.compile_on_chip(fn, specs, chip)
  text = compiled.as_text()
  if os.environ.get("ANCHOR_STATIC_PROFILE", "1") == "1":
    cycles, count = static_estimate.kernel_cycles(text)
  else:
    cycles, count = None, text.count('custom_call_target="tpu_custom_call"')
  children.print_row(dict(cycles=cycles, kernels=count, seconds=round(time.time() - start, 1),
                          peak_rss_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024))


def choose(key: str, chip: str) -> None:
  from benchmarks import peers
  from benchmarks.peers import protocol
  spec = peers.spec_by_key(key)
  with protocol.lowering(spec, chip):
    children.print_row(spec.choose(chip))


def main(argv: list[str]) -> int:
  mode, *args = argv
  if mode == "compile" and os.environ.get("ANCHOR_STATIC_PROFILE", "1") == "1":
    children.enable_static_profile()   # before jax loads
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  {"compile": compile_truncation, "choose": choose}[mode](*args)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
