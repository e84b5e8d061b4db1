"""`EpisodeProxy`: one OpenAI-compatible HTTP endpoint on 127.0.0.1 in front of the engines, for agent programs
that run as subprocesses (relayrl.agents.external).

Each episode gets its own base URL, `http://127.0.0.1:PORT/ep/<episode id>/v1`, and its own API key: a request
is served only when both match an open episode (unknown or finished episodes: 404; another episode's path with
this key: 401), so one program's calls never land in another's trajectory. Calls are served and recorded by the
same `RecordingBackend` as `OpenAIAgent`'s in-process client (token-exact, incremental multi-call
conversations), so the two agents share their token bookkeeping.

The server runs in a thread of its own (uvicorn) and hands each call to the event loop its episode runs in
(`run_coroutine_threadsafe`): the rollout controller and the session are only touched from that loop, whatever
loop or thread the scheduler runs episodes in.

Caps (a flooding program costs its episode only): at most `max_calls` chat completions and `max_tokens`
generated tokens per episode; a call past either is answered 429 and fails the episode. Each call generates at
most `per_call_tokens` (the run's `sampling.max_new_tokens`): a program's `max_tokens` may lower it, not raise it;
temperature, top_p and top_k are always the run's (the trainer recomputes logprobs at the run's temperature).

A call is read as `relayrl serve` reads one (RecordingBackend.request, with relayrl.serve's checks) and answered
by the same code: `stop` ends generation in the engine and cuts the returned text before the stop string, while
the recorded tokens keep every sampled token (relayrl.engine.stops); `logprobs` / `top_logprobs`; tool calls in
the served chat template's format (Hermes, Llama 3, Mistral) with `tool_choice` auto / none / a named function
and `parallel_tool_calls` (relayrl.serve.chat_tools). What serve refuses is refused with the same 400 naming
the field: `tool_choice: required`, `response_format` json, guided decoding, penalties, logit_bias, the legacy
`functions`; and `n` other than 1 (each call is one sample of the episode's trajectory).

`stream: true` streams token by token with `relayrl serve`'s code (relayrl.serve.streaming): OpenAI's
chat.completion.chunk events as the engine samples the tokens (the rollout controller hands them on), the content
up to where a tool call may start (stop strings held back), the parsed tool calls and the finish reason at the
end, usage when `stream_options.include_usage`, then `[DONE]`. The call is recorded exactly as an unstreamed one;
a refusal that comes before the first token (the caps, a malformed request) is the same HTTP error as an
unstreamed call's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from relayrl.agents.openai_agent import ChatRequest, RecordingBackend, Session, requested_tokens
from relayrl.engine.base import GenOutput, TokenCallback
from relayrl.serve.errors import (
    ApiError,
    BadRequest,
    api_error_response,
    install_error_handlers,
    internal_error,
    read_json,
)
from relayrl.serve.limits import DEFAULT_MAX_BODY
from relayrl.serve.streaming import Answer, ChatChunks, Choice, IncrementalText, Stream

_RUN_OWNS = ("max_completion_tokens", "temperature", "top_p", "top_k")  # set by the run, not by a program's call


class EpisodeFailed(RuntimeError):
    """The proxy refused a call that breaks the episode's caps: the episode is over and costs its sample."""


@dataclass
class Episode:
    """One open episode: where its calls run (`loop`), what it may spend, and why it failed if it did."""

    id: str
    key: str
    session: Session
    loop: asyncio.AbstractEventLoop
    max_calls: int
    max_tokens: int
    calls: int = 0
    tokens: int = 0  # generated tokens, plus those reserved by calls in flight
    failure: str | None = None
    failed: asyncio.Event = field(default_factory=asyncio.Event)  # made in `loop` (EpisodeProxy.open)
    pending: set[concurrent.futures.Future] = field(default_factory=set)

    def fail(self, why: str) -> EpisodeFailed:
        """Mark the episode failed (the agent stops its program) and return the error to refuse the call with."""
        self.failure = self.failure or why
        self.failed.set()
        return EpisodeFailed(why)


