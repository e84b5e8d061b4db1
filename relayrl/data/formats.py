"""The row formats users bring, normalised: relayrl's `question`/`answer`, and TRL's standard and conversational ones.

A prompt is text (`question`, or TRL's standard `prompt: str`) or a list of chat messages (TRL's conversational
`prompt: [{"role": ..., "content": ...}]`, or a `messages` column holding a whole conversation). Whatever the form,
a loaded row keeps every column it came with and gains:

- `question`: the prompt as text (a message list's last user message), so rewards, agents and logs that read
  `row["question"]` work on every format;
- `answer`: the reference answer as text, from the `answer_key` column or else a message list's final assistant
  turn (TRL's SFT-style `messages` rows carry their reference that way); absent only with `answer_key: null`;
- `prompt_messages`: for a message-list prompt only, the validated messages the model is prompted with (without
  that final assistant turn). Text rows do not get it, so they stay exactly as they were;
- `images`: a row with an `image`/`images` column only, its image files (relayrl.data.images), and then also
  `prompt_messages`, with one `{"type": "image"}` content part per image.

`prompt_messages(row, system, suffix)` is the one place that turns a row into the chat messages an agent sends;
PromptBuilder and the tool agent both use it, so every agent sees a row's prompt the same way.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from relayrl.common.errors import InputError
from relayrl.config.schema import DatasetConfig
from relayrl.data.images import IMAGES, content_text, read_images, with_image_parts

PROMPT_KEYS = ("question", "prompt", "messages")  # looked for in this order when prompt_key is null
ROLES = ("system", "user", "assistant", "tool")
MESSAGES = "prompt_messages"  # the row field holding a message-list prompt, validated


def prompt_field(where: str, row: dict[str, Any], cfg: DatasetConfig, key: str) -> str:
    """The row field holding the prompt: `prompt_key`, or the first of PROMPT_KEYS the row has."""
    if cfg.prompt_key is not None:
        if row.get(cfg.prompt_key) in (None, "", []):
            raise InputError(f"{where}: row has no {cfg.prompt_key!r} (keys: {sorted(row)}); "
                             f"set {key}.prompt_key, or map it with {key}.columns / map")
        return cfg.prompt_key
    for name in PROMPT_KEYS:
        if row.get(name) not in (None, "", []):
            return name
    names = ", ".join(repr(k) for k in PROMPT_KEYS[:-1]) + f" or {PROMPT_KEYS[-1]!r}"
    raise InputError(f"{where}: row has no {names} to prompt with (keys: {sorted(row)}); "
                     f"set {key}.prompt_key, or map it with {key}.columns / map")


def _message(field_at: str, i: int, msg: Any) -> dict[str, Any]:
    """One chat message checked; keys whose value is None (as arrow gives for absent struct fields) dropped."""
    at = f"{field_at}, message {i}"
    if not isinstance(msg, dict):
        raise InputError(f"{at} is a {type(msg).__name__}, expected an object with role and content")
    if msg.get("role") not in ROLES:
        raise InputError(f"{at}: role {msg.get('role')!r} is not one of {', '.join(ROLES)}")
    content = msg.get("content")
    if isinstance(content, list):  # multimodal content parts (TRL's and HF's vision messages)
        return {**{k: v for k, v in msg.items() if v is not None}, "content": [_part(at, j, p)
                                                                                for j, p in enumerate(content)]}
    if not isinstance(content, str):
        got = "missing" if content is None else f"of type {type(content).__name__}"
        raise InputError(f"{at}: content is {got}, expected a string or a list of content parts")
    return {k: v for k, v in msg.items() if v is not None}


def _part(at: str, j: int, part: Any) -> dict[str, Any]:
    """One content part: {"type": "text", "text": str} or {"type": "image"} (the image itself is in the row's image
    column, relayrl.data.images); keys whose value is None dropped, as for messages."""
    if not isinstance(part, dict) or part.get("type") not in ("text", "image"):
        raise InputError(f"{at}, content part {j}: expected {{'type': 'text', 'text': ...}} or {{'type': 'image'}}, "
                         f"got {part!r:.80}")
    if part["type"] == "text" and not isinstance(part.get("text"), str):
        raise InputError(f"{at}, content part {j}: a text part without a 'text' string")
    return {k: v for k, v in part.items() if v is not None}


def split_messages(at: str, value: list[Any]) -> tuple[list[dict[str, Any]], str | None]:
    """(prompt messages, reference): a final assistant turn is the reference, everything before it the prompt.

    The prompt must hold a user message and end with a user or tool message: that is where the model speaks next.
    `at` ('file:line: data.train field 'prompt'') starts every error message."""
    msgs = [_message(at, i, m) for i, m in enumerate(value)]
    reference = content_text(msgs.pop()["content"]) if msgs and msgs[-1]["role"] == "assistant" else None
    if not any(m["role"] == "user" for m in msgs):
        raise InputError(f"{at} has no user message to prompt with")
    if msgs[-1]["role"] not in ("user", "tool"):
        raise InputError(f"{at} ends with a {msgs[-1]['role']} message; a prompt ends with "
                         f"a user or tool message (a final assistant turn is taken as the reference answer)")
    return msgs, reference


def normalise_row(where: str, row: dict[str, Any], cfg: DatasetConfig, key: str) -> dict[str, Any]:
    """The row with `question`, `answer` (unless answer_key is null) and, for message prompts, `prompt_messages`."""
    field = prompt_field(where, row, cfg, key)
    value = row[field]
    out = dict(row)
    reference = None
    images = read_images(where, row, _source_dir(cfg))
    if isinstance(value, list):
        msgs, reference = split_messages(f"{where}: {key} field {field!r}", value)
        out[MESSAGES] = msgs
        out["question"] = content_text(next(m["content"] for m in reversed(msgs) if m["role"] == "user"))
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        out.pop(MESSAGES, None)
        out["question"] = str(value)
    else:
        raise InputError(f"{where}: {key} field {field!r} is a {type(value).__name__}; a prompt is text or a list "
                         f"of chat messages")
    if images:  # the prompt becomes messages with one image part per image (relayrl.data.images)
        out.pop("image", None)
        msgs = out.get(MESSAGES) or [{"role": "user", "content": out["question"]}]
        out[MESSAGES], out[IMAGES] = with_image_parts(f"{where}: {key} field {field!r}", msgs, len(images)), images
    if cfg.answer_key is None:
        if reference is not None:
            out["answer"] = reference
        return out
    gold = row.get(cfg.answer_key)
    if gold in (None, ""):
        if reference is None:
            raise InputError(f"{where}: row has no {cfg.answer_key!r} (keys: {sorted(row)}); set "
                             f"{key}.answer_key (null when the reward needs no reference answer), or map it "
                             f"with {key}.columns / map")
        gold = reference
    out["answer"] = str(gold)
    return out


def prompt_messages(row: dict[str, Any], system: str | None = None, suffix: str = "") -> list[dict[str, Any]]:
    """The chat messages a row prompts with: its message list (or its question as one user message), `system`
    before the row's own system message (one message, joined by a blank line: templates take one system turn),
    and `suffix` appended to the last user message (an answer-format instruction belongs to the question)."""
    msgs = [dict(m) for m in row.get(MESSAGES) or [{"role": "user", "content": row["question"]}]]
    if system:
        if msgs[0]["role"] == "system":
            msgs[0]["content"] = _join(system + "\n\n", msgs[0]["content"], "")
        else:
            msgs.insert(0, {"role": "system", "content": system})
    if suffix:
        last = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        msgs[last]["content"] = _join("", msgs[last]["content"], suffix)
    return msgs


def _join(before: str, content: str | list[dict[str, Any]], after: str) -> str | list[dict[str, Any]]:
    """Text around a message's content: around its string, or as text parts around its content parts."""
    if isinstance(content, str):
        return before + content + after
    return ([{"type": "text", "text": before}] if before else []) + content + (
        [{"type": "text", "text": after}] if after else [])


def _source_dir(cfg: DatasetConfig) -> Path | None:
    """The folder relative image paths are read from: the dataset file's (None: the working directory)."""
    path = Path(cfg.source).expanduser()
    return path.parent if path.is_file() else path if path.is_dir() else None
