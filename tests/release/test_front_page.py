"""The front page stays true (issue 29): README.md opens with the two commands, every
relative link of README.md, docs/**/*.md and the cards resolves (anchors included), the
TPU-VM install line is the tested lock's, and every number the front page, the cards'
openings, docs/performance.md's answer (its tables and its misses, before its Method) and the
opening of each docs/performance/ page quote is in the results file it comes from
(benchmarks/results/estimates.md, written by benchmarks/estimate.py; calibration.md; the
seed prediction; the docs' tables made from estimates.jsonl). Text only but for that last
set (benchmarks/reports, which imports jax); a few seconds."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ESTIMATES = ROOT / "benchmarks" / "results" / "estimates.md"
CALIBRATION = ROOT / "benchmarks" / "results" / "calibration.md"
SEED_PREDICTION = ROOT / "benchmarks" / "results" / "seed_prediction.json"
CARD_CHART = "estimates.png"   # scripts/build.py CARD_CHART: the chart at the Hub repo's root

TWO_COMMANDS = """# Pallas TPU kernels for PyTorch

```bash
bash scripts/setup.sh     # 1. set up .venv (+ .venv-jax012) from pinned locks, build the Hub repos, run the main job
bash scripts/test.sh      # 2. run every test, network cut, on both JAX stacks
```
"""

# A decimal number standing alone: "81.85", "1,211.24", "4.55" (of "4.55x"); not a piece of
# a version such as "0.0.42.1" or "0.12.0.1".
DECIMAL = re.compile(r"(?<![\d.])\d[\d,]*\.\d+(?![\d.])")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _cards() -> list[Path]:
  return sorted(ROOT.glob("torch-ext/*/CARD.md"))


def _docs() -> list[Path]:
  return sorted((ROOT / "docs").rglob("*.md"))


def _prose(text: str) -> str:
  """The text without fenced code blocks and inline code (links there are code, not links)."""
  text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
  return re.sub(r"`[^`\n]*`", "", text)


def _slug(heading: str) -> str:
  """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
  text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
  return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
  seen: dict[str, int] = {}
  anchors = set()
  text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)
  for line in text.splitlines():
    m = re.match(r"#{1,6} (.+)", line)
    if m:
      slug = _slug(m.group(1))
      anchors.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
      seen[slug] = seen.get(slug, 0) + 1
  return anchors


def _section(text: str, heading: str) -> str:
  start = text.index(heading)
  end = text.find("\n## ", start + len(heading))
  return text[start:] if end < 0 else text[start:end]


def _table(text: str, header_start: str) -> list[list[str]]:
  """The rows (cells stripped) of the first markdown table whose header starts so."""
  lines = text.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith(header_start))
  rows = []
  for line in lines[start + 2:]:
    if not line.startswith("|"):
      break
    rows.append([c.strip() for c in line.strip().strip("|").split("|")])
  return rows


def _number(cell: str) -> float:
  return float(DECIMAL.search(cell).group().replace(",", ""))


def test_readme_opens_with_the_two_commands():
  assert README.read_text().startswith(TWO_COMMANDS)
  assert (ROOT / "scripts" / "setup.sh").is_file() and (ROOT / "scripts" / "test.sh").is_file()


