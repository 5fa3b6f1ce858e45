"""Calibration: this project's static estimator against tokamax's times measured on real TPUs.

    .venv-jax012/bin/python benchmarks/calibration.py [--thorough] [--chips v5e v6e]
                                                      [--families ...] [--out benchmarks/results]

tokamax 0.0.17 (installed in .venv-tokamax-jax012) ships autotuning caches timed on real
chips: `tokamax/data/autotuning/<chip dir>/<op>.json`, keyed by the op's arguments (shapes,
mask, group sizes), each with the configs tried and their `evaluation_times_ms`. For every
timed (entry, config) of the families below, this rates the same kernel, at the same shape and
config, by the method every row of results/estimates.md uses (estimate.py's docstring):

    predicted_us = max(cycles / clock, hbm_bytes / hbm_bandwidth) (+ the op's XLA glue)
    ratio        = measured_us / predicted_us      (measured = median of the timed runs)

  flash_attention   tokamax's `dot_product_attention` mosaic op (pallas_mosaic_tpu_flash_
                    attention.json): its splash fork on [H, T, D] per batch element, at the
                    entry's block sizes, layouts, scheduler and exp flavour. Rated like
                    peers/tokamax_ops.py's TokamaxAttentionAnchor: the six SMEM block lists
                    are closed forms of the causal (or full) block list, checked against
                    tokamax's own process_mask; the whole grid of a head is compiled at 2 and 4
                    heads (for GQA: g and 2g heads), extrapolated linearly to batch x heads (the op
                    vmaps the kernel over the batch: one more grid axis). The op also scales q and
                    moves q, k, v and the output between [B, T, H, D] and [B, H, T, D] with XLA:
                    those bytes (read + write of each) are added at HBM bandwidth.
  splash_attention  tokamax's experimental `splash_attention` op (splash_attention.json): the
                    same kernel on [H, T, D] (no glue), at the op's heuristic config (the
                    cache records the config as "{}": the op's own choice).
  ragged_dot        tokamax's `ragged_dot` mosaic op (pallas_mosaic_tpu_ragged_dot.json),
                    forward layout only (lhs [m, k] x rhs [G, k, n]): tokamax_ops.TokamaxGmmAnchor
                    at the entry's tiling and input_buffer_count, with the entry's own group
                    sizes (tokamax's seeded random draw for {num_groups, total_size} keys): the
                    active-tile count and the replayed HBM bytes come from them (checked
                    against tokamax's make_group_metadata), the kernel is compiled at 4 and 8
                    active tiles and extrapolated.
  ragged_dot_v2     pallas_mosaic_tpu_v2_ragged_dot.json: listed, not rated (see V2_NOT_RATED).

Entries that are not the plain forward kernel (bias / boolean masks, dropout, transposed
ragged dims, quantized or non-bf16 operands, ragged_dot's return_residuals keys, which time
more than the forward product) are listed with the reason and not rated.

Writes <out>/calibration.jsonl (one row per rated or skipped entry) and <out>/calibration.md
(per entry, and per family x chip: median ratio and spread; reports/calibration.py).
`expected_factor(chip, kernel)` (rating/calibration.py) is the "expected on hardware" factor
estimate.py's table applies to its static predictions. The library is rating/calibration.py
(the caches, the rating, the summaries) and rating/calibration_specs.py (the kernels rated at
the entries). Nothing here runs on a TPU: the measured times are tokamax's, the predictions
are ours.
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402

from benchmarks import RESULTS, read_rows, write_rows  # noqa: E402
from benchmarks.rating.calibration import (FAMILY_FILES, chosen_entries, predicted,  # noqa: E402
                                           rate)
from benchmarks.reports import calibration as report  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--chips", nargs="+", default=["v5e", "v6e"])
  parser.add_argument("--families", nargs="+", default=list(FAMILY_FILES))
  parser.add_argument("--thorough", action="store_true", help="every entry (hours)")
  parser.add_argument("--out", type=Path, default=RESULTS)
  parser.add_argument("--retry-failed", action="store_true",
                      help="keep --out's rated rows, re-rate only the entries whose rating failed")
  parser.add_argument("--markdown-only", action="store_true",
                      help="recompute the arithmetic of --out's calibration.jsonl and rewrite "
                           "calibration.md (no rating)")
  args = parser.parse_args(argv)
  if args.markdown_only:   # recompute each rated row's arithmetic, rewrite the outputs
    from tpu_kernels import chips
    rows = [dict(r, **predicted(r, chips.get_chip(r["chip"]))) if r.get("rated") else r
            for r in read_rows(args.out / "calibration.jsonl")]
    write_rows(args.out / "calibration.jsonl", rows)
    (args.out / "calibration.md").write_text(report.markdown(rows))
    return 0
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  old = {(r["family"], r["chip"], r["entry"], json.dumps(r["config"])): r
         for r in read_rows(args.out / "calibration.jsonl")} if args.retry_failed else {}
  rows = []
  for entry in chosen_entries(args.chips, args.families, args.thorough):
    kept = old.get((entry.family, entry.chip, entry.name, json.dumps(entry.cfg)))
    if kept and (kept.get("rated") or kept["error"].startswith("not rated:")):
      rows.append(kept)
      continue
    rows.append(rate(entry))
    print(json.dumps({k: v for k, v in rows[-1].items() if k != "truncated"}), file=sys.stderr,
          flush=True)
  args.out.mkdir(parents=True, exist_ok=True)
  write_rows(args.out / "calibration.jsonl", rows)
  table = report.markdown(rows)
  (args.out / "calibration.md").write_text(table)
  print(table)
  return 0


if __name__ == "__main__":
  sys.exit(main())
