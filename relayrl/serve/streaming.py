"""Streaming of OpenAI chat and text completions as server-sent events, token by token from the engine.

A streamed request's samples run in the engine like any other (the server's fair queue, one continuous batch);
each also carries a listener (LocalEngine.submit's `on_token`) that the engine's worker thread calls with every
token as it is sampled. The listener only hands the token to the event loop (`call_soon_threadsafe` into one
queue per request), so the worker never waits for a client: a slow reader holds up its own stream and nothing
else. The request's GenOutput is unchanged, and the end of each stream is built from it -- the text not yet sent,
the remaining tokens' logprobs, tool calls, the finish reason -- so the joined deltas are exactly the non-streamed
answer.

Text increments (`IncrementalText`) are whole characters and never show a stop string:
- tokens are detokenized incrementally over a window of recent tokens (vLLM's prefix / read offsets), and a
  piece that ends in U+FFFD (a multi-byte character whose bytes are not all sampled yet) is held back until the
  character is whole;
- the longest tail that could still begin a stop string (up to the longest stop string less one character) is
  held back until it cannot; when the text comes to contain a stop string, nothing from it on is ever sent.
Chat with `tools` holds back the same way from where a tool call starts (`marker`): the content streams up to
there, the parsed tool_calls come as deltas at the end -- what vLLM does without a streaming tool parser.

Chunks are OpenAI's: `chat.completion.chunk` (a first delta with the role, then content pieces, then one with
`finish_reason`) and `text_completion` chunks; choices of n > 1 interleave, each with its `index`; per-token
logprobs (and `token_ids` with `return_token_ids`) travel in the chunk whose text they complete;
`stream_options.include_usage` adds `"usage": null` to every chunk and a last chunk with empty choices and the
usage; `data: [DONE]` ends the stream. An error after the stream began is an event `data: {"error": {...}}`, and
the stream ends. A client that disconnects cancels the stream: its samples leave the queue, or the engine at its
next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from relayrl.engine.base import GenOutput, SamplingParams, TokenCallback
from relayrl.engine.stops import first_stop
from relayrl.serve.errors import ApiError, BadRequest, log_error
from relayrl.serve.openai_api import Alternatives, chat_logprobs, completion_logprobs

log = logging.getLogger("relayrl.serve")
DONE = "data: [DONE]\n\n"
Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped (what the answer's text is)


def stream_options(body: dict[str, Any]) -> bool | None:
    """Whether the request streams: None when not, else whether it asks for the usage chunk
    (`stream_options.include_usage`); 400 naming the field when either is malformed."""
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("stream", "must be a boolean")
    options = body.get("stream_options")
    if not stream:
        if options is not None:
            raise BadRequest("stream_options", "is only allowed with stream: true")
        return None
    if options is None:
        return False
    if not isinstance(options, dict) or not set(options) <= {"include_usage"}:
        raise BadRequest("stream_options", 'must be {"include_usage": true} or {"include_usage": false}')
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise BadRequest("stream_options.include_usage", "must be a boolean")
    return usage


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class IncrementalText:
    """A sample's text as its tokens arrive, given out in pieces that are whole characters and never show a stop
    string or what follows `marker` (module doc). `finish` reconciles with the final text."""

    def __init__(self, decode: Decode, stops: tuple[str, ...] = (), marker: str | None = None):
        """`marker`: where text may stop being content ("": anywhere, so all of it waits for `finish`)."""
        self.decode, self.marker = decode, marker
        self.stops = stops + ((marker,) if marker is not None else ())
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list[int] = []
        self.text = ""  # the whole characters decoded so far
        self.sent = 0  # characters of `text` given out
        self.ended = False  # a stop string (or the marker) occurred: nothing more is given out before `finish`
        self._prefix = self._read = 0  # vLLM's offsets: ids[_prefix:_read] were decoded, the window's context

    def push(self, token: int) -> str:
        """The text that may be sent now that `token` was sampled ("" while held back)."""
        self.ids.append(token)
        if self.ended:
            return ""
        before = self.decode(self.ids[self._prefix:self._read])
        after = self.decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix, self._read = self._read, len(self.ids)
        return self._release()

    def _release(self) -> str:
        end = len(self.text)
        if self.stops:
            hit = first_stop(self.text[self.sent:], self.stops)  # an occurrence never starts in what was sent
            if hit is not None:
                end, self.ended = self.sent + hit[0], True
            else:
                end -= self._open_tail()
        if self.marker and not self.ended:  # content before a tool call comes back stripped: hold trailing spaces
            end = min(end, self.sent + len(self.text[self.sent:end].rstrip()))
        piece = self.text[self.sent:end] if end > self.sent else ""
        self.sent += len(piece)
        return piece

    def _open_tail(self) -> int:
        """Characters at the end of the text that may be the start of a stop string (held back)."""
        tail = self.text[max(self.sent, len(self.text) - self.hold):]
        for k in range(len(tail), 0, -1):
            if any(s.startswith(tail[-k:]) for s in self.stops):
                return k
        return 0

    def finish(self, final: str) -> str:
        """What is left to send of `final`, the answer's text (cut at its stop string, up to its tool call)."""
        sent = self.text[:self.sent]
        if not final.startswith(sent):  # what was sent turned out to be a tool call (a format without a marker)
            log.debug("a streamed text is not a prefix of the final content; nothing more is sent")
            return ""
        self.sent = len(final)
        return final[len(sent):]


