"""Checks of OpenAI /v1 request bodies for `relayrl serve`: every field a client sends, against the limits.

What the engine cannot honour is refused with 400 rather than ignored (penalties, logit_bias, best_of > 1,
and constrained decoding: `response_format` json, vLLM's guided_* fields -- relayrl.serve.chat_tools; sampling
from another distribution than asked corrupts RL data); vLLM's extensions that it can honour are (`top_k`
with -1 = off, `ignore_eos`, `stop_token_ids`, `return_token_ids`). `stop` (a string or up to 4) ends generation
in the engine as soon as the text contains one (relayrl.engine.stops). Messages and tools are checked for the
shapes chat templates expect before a template sees them, so a malformed message is a 400 naming it, not a
template's exception.

Logprobs (`logprob_options`), as OpenAI defines them: chat takes `logprobs: true` and `top_logprobs: k` (k <=
MAX_TOP_LOGPROBS, OpenAI's 20, and only with logprobs: true); completions take `logprobs: k` (k <=
MAX_COMPLETION_LOGPROBS, OpenAI's 5; 0 = the sampled tokens' logprobs, no alternatives) and `echo: true` (the
prompt comes back before the completion, with its tokens' logprobs when logprobs are asked; `max_tokens: 0` with
echo scores the prompt alone, which is what log-likelihood evaluations send). Chat has no echo.
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

from relayrl.engine.base import SamplingParams
from relayrl.serve.chat_tools import check_structured_output
from relayrl.serve.errors import BadRequest
from relayrl.serve.limits import (
    CHARS_PER_TOKEN,
    MAX_TOKENS_HINT,
    ServerLimits,
    boolean,
    flag,
    number,
    seed,
    stop_strings,
    stop_token_ids,
    temperature,
    top_k,
    top_p,
)
from relayrl.serve.tool_schema import check_name, check_schema

log = logging.getLogger("relayrl.serve")
# OpenAI / vLLM options that would change what is sampled: refused unless neutral
NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
           "best_of": 1, "suffix": None, "logit_bias": None}
MAX_TOP_LOGPROBS = 20  # alternatives per token: OpenAI's bound for chat top_logprobs (and SGLang's top_logprobs_num)
MAX_COMPLETION_LOGPROBS = 5  # OpenAI's bound for /v1/completions `logprobs`
LEGACY_FUNCTIONS = ("functions", "function_call")  # refused, never ignored: a client would wait for calls in vain


def sampling(body: dict[str, Any], limits: ServerLimits, prompt_len: int) -> tuple[SamplingParams, int]:
    """OpenAI sampling fields -> (SamplingParams, n); max_tokens defaults to what the context leaves."""
    for key, neutral in NEUTRAL.items():
        if body.get(key) not in (None, neutral):
            raise BadRequest(key, f"is not supported (only {neutral})", "unsupported_value")
    _check_extras(body)
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    room = max(1, min(limits.max_tokens, limits.max_seq_len - prompt_len))
    max_tokens = number(body, key, room, int, low=1, high=limits.max_tokens, hint=MAX_TOKENS_HINT)
    n = number(body, "n", 1, int, low=1)
    limits.check_samples(n, "n")
    return SamplingParams(max_new_tokens=limits.new_tokens(prompt_len, max_tokens), temperature=temperature(body),
                          top_p=top_p(body), top_k=top_k(body, limits.vocab_size),
                          stop_token_ids=stop_token_ids(body, limits.vocab_size),
                          ignore_eos=flag(body, "ignore_eos", False), seed=seed(body, ("seed",), n),
                          stop_strings=stop_strings(body)), n


def _check_extras(body: dict[str, Any]) -> None:
    """Fields that only shape the answer: the right type, or 400; constrained decoding: 400."""
    flag(body, "return_token_ids", False)
    flag(body, "parallel_tool_calls", True)  # honoured by relayrl.serve.chat_tools
    check_structured_output(body)
    for key in LEGACY_FUNCTIONS:
        if body.get(key) is not None:
            raise BadRequest(key, "is OpenAI's deprecated function calling; send tools and tool_choice instead",
                             "unsupported_value")
    for key in ("model", "user"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise BadRequest(key, "must be a string")


def messages(raw: Any, limits: ServerLimits, images: bool = False) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: string content (text parts joined), tool-call arguments as
    objects (OpenAI sends them as JSON strings; templates render them with tojson). With `images` (relayrl serve),
    a content holding `image_url` parts stays a list of parts: text parts and `{"type": "image", "url", "field"}`
    (`take_images` takes url and field out before the template sees them); else image parts are a 400."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRequest(where, 'must be an object with a "role" string')
        m = {**m, "content": _content(m.get("content"), f"{where}.content", images)}
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise BadRequest(f"{where}.{key}", "must be a string")
        if m.get("tool_calls"):
            m["tool_calls"] = _tool_calls(m["tool_calls"], f"{where}.tool_calls")
        out.append(m)
    return out


def _content(content: Any, where: str, images: bool = False) -> str | list[dict[str, Any]] | None:
    if content is None or isinstance(content, str):
        return content
    kinds = ("text", "image_url") if images else ("text",)
    if not isinstance(content, list) or not all(isinstance(p, dict) and p.get("type") in kinds for p in content):
        raise BadRequest(where, "must be a string or a list of text parts" + (
            " and image_url parts" if images else " (only text is supported)"))
    parts: list[dict[str, Any]] = []
    for j, p in enumerate(content):
        if p["type"] == "image_url":
            url = p.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            parts.append({"type": "image", "url": url, "field": f"{where}[{j}].image_url.url"})
        elif not isinstance(p.get("text", ""), str):
            raise BadRequest(where, "text parts must hold strings")
        else:
            parts.append({"type": "text", "text": p.get("text", "")})
    if any(p["type"] == "image" for p in parts):
        return parts
    return "".join(p["text"] for p in parts)


def take_images(msgs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[tuple[Any, str]]]:
    """(messages with bare `{"type": "image"}` parts, what the template renders as the image placeholder; each
    image's (url, field) in order) from `messages(..., images=True)`."""
    found: list[tuple[Any, str]] = []
    out = []
    for m in msgs:
        if isinstance(m.get("content"), list):
            found += [(p["url"], p["field"]) for p in m["content"] if p["type"] == "image"]
            m = {**m, "content": [{"type": "image"} if p["type"] == "image" else p for p in m["content"]]}
        out.append(m)
    return out, found


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list):
        raise BadRequest(where, "must be a list")
    out = []
    for i, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where}[{i}]", 'must be {"type": "function", "function": {"name", "arguments"}}')
        args = fn.get("arguments")
        if isinstance(args, str):
            with contextlib.suppress(ValueError, RecursionError):  # else the template shows the string as it came
                args = json.loads(args)
        elif args is not None and not isinstance(args, dict):
            raise BadRequest(f"{where}[{i}].function.arguments", "must be a JSON string or an object")
        out.append({**call, "function": {**fn, "arguments": args}})
    return out


