"""Tool-call formats: how a model writes a tool call, how its results go back, and which format a template uses.

Chat models are trained on one way of writing a call, and their chat template says which:

- `hermes` (Qwen2.5, Hermes, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number per turn.
- `llama3` (Llama 3.1 / 3.2 / 3.3 JSON tool calling): the whole message is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`; several calls are separated by `;`. Results go back in `ipython` turns
  (the templates map the `tool` role to it); a turn may end with `<|eom_id|>` instead of `<|eot_id|>`.
- `mistral` (v3 tokenizer, Mistral-7B-Instruct-v0.3, Nemo): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`,
  or the newer `[TOOL_CALLS]name[ARGS]{...}`. The template wants a 9-character alphanumeric `tool_call_id` on
  each tool message and puts the content inside a JSON object, so the content must itself be JSON.

Each parser returns, per call, a {"name", "arguments"} dict (a Mistral call that carries a valid "id" keeps it)
or an error string for a malformed call (the agent sends the error back as the tool result). `detect_format`
picks a format from the chat template's text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relayrl.common.errors import InputError
from relayrl.tools import Tool

Call = dict[str, Any] | str  # a parsed call, or an error message for the model
BAD_CALL = 'error: a tool call must be {"name": ..., "arguments": {...}}'
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"
_TOOL_CALLS = "[TOOL_CALLS]"
_CALL_ID = re.compile(r"[A-Za-z0-9]{9}")
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?\[ARGS\](.*)", re.DOTALL)


def _json_error(e: json.JSONDecodeError) -> str:
    return f"error: tool call is not valid JSON ({e.msg} at char {e.pos})"


def _call(obj: Any, args_keys: tuple[str, ...] = ("arguments",)) -> Call:
    """A call dict from a decoded JSON object; arguments sent as a JSON string are decoded (some models do)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return BAD_CALL
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            args = {}
    return {"name": obj["name"], "arguments": args if isinstance(args, dict) else {}}


def parse_hermes(text: str) -> list[Call]:
    """Every `<tool_call>{...}</tool_call>` in the text (an unclosed last one counts: generation was cut)."""
    calls: list[Call] = []
    for body in _HERMES_CALL.findall(text):
        try:
            calls.append(_call(json.loads(body)))
        except json.JSONDecodeError as e:
            calls.append(_json_error(e))
    return calls


def _json_sequence(text: str, sep: str) -> tuple[list[Any], json.JSONDecodeError | None]:
    """JSON values one after another, separated by whitespace and `sep`; stops at the first invalid one."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == sep):
            pos += 1
        if pos == len(text):
            return values, None
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            return values, e
        values.append(value)


def parse_llama3(text: str) -> list[Call]:
    """A Llama 3 turn is a tool call when it starts with `<|python_tag|>` or `{` (as vLLM's llama3_json parser
    decides); its calls are JSON objects separated by `;`, arguments under "parameters" (or "arguments")."""
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG):]
    elif not body.startswith("{"):
        return []
    values, error = _json_sequence(body.replace(_PYTHON_TAG, ";"), ";")
    calls: list[Call] = [_call(v, ("parameters", "arguments")) for v in values]
    return calls + ([_json_error(error)] if error else [])


def parse_mistral(text: str) -> list[Call]:
    """`[TOOL_CALLS] [{...}, ...]` (v3 tokenizer) or `[TOOL_CALLS]name[ARGS]{...}` repeated (v11+ tokenizers)."""
    start = text.find(_TOOL_CALLS)
    if start < 0:
        return []
    calls: list[Call] = []
    for chunk in text[start:].split(_TOOL_CALLS)[1:]:
        named = _MISTRAL_NAMED.match(chunk)
        if named:
            try:
                calls.append(_call({"name": named[1], "arguments": json.loads(named[2].strip())}))
            except json.JSONDecodeError as e:
                calls.append(_json_error(e))
            continue
        values, error = _json_sequence(chunk, ",")
        for v in values:
            calls += [_with_id(_call(c), c) for c in (v if isinstance(v, list) else [v])]
        calls += [_json_error(error)] if error else []
    return calls


def _with_id(call: Call, obj: Any) -> Call:
    """Keep a call's own 9-character id (v3 history writes one) so its result can name the same id."""
    cid = obj.get("id") if isinstance(obj, dict) else None
    if isinstance(call, dict) and isinstance(cid, str) and _CALL_ID.fullmatch(cid):
        call["id"] = cid
    return call


