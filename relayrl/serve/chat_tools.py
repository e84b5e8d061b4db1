"""Tool calling and structured output for `relayrl serve`'s chat completions.

Tool calls come back in the format the served model's chat template writes (`relayrl.tools.calls`: Hermes
`<tool_call>`, Llama 3 JSON, Mistral `[TOOL_CALLS]`), chosen once at server start from the template as the
tool agent chooses it, and are returned in OpenAI's shape: `{"id", "type": "function", "function": {"name",
"arguments": <a JSON string>}}`, the arguments re-serialised from the parsed object. `content` is the text
before the first call (None when empty, as vLLM returns it). A turn in which any call is malformed is returned
as plain text (`content`, no `tool_calls`) -- what vLLM's parsers do -- so a client never acts on half a turn.
Mistral templates refuse any `tool_call_id` but 9 alphanumeric characters when the conversation comes back, so
with that format ids are such (a call's own valid id is kept), as vLLM makes them; other formats get `call_...`.

`tool_choice` (vLLM's meanings): "auto" (the default with tools) parses the output; "none" still renders the
tools in the prompt (vLLM's default) but does not parse: the output is content. A named function
`{"type": "function", "function": {"name": X}}` prefills the assistant turn with the format's opening of a call
to X, so the call and its name are certain; those prefilled tokens are prompt (`prompt_token_ids`), never
generated tokens or logprobs. Without a grammar engine the arguments the model writes after the prefill are not
guaranteed JSON: when they do not parse, the reply is the turn as text (the prefilled opening included), no
`tool_calls`. "required" (some call to some tool) would need constrained decoding and is refused with 400.
`parallel_tool_calls: false` returns at most the turn's first call (what OpenAI promises; nothing stops the model
from writing more, so the rest are dropped from the answer, as a named choice drops what follows its call).
OpenAI's legacy `functions` / `function_call` are refused with 400 naming them (relayrl.serve.openai_params).

`response_format` `{"type": "text"}` is accepted; `json_object` and `json_schema`, and vLLM's guided-decoding
fields, need constrained decoding that relayrl's engine does not have: 400 naming the field, never ignored.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from relayrl.engine.base import GenOutput
from relayrl.engine.stops import cut_at_stop
from relayrl.serve.errors import BadRequest
from relayrl.tools import Tool
from relayrl.tools.calls import FORMATS, ToolCallFormat, detect_format

log = logging.getLogger("relayrl.serve")
# where a call starts in each format's text: what comes before it is the message's content
CALL_START = {"hermes": "<tool_call>", "mistral": "[TOOL_CALLS]"}  # llama3: the whole turn is the call
# the opening of a call to a named function, up to its arguments ({name}: the name as a JSON string)
_OPENING = {"hermes": '<tool_call>\n{{"name": {name}, "arguments": ',
            "llama3": '{{"name": {name}, "parameters": ',
            "mistral": '[TOOL_CALLS] [{{"name": {name}, "arguments": '}
_ALNUM = string.ascii_letters + string.digits
# fields that ask for constrained decoding (OpenAI's response_format; vLLM's guided_* and structured_outputs)
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
NEEDS_GRAMMAR = "needs constrained decoding, which relayrl serve does not have"
NO_GRAMMAR = (f"{NEEDS_GRAMMAR}; describe the JSON wanted in the prompt and validate the reply (or serve the "
              "model with vLLM or SGLang for guided decoding)")


def check_structured_output(body: dict[str, Any]) -> None:
    """`response_format` other than text, or a guided-decoding field: 400 naming it (module doc)."""
    fmt = body.get("response_format")
    if fmt is not None:
        kind = fmt.get("type") if isinstance(fmt, dict) else None
        if kind in ("json_object", "json_schema"):
            raise BadRequest("response_format", f'{{"type": "{kind}"}} {NO_GRAMMAR}', "unsupported_value")
        if kind != "text":
            raise BadRequest("response_format", 'must be {"type": "text"} (json_object and json_schema are '
                             "not supported)")
    for key in GUIDED:
        if body.get(key) is not None:
            raise BadRequest(key, NO_GRAMMAR, "unsupported_value")


@dataclass(frozen=True)
class ToolChoice:
    """A request's checked `tool_choice`: "auto", "none", or the name of the function to call (`named`)."""

    mode: str  # "auto" | "none" | "named"
    name: str | None = None
    prefill: str = ""  # text that opens the assistant turn (a named call's opening), part of the prompt
    single: bool = False  # parallel_tool_calls: false: at most one call comes back