class EpisodeProxy:
    """The HTTP server and the registry of open episodes; `open`/`close` one episode, `stop` the server."""

    def __init__(self, backend: RecordingBackend, per_call_tokens: int, max_body_bytes: int = DEFAULT_MAX_BODY):
        self.backend, self.per_call_tokens, self.max_body_bytes = backend, per_call_tokens, max_body_bytes
        self.episodes: dict[str, Episode] = {}
        self.app = self._make_app()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))  # loopback only: the programs run on this machine
        self.port: int = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="relayrl-episode-proxy", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the external agents' proxy server did not start")
            time.sleep(0.01)

    def open(self, session: Session, max_calls: int, max_tokens: int) -> Episode:
        """Register an episode; call from the event loop its calls should run in."""
        ep = Episode(secrets.token_hex(8), secrets.token_urlsafe(18), session, asyncio.get_running_loop(),
                     max_calls, max_tokens)
        self.backend.sessions[session.sid] = session
        self.episodes[ep.id] = ep
        return ep

    def base_url(self, ep: Episode) -> str:
        return f"http://127.0.0.1:{self.port}/ep/{ep.id}/v1"

    def close(self, ep: Episode) -> None:
        """Refuse the episode's further calls and cancel those in flight (their program is gone)."""
        self.episodes.pop(ep.id, None)
        self.backend.sessions.pop(ep.session.sid, None)
        for fut in list(ep.pending):
            fut.cancel()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)

    # ---- serving (proxy thread) -------------------------------------------------------------------
    def _episode(self, eid: str, request: Request) -> Episode:
        """The open episode this request is for, if its key matches (refusals never say whose an episode is)."""
        ep = self.episodes.get(eid)
        if ep is None:
            raise ApiError(404, None, f"no open episode {eid!r} (unknown, or finished)", "episode_not_found")
        auth = request.headers.get("authorization", "")
        if not secrets.compare_digest(auth.removeprefix("Bearer ").strip().encode(), ep.key.encode()):
            raise ApiError(401, None, "this API key is not this episode's", "invalid_api_key")
        return ep

    def _make_app(self) -> FastAPI:
        app = FastAPI(title="relayrl episode proxy", docs_url=None, redoc_url=None, openapi_url=None)
        install_error_handlers(app)

        @app.post("/ep/{eid}/v1/chat/completions")
        async def chat(eid: str, request: Request) -> Response:
            try:
                ep = self._episode(eid, request)
                body = await read_json(request, self.max_body_bytes)
                if not isinstance(body, dict):
                    raise BadRequest("body", "must be a JSON object")
                wanted = requested_tokens(body, self.per_call_tokens)
                # checked whole as relayrl serve checks it; the run's temperature and top_p (the trainer
                # recomputes logprobs at the run's temperature)
                req = self.backend.request({k: v for k, v in body.items() if k not in _RUN_OWNS})
                if req.stream is not None:
                    return await self._stream(ep, req, wanted)
                reply, _ = await asyncio.wrap_future(self._call(ep, req, wanted))
            except EpisodeFailed as e:
                return api_error_response(ApiError(429, None, str(e), "episode_limit_exceeded"))
            except ApiError as e:
                return api_error_response(e)
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                return api_error_response(ApiError(404, None, "the episode finished", "episode_not_found"))
            except Exception as e:
                return internal_error(request, e)
            return JSONResponse(reply)

        @app.get("/ep/{eid}/v1/models")
        async def models(eid: str, request: Request) -> dict[str, Any]:
            self._episode(eid, request)
            return {"object": "list", "data": [{"id": self.backend.model_name, "object": "model",
                                                "owned_by": "relayrl"}]}

        return app

    def _call(self, ep: Episode, req: ChatRequest, wanted: int,
              on_token: TokenCallback | None = None) -> concurrent.futures.Future:
        """Serve the call in its episode's loop (`_serve`); closing the episode cancels it."""
        fut = asyncio.run_coroutine_threadsafe(self._serve(ep, req, wanted, on_token), ep.loop)
        ep.pending.add(fut)
        fut.add_done_callback(ep.pending.discard)
        return fut

    async def _stream(self, ep: Episode, req: ChatRequest, wanted: int) -> Response:
        """Serve a streamed call (module doc): the response starts once its first token is sampled, so a refusal
        before that is answered as an unstreamed call's; a client that hangs up cancels the call."""
        loop, tok, backend = asyncio.get_running_loop(), self.backend.tokenizer, self.backend
        answer = Answer(lambda ids: [tok.decode([t]) for t in ids], backend.alternatives, req.asked.wanted,
                        bool(req.asked.top), req.with_ids)
        served: dict[str, Any] = {}  # the call's reply, once served
        chunks = _CallChunks(answer, lambda out, params: _reply_parts(served))
        text = IncrementalText(lambda ids: tok.decode(ids, skip_special_tokens=True), req.params.stop_strings,
                               backend.tools.call_start(req.choice))
        choice = Choice(0, [], req.params, text)
        stream = Stream(f"chatcmpl-{secrets.token_hex(12)}", backend.model_name, chunks, [choice], req.stream, 0)
        started, listener, out = asyncio.Event(), stream.listener(0), loop.create_future()

        def on_token(token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
            listener(token, logprob, top)
            loop.call_soon_threadsafe(started.set)

        def done(f: asyncio.Future) -> None:
            started.set()
            if f.cancelled():
                out.cancel()
            elif f.exception() is not None:
                out.set_exception(f.exception())
            else:
                reply, gen = f.result()
                served["reply"], choice.prompt = reply, reply["choices"][0].get("prompt_token_ids", [])
                stream.prompt_tokens = reply["usage"]["prompt_tokens"]
                out.set_result(gen)

        call = self._call(ep, req, wanted, on_token)
        asyncio.wrap_future(call).add_done_callback(done)
        out.add_done_callback(lambda f: call.cancel() if f.cancelled() else None)  # the client went away
        stream.start([out])
        try:
            await started.wait()
        except asyncio.CancelledError:  # the client went away before the first token
            out.cancel()
            raise
        if out.done():
            out.result()  # a refusal (or the episode's end) before the first token: raised as an HTTP error
        return StreamingResponse(stream.events(), media_type="text/event-stream")

    # ---- serving (episode loop) -------------------------------------------------------------------
    async def _serve(self, ep: Episode, req: ChatRequest, wanted: int,
                     on_token: TokenCallback | None = None) -> tuple[dict[str, Any], GenOutput]:
        """Check the caps, reserve the call's tokens (at most `wanted`), generate and record it
        (RecordingBackend.serve); the reply and the recorded output."""
        if ep.failure is not None:
            raise EpisodeFailed(ep.failure)
        if ep.calls >= ep.max_calls:
            raise ep.fail(f"the episode made more than max_calls={ep.max_calls} chat completion calls")
        left = ep.max_tokens - ep.tokens
        if left <= 0:
            raise ep.fail(f"the episode generated max_tokens={ep.max_tokens} tokens and asked for more")
        n = min(self.per_call_tokens, left, wanted)
        ep.calls += 1
        ep.tokens += n
        used = 0
        try:
            reply, out = await self.backend.serve(
                dataclasses.replace(req, params=dataclasses.replace(req.params, max_new_tokens=n)), ep.session.sid,
                on_token)
            used = len(out.output_ids)
            return reply, out
        finally:
            ep.tokens -= n - used


class _CallChunks(ChatChunks):
    """A proxied call's chunks: its prompt's token ids are known once the call was served, so they come with the
    finish rather than with the role."""

    def first(self, c: Choice) -> dict[str, Any]:
        return {k: v for k, v in super().first(c).items() if k != "prompt_token_ids"}

    def last(self, c: Choice, out: GenOutput) -> list[dict[str, Any]]:
        chunks = super().last(c, out)
        if self.answer.with_ids:
            chunks[-1]["prompt_token_ids"] = c.prompt
        return chunks


def _reply_parts(served: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]] | None, str]:
    """(content, tool_calls, finish_reason) of the served call's reply."""
    choice = served["reply"]["choices"][0]
    return choice["message"]["content"], choice["message"].get("tool_calls"), choice["finish_reason"]