def _describe(tools: list[Tool], how: list[str]) -> str:
    """A system prompt for templates without tool support: how to call (`how`) and what can be called."""
    lines = ["You can call tools. " + how[0], *how[1:], "The result comes back in a tool message. Available tools:"]
    lines += [f"- {t.name}({', '.join(t.parameters.get('properties', {}))}): {t.description}" for t in tools]
    lines.append("When you know the answer, reply without a tool call.")
    return "\n".join(lines)


def call_id(*parts: object) -> str:
    """A deterministic 9-character alphanumeric tool call id (what Mistral templates require)."""
    return hashlib.sha256("/".join(map(str, parts)).encode()).hexdigest()[:9]


@dataclass(frozen=True)
class ToolCallFormat:
    """One way of writing tool calls. `keep_special`: parse the text with special tokens kept (the call marker
    is one); `turn_end_tokens`: tokens besides eos that end an assistant turn; `call_ids`: tool messages carry a
    `tool_call_id`."""

    name: str
    parse: Callable[[str], list[Call]]
    how: tuple[str, ...]
    keep_special: bool = False
    turn_end_tokens: tuple[str, ...] = ()
    call_ids: bool = False

    def system_prompt(self, tools: list[Tool]) -> str:
        return _describe(tools, list(self.how))

    def tool_messages(self, results: list[str], ids: list[str], template: str) -> list[dict[str, Any]]:
        """The `tool` messages of one turn's results, in the shape the template needs."""
        if not self.call_ids:
            return [{"role": "tool", "content": r} for r in results]
        json_content = '{"content": ' in template  # v3 templates paste content into a JSON object as is
        return [{"role": "tool", "tool_call_id": i, "content": _as_json(r) if json_content else r}
                for r, i in zip(results, ids, strict=True)]


def _as_json(text: str) -> str:
    """Text that is already JSON stays (as mistral_common sends it); anything else becomes a JSON string."""
    try:
        json.loads(text)
        return text
    except json.JSONDecodeError:
        return json.dumps(text)


FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", parse_hermes, (
        "To call one, write on its own line:",
        '<tool_call>{"name": "TOOL_NAME", "arguments": {"ARG": "VALUE"}}</tool_call>')),
    "llama3": ToolCallFormat("llama3", parse_llama3, (
        "To call one, reply with only this JSON (several calls: separate them with ;):",
        '{"name": "TOOL_NAME", "parameters": {"ARG": "VALUE"}}'), turn_end_tokens=("<|eom_id|>",)),
    "mistral": ToolCallFormat("mistral", parse_mistral, (
        "To call tools, reply with only:",
        '[TOOL_CALLS] [{"name": "TOOL_NAME", "arguments": {"ARG": "VALUE"}}]'), keep_special=True, call_ids=True),
}
CHOICES = ("auto", *FORMATS)


def detect_format(template: str | None) -> tuple[str, str]:
    """(format name, why) from a chat template's text: the marker it writes for tool calls."""
    text = template or ""
    if _TOOL_CALLS in text:
        return "mistral", f"the chat template writes {_TOOL_CALLS}"
    if "<tool_call>" in text:
        return "hermes", "the chat template writes <tool_call>"
    if _PYTHON_TAG in text or "ipython" in text:
        return "llama3", "the chat template has Llama 3 ipython tool turns"
    if "tools" in text:
        return "hermes", "the chat template takes tools but writes no known call marker; hermes is the default"
    return "hermes", "the chat template has no tool support; the system prompt describes the hermes format"


def resolve_format(name: str, template: str | None) -> tuple[ToolCallFormat, str]:
    """The format for `agent.kwargs.tool_format` (auto: detected from the template) and why it was chosen."""
    if name not in CHOICES:
        raise InputError(f"agent.kwargs.tool_format: unknown tool-call format {name!r}; known: {', '.join(CHOICES)}")
    if name == "auto":
        detected, why = detect_format(template)
        return FORMATS[detected], f"auto: {why}"
    return FORMATS[name], "set by agent.kwargs.tool_format"


def parse_tool_calls(text: str) -> list[dict[str, Any] | str]:
    """Hermes tool calls in a turn: {"name", "arguments"} dicts, or an error string for a malformed one."""
    return parse_hermes(text)


def tools_system_prompt(tools: list[Tool]) -> str:
    """A system prompt describing the tools in the hermes format, for templates without tool support."""
    return FORMATS["hermes"].system_prompt(tools)
