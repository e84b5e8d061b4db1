"""OpenAI-compatible HTTP routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) over a backend.

The routes only translate between OpenAI JSON and a backend's two coroutines, so the same app serves
`relayrl serve` (a LocalEngine behind it) and the recording client that turns agents written against the
`openai` package into trainable trajectories (`relayrl.agents.openai_agent`). Session-scoped routes
(`/sessions/{sid}/v1/...`) let one app record many concurrent episodes apart.

Extensions (as vLLM and SGLang offer): `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to
each choice. Logprobs are OpenAI's (`chat_response`, `completion_logprobs`): chat `logprobs.content[j] = {token,
logprob, bytes, top_logprobs: [{token, logprob, bytes}]}`; completions `logprobs = {tokens, token_logprobs,
top_logprobs: [{token: logprob}], text_offset}`, with the prompt's tokens first under `echo` (the first one's
logprob and alternatives null: nothing comes before it). `bytes` is the token's text in UTF-8, as vLLM gives it.

Streaming (`stream: true`): an app made with `streaming=True` (`relayrl serve`) hands the request to its backend,
which checks it whole and returns an `EventStream` instead of a body (relayrl.serve.streaming), so a refused
streaming request gets the same HTTP error as a non-streamed one before any byte of the stream. Other apps answer
`stream: true` with HTTP 400 ("stream: streaming is not supported") rather than with a non-streamed body that a
streaming client would fail to parse.

Model names: an app given `served_models` (`relayrl serve --served-model-name`) lists them all in /v1/models and
answers a request that names another `model` with 404, as vLLM does (a request without `model` is served); the
recording app has no list and serves whatever its client names.

Errors are OpenAI's `{"error": {"message", "type", "param", "code"}}`: a backend refuses a request by raising
`relayrl.serve.errors.ApiError` (BadRequest names the field); any other exception is answered 500 with a
request id only, its details logged (`relayrl.serve.errors`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, StreamingResponse

from relayrl.serve.errors import (
    ApiError,
    api_error_response,
    error_response,
    install_error_handlers,
    internal_error,
    read_json,
)
from relayrl.serve.limits import DEFAULT_MAX_BODY, flag
from relayrl.serve.security import key_check

__all__ = ["ChatBackend", "EventStream", "chat_logprobs", "chat_response", "completion_logprobs", "error_response",
           "make_openai_app"]
Alternatives = list[tuple[str, float]]  # a token's most likely alternatives: (text, logprob), most likely first


class EventStream(Protocol):
    """A streamed answer: its server-sent events, in order (relayrl.serve.streaming.Stream)."""

    def events(self) -> AsyncIterator[str]: ...


class ChatBackend(Protocol):
    """Answers a request's body with the answer's JSON or, for a streamed request of a streaming app, an
    EventStream."""

    model_name: str

    async def chat(self, body: dict[str, Any], session: str | None) -> dict[str, Any] | EventStream: ...

    async def complete(self, body: dict[str, Any], session: str | None) -> dict[str, Any] | EventStream: ...


def chat_response(cid: str, model: str, content: str | None, tool_calls: list[dict] | None, finish: str,
                  prompt_ids: list[int], output_ids: list[int], logprobs: list[float] | None,
                  tokens: list[str] | None, with_ids: bool, top: list[Alternatives] | None = None) -> dict[str, Any]:
    """An OpenAI chat.completion object for one choice; `top`: each token's alternatives (top_logprobs)."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs is not None:
        choice["logprobs"] = chat_logprobs(tokens or [""] * len(logprobs), logprobs, top or [[] for _ in logprobs])
    if with_ids:
        choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, output_ids
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
                                           "total_tokens": len(prompt_ids) + len(output_ids)}}


def chat_logprobs(tokens: list[str], logprobs: list[float], top: list[Alternatives]) -> dict[str, Any]:
    """A chat choice's (or a chunk's) `logprobs`: each token with its logprob and alternatives."""
    return {"content": [{**_token(t, lp), "top_logprobs": [_token(a, alp) for a, alp in alts]}
                        for t, lp, alts in zip(tokens, logprobs, top)]}


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


