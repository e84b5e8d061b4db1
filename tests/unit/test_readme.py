"""README.md is a product page a new user reads first, and docs/guide.md the reference it points to.

Why: the README's first lines are the two commands a user runs on a fresh machine, its Python example is the one a
user copies, and its links are how a reader gets to the rest; each of those breaks silently when code or files
move. These checks read the files as they are in the checkout.
"""

from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import pytest

import relayrl

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "guide.md"
COMMANDS = ["bash scripts/setup.sh && .venv/bin/relayrl train --config examples/arithmetic_grpo.yaml",
            "bash .ci/run"]
MAX_LINES, MAX_WIDTH = 200, 200
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each code block in order: fenced (```lang) and indented (4 spaces after a blank line)."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((line[3:].strip(), "\n".join(lines[i + 1:end])))
            i = end + 1
        elif line.startswith("    ") and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            blocks.append(("", "\n".join(x[4:] for x in lines[i:end]).strip()))
            i = end
        else:
            i += 1
    return blocks


def heading_anchors(text: str) -> set[str]:
    """The anchors GitHub gives a Markdown file's headings (outside code blocks)."""
    anchors, fenced = set(), False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def broken_links(doc: Path) -> list[str]:
    """Relative links of `doc` whose file, or whose heading anchor in a Markdown file, does not exist."""
    text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code is not linked
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        if not file.exists():
            bad.append(f"{target}: no file {file.relative_to(ROOT) if file.is_relative_to(ROOT) else file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            bad.append(f"{target}: no heading #{anchor} in {file.name}")
    return bad


def test_readme_is_short_and_narrow():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines; reference material goes to docs/guide.md"
    wide = [f"line {i}: {len(x)} chars" for i, x in enumerate(lines, 1) if len(x) > MAX_WIDTH]
    assert not wide, wide


def test_readme_starts_with_the_two_commands():
    blocks = code_blocks(README.read_text())
    assert [code for _, code in blocks[:2]] == COMMANDS
    head = README.read_text().split(COMMANDS[1])[0]
    assert head.count("\n") < 12, "the two commands are the first thing a reader sees"


@pytest.mark.parametrize("doc", [README, GUIDE], ids=lambda p: p.name)
def test_relative_links_point_to_files_that_exist(doc):
    assert LINK.findall(doc.read_text()), f"{doc.name} has no links: the parser is wrong"
    assert broken_links(doc) == []


def test_guide_stays_a_guide():
    assert len(GUIDE.read_text().splitlines()) <= 500


def train_calls(code: str) -> list[ast.Call]:
    """Calls of relayrl.train / train in `code`."""
    def name(f: ast.expr) -> str:
        return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
    return [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Call) and name(n.func) == "train"]


def test_readme_python_example_calls_train_as_it_is():
    python = [code for lang, code in code_blocks(README.read_text()) if lang == "python"]
    assert python, "README.md has no ```python block (the 'Train your own' example)"
    code = python[0]
    assert len(code.splitlines()) <= 10, "the README's example stays at most 10 lines"
    compile(code, "README.md", "exec")
    calls = train_calls(code)
    assert calls, "the README's example does not call relayrl.train"
    accepted = set(inspect.signature(relayrl.train).parameters)
    for call in calls:
        given = {k.arg for k in call.keywords}
        assert given <= accepted, f"relayrl.train takes no {sorted(given - accepted)}; it takes {sorted(accepted)}"
        assert {"model", "dataset", "reward"} <= given


def test_the_checks_catch_a_broken_page(tmp_path):
    """The same checks on a page with a wrong command, a dead link and an argument train does not take."""
    page = tmp_path / "README.md"
    page.write_text("# x\n\n    bash scripts/setup.sh\n\nTests:\n\n    bash .ci/run\n\n"
                    "[a](docs/nope.md) [b](#nowhere)\n\n"
                    "```python\nimport relayrl\nrelayrl.train(model='m', data=[], reward=len)\n```\n")
    assert [c for _, c in code_blocks(page.read_text())][:2] != COMMANDS
    assert len(broken_links(page)) == 2
    (call,) = train_calls(code_blocks(page.read_text())[2][1])
    assert {k.arg for k in call.keywords} - set(inspect.signature(relayrl.train).parameters) == {"data"}


def test_guide_python_blocks_compile():
    blocks = [code for lang, code in code_blocks(GUIDE.read_text()) if lang == "python"]
    assert blocks
    for code in blocks:
        compile(code, "docs/guide.md", "exec")
