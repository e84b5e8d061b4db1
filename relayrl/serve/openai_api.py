"""OpenAI-compatible HTTP routes (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) over a backend.

The routes only translate between OpenAI JSON and a backend's two coroutines, so the same app serves
`relayrl serve` (a LocalEngine behind it) and the recording client that turns agents written against the
`openai` package into trainable trajectories (`relayrl.agents.openai_agent`). Session-scoped routes
(`/sessions/{sid}/v1/...`) let one app record many concurrent episodes apart.

Extensions (as vLLM and SGLang offer): `return_token_ids: true` adds `prompt_token_ids` and `token_ids` to
each choice; logprobs come back for every generated token when `logprobs: true`.

Streaming is not supported: `stream: true` is answered with HTTP 400 ("stream: streaming is not supported")
rather than with a non-streamed body that a streaming client would fail to parse.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse


class ChatBackend(Protocol):
    model_name: str

    async def chat(self, body: dict[str, Any], session: str | None) -> dict[str, Any]: ...

    async def complete(self, body: dict[str, Any], session: str | None) -> dict[str, Any]: ...


def chat_response(cid: str, model: str, content: str | None, tool_calls: list[dict] | None, finish: str,
                  prompt_ids: list[int], output_ids: list[int], logprobs: list[float] | None,
                  tokens: list[str] | None, with_ids: bool) -> dict[str, Any]:
    """An OpenAI chat.completion object for one choice."""
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": finish, "logprobs": None}
    if logprobs is not None:
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for t, lp in zip(tokens or [""] * len(logprobs), logprobs)]}
    if with_ids:
        choice["prompt_token_ids"], choice["token_ids"] = prompt_ids, output_ids
    return {"id": cid, "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [choice], "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(output_ids),
                                           "total_tokens": len(prompt_ids) + len(output_ids)}}


def make_openai_app(backend: ChatBackend, api_key: str | None = None, lifespan: Callable | None = None) -> FastAPI:
    """The /v1 routes over `backend`; `lifespan` lets a server own resources (an engine) for the app's life."""
    app = FastAPI(title="relayrl OpenAI-compatible API", lifespan=lifespan)

    def check_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        if api_key is not None and not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise HTTPException(status_code=401, detail="invalid API key")

    async def handle(request: Request, fn, session: str | None) -> JSONResponse:
        check_key(request)
        try:
            body = await request.json()
        except ValueError:
            return error_response(400, "request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "body: must be a JSON object")
        if body.get("stream"):
            return error_response(400, "stream: streaming is not supported")
        try:
            return JSONResponse(await fn(body, session))
        except (ValueError, KeyError, TypeError) as e:  # bad request content, named in the message
            return error_response(400, f"{type(e).__name__}: {e}")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, backend.chat, None)

    @app.post("/sessions/{sid}/v1/chat/completions")
    async def session_chat(sid: str, request: Request):
        return await handle(request, backend.chat, sid)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, backend.complete, None)

    @app.post("/sessions/{sid}/v1/completions")
    async def session_completions(sid: str, request: Request):
        return await handle(request, backend.complete, sid)

    @app.get("/v1/models")
    @app.get("/sessions/{sid}/v1/models")
    async def models(request: Request, sid: str | None = None):
        check_key(request)
        return {"object": "list", "data": [{"id": backend.model_name, "object": "model", "owned_by": "relayrl"}]}

    return app


def error_response(status: int, message: str) -> JSONResponse:
    """OpenAI's (and SGLang's) error body, so clients of either API read our errors the usual way."""
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "code": status}},
                        status_code=status)