@dataclass
class Choice:
    """One streamed sample: its index among the choices, its text, and the tokens sent so far."""

    index: int
    prompt: list[int]
    params: SamplingParams
    text: IncrementalText
    tokens: list[tuple[int, float, list[tuple[int, float]] | None]] = field(default_factory=list)
    sent_tokens: int = 0  # tokens whose logprobs / ids went out in a chunk
    opened: bool = False  # a chunk of it went out (completions send prompt_token_ids with the first)


Tops = list[list[tuple[int, float]] | None]  # per token, its alternatives (token id, logprob), or None


class Chunks(Protocol):
    """The choice objects of one kind of stream (chat or completions): a choice's opening (or None), a piece of
    text with the tokens it completes, and the choice's last chunks from its finished output."""

    object: str

    def first(self, c: Choice) -> dict[str, Any] | None: ...

    def piece(self, c: Choice, text: str, ids: list[int], logprobs: list[float], tops: Tops) -> dict[str, Any]: ...

    def last(self, c: Choice, out: GenOutput) -> list[dict[str, Any]]: ...


@dataclass
class Answer:
    """How a backend turns tokens into an answer's parts, for the chunks: token texts and alternatives (for
    logprobs) and what was asked back beside the text."""

    texts: Callable[[list[int]], list[str]]
    alternatives: Callable[[list[tuple[int, float]]], Alternatives]
    logprobs: bool = False
    top: bool = False
    with_ids: bool = False

    def tops(self, tops: Tops) -> list[Alternatives]:
        return [self.alternatives(a) if self.top and a else [] for a in tops]


# (content, tool_calls, finish_reason) of a finished chat output: the backend's non-streamed answer
ChatReply = Callable[[GenOutput, SamplingParams], tuple[str | None, list[dict[str, Any]] | None, str]]


