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
temperature and top_p are always the run's (the trainer recomputes logprobs at the run's temperature).

`stream: true` is answered with server-sent events in OpenAI's chat.completion.chunk format, sent once the
completion is generated (a role chunk, the content, tool calls, the finish reason, usage when
`stream_options.include_usage`, then `[DONE]`): clients and frameworks that stream work, without token-by-token
latency.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from relayrl.agents.openai_agent import RecordingBackend, Session
from relayrl.serve.errors import (
    ApiError,
    BadRequest,
    api_error_response,
    install_error_handlers,
    internal_error,
    read_json,
)
from relayrl.serve.limits import DEFAULT_MAX_BODY, flag

_RUN_OWNS = ("max_completion_tokens", "temperature", "top_p")  # set by the run, not by a program's call


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
                stream = flag(body, "stream", False)
                fut = asyncio.run_coroutine_threadsafe(self._serve(ep, body), ep.loop)
                ep.pending.add(fut)
                fut.add_done_callback(ep.pending.discard)
                reply = await asyncio.wrap_future(fut)
            except EpisodeFailed as e:
                return api_error_response(ApiError(429, None, str(e), "episode_limit_exceeded"))
            except ApiError as e:
                return api_error_response(e)
            except (asyncio.CancelledError, concurrent.futures.CancelledError):
                return api_error_response(ApiError(404, None, "the episode finished", "episode_not_found"))
            except Exception as e:
                return internal_error(request, e)
            if stream:
                return StreamingResponse(sse_chunks(reply, body), media_type="text/event-stream")
            return JSONResponse(reply)

        @app.get("/ep/{eid}/v1/models")
        async def models(eid: str, request: Request) -> dict[str, Any]:
            self._episode(eid, request)
            return {"object": "list", "data": [{"id": self.backend.model_name, "object": "model",
                                                "owned_by": "relayrl"}]}

        return app

    # ---- serving (episode loop) -------------------------------------------------------------------
    async def _serve(self, ep: Episode, body: dict[str, Any]) -> dict[str, Any]:
        """Check the caps, reserve the call's tokens, generate and record it (RecordingBackend.chat)."""
        check_messages(body)
        if ep.failure is not None:
            raise EpisodeFailed(ep.failure)
        if ep.calls >= ep.max_calls:
            raise ep.fail(f"the episode made more than max_calls={ep.max_calls} chat completion calls")
        left = ep.max_tokens - ep.tokens
        if left <= 0:
            raise ep.fail(f"the episode generated max_tokens={ep.max_tokens} tokens and asked for more")
        n = min(self.per_call_tokens, left, requested_tokens(body, self.per_call_tokens))
        ep.calls += 1
        ep.tokens += n
        # the run's temperature and top_p: the trainer recomputes logprobs at the run's temperature
        body = {k: v for k, v in body.items() if k not in _RUN_OWNS} | {"max_tokens": n}
        used = 0
        try:
            reply = await self.backend.chat(body, ep.session.sid)
            used = reply["usage"]["completion_tokens"]
            return reply
        finally:
            ep.tokens -= n - used


def check_messages(body: dict[str, Any]) -> None:
    """The request's messages are a list of objects with a role (else 400 naming the field, not a 500)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]", "must be an object with a role")
    if body.get("tools") is not None and not isinstance(body["tools"], list):
        raise BadRequest("tools", "must be a list of tools")


def requested_tokens(body: dict[str, Any], default: int) -> int:
    """The call's own token limit (max_completion_tokens, else max_tokens), else `default`."""
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest("max_tokens", f"must be a positive integer, got {value!r}")
    return value


def sse_chunks(reply: dict[str, Any], body: dict[str, Any]) -> Iterator[str]:
    """A chat.completion as OpenAI's stream of chat.completion.chunk events (see the module docstring)."""
    choice, message = reply["choices"][0], reply["choices"][0]["message"]
    base = {"id": reply["id"], "object": "chat.completion.chunk", "created": reply["created"],
            "model": reply["model"]}

    def event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
        chunk = base | {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish} | extra]}
        return f"data: {json.dumps(chunk)}\n\n"

    yield event({"role": "assistant", "content": ""})
    ids = {k: choice[k] for k in ("prompt_token_ids", "token_ids") if k in choice}
    yield event({"content": message.get("content") or ""}, logprobs=choice["logprobs"], **ids)
    if message.get("tool_calls"):
        yield event({"tool_calls": [c | {"index": i} for i, c in enumerate(message["tool_calls"])]})
    yield event({}, choice["finish_reason"])
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        yield f"data: {json.dumps(base | {'choices': [], 'usage': reply['usage']})}\n\n"
    yield "data: [DONE]\n\n"
