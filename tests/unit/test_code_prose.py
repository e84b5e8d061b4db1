"""The package's comments and docstrings say why the code does what it does, in the repository's own terms: no
references to documents outside it (the design notes it grew from: "seed 001", seeds/, DESIGN.md, ../shared), no
CPU models and no dates. Those belong to what one run measured, and docs/benchmarks.md records them with their
machine and date; the code points there. Read with `tokenize`, nothing is imported; code and other strings (log
messages, error texts) are not checked here."""

from __future__ import annotations

import io
import re
import tokenize
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "relayrl"

# what a comment or docstring must not say, and why
FORBIDDEN = {
    "a document outside the repository": re.compile(
        r"\bseeds?\s+00\d\b|\bseeds/|\bDESIGN\.md\b|\.\./shared\b|\bshared/reference\b"),
    "a CPU model (one machine's measurement)": re.compile(
        r"\bEPYC\b|\bXeon\b|\bZen\s?[1-5]\b|\bSapphire\s+Rapids\b|\bGraviton\s?\d*\b", re.IGNORECASE),
    "a date (when a run was measured)": re.compile(r"\b20\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])\b"),
}
# a string token is a docstring (or another bare string statement) when it starts a logical line
_STATEMENT_START = {tokenize.NEWLINE, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING, None}


def prose(source: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every comment line and docstring line in `source`."""
    previous = None
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
        elif tok.type == tokenize.STRING and previous in _STATEMENT_START:
            for offset, line in enumerate(tok.string.splitlines()):
                yield tok.start[0] + offset, line
        if tok.type not in (tokenize.COMMENT, tokenize.NL):
            previous = tok.type


def offences(source: str) -> list[tuple[int, str, str]]:
    """(line, why, text) for each comment or docstring line that matches a FORBIDDEN pattern."""
    return [(line, why, text.strip()) for line, text in prose(source)
            for why, pattern in FORBIDDEN.items() if pattern.search(text)]


def test_comments_and_docstrings_cite_no_run_and_no_outside_document():
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {why}: {text}"
             for path in sorted(ROOT.rglob("*.py")) for line, why, text in offences(path.read_text())]
    assert not found, ("say why in the code's own terms; figures go to docs/benchmarks.md, which the code may "
                       "point to:\n" + "\n".join(found))


def test_the_scan_finds_each_kind_in_comments_and_docstrings_only():
    source = '''"""Module docstring: the reward follows seed 001."""
import os  # measured on an AMD EPYC (Zen 3)


def f():
    """Rounded stochastically.

    Seen on a Sapphire Rapids Xeon, 2026-11-24 (DESIGN.md; ../shared/notes)."""
    x = "seed 002 on a Graviton3, 2026-11-25"  # not prose: a string in code
    return x


class C:
    # see seeds/003 for the loop
    """Class docstring on a Zen 4."""
'''
    hits = offences(source)
    by_line = {line: {why for ln, why, _ in hits if ln == line} for line, _, _ in hits}
    outside, cpu, date = FORBIDDEN
    assert by_line == {1: {outside}, 2: {cpu}, 8: {outside, cpu, date}, 14: {outside}, 15: {cpu}}


def test_the_scan_lets_the_code_own_words_pass():
    source = '''"""Seeded sampling: a request's seed (e.g. 1234) gives the same tokens; docs/design.md explains why.

Zenodo, xeonic and epycycle are not CPU models; 2026 alone, or 1e-5, is not a date; seeds 1 and 2 are fine."""
SEED = 0o01  # seed 0, seed 10 and seed 100 name random seeds, not documents
'''
    assert offences(source) == []
