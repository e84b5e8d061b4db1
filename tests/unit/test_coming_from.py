"""docs/coming-from.md cannot go stale: every relayrl key its tables name exists in the schema, every
`key=value` there loads as an override, and every `relayrl ...` command in its tables parses."""

import re
import shlex
from pathlib import Path

import pytest

from relayrl.cli import parser
from relayrl.config import ConfigError
from relayrl.config.docs import keys
from relayrl.config.schema import Config, load_run_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "coming-from.md"
KEY_REF = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*)(?:=(\S+))?$")


def table_cells(text: str, column: str) -> list[str]:
    """The cells under the header `column` of every markdown table in `text`."""
    cells, index = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            index = None
            continue
        row = [c.strip() for c in line.strip().strip("|").split("|")]
        if index is None:
            index = row.index(column) if column in row else -1
        elif index >= 0 and not set(line) <= set("|-: ") and index < len(row):
            cells.append(row[index])
    return cells


def key_refs(cell: str) -> list[tuple[str, str | None]]:
    """(key, value or None) of each backticked span that reads as a config key: dotted or `key=value`, lower
    case, no spaces. Other spans (commands, values, import paths) are not keys."""
    refs = []
    for span in re.findall(r"`([^`]+)`", cell):
        m = KEY_REF.match(span)
        if m and ("." in span or "=" in span):
            refs.append((m.group(1), m.group(2)))
    return refs


def unknown_keys(refs: list[tuple[str, str | None]]) -> list[str]:
    """Keys that are neither schema keys nor entries of a dict-valued key (agent.kwargs.episode)."""
    known = {k.key: k for k in keys(Config)}
    dicts = [k.key + "." for k in known.values() if k.type.startswith("dict")]
    return [key for key, _ in refs if key not in known and not any(key.startswith(d) for d in dicts)]


def override_sets(refs: list[tuple[str, str | None]]) -> list[list[str]]:
    """One override list per `key=value` of a cell: that value with the cell's first value of every other key
    (a cell may need two knobs at once, and may list alternatives of one key: `algo.adv_std=group` / `...=batch`)."""
    pairs = [(k, v) for k, v in refs if v is not None]
    sets = []
    for key, value in pairs:
        companions: dict[str, str] = {}
        for k, v in pairs:
            if k != key:
                companions.setdefault(k, v)
        sets.append([*(f"{k}={v}" for k, v in companions.items()), f"{key}={value}"])
    return sets


def relayrl_cells() -> list[str]:
    return table_cells(DOC.read_text(), "relayrl")


def test_every_relayrl_key_in_the_tables_exists():
    refs = [r for cell in relayrl_cells() for r in key_refs(cell)]
    assert len({k for k, _ in refs}) > 80, "the tables name far fewer keys than they did: is the parser broken?"
    assert unknown_keys(refs) == []


def test_every_key_value_in_the_tables_loads():
    bad = []
    for cell in relayrl_cells():
        for overrides in override_sets(key_refs(cell)):
            try:
                load_run_config(None, overrides)
            except ConfigError as e:
                bad.append(f"{overrides}: {e}")
    assert bad == []


def test_every_command_in_the_tables_parses():
    commands = [span for cell in relayrl_cells() for span in re.findall(r"`(relayrl [^`]+)`", cell)]
    assert {shlex.split(c)[1] for c in commands} >= {"train", "eval", "serve", "show-trajectories", "plot"}
    for command in commands:
        args = parser().parse_args(shlex.split(command)[1:])
        if args.command in ("train", "eval"):
            load_run_config(None, args.overrides)  # the overrides shown are real keys and values


def test_the_checks_catch_a_stale_doc():
    """The same parsing on a doc with a renamed key, a bad value and an unrelated column."""
    doc = ("| TRL | relayrl | notes |\n|---|---|---|\n| `beta` | `algo.kl_coeff` | `not.a.key` |\n"
           "| `loss_type` | `algo.loss_agg=token_sum`, `relayrl.Agent`, `single_turn` | |\n\ntext\n")
    cells = table_cells(doc, "relayrl")
    assert cells == ["`algo.kl_coeff`", "`algo.loss_agg=token_sum`, `relayrl.Agent`, `single_turn`"]
    refs = [r for cell in cells for r in key_refs(cell)]
    assert refs == [("algo.kl_coeff", None), ("algo.loss_agg", "token_sum")]
    assert unknown_keys(refs) == ["algo.kl_coeff"]
    assert override_sets(key_refs("`a.b=1`, `c.d=2` / `c.d=3`")) == [["c.d=2", "a.b=1"], ["a.b=1", "c.d=2"],
                                                                     ["a.b=1", "c.d=3"]]
    with pytest.raises(ConfigError, match="algo.loss_agg"):
        load_run_config(None, ["algo.loss_agg=token_sum"])


def test_readme_links_the_page():
    assert "docs/coming-from.md" in (DOC.parents[1] / "README.md").read_text()
