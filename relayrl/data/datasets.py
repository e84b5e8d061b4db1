"""Prompt datasets: GSM8K files, any JSONL/JSON file, reasoning-gym tasks, or a user function.

Every source becomes a list of rows `{"question": str, "answer": str, ...}` validated up front, so
a malformed row is reported (file, line, missing key) before any model is loaded. Every problem with a
file (not UTF-8, invalid JSON, a row that is not an object) is an `InputError` naming the file and line,
which the CLI prints without a traceback.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from relayrl.common.utils import InputError, import_from_path
from relayrl.config.loader import decode_utf8
from relayrl.config.schema import DatasetConfig, PromptConfig

GSM8K_ENV = "RELAYRL_GSM8K_DIR"


def gsm8k_search_path() -> list[Path]:
    """Where GSM8K jsonl files are looked for: $RELAYRL_GSM8K_DIR, the shared data folder, the cache."""
    repo = Path(__file__).resolve().parents[2]
    places = [Path(os.environ[GSM8K_ENV])] if os.environ.get(GSM8K_ENV) else []
    places += [repo.parent / "shared" / "data" / "gsm8k", Path.cwd().parent / "shared" / "data" / "gsm8k",
               Path.home() / ".cache" / "relayrl" / "data" / "gsm8k"]
    return places


def find_gsm8k(split: str) -> Path:
    for folder in gsm8k_search_path():
        if (folder / f"{split}.jsonl").is_file():
            return folder / f"{split}.jsonl"
    tried = ", ".join(str(p / f"{split}.jsonl") for p in gsm8k_search_path())
    raise FileNotFoundError(f"GSM8K split {split!r} not found; looked in: {tried}. "
                            f"Set {GSM8K_ENV} to the folder holding train.jsonl/test.jsonl.")


def _read_file(path: Path) -> list[tuple[str, Any]]:
    """Rows of a .jsonl or .json file, each with a 'file:line' (or 'file[i]') location for errors."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    try:
        text = decode_utf8(path.read_bytes())
    except ValueError as e:  # names the line and column
        raise InputError(f"{path}: {e}") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{e.lineno}: invalid JSON: {e.msg} (column {e.colno})") from None
        if not isinstance(data, list):
            raise InputError(f"{path}: expected a JSON list of objects, got a {type(data).__name__}")
        return [(f"{path}[{i}]", row) for i, row in enumerate(data)]
    rows = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside a JSON string
        if line.strip():
            try:
                rows.append((f"{path}:{n}", json.loads(line)))
            except json.JSONDecodeError as e:
                raise InputError(f"{path}:{n}: invalid JSON: {e.msg} (column {e.colno})") from None
    return rows


def _reasoning_gym(task: str, cfg: DatasetConfig) -> list[tuple[str, Any]]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(task, size=cfg.size or 1000, seed=cfg.seed, **cfg.kwargs)
    except Exception as e:
        raise ValueError(f"reasoning_gym task {task!r} with kwargs {cfg.kwargs}: {e}") from e
    return [(f"reasoning_gym:{task}[{i}]", {"question": e["question"], "answer": str(e["answer"])})
            for i, e in enumerate(ds)]


def _raw_rows(cfg: DatasetConfig) -> list[tuple[str, Any]]:
    src = cfg.source
    if src.startswith("gsm8k:"):
        return _read_file(find_gsm8k(src.split(":", 1)[1]))
    if src.startswith("reasoning_gym:"):
        return _reasoning_gym(src.split(":", 1)[1], cfg)
    if ":" in src and not Path(src).exists():
        rows = import_from_path(src)(**cfg.kwargs)
        return [(f"{src}[{i}]", row) for i, row in enumerate(rows)]
    return _read_file(Path(src).expanduser())


def load_rows(cfg: DatasetConfig) -> list[dict[str, Any]]:
    """Load, validate and normalise a dataset to rows with 'question' and 'answer' strings."""
    out = []
    for where, row in _raw_rows(cfg):
        if not isinstance(row, dict):
            raise InputError(f"{where}: row is a {type(row).__name__}, expected an object")
        for key in (cfg.prompt_key, cfg.answer_key):
            if key not in row or row[key] in (None, ""):
                raise InputError(f"{where}: row has no {key!r} (keys: {sorted(row)}); "
                                 f"set data.*.prompt_key / answer_key")
        out.append({**row, "question": str(row[cfg.prompt_key]), "answer": str(row[cfg.answer_key])})
        if cfg.size is not None and len(out) >= cfg.size:
            break
    if not out:
        raise InputError(f"dataset {cfg.source!r} has no rows")
    return out


class PromptBuilder:
    """Turn a row into prompt token ids: chat template with the question (+ suffix) as the user turn."""

    def __init__(self, tokenizer, cfg: PromptConfig):
        self.tokenizer, self.cfg = tokenizer, cfg
        if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.prompt.chat_template is true but the tokenizer has no chat template")

    def messages(self, row: dict[str, Any]) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.cfg.system}] if self.cfg.system else []
        return msgs + [{"role": "user", "content": row["question"] + self.cfg.suffix}]

    def text(self, row: dict[str, Any]) -> str:
        if not self.cfg.chat_template:
            return row["question"] + self.cfg.suffix
        return self.tokenizer.apply_chat_template(self.messages(row), tokenize=False, add_generation_prompt=True)

    def __call__(self, row: dict[str, Any]) -> list[int]:
        return self.tokenizer(self.text(row), add_special_tokens=not self.cfg.chat_template)["input_ids"]
