"""The main job: build the kernel repos, load one as a user would, run a kernelized model,
and show that every kernel compiles for each TPU generation.

    python scripts/demo.py [--dist DIR]

1. scripts/build.py writes dist/<kernel>/ for every ready kernel of build.toml.
2. `get_kernel("<org>/rms-norm-tpu", version=1)` loads it through the real `kernels`
   loader (LOCAL_KERNELS points the repo id at dist/, since the Hub is not reachable here).
3. A tiny randomly initialised Qwen3 model is kernelized (its RMSNorms run the Pallas
   kernel, in interpret mode on this CPU) and generates tokens next to the stock model.
4. Each kernel is compiled ahead of time with libtpu for v5e / v6e / v5p (no TPU needed).
Exits non-zero if the tokens differ or a compile fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import build  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--dist", type=Path, default=ROOT / "dist", help="where to build")
  dist = parser.parse_args(argv).dist.resolve()
  manifest = build.load_manifest()
  org = manifest["collection"]["hub-org"]
  print("== 1. building the kernel repos")
  ready = build.ready_kernels(manifest)
  for name in ready:
    print(f"   {name}: {build.build_kernel(name, manifest, dist)}")
  os.environ["LOCAL_KERNELS"] = ":".join(f"{org}/{n}={dist / n}" for n in ready)

  print(f"== 2. get_kernel('{org}/rms-norm-tpu', version=1)")
  import torch
  from kernels import get_kernel

  import transformers_integration as ti

  rms = get_kernel(f"{org}/rms-norm-tpu", version=1)
  print(f"   loaded {rms.__name__} from {Path(rms.__file__).parent}")

  print("== 3. kernelize a tiny Qwen3 (random weights) and generate greedily on CPU")
  stock = ti.tiny_model("qwen3", torch.float32)
  kernelized = ti.tiny_model("qwen3", torch.float32)
  kernelized.load_state_dict(stock.state_dict())
  ti.kernelize_rms_norm(kernelized, f"{org}/rms-norm-tpu")
  print(f"   {len(ti.rms_norm_modules(kernelized))} RMSNorm modules now run the Pallas kernel "
        "(interpret mode on CPU)")
  prompt = torch.tensor([[5, 17, 42, 99, 7, 64]])
  start = time.perf_counter()
  expected = stock.generate(prompt, max_new_tokens=8, do_sample=False)
  got = kernelized.generate(prompt, max_new_tokens=8, do_sample=False)
  same = torch.equal(got, expected)
  print(f"   stock:      {expected[0, prompt.shape[1]:].tolist()}")
  print(f"   kernelized: {got[0, prompt.shape[1]:].tolist()}  "
        f"{'MATCH' if same else 'MISMATCH'} ({time.perf_counter() - start:.1f} s)")

  print("== 4. ahead-of-time compiles with libtpu (the real TPU compiler; no TPU here)")
  import aot_summary

  compile_failures = aot_summary.main()
  print("== summary: " + ("tokens match, all kernels compile" if same and not compile_failures
                          else "FAILED"))
  return 0 if same and not compile_failures else 1


if __name__ == "__main__":
  sys.exit(main())
