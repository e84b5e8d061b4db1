"""Prompt datasets: the shipped GSM8K, JSONL/JSON files, files and folders Hugging Face `datasets` reads
(parquet, csv, arrow, save_to_disk; `relayrl.data.hf`), hub ids from the local cache, reasoning-gym tasks,
or a user function.

Every source becomes a list of rows `{"question": str, "answer": str, ...}` validated up front, so
a malformed row is reported (file, line, missing key) before any model is loaded. Prompts may be text or chat
messages (TRL's standard and conversational formats, `relayrl.data.formats`); every other column is kept.
Every problem with a file (not UTF-8, invalid JSON, a row that is not an object) is an `InputError` naming the
file and line, which the CLI prints without a traceback. Fields are mapped by `columns` and `map`
(`relayrl.data.fields`).
"""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from relayrl.common.errors import InputError
from relayrl.common.imports import import_from_path
from relayrl.config.loader import decode_utf8
from relayrl.config.schema import DatasetConfig, PromptConfig
from relayrl.data.fields import map_row, row_function
from relayrl.data.formats import MESSAGES, normalise_row, prompt_messages
from relayrl.data.images import IMAGES
from relayrl.models.images import decode_image

GSM8K_ENV = "RELAYRL_GSM8K_DIR"
BUILTIN_GSM8K = Path(__file__).resolve().parent / "builtin" / "gsm8k"
DECOMPRESS = {".gz": gzip.decompress, ".xz": lzma.decompress, ".bz2": bz2.decompress}
HF_SUFFIXES = (".parquet", ".csv", ".tsv", ".arrow")  # read through Hugging Face datasets
Located = tuple[str, Any]  # (where, for errors: 'file:line' / 'file[i]'; the raw row)
BUILTIN_SOURCES = ("gsm8k:", "reasoning_gym:")  # shipped tasks: they come with their answer-format instruction
BOXED_SUFFIX = "\nPut your final answer within \\boxed{}."  # that instruction (math_reward reads \boxed{})
# lists/objects inside one row: deeper rows are refused at load, since json (and later pickle, for the judge's
# workers) recurse per level and would crash with a traceback mid-run; real rows nest a few levels
MAX_JSON_DEPTH = 64


def gsm8k_search_path() -> list[Path]:
    """Where GSM8K splits are looked for: $RELAYRL_GSM8K_DIR, then the copy shipped in the package."""
    places = [Path(os.environ[GSM8K_ENV]).expanduser()] if os.environ.get(GSM8K_ENV) else []
    return [*places, BUILTIN_GSM8K]


def find_gsm8k(split: str) -> Path:
    """The first `<split>.jsonl` (plain or .xz/.gz/.bz2) on the search path."""
    names = [f"{split}.jsonl", *(f"{split}.jsonl{ext}" for ext in DECOMPRESS)]
    for folder in gsm8k_search_path():
        for name in names:
            if (folder / name).is_file():
                return folder / name
    tried = ", ".join(str(p / f"{split}.jsonl[.xz]") for p in gsm8k_search_path())
    raise FileNotFoundError(f"GSM8K split {split!r} not found (splits: train, test); looked in: {tried}. "
                            f"Set {GSM8K_ENV} to the folder holding train.jsonl/test.jsonl.")


def _read_bytes(path: Path) -> bytes:
    """The file's bytes, decompressed when it ends in .gz/.xz/.bz2."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise InputError(f"{path}: cannot read: {e.strerror or e}") from None
    unpack = DECOMPRESS.get(path.suffix.lower())
    if unpack is None:
        return data
    try:
        return unpack(data)
    except (OSError, EOFError, lzma.LZMAError) as e:
        raise InputError(f"{path}: cannot decompress: {e}") from None


def _read_file(path: Path) -> list[Located]:
    """Rows of a .jsonl or .json file (optionally compressed), each with a 'file:line' (or 'file[i]')
    location for errors."""
    raw = _read_bytes(path)
    try:
        text = decode_utf8(raw)
    except ValueError as e:  # names the line and column
        raise InputError(f"{path}: {e}") from None
    inner = Path(path.stem) if path.suffix.lower() in DECOMPRESS else path  # d.json.gz is read as d.json
    if inner.suffix.lower() == ".json":
        data = _parse_json(text, str(path), 1)
        if not isinstance(data, list):
            raise InputError(f"{path}: expected a JSON list of objects, got a {type(data).__name__}")
        for i, row in enumerate(data):
            _check_depth(row, f"{path}[{i}]")
        return [(f"{path}[{i}]", row) for i, row in enumerate(data)]
    rows = []
    for n, line in enumerate(text.split("\n"), 1):  # not splitlines(): U+2028 may sit inside a JSON string
        if line.strip():
            row = _parse_json(line, str(path), n)
            _check_depth(row, f"{path}:{n}")
            rows.append((f"{path}:{n}", row))
    return rows


def _parse_json(text: str, path: str, first_line: int) -> Any:
    """json.loads with every failure an InputError naming the file and line (a JSONL file's line counts from
    `first_line`)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InputError(f"{path}:{first_line + e.lineno - 1}: invalid JSON: {e.msg} (column {e.colno})") from None
    except RecursionError:
        raise InputError(f"{path}:{first_line}: nested more than {MAX_JSON_DEPTH} levels deep") from None


