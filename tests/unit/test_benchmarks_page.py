"""docs/benchmarks.md stays a page of current results: short, every result file and bench script it names exists,
and no heading repeats (a repeated "Sixth run" was how a reader lost track of which number was current)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "benchmarks.md"
MAX_LINES = 850


def _text() -> str:
    return PAGE.read_text()


def test_the_page_is_short():
    n = len(_text().splitlines())
    assert n <= MAX_LINES, f"docs/benchmarks.md has {n} lines (at most {MAX_LINES}): move history to docs/history.md"


def test_every_result_file_it_names_exists():
    text = _text()
    named = set(re.findall(r"bench/results/[\w./-]+?\.(?:json|jsonl|txt|log|png)", text))
    named |= {f"bench/results/{m}" for m in re.findall(r"`(gpu_h\d00/[\w.-]+)`", text)}  # paths under a named folder
    assert named, "no bench/results/ path found: the pattern or the page changed"
    missing = sorted(p for p in named if not (REPO / p).is_file())
    assert not missing, f"docs/benchmarks.md names result files that do not exist: {missing}"


def test_every_bench_script_it_names_exists():
    scripts = set(re.findall(r"bench/\w+\.py", _text()))
    assert scripts
    missing = sorted(s for s in scripts if not (REPO / s).is_file())
    assert not missing, f"docs/benchmarks.md names bench scripts that do not exist: {missing}"


def test_no_heading_repeats():
    headings = [line.strip() for line in _text().splitlines() if re.match(r"#{1,6} ", line)]
    repeated = sorted({h for h in headings if headings.count(h) > 1})
    assert not repeated, f"headings that repeat in docs/benchmarks.md: {repeated}"
