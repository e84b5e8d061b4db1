"""Every config key explains itself: --help-config and docs/config.md come from the schema's own comments."""

from dataclasses import dataclass, field
from pathlib import Path

from relayrl.cli import main
from relayrl.config.docs import describe, field_comments, keys, markdown
from relayrl.config.schema import Config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_every_key_has_a_meaning():
    missing = [k.key for k in keys(Config) if not k.meaning]
    assert not missing, f"add a comment beside these keys in relayrl/config/schema.py: {missing}"


def test_docs_config_md_is_generated_from_the_schema():
    assert DOCS.read_text() == markdown(Config), "stale: run `python -m relayrl.config.docs > docs/config.md`"


def test_help_config_prints_type_default_and_meaning(capsys):
    assert main(["train", "--help-config"]) == 0
    lines = capsys.readouterr().out.splitlines()
    i = lines.index("engine.dtype: Literal['auto', 'float32', 'bfloat16', 'float16'] = 'auto'")
    assert "bfloat16 where bf16 is native" in lines[i - 2] + lines[i - 1] + lines[i + 1]


@dataclass
class _Example:
    # the comment above a field
    # may take two lines
    a: int = 1
    b: str = "x"  # the comment on its line wins
    c: float = 0.5
    d: list[int] = field(default_factory=list, metadata={"help": "metadata help"})


def test_comments_above_and_beside_fields_are_read():
    assert field_comments(_Example) == {"a": "the comment above a field may take two lines",
                                        "b": "the comment on its line wins"}
    rows = {k.key: (k.type, k.default, k.meaning) for k in keys(_Example)}
    assert rows["c"] == ("float", "0.5", "") and rows["d"] == ("list[int]", "[]", "metadata help")
    assert describe(_Example).splitlines()[:2] == ["a: int = 1", "    the comment above a field may take two lines"]
