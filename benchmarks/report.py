"""Every table and chart again, from the stored ratings alone (no rating, no TPU, no libtpu):

    python benchmarks/report.py                 results/{,jax012/}estimates.md and charts,
                                                results/calibration.md, and the generated
                                                blocks of the docs (reports/docs.py)
    python benchmarks/report.py --out DIR       the results files into DIR instead (the docs
                                                are left alone): compare them with results/
    python benchmarks/report.py --print NAME    one table on stdout (NAME: see --help)

The same rows give the same bytes (tests/release/test_results_regenerate.py): a file that
changes when this runs was edited by hand or written from other rows.
"""

import sys
from pathlib import Path

if __name__ == "__main__":   # run as a script: import `benchmarks` from the repository root
  sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse  # noqa: E402

from benchmarks.reports import docs  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", type=Path,
                      help="write the results files here (default: benchmarks/results, and the "
                           "docs' generated blocks in place)")
  parser.add_argument("--print", dest="table", choices=sorted(docs.TABLES),
                      help="print one table and write nothing")
  args = parser.parse_args(argv)
  if args.table:
    print(docs.TABLES[args.table](), end="")
    return 0
  for path in docs.write_results(args.out):
    print(f"wrote {path}")
  if args.out is None:
    for path in docs.write_blocks():
      print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
