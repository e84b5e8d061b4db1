"""What each config key means, read from the schema's own comments: `--help-config` and docs/config.md.

The schema (relayrl/config/schema.py) documents a key with a comment on its line or on the lines just above
it. Reading those comments keeps one source of truth: the meaning sits beside the default it explains, and
a key without one fails `tests/unit/test_config_docs.py`. docs/config.md is generated from here
(`python -m relayrl.config.docs > docs/config.md`; the same test fails when the file is stale).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import sys
import textwrap
import tokenize
from collections.abc import Iterator
from typing import Any, NamedTuple, get_args

from relayrl.config.loader import _MISSING, _required, _schema, _type_name


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field name: its comment} for a dataclass: the comment on the field's line, else the comment lines
    right above it (joined); fields without either are absent."""
    source = textwrap.dedent(inspect.getsource(cls))
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    names = {f.name for f in dataclasses.fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []
    line_start = True
    for i, tok in enumerate(tokens):
        if tok.type == tokenize.COMMENT and line_start:
            above.append(tok.string.lstrip("#").strip())
        elif tok.type == tokenize.NAME and line_start and tok.string in names and tok.start[1] == 4 \
                and tokens[i + 1].string == ":":
            trailing = next((t.string for t in tokens[i:] if t.start[0] == tok.start[0]
                             and t.type == tokenize.COMMENT), None)
            text = trailing.lstrip("#").strip() if trailing else " ".join(above)
            if text:
                out[tok.string] = text
            above = []
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.COMMENT):
            above = [] if line_start else above
        if tok.type in (tokenize.NL, tokenize.NEWLINE):
            line_start = True
        elif tok.type not in (tokenize.INDENT, tokenize.DEDENT):
            line_start = False
    return out


class Key(NamedTuple):
    key: str  # dotted
    type: str
    default: str  # repr of the default, "(required)", or "" for a section that always exists
    meaning: str
    section: bool


def keys(cls: type, prefix: str = "") -> Iterator[Key]:
    """Every key of a config class, nested sections (and their keys) included."""
    comments = field_comments(cls)
    for name, (f, tp) in _schema(cls).items():
        key = f"{prefix}.{name}" if prefix else name
        nested = [a for a in (tp, *get_args(tp)) if isinstance(a, type) and dataclasses.is_dataclass(a)]
        meaning = f.metadata.get("help") or comments.get(name, "")
        if _required(f):
            default = "(required)"
        else:
            value = f.default if f.default is not _MISSING else f.default_factory()
            default = "" if dataclasses.is_dataclass(value) else repr(value)
        if nested:
            yield Key(key, _type_name(tp), default, meaning or _own_doc(nested[0]), True)
            yield from keys(nested[0], key)
        else:
            yield Key(key, _type_name(tp), default, meaning, False)


def _own_doc(cls: type) -> str:
    """The first line of a class's own docstring (not the signature dataclasses write when it has none)."""
    doc = inspect.getdoc(cls) or ""
    return "" if doc.startswith(f"{cls.__name__}(") else doc.split("\n")[0]


def describe(cls: type) -> str:
    """`relayrl train --help-config`: one line per key, `key: type = default`, then its meaning indented."""
    lines = []
    for k in keys(cls):
        if k.section and not k.default:
            head = f"{k.key}:"
        else:
            head = f"{k.key}: {k.type}" + (" (required)" if k.default == "(required)" else f" = {k.default}")
        lines.append(head)
        lines.extend("    " + part for part in textwrap.wrap(k.meaning, 100))
    return "\n".join(lines)


def markdown(cls: type) -> str:
    """docs/config.md: a table per section."""
    out = ["# Configuration reference", "",
           "Generated from the comments of `relayrl/config/schema.py` by `python -m relayrl.config.docs`; do not "
           "edit by hand. Every key can be set in YAML or on the command line as `section.key=value`; "
           "`relayrl train --help-config` prints the same.", ""]
    header = ["| key | type | default | meaning |", "|---|---|---|---|"]
    rows = list(keys(cls))
    top = [k for k in rows if "." not in k.key and not k.section]
    if top:
        out += ["## Top level", "", *header, *map(_row, top)]
    for k in rows:
        if k.section:
            optional = f" (optional: default {k.default})" if k.default else ""
            out += ["", f"## `{k.key}`{optional}", "", k.meaning, "", *header]
        elif "." in k.key:
            out.append(_row(k))
    return "\n".join(out).replace("\n\n\n", "\n\n") + "\n"


def _row(k: Key) -> str:
    return f"| `{k.key}` | `{_cell(k.type)}` | `{_cell(k.default)}` | {_cell(k.meaning)} |"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|")


if __name__ == "__main__":
    from relayrl.config.schema import Config

    sys.stdout.write(markdown(Config))