@pytest.mark.parametrize("path", [README, *_docs(), *_cards()], ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
  is_card = path.name == "CARD.md"
  broken = []
  for target in LINK.findall(_prose(path.read_text())):
    if re.match(r"[a-z]+:", target):   # https:, mailto:
      continue
    if is_card:
      # A card is the Hub repo's README: the only relative file there is the chart the
      # build ships beside it; anything else must be an absolute link.
      if target != CARD_CHART:
        broken.append(f"{target} (a card may link only {CARD_CHART} relatively)")
      continue
    file_part, _, anchor = target.partition("#")
    resolved = (path.parent / file_part).resolve() if file_part else path
    if not resolved.exists():
      broken.append(f"{target}: no such file")
    elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
      broken.append(f"{target}: no heading with anchor #{anchor}")
  assert not broken, broken


def test_install_line_is_the_tested_lock():
  """README and cards (build.toml tpu-vm-install) give one install line, and each of its
  pins is the locks' (check_install_line.tested_versions: requirements-torchtpu.txt's, the
  stack tests/torchtpu runs the real wheel on, else requirements.txt's)."""
  import check_install_line

  install = check_install_line.install_line()
  assert f"```\n{install}\n```" in _section(README.read_text(), "## Install on a TPU VM")
  tested = check_install_line.tested_versions()
  pins = {check_install_line.normalize(name): version
          for name, version in re.findall(r"([A-Za-z0-9_.\-]+)==([\w.]+)", install)}
  # The whole stack is pinned; huggingface-hub too once the index offers a newer one than
  # the locks test (transformers and kernels only bound it).
  assert set(check_install_line.STACK) - {"huggingface-hub"} <= set(pins)
  assert set(pins) <= set(check_install_line.STACK)
  assert pins == {name: tested[name] for name in pins}
  for card in _cards():
    assert "```\n{install}\n```" in card.read_text().split("## Details")[0], card


def test_headline_rows_are_the_estimates_files():
  """Each row of the README's headline table is the same case's row of estimates.md's
  targets table: our µs, efficiency, the best other's µs and the ratio, and the best
  other named by its first word (xla / jax / tokamax)."""
  perf = _section(README.read_text(), "## Performance (static estimates, not measurements)")
  assert "static estimate" in perf.splitlines()[0].lower()
  ours = _table(perf, "| case (static estimate")
  targets = {(r[0], r[1]): r for r in _table(ESTIMATES.read_text(), "| case | chip | ours µs |")}
  assert len(ours) >= 8
  for case, chip, us, efficiency, other, other_us, ratio in ours:
    row = targets.get((case, chip))
    assert row is not None, f"{case} on {chip}: not in {ESTIMATES.name}'s targets table"
    _, _, r_us, r_efficiency, _, r_other, r_other_us, r_ratio = row
    assert (us, _number(efficiency), other_us) == (r_us, _number(r_efficiency), r_other_us), case
    assert ratio == r_ratio.split()[0], case
    assert other.split()[0].lower() == r_other.split()[0].lower(), (other, r_other)


@functools.cache
def _estimate_numbers() -> frozenset[float]:
  """Every decimal of the generated results the front page may quote: the estimates, the
  calibration against real-chip times (benchmarks/calibration.py) and the seed prediction
  (benchmarks/seed_prediction.py)."""
  text = ESTIMATES.read_text() + CALIBRATION.read_text()
  numbers = {float(n.replace(",", "")) for n in DECIMAL.findall(text)}
  # The seed-prediction ratios (benchmarks/seed_prediction.py), as the README rounds them,
  # and the speed-ups that prediction is set against.
  seed = json.loads(SEED_PREDICTION.read_text())
  numbers |= {round(v, 2) for chip in seed["summary"].values() for k, v in chip.items()
              if k.endswith("_ratio")}
  return frozenset(numbers) | set(seed["seed_speedup"].values()) | _table_numbers(
      "quantized-decode", "w8a8-decode", "tpu-inference-gmm")


@functools.cache
def _table_numbers(*names: str) -> frozenset[float]:
  """The numbers of the docs' tables made from the results (benchmarks/reports/docs.py's
  TABLES; by default every one: the quantized-decode, int8-activation (w8a8) and
  tpu-inference gmm tables, with speed-ups over the best bf16 anchor and ours ÷
  tpu-inference; the experts layer's; the seed prediction's; the per-kernel summaries)."""
  from benchmarks.reports import docs
  text = "".join(docs.TABLES[name]() for name in names or docs.TABLES)
  return frozenset(float(n.replace(",", "")) for n in DECIMAL.findall(text))


def test_every_number_of_the_performance_section_is_in_the_estimates_file():
  """The README's performance section (table and prose) quotes only numbers of
  estimates.md and calibration.md; a number changed on the front page alone fails here."""
  perf = _section(README.read_text(), "## Performance (static estimates, not measurements)")
  quoted = {n for n in DECIMAL.findall(_prose(perf))}
  assert quoted, "the performance section quotes no number"
  missing = sorted(n for n in quoted if float(n.replace(",", "")) not in _estimate_numbers())
  assert not missing, missing


def _unquoted(text: str) -> list[str]:
  """The decimal numbers of `text` (its prose) that no results file, nor a docs table made
  from them, holds."""
  known = _estimate_numbers() | _table_numbers()
  return sorted({n for n in DECIMAL.findall(_prose(text))
                 if float(n.replace(",", "")) not in known})


def test_the_performance_page_leads_with_numbers_of_the_results():
  """docs/performance.md opens with the answer: one table per kernel (generated: see
  tests/release/test_results_regenerate.py), then the misses, each with its reason, before
  the method. Every number of the answer and the misses is in the results."""
  text = (ROOT / "docs" / "performance.md").read_text()
  headings = re.findall(r"^## (.+)$", text, re.M)
  assert headings[:2] == ["The answer, kernel by kernel", "Where it misses, and why"]
  assert headings.index("Method") > headings.index("Where it misses, and why")
  answer = text[:text.index("\n## ", text.index("\n## Where it misses, and why") + 1)]
  assert answer.count("<!-- generated: summary-") >= 4
  assert not _unquoted(answer)


@pytest.mark.parametrize("page", sorted((ROOT / "docs" / "performance").glob("*.md")),
                         ids=lambda p: p.name)
def test_each_performance_page_opens_with_numbers_of_the_results(page):
  """A derivation page opens (before its first section) with what it derives, in numbers of
  the results; the derivation below holds hand counts and intermediate ratings as well."""
  text = page.read_text()
  assert text.startswith("# ") and "\n## " in text
  assert not _unquoted(text[:text.index("\n## ")])


@pytest.mark.parametrize("card", _cards(), ids=lambda p: p.parent.name)
def test_card_opening_quotes_the_estimates_file(card):
  """A card's first screen (before Details) quotes speed from estimates.md: every number
  with two decimals (µs, efficiencies, ratios) of its Performance section and of any line
  giving µs is there; rounded figures (661 µs, 32.5 ms) are checked by eye."""
  opening = _prose(card.read_text().split("## Details")[0])
  speed = _section(opening, "## Performance (static estimates") + "\n".join(
      l for l in opening.splitlines() if "µs" in l)
  quoted = [n for n in DECIMAL.findall(speed) if re.fullmatch(r"[\d,]+\.\d\d", n)]
  missing = sorted(n for n in quoted if float(n.replace(",", "")) not in _estimate_numbers())
  assert not missing, missing
  assert "{chart}" in opening and "static estimates, not measured" in opening.lower()


@pytest.mark.parametrize("chart", sorted((ROOT / "benchmarks" / "results").rglob("*.png")),
                         ids=lambda p: str(p.relative_to(ROOT / "benchmarks" / "results")))
def test_every_chart_is_a_whole_png(chart):
  """Every chart the front page and the cards show decodes to its last row: a rating run
  stopped mid-write (on a full disk, 2026-12-05) once left estimates.png truncated, which
  git took as a change like any other."""
  from PIL import Image   # matplotlib's own dependency, in .venv
  with Image.open(chart) as image:
    image.load()
    assert image.width > 0 and image.height > 0
