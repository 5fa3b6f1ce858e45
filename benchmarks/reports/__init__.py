"""Tables and charts, written from the stored ratings alone (benchmarks/results/): nothing
here rates anything, so regenerating every file from the same rows gives the same bytes
(tests/release/test_results_regenerate.py checks it).

  estimates.py   results/estimates.md (every row; the targets table the README quotes)
  charts.py      results/estimates.png and estimates-<kernel>.png
  calibration.py results/calibration.md
  tables.py      the docs' tables made from results (quantized decode, tpu-inference's gmm,
                 the experts layer, the seed prediction)
  summary.py     docs/performance.md's opening: one table per kernel (ours, the best peer,
                 the ratio, the efficiency, per chip)
  docs.py        the generated blocks of the docs, and writing them
  wallclock.py   benchmarks/wallclock.py's tables

`python benchmarks/report.py` writes them all again (report.py's docstring).
"""
