"""Tunes paged attention's decode block_kv with libtpu's static estimate; writes the table.

    python benchmarks/tune_paged_attention.py [--out kernels/tpu_kernels/paged_attention_tuned.py]

For every key of the grid below (chip, cache dtype, page size, head_dim, KV heads), each
block_kv candidate that the kernel allows (a multiple of the page size, at most 64 pages,
within the VMEM budget) is rated with benchmarks/paged_estimate.py on a uniform decode
batch (G = 4 query heads per KV head, 8192 tokens of context); the candidate with the
fewest estimated cycles wins (ties: the larger block, fewer grid steps). Every
candidate's estimate goes to benchmarks/results/paged_tuning.jsonl, and the winners to
the generated table module, which ships with the kernel. Static estimates, not
measurements. About 10 minutes. Each key is rated in its own subprocess: the estimator's
memory grows with every compile of a process (one process rating the whole grid reached
22 GB and was killed).

v6e only: on v5e, libtpu 0.0.42's static profile aborts the process on this kernel (an
LLO_CHECK in a vunpack, "Expected vector-int16, got vector-int32"; the same kernel
compiles for v5e without the profile flag, see tests/jax/test_paged_attention_aot.py).
v5e shapes therefore take the heuristic tiling.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import paged_estimate  # noqa: E402  (sets the static-profile flag before jax loads)
import jax.numpy as jnp  # noqa: E402

from tpu_kernels import chips, paged_attention as PA, vmem  # noqa: E402

CHIPS = ("v6e",)
CONTEXT = 8192
GROUP = 4


def grid() -> list[PA.TuningKey]:
  """The decode buckets tuned so far: Llama-3-8B-like heads (32 / 8, D 128) at the page
  sizes serving engines use, bf16 and int8 caches. Other buckets use the heuristic."""
  return [PA.TuningKey(chip, kv_dtype, page_size, 128, 8) for chip in CHIPS
          for kv_dtype in ("bfloat16", "int8") for page_size in (16, 64, 256)]


def candidates(key: PA.TuningKey) -> list[int]:
  chip = chips.get_chip(key.chip)
  budget = vmem.vmem_budget(chip, None)
  out = []
  for block_kv in PA._BLOCK_KV_CANDIDATES:
    if block_kv % key.page_size or block_kv // key.page_size > PA._MAX_PAGES_PER_BLOCK \
        or block_kv > CONTEXT:
      continue
    t = PA.paged_tiling(1, 1, CONTEXT // key.page_size, key.page_size, key.head_dim,
                        num_kv_heads=key.num_kv_heads, group=GROUP, q_dtype=jnp.bfloat16,
                        kv_dtype=jnp.dtype(key.kv_dtype), chip=key.chip, block_kv=block_kv)
    if t.vmem_plan_bytes <= budget:
      out.append(block_kv)
  return out


def module_text(table: dict[PA.TuningKey, int]) -> str:
  head = (ROOT / "kernels/tpu_kernels/paged_attention_tuned.py").read_text().split(
      "BLOCK_KV:")[0]
  lines = [head + "BLOCK_KV: dict[tuple[str, str, int, int, int], int] = {"]
  for key in sorted(table):
    lines.append(f"    ({key.chip!r}, {key.kv_dtype!r}, {key.page_size}, {key.head_dim}, "
                 f"{key.num_kv_heads}): {table[key]},")
  lines.append("}")
  return "\n".join(lines) + "\n"


def rate(key: PA.TuningKey) -> list[dict]:
  """Every candidate of one key, estimated in this process."""
  case = paged_estimate.PagedDecode(CONTEXT, 64, GROUP * key.num_kv_heads, key.num_kv_heads,
                                   key.head_dim, key.page_size, key.kv_dtype)
  return [paged_estimate.estimate(case, key.chip, block_kv) for block_kv in candidates(key)]


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", default=str(ROOT / "kernels/tpu_kernels/paged_attention_tuned.py"))
  p.add_argument("--log", default=str(ROOT / "benchmarks/results/paged_tuning.jsonl"))
  p.add_argument("--key", help=argparse.SUPPRESS)   # internal: rate one key, print JSON lines
  a = p.parse_args(argv)
  if a.key:
    for row in rate(PA.TuningKey(*json.loads(a.key))):
      print("ROW " + json.dumps(row), flush=True)
    return 0
  table = {}
  with open(a.log, "w") as log:
    for key in grid():
      result = subprocess.run(
          [sys.executable, __file__, "--key", json.dumps(dataclasses.astuple(key))],
          capture_output=True, text=True, check=True)
      rows = [json.loads(line[4:]) for line in result.stdout.splitlines()
              if line.startswith("ROW ")]
      for row in rows:
        log.write(json.dumps(row) + "\n")
        print(f"{key}: block_kv {row['block_kv']}: {row['estimated_cycles']} cycles", flush=True)
      table[key] = -min((r["estimated_cycles"], -r["block_kv"]) for r in rows)[1]
  Path(a.out).write_text(module_text(table))
  print(f"wrote {a.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