@dataclass
class ChatChunks:
    """`chat.completion.chunk` choices: the role first, content pieces, tool calls at the end, the finish."""

    answer: Answer
    reply: ChatReply
    object: str = "chat.completion.chunk"

    def first(self, c: Choice) -> dict[str, Any]:
        choice = {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return choice | ({"prompt_token_ids": c.prompt} if self.answer.with_ids else {})

    def piece(self, c: Choice, text: str, ids: list[int], logprobs: list[float], tops: Tops) -> dict[str, Any]:
        a = self.answer
        lp = chat_logprobs(a.texts(ids), logprobs, a.tops(tops)) if a.logprobs else None
        choice = {"index": c.index, "delta": {"content": text}, "logprobs": lp, "finish_reason": None}
        return choice | ({"token_ids": ids} if a.with_ids else {})

    def last(self, c: Choice, out: GenOutput) -> list[dict[str, Any]]:
        content, calls, finish = self.reply(out, c.params)
        text, (ids, logprobs, tops) = c.text.finish(content or ""), rest(c, out)
        chunks = [self.piece(c, text, ids, logprobs, tops)] if text or ids else []
        if calls:
            chunks.append({"index": c.index, "delta": {"tool_calls": [{"index": k, **call} for k, call in
                                                                      enumerate(calls)]},
                           "logprobs": None, "finish_reason": None})
        return [*chunks, {"index": c.index, "delta": {}, "logprobs": None, "finish_reason": finish}]


@dataclass
class CompletionChunks:
    """`text_completion` choices: text pieces (logprobs with running text offsets), then the finish."""

    answer: Answer
    final: Callable[[GenOutput, SamplingParams], tuple[str, str]]  # (text, finish_reason) of a finished output
    object: str = "text_completion"
    offsets: dict[int, int] = field(default_factory=dict)  # per choice, where its next token's text starts

    def first(self, c: Choice) -> None:
        return None

    def piece(self, c: Choice, text: str, ids: list[int], logprobs: list[float], tops: Tops) -> dict[str, Any]:
        a, lp = self.answer, None
        if a.logprobs:
            tokens, start = a.texts(ids), self.offsets.get(c.index, 0)
            lp = completion_logprobs(tokens, list(logprobs), list(a.tops(tops)), start)
            self.offsets[c.index] = start + sum(len(t) for t in tokens)
        choice = {"index": c.index, "text": text, "logprobs": lp, "finish_reason": None}
        if a.with_ids:
            choice |= {"token_ids": ids} if c.opened else {"prompt_token_ids": c.prompt, "token_ids": ids}
            c.opened = True
        return choice

    def last(self, c: Choice, out: GenOutput) -> list[dict[str, Any]]:
        final, finish = self.final(out, c.params)
        text, (ids, logprobs, tops) = c.text.finish(final), rest(c, out)
        chunks = [self.piece(c, text, ids, logprobs, tops)] if text or ids else []
        return [*chunks, {"index": c.index, "text": "", "logprobs": None, "finish_reason": finish}]


class Stream:
    """The samples of one streamed request and their SSE events (`events`); built by the backend once the request
    was checked whole, so every refusal is an HTTP error before the first byte."""

    def __init__(self, cid: str, model: str, chunks: Chunks, choices: list[Choice], usage: bool | None,
                 prompt_tokens: int):
        self.cid, self.model, self.chunks, self.choices = cid, model, chunks, choices
        self.usage, self.prompt_tokens = usage, prompt_tokens
        self.created = int(time.time())
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.futures: list[asyncio.Future] = []
        self._loop = asyncio.get_running_loop()

    def listener(self, i: int) -> TokenCallback:
        """Choice i's listener: runs on the engine's worker thread, hands the token to the event loop."""
        def on_token(token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
            self._loop.call_soon_threadsafe(self.queue.put_nowait, (i, (token, logprob, top)))
        return on_token

    def start(self, futures: list[asyncio.Future]) -> Stream:
        """Follow the samples' futures (one per choice, submitted with `listener(i)`): each one's end follows
        its tokens in the queue, since the engine resolves a request after handing out its last token."""
        self.futures = futures
        for i, f in enumerate(futures):
            f.add_done_callback(lambda f, i=i: self.queue.put_nowait((i, f)))
        return self

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> str:
        data = {"id": self.cid, "object": self.chunks.object, "created": self.created, "model": self.model,
                "choices": choices, **extra}
        if self.usage and "usage" not in data:
            data["usage"] = None
        return sse(data)

    async def events(self) -> AsyncIterator[str]:
        """The SSE events; closing it early (the client went away) cancels the samples still running."""
        try:
            for c in self.choices:
                if (first := self.chunks.first(c)) is not None:
                    yield self.chunk([first])
            outs: list[GenOutput | None] = [None] * len(self.choices)
            while any(o is None for o in outs):
                i, item = await self.queue.get()
                c = self.choices[i]
                if isinstance(item, tuple):
                    if (piece := self._token(c, item)) is not None:
                        yield self.chunk([piece])
                    continue
                if item.cancelled() or item.exception() is not None:
                    yield self._error(item.exception())
                    return
                outs[i] = item.result()
                for last in self.chunks.last(c, outs[i]):
                    yield self.chunk([last])
            if self.usage:
                done = sum(len(o.output_ids) for o in outs if o is not None)
                yield self.chunk([], usage={"prompt_tokens": self.prompt_tokens, "completion_tokens": done,
                                            "total_tokens": self.prompt_tokens + done})
            yield DONE
        finally:
            for f in self.futures:
                f.cancel()

    def _token(self, c: Choice, token: tuple[int, float, list[tuple[int, float]] | None]) -> dict[str, Any] | None:
        c.tokens.append(token)
        text = c.text.push(token[0])
        if not text:
            return None
        new = c.tokens[c.sent_tokens:]
        c.sent_tokens = len(c.tokens)
        return self.chunks.piece(c, text, [t for t, _, _ in new], [lp for _, lp, _ in new], [a for _, _, a in new])

    def _error(self, exc: BaseException | None) -> str:
        """OpenAI's error event; a fault of the server is told by request id only (relayrl.serve.errors)."""
        if isinstance(exc, ApiError):
            status, message, param, code = exc.status, str(exc), exc.field, exc.code
        elif exc is None:
            status, message, param, code = 499, "the request was cancelled", None, None
        else:
            rid = log_error("a streamed completion", exc)
            status, message, param, code = 500, f"internal error (request id {rid}; details are in the server " \
                "log)", None, "internal_error"
        kind = "invalid_request_error" if status < 500 else "server_error"
        return sse({"error": {"message": message, "type": kind, "param": param, "code": code}})


def rest(c: Choice, out: GenOutput) -> tuple[list[int], list[float], list[list[tuple[int, float]] | None]]:
    """The output's tokens not yet sent in a chunk (the GenOutput is the authority), with their logprobs."""
    k = c.sent_tokens
    tops = out.top_logprobs[k:] if out.top_logprobs else [None] * (len(out.output_ids) - k)
    c.sent_tokens = len(out.output_ids)
    return out.output_ids[k:], out.logprobs[k:], tops