def tools(raw: Any) -> list[dict[str, Any]] | None:
    """OpenAI function tools: [{"type": "function", "function": {"name", "description"?, "parameters"?}}],
    each schema checked whole (relayrl.serve.tool_schema) before a template sees it."""
    if not raw:
        return None
    if not isinstance(raw, list):
        raise BadRequest("tools", "must be a list of function tools")
    for i, t in enumerate(raw):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or t.get("type", "function") != "function":
            raise BadRequest(f"tools[{i}]", 'must be {"type": "function", "function": {"name": ...}}')
        check_name(fn.get("name"), f"tools[{i}].function.name")
        if not isinstance(fn.get("description", ""), str):
            raise BadRequest(f"tools[{i}].function.description", "must be a string")
        check_schema(fn.get("parameters", {}), f"tools[{i}].function.parameters")
    return raw


def check_size(parts: list[Any], limits: ServerLimits, field: str) -> None:
    """Refuse text far longer than any prompt the server accepts before the template and tokenizer see it."""
    chars, stack = 0, list(parts)
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            chars += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    if chars > limits.max_prompt_tokens * CHARS_PER_TOKEN:
        raise BadRequest(field, f"{chars} characters of text is longer than any prompt this server accepts "
                         f"({limits.max_prompt_tokens} tokens; --max-prompt-tokens)", "context_length_exceeded")


def render_error(e: Exception) -> BadRequest:
    """A chat template that fails on the messages is the request's fault; only a template's own message
    (raise_exception: "roles must alternate ...") is passed on, anything else goes to the log."""
    if type(e) is TemplateError and str(e):
        return BadRequest("messages", f"the chat template refuses them: {str(e)[:300]}")
    log.warning("chat template failed on a request's messages", exc_info=True)
    return BadRequest("messages", "could not be rendered with the model's chat template")


def completion_prompts(prompt: Any, limits: ServerLimits) -> list[str | list[int]]:
    """`prompt` as a string, token ids, or a batch of either; each checked, the batch within --max-n."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], str | list)):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt", "must be a string, a list of token ids, or a non-empty list of either")
    limits.check_samples(len(prompt), "prompt")
    return [limits.check_text(p, f"prompt[{i}]") if isinstance(p, str) else limits.check_prompt(p, f"prompt[{i}]")
            for i, p in enumerate(prompt)]


@dataclass(frozen=True)
class Logprobs:
    """What a request asks back beside the text (module doc)."""

    wanted: bool = False  # the sampled tokens' logprobs
    top: int = 0  # alternatives per token
    echo: bool = False  # completions: the prompt first (its tokens' logprobs too, when wanted)

    @property
    def score_prompt(self) -> bool:
        return self.echo and self.wanted


def logprob_options(body: dict[str, Any], chat: bool) -> Logprobs:
    """`logprobs`, `top_logprobs` and `echo` checked: the right type, in range, and in the combinations OpenAI
    accepts, or 400 naming the field."""
    echo = flag(body, "echo", False)
    top = number(body, "top_logprobs", 0, int, low=0, high=MAX_TOP_LOGPROBS)
    if chat:
        if echo:
            raise BadRequest("echo", "is not supported by chat completions (only by /v1/completions)",
                             "unsupported_value")
        wanted = boolean(body.get("logprobs"), False, "logprobs")
        if top and not wanted:
            raise BadRequest("top_logprobs", "needs logprobs: true")
        return Logprobs(wanted, top)
    if top:
        raise BadRequest("top_logprobs", "is a chat completions field; /v1/completions takes logprobs: <count>")
    raw = body.get("logprobs")
    if raw is None or isinstance(raw, bool):  # OpenAI's is a count; true (some clients send it) is a count of 0
        return Logprobs(bool(raw), 0, echo)
    return Logprobs(True, number(body, "logprobs", 0, int, low=0, high=MAX_COMPLETION_LOGPROBS), echo)


def completion_sampling(body: dict[str, Any], limits: ServerLimits, prompt_len: int,
                        asked: Logprobs) -> tuple[SamplingParams | None, int]:
    """`sampling` for /v1/completions, where max_tokens 0 with echo asks for the prompt alone (nothing is generated:
    None)."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    if asked.echo and number(body, key, None, int, low=0) == 0:
        return None, sampling({**body, key: None}, limits, prompt_len)[1]
    return sampling(body, limits, prompt_len)