class ChatTools:
    """The served model's tool-call format, and what a chat request's tools, tool_choice and output become."""

    def __init__(self, tokenizer: Any):
        self.tok = tokenizer
        template = getattr(tokenizer, "chat_template", "") or ""
        self.native = "tools" in template  # else a system prompt describes the tools and the format
        name, why = detect_format(template)
        self.format: ToolCallFormat = FORMATS[name]
        log.info("tool-call format %s (%s)", name, why)

    def template_inputs(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                        ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """(messages, apply_chat_template kwargs): tools go to a template that takes them, else into a system
        prompt that describes them and the format's way of calling."""
        if not tools:
            return messages, {}
        if self.native:
            return messages, {"tools": tools}
        described = [Tool(t["function"]["name"], t["function"].get("description", ""),
                          t["function"].get("parameters", {}), None) for t in tools]
        return [{"role": "system", "content": self.format.system_prompt(described)}, *messages], {}

    def choice(self, raw: Any, tools: list[dict] | None, parallel: bool = True) -> ToolChoice:
        """`tool_choice` checked against `tools` (module doc); 400 naming it when it cannot be honoured.
        `parallel`: the request's parallel_tool_calls."""
        choice = self._choice(raw, tools)
        return choice if parallel else dataclasses.replace(choice, single=True)

    def _choice(self, raw: Any, tools: list[dict] | None) -> ToolChoice:
        if raw is None:
            return ToolChoice("auto" if tools else "none")
        if raw in ("auto", "none"):
            return ToolChoice(raw if tools else "none")
        if raw == "required":
            raise BadRequest("tool_choice", f'"required" {NEEDS_GRAMMAR}; name the function '
                             '({"type": "function", "function": {"name": ...}}) or use "auto"', "unsupported_value")
        fn = raw.get("function") if isinstance(raw, dict) and raw.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest("tool_choice", 'must be "auto", "none", or {"type": "function", "function": '
                             '{"name": ...}}')
        names = [t["function"]["name"] for t in tools or []]
        if fn["name"] not in names:
            raise BadRequest("tool_choice", f"names the function {fn['name'][:100]!r}, which is not among tools"
                             f" ({', '.join(names)[:300] or 'none given'})")
        return ToolChoice("named", fn["name"], _OPENING[self.format.name].format(name=json.dumps(fn["name"])))

    def call_start(self, choice: ToolChoice) -> str | None:
        """Where streamed content must stop, since what follows may be a tool call: the format's call marker;
        "" (all of it) where the marker is a special token (absent from the text), the whole turn is the call
        (llama3), or the call is forced (named tool_choice); None without tools."""
        if choice.mode == "none":
            return None
        if choice.mode == "named" or self.format.keep_special:
            return ""
        return CALL_START.get(self.format.name, "")

    def reply(self, choice: ToolChoice, out: GenOutput, text: str, stops: tuple[str, ...],
              finish: str) -> tuple[str | None, list[dict[str, Any]] | None, str]:
        """(content, tool_calls, finish_reason) of one output whose decoded text is `text`. A named call
        finishes as the engine stopped ("stop"), as OpenAI and vLLM report it; parsed "auto" calls with
        "tool_calls"."""
        if choice.mode == "none":
            return text, None, finish
        raw = choice.prefill + self._calls_text(out, text, stops)
        calls = self.format.parse(raw)
        if choice.mode == "named" or choice.single:
            calls = calls[:1]  # the forced (or only allowed) call; what is written after it is not part of the answer
        if not calls or not all(isinstance(c, dict) for c in calls):
            return (choice.prefill + text if choice.prefill else text), None, finish
        start = CALL_START.get(self.format.name)
        content = raw.split(start)[0].strip() if start else ""
        tool_calls = [self._openai_call(c) for c in calls if isinstance(c, dict)]
        return content or None, tool_calls, finish if choice.mode == "named" else "tool_calls"

    def _calls_text(self, out: GenOutput, text: str, stops: tuple[str, ...]) -> str:
        """The text calls are parsed from: with special tokens where the format's call marker is one (the
        ending stop token left out; a stop string cuts the text as it cuts the content)."""
        if not self.format.keep_special:
            return text
        ended_by_token = out.finish_reason == "stop" and out.stop_string is None and out.output_ids
        ids = out.output_ids[:-1] if ended_by_token else out.output_ids
        kept = self.tok.decode(ids, skip_special_tokens=False)
        return cut_at_stop(kept, stops) if out.stop_string is not None else kept

    def _openai_call(self, call: dict[str, Any]) -> dict[str, Any]:
        if self.format.call_ids:  # the template checks ids when the conversation comes back
            cid = call.get("id") or "".join(secrets.choice(_ALNUM) for _ in range(9))
        else:
            cid = f"call_{uuid.uuid4().hex[:24]}"
        return {"id": cid, "type": "function",
                "function": {"name": call["name"], "arguments": json.dumps(call["arguments"], ensure_ascii=False)}}
