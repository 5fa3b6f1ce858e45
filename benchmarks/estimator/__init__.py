"""The instrument: libtpu's static cycle estimate (and XLA's cost model), driven from CPU.

What it is, and what it cannot see (docs/performance.md: the method and the blind spots):
  * each Mosaic kernel of a program compiled ahead of time with the static profile on
    carries `estimated_cycles`: the bundles really issued plus DMA-wait stalls, identical
    run to run;
  * it does not cap HBM bandwidth, so a rating predicts max(cycles / clock, bytes really
    moved / HBM bandwidth), the bytes counted by replaying the grid (`visible.replay`);
  * it reads every SMEM / scalar-prefetch value as 0 (`visible`: the case's values shown
    as closed forms), rates kernels with 3-D blocks 0 cycles, loses values a kernel
    carries across grid steps in scratch, and may abort the process (an LLO_CHECK) or take
    minutes and gigabytes on big grids (`children`: one rating per process; big grids are
    rated truncated and extrapolated by each rating method);
  * it crashes on XLA's ragged_dot: plain XLA programs are rated by XLA's cost_analysis
    (`xla_cost`).

  children.py         one rating per child process: the profile flag, ROW lines, the v5e retry
  static_estimate.py  compiling for a chip; reading the cycles of kernels and ops
  visible.py          SMEM values shown to the estimator; grid replay; answering for the chip
  xla_cost.py         plain XLA programs by cost_analysis, or op by op (the glue)
"""