def _check_depth(row: Any, where: str) -> None:
    """Refuse a row nested deeper than MAX_JSON_DEPTH (an explicit stack: the check itself must not recurse)."""
    stack = [(row, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise InputError(f"{where}: nested more than {MAX_JSON_DEPTH} levels deep")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((v, depth + 1) for v in children if isinstance(v, dict | list))


def _reasoning_gym(task: str, cfg: DatasetConfig) -> list[tuple[str, Any]]:
    import reasoning_gym

    try:
        ds = reasoning_gym.create_dataset(task, size=cfg.size or 1000, seed=cfg.seed, **cfg.kwargs)
    except Exception as e:
        raise ValueError(f"reasoning_gym task {task!r} with kwargs {cfg.kwargs}: {e}") from e
    return [(f"reasoning_gym:{task}[{i}]", {"question": e["question"], "answer": str(e["answer"])})
            for i, e in enumerate(ds)]


def _raw_rows(cfg: DatasetConfig, key: str) -> Iterable[Located]:
    src = cfg.source
    if src.startswith("gsm8k:"):
        return _read_file(find_gsm8k(src.split(":", 1)[1]))
    if src.startswith("reasoning_gym:"):
        return _reasoning_gym(src.split(":", 1)[1], cfg)
    path = Path(src).expanduser()
    json_file = any(s in (".jsonl", ".json") for s in path.suffixes)
    if ":" in src and not path.exists() and not src.startswith("hf:"):
        rows = import_from_path(src)(**cfg.kwargs)
        return [(f"{src}[{i}]", row) for i, row in enumerate(rows)]
    if path.is_dir() or path.suffix.lower() in HF_SUFFIXES or not (path.exists() or json_file):
        from relayrl.data import hf  # imports datasets + pyarrow (seconds): only the sources needing them pay

        return hf.hf_rows(cfg, key)
    return _read_file(path)


def load_rows(cfg: DatasetConfig, key: str = "data.train", prompt: PromptConfig | None = None) -> list[dict[str, Any]]:
    """Load, validate and normalise a dataset to rows with a 'question' string, an 'answer' string (unless
    `answer_key` is null) and, for chat-message prompts, 'prompt_messages' (`relayrl.data.formats`).

    `key` is the config section (data.train / data.eval) that error messages name. With `prompt` given, rows
    are also checked against it (message prompts need the chat template), so that fails before a model loads."""
    fn = row_function(cfg, key)  # a bad map function fails before any file is read
    raw_text = prompt is not None and not prompt.chat_template
    out = []
    for where, raw in _raw_rows(cfg, key):
        if not isinstance(raw, dict):
            raise InputError(f"{where}: row is a {type(raw).__name__}, expected an object")
        row = map_row(where, raw, cfg, fn, key)
        if row is None:
            continue
        row = normalise_row(where, row, cfg, key)
        if raw_text and MESSAGES in row:
            raise InputError(f"{where}: the prompt is a list of chat messages but data.prompt.chat_template is "
                             f"false (raw text); chat messages need the chat template")
        out.append(row)
        if cfg.size is not None and len(out) >= cfg.size:
            break
    if not out:
        raise InputError(f"dataset {cfg.source!r} has no rows")
    return out


def default_suffix(source: str) -> str:
    """The answer-format instruction a source brings: the shipped tasks theirs, the user's data none (its task
    says how to answer; a hidden instruction would change what the model is asked)."""
    return BOXED_SUFFIX if source.startswith(BUILTIN_SOURCES) else ""


def system_and_suffix(cfg: PromptConfig, dataset: DatasetConfig | None) -> tuple[str | None, str]:
    """The system prompt and suffix `dataset`'s rows get: its own `system` over cfg.system, and cfg.suffix or,
    left at None, the source's own (no dataset: no default suffix)."""
    system = dataset.system if dataset is not None and dataset.system is not None else cfg.system
    suffix = cfg.suffix if cfg.suffix is not None else default_suffix(dataset.source if dataset else "")
    return system, suffix


class PromptBuilder:
    """Turn a row into prompt token ids: the chat template over the row's messages (a text prompt is one user
    turn), with the system prompt and the suffix resolved for `dataset` (its `system` overrides cfg.system; a
    suffix left at None is the source's own, `default_suffix`). Without a dataset, rows get no default suffix.

    A vision-language model's `processor` turns a row with images (relayrl.data.images) into its prompt: the chat
    template renders each image part as the image placeholder, and the processor expands each into the image's
    tokens."""

    def __init__(self, tokenizer, cfg: PromptConfig, dataset: DatasetConfig | None = None, processor=None):
        self.tokenizer, self.cfg, self.processor = tokenizer, cfg, processor
        self.system, self.suffix = system_and_suffix(cfg, dataset)
        if cfg.chat_template and not getattr(tokenizer, "chat_template", None):
            raise ValueError("data.prompt.chat_template is true but the tokenizer has no chat template")

    def messages(self, row: dict[str, Any]) -> list[dict[str, Any]]:
        return prompt_messages(row, self.system, self.suffix)

    def text(self, row: dict[str, Any]) -> str:
        if not self.cfg.chat_template:
            if MESSAGES in row:
                raise ValueError("a chat-message prompt needs data.prompt.chat_template: true")
            return row["question"] + self.suffix
        return self.tokenizer.apply_chat_template(self.messages(row), tokenize=False, add_generation_prompt=True)

    def __call__(self, row: dict[str, Any]) -> list[int]:
        if not row.get(IMAGES):
            return self.tokenizer(self.text(row), add_special_tokens=not self.cfg.chat_template)["input_ids"]
        if self.processor is None:
            raise ValueError("a row with images needs a vision-language model's processor")
        pil = [decode_image(b, f"image {i}") for i, b in enumerate(row[IMAGES])]
        ids = self.processor(text=[self.text(row)], images=[pil], add_special_tokens=False)["input_ids"]
        return [int(t) for t in ids[0]]
