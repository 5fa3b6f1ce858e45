"""Nothing measured changes by being reported again (issue 58): every results table and chart,
written anew from the stored ratings alone (`python benchmarks/report.py --out DIR`: no
rating, no libtpu), is byte for byte the committed file, and every generated block of the
docs is the table its results make. A results file edited by hand, or written from other
rows than the ones committed, fails here.

The charts are compared byte for byte too: matplotlib's Agg writer puts no date or path in
a PNG (its one text chunk names matplotlib's version), so the same rows and the same
matplotlib (the lock's, requirements.txt; .venv-jax012 pins the same) give the same bytes.
About 15 s (the charts of every row).
"""

from __future__ import annotations

import pytest

from benchmarks import RESULTS
from benchmarks.reports import docs


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
  out = tmp_path_factory.mktemp("results")
  written = docs.write_results(out)
  return out, written


def test_every_results_table_and_chart_regenerates_byte_for_byte(regenerated):
  out, written = regenerated
  derived = sorted(p.relative_to(RESULTS) for p in RESULTS.rglob("*")
                   if p.suffix in (".md", ".png"))
  assert sorted(p.relative_to(out) for p in written) == derived   # none stale, none missing
  differ = [str(rel) for rel in derived
            if (out / rel).read_bytes() != (RESULTS / rel).read_bytes()]
  assert not differ, f"regenerated from the stored rows, these differ: {differ}"


def test_every_generated_block_of_the_docs_is_its_results_table():
  found = {}
  for page in docs.pages():
    for name, text in docs.blocks(page).items():
      assert name in docs.TABLES, f"{page.name}: no table named {name!r}"
      assert text == docs.block(name), f"{page.name}: block {name!r} is not its table " \
          "(python benchmarks/report.py writes it)"
      found[name] = page
  # Every kernel's summary table stands on docs/performance.md, the page that leads with them.
  summaries = {name for name in docs.TABLES if name.startswith("summary-")}
  assert {n for n, page in found.items() if page.name == "performance.md"} >= summaries
