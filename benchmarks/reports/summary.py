"""docs/performance.md's opening: the answer, one table per kernel, from results/estimates.jsonl.

For each kernel (a Hub repo: `case.kernel`), its headline cases (or, for a kernel with none,
its first family's) row by row, per chip: our prediction, its efficiency against the target,
the best other implementation rated beside it (XLA's or a peer's) and ours against it,
exactly as results/estimates.md's targets table has them (reports/estimates.py). Then each
other family of the kernel's cases (cases/) in
one row per chip: how many cases, the range of our predictions and efficiencies, how many
meet the target, and the range of ours against the best other, with how many are slower.
Every number is a row's own, formatted as estimates.md formats it.
"""

from __future__ import annotations

from benchmarks import cases
from benchmarks.peers.protocol import OURS
from benchmarks.reports.estimates import targets

TARGETS_HEADER = ("| case | chip | ours µs | efficiency | target | best other | its µs "
                  "| ours vs best |")


def _family_of() -> dict:
  return {c.name: family for family in cases.families() for c in family.CASES}


def best_other(rows: list[dict], r: dict) -> dict | None:
  others = [o for o in rows if o["case"] == r["case"] and o["chip"] == r["chip"]
            and o["source"] != OURS and "predicted_us" in o]
  return min(others, key=lambda o: o["predicted_us"], default=None)


def _span(values: list[float], fmt: str, suffix: str = "") -> str:
  low, high = min(values), max(values)
  if f"{low:{fmt}}" == f"{high:{fmt}}":
    return f"{low:{fmt}}{suffix}"
  return f"{low:{fmt}}{suffix} - {high:{fmt}}{suffix}"


def family_rows(rows: list[dict], family, kernel: str) -> list[str]:
  """One line per chip: the family's cases of `kernel` in ranges."""
  names = {c.name for c in family.CASES if c.kernel == kernel}
  out = []
  for chip in sorted({r["chip"] for r in rows}):
    mine = [r for r in rows if r["case"] in names and r["chip"] == chip and r["source"] == OURS]
    rated = [r for r in mine if "predicted_us" in r]
    if not mine:
      continue
    label = family.__name__.rsplit(".", 1)[-1].replace("_", " ")
    if not rated:
      out.append(f"| {label} ({len(names)} cases) | {chip} | none rated ||||")
      continue
    met = sum(r["efficiency"] >= r["target"] for r in rated)
    versus = [(b["predicted_us"] / r["predicted_us"]) for r in rated
              if (b := best_other(rows, r)) is not None]
    slower = sum(v < 1 - 0.005 for v in versus)   # within half a percent is level
    ratio = (_span(versus, ".2f", "x") + (f" (slower in {slower})" if slower else "")
             if versus else "no other rated")
    unrated = f", {len(mine) - len(rated)} not rated" if len(rated) < len(mine) else ""
    out.append(f"| {label} ({len(rated)} cases{unrated}) | {chip} "
               f"| {_span([r['predicted_us'] for r in rated], ',.2f')} "
               f"| {_span([r['efficiency'] for r in rated], '.2f')} | {met} of {len(rated)} "
               f"| {ratio} |")
  return out


def kernel_table(rows: list[dict], kernel: str) -> str:
  """Markdown: the kernel's leading family row by row (estimates.md's targets table; the
  headline's, or for a kernel with no headline cases its first family's), then its other
  families in ranges."""
  family_of = _family_of()
  lead, *others = [f for f in cases.families() if any(c.kernel == kernel for c in f.CASES)]
  leading = [r for r in rows if r["kernel"] == kernel and family_of.get(r["case"]) is lead]
  lines = targets(leading)
  start = lines.index(TARGETS_HEADER)
  out = lines[start:]
  family_lines = [line for family in others for line in family_rows(rows, family, kernel)]
  if family_lines:   # families whose cases have no rows yet add nothing
    out += ["", "| family | chip | ours µs | efficiency | target met | ours vs best other |",
            "|---|---|---:|---:|---:|---:|", *family_lines]
  return "\n".join(out) + "\n"


def kernels(rows: list[dict]) -> list[str]:
  """The kernels with rows, in the headline's order."""
  order = [c.kernel for c in cases.all_cases()]
  return sorted({r["kernel"] for r in rows if r.get("kernel")}, key=order.index)