def completion_logprobs(tokens: list[str], logprobs: list[float | None], top: list[Alternatives | None],
                        offset: int) -> dict[str, Any]:
    """A completion choice's `logprobs`; `offset`: where the first token starts in the choice's text (after the
    prompt, unless echoed). Alternatives whose texts coincide (pieces of one character) keep the likelier."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    dicts: list[dict[str, float] | None] = []
    for alts in top:
        d: dict[str, float] | None = None if alts is None else {}
        for text, lp in alts or []:
            d.setdefault(text, lp)
        dicts.append(d)
    return {"tokens": tokens, "token_logprobs": logprobs, "top_logprobs": dicts, "text_offset": offsets}


def make_openai_app(backend: ChatBackend, api_key: str | None = None, lifespan: Callable | None = None,
                    max_body_bytes: int = DEFAULT_MAX_BODY, served_models: tuple[str, ...] | None = None,
                    streaming: bool = False) -> FastAPI:
    """The /v1 routes over `backend`; `lifespan` lets a server own resources (an engine) for the app's life.
    With an API key the interactive docs (/docs, /redoc, /openapi.json) are off: they would describe the API
    to anyone, key or not. `served_models`: the names a request's `model` may take (None: any). `streaming`: the
    backend answers `stream: true` (module doc); else it is refused."""
    docs = {} if api_key is None else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="relayrl OpenAI-compatible API", lifespan=lifespan, **docs)
    install_error_handlers(app)
    check_key = key_check(api_key)

    async def handle(request: Request, fn, session: str | None) -> JSONResponse | StreamingResponse:
        """Backend errors that name a field (ApiError) are the client's; anything else is answered with a
        request id only (see relayrl.serve.errors). A streamed answer's errors come in the stream."""
        try:
            body = await read_json(request, max_body_bytes)
            if not streaming and flag(body, "stream", False):
                return error_response(400, "stream: streaming is not supported", "stream", "unsupported_value")
            if served_models is not None and isinstance(body.get("model"), str) and body["model"] not in served_models:
                return model_not_found(body["model"])
            answer = await _unless_disconnected(request, fn(body, session))
            if isinstance(answer, dict):
                return JSONResponse(answer)
            return StreamingResponse(answer.events(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        except ApiError as e:
            return api_error_response(e)
        except HTTPException:
            raise
        except Exception as e:
            return internal_error(request, e)

    @app.post("/v1/chat/completions", dependencies=[Depends(check_key)])
    async def chat(request: Request):
        return await handle(request, backend.chat, None)

    @app.post("/sessions/{sid}/v1/chat/completions", dependencies=[Depends(check_key)])
    async def session_chat(sid: str, request: Request):
        return await handle(request, backend.chat, sid)

    @app.post("/v1/completions", dependencies=[Depends(check_key)])
    async def completions(request: Request):
        return await handle(request, backend.complete, None)

    @app.post("/sessions/{sid}/v1/completions", dependencies=[Depends(check_key)])
    async def session_completions(sid: str, request: Request):
        return await handle(request, backend.complete, sid)

    @app.get("/v1/models", dependencies=[Depends(check_key)])
    @app.get("/sessions/{sid}/v1/models", dependencies=[Depends(check_key)])
    async def models(request: Request, sid: str | None = None):
        names = served_models or (backend.model_name,)
        return {"object": "list", "data": [{"id": n, "object": "model", "owned_by": "relayrl"} for n in names]}

    return app


def model_not_found(model: str) -> JSONResponse:
    """vLLM's answer to a `model` it does not serve, word for word (clients such as the openai SDK raise
    NotFoundError on it); a name past 200 characters is cut short."""
    shown = model if len(model) <= 200 else f"{model[:200]}..."
    return JSONResponse({"error": {"message": f"The model `{shown}` does not exist.", "type": "NotFoundError",
                                   "param": "model", "code": 404}}, status_code=404)


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work`, cancelling it when the client hangs up: its samples leave the server's queue (or stop at
    the engine's next step) instead of generating for nobody."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=1.0)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise HTTPException(status_code=499, detail="client disconnected")
    finally:
        task.cancel()
