"""`relayrl serve`: one model in a `LocalEngine`, served over HTTP by uvicorn.

One FastAPI app carries two APIs over the same engine (so they share its continuous batch):
- the SGLang-compatible native API (`relayrl.serve.native`): token ids in and out, weight reloads,
  pause / abort; relayrl's RemoteEngine is its client;
- the OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) for agents and tools
  written against the `openai` package. Chat renders messages with the tokenizer's chat template; `tools`
  are described in the template (or a system prompt when it has no tool support) and `<tool_call>` output is
  returned as OpenAI `tool_calls`; `return_token_ids: true` adds `prompt_token_ids` / `token_ids` (vLLM's
  extension). Streaming is not supported (`stream: true` -> HTTP 400). The served model is named by the
  --model argument in /v1/models and responses; a request's `model` field is not checked (one model is
  served). Options that would change what is sampled and that the engine cannot honour (stop strings,
  penalties, logit_bias, echo, best_of > 1) are refused with 400; only the sampled tokens' logprobs are
  returned (top alternatives are not computed).

Lifecycle: the engine is loaded before the server binds, the ready line is printed once it accepts
requests, and SIGTERM / SIGINT shut down gracefully: new generations get 503, running ones finish at once
with finish_reason "abort", the engine is closed in the lifespan shutdown and the process exits with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from relayrl.agents.tool import parse_tool_calls, tools_system_prompt
from relayrl.engine.base import GenOutput, SamplingParams
from relayrl.hardware import resolve_dtype
from relayrl.serve.native import BadRequest, ServerState, health, native_router, number
from relayrl.serve.openai_api import chat_response, make_openai_app
from relayrl.tools import Tool

# OpenAI / vLLM options that would change what is sampled: refused unless neutral (see native.py's docstring)
_NEUTRAL = {"frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1, "min_p": 0, "min_tokens": 0,
            "best_of": 1, "echo": False, "suffix": None, "logit_bias": None}


def _template_content(content: Any, where: str) -> Any:
    """OpenAI content parts -> the plain string chat templates expect (text parts only)."""
    if not isinstance(content, list):
        return content
    if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        raise BadRequest(where, "only text content parts are supported")
    return "".join(p.get("text", "") for p in content)


def _template_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages as chat templates expect them: string content, tool-call arguments as objects (OpenAI sends
    them as JSON strings; templates render them with tojson)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages", "must be a non-empty list of messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}]", 'must be an object with a "role"')
        m = {**m, "content": _template_content(m.get("content"), f"messages[{i}].content")}
        if m.get("tool_calls"):
            m["tool_calls"] = [_parsed_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if isinstance(fn.get("arguments"), str):
        with contextlib.suppress(json.JSONDecodeError):
            fn["arguments"] = json.loads(fn["arguments"])
    return {**call, "function": fn}


def _openai_tool_calls(text: str) -> list[dict[str, Any]]:
    """`<tool_call>{...}</tool_call>` blocks in the output as OpenAI tool_calls (malformed ones are dropped)."""
    return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
            for c in parse_tool_calls(text) if isinstance(c, dict)]


def _finish(out: GenOutput, tool_calls: bool = False) -> str:
    if tool_calls:
        return "tool_calls"
    return {"length": "length", "abort": "abort"}.get(out.finish_reason, "stop")


class EngineBackend:
    """The ChatBackend of `make_openai_app` over the served engine; every request stands alone."""

    def __init__(self, state: ServerState, model_name: str):
        self.state, self.model_name, self.tok = state, model_name, state.tokenizer
        self.native_tools = "tools" in (getattr(self.tok, "chat_template", "") or "")

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
        """Render with the chat template (generation prompt added) and tokenize, as RecordingBackend does."""
        if tools and not self.native_tools:
            described = [Tool(t["function"]["name"], t["function"].get("description", ""),
                              t["function"].get("parameters", {}), None) for t in tools]
            messages = [{"role": "system", "content": tools_system_prompt(described)}, *messages]
        kw = {"tools": tools} if tools and self.native_tools else {}
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        return self.state.check_prompt(self.tok(text, add_special_tokens=False)["input_ids"], "messages")

    def params(self, body: dict[str, Any], prompt_len: int) -> tuple[SamplingParams, int]:
        """OpenAI sampling fields -> (SamplingParams, n); max_tokens defaults to the rest of the context."""
        for key, neutral in _NEUTRAL.items():
            if body.get(key) not in (None, neutral):
                raise BadRequest(key, f"is not supported (only {neutral})")
        if body.get("stop"):
            raise BadRequest("stop", "stop strings are not supported")
        key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        max_tokens = number(body, key, self.state.engine.max_seq_len - prompt_len, int)
        n = number(body, "n", 1, int)
        for field, value in ((key, max_tokens), ("n", n)):
            if value < 1:
                raise BadRequest(field, f"must be >= 1, got {value}")
        try:
            return SamplingParams(max_new_tokens=max_tokens, temperature=number(body, "temperature", 1.0, float),
                                  top_p=number(body, "top_p", 1.0, float),
                                  top_k=max(number(body, "top_k", 0, int), 0), seed=number(body, "seed", None, int)), n
        except ValueError as e:
            raise BadRequest("sampling", str(e)) from None

    async def sample(self, prompt: list[int], params: SamplingParams, n: int) -> list[GenOutput]:
        """n samples of one prompt (the engine prefills it once); a seeded request gives sample i seed+i,
        so the n choices differ but stay reproducible."""
        seeded = [params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                  for i in range(n)]
        return list(await asyncio.gather(*(self.state.generate(prompt, p) for p in seeded)))

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tok.decode([t]) for t in ids]

    async def chat(self, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        messages, tools = _template_messages(body.get("messages")), body.get("tools") or None
        prompt = self.chat_prompt_ids(messages, tools)
        params, n = self.params(body, len(prompt))
        outs = await self.sample(prompt, params, n)
        cid, choices, want_lp = f"chatcmpl-{uuid.uuid4().hex}", [], bool(body.get("logprobs"))
        for i, out in enumerate(outs):
            text = self.tok.decode(out.output_ids, skip_special_tokens=True)
            calls = _openai_tool_calls(text) if tools else []
            content = text.split("<tool_call>")[0].strip() if calls else text
            reply = chat_response(cid, self.model_name, content or None, calls or None, _finish(out, bool(calls)),
                                  prompt, out.output_ids, out.logprobs if want_lp else None,
                                  self.token_texts(out.output_ids) if want_lp else None,
                                  bool(body.get("return_token_ids")))
            choices.append({**reply["choices"][0], "index": i})
        return {**reply, "choices": choices, "usage": _usage([len(prompt)], outs)}

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        """`prompt` as a string, token ids, or a batch of either."""
        if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("prompt", "must be a string, a list of token ids, or a non-empty list of either")
        return [self.state.check_prompt(self.tok(p)["input_ids"] if isinstance(p, str) else p, f"prompt[{i}]")
                for i, p in enumerate(prompt)]

    async def complete(self, body: dict[str, Any], session: str | None) -> dict[str, Any]:
        prompts = self.completion_prompts(body.get("prompt"))
        jobs = [(p, *self.params(body, len(p))) for p in prompts]
        per_prompt = await asyncio.gather(*(self.sample(p, params, n) for p, params, n in jobs))
        want_lp, with_ids = body.get("logprobs") not in (None, False), bool(body.get("return_token_ids"))
        choices = []
        for prompt, outs in zip(prompts, per_prompt):
            for out in outs:
                choice: dict[str, Any] = {"index": len(choices), "finish_reason": _finish(out), "logprobs": None,
                                          "text": self.tok.decode(out.output_ids, skip_special_tokens=True)}
                if want_lp:  # only the sampled tokens' logprobs: top alternatives are not computed
                    choice["logprobs"] = {"tokens": self.token_texts(out.output_ids),
                                          "token_logprobs": list(out.logprobs), "top_logprobs": None}
                if with_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = prompt, list(out.output_ids)
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": _usage([len(p) for p in prompts], [o for outs in per_prompt for o in outs])}


def _usage(prompt_lens: list[int], outs: list[GenOutput]) -> dict[str, int]:
    prompt, completion = sum(prompt_lens), sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_app(state: ServerState, model_name: str) -> FastAPI:
    """The one app: OpenAI routes, native routes, and an open /health; the engine is closed on shutdown."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.closing = True
        await asyncio.to_thread(state.engine.close)

    app = make_openai_app(EngineBackend(state, model_name), state.api_key, lifespan=lifespan)
    app.include_router(native_router(state))

    async def health_route() -> Any:
        return health(state)

    app.add_api_route("/health", health_route, methods=["GET"])
    return app


class RelayServer(uvicorn.Server):
    """uvicorn plus relayrl's lifecycle: a ready line once listening, running generations aborted as soon as
    a shutdown starts (uvicorn would otherwise wait for them to finish), and exit code 0 on SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started and not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            print(f"relayrl serve: ready on http://{host}:{port}", flush=True)

    async def shutdown(self, sockets: list | None = None) -> None:
        self.state.closing = True  # from here on nothing reaches the engine
        await asyncio.to_thread(self.state.engine.abort)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn's, minus re-raising the signal after the graceful shutdown: a requested stop is a clean
        exit (code 0), not a death by signal."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 30000, dtype: str = "auto",
          max_batch_size: int = 64, max_seq_len: int | None = None, max_tokens_in_flight: int | None = None,
          api_key: str | None = None, seed: int = 0, log_level: str = "info") -> None:
    """Load `model` (a folder or an alias) and serve it until SIGTERM / SIGINT. Port 0 picks a free port
    (the ready line tells which)."""
    from relayrl.engine.local import LocalEngine
    from relayrl.models import load_tokenizer, resolve_model_path

    path = resolve_model_path(model)
    dtype, why = resolve_dtype(dtype)
    print(f"relayrl serve: {dtype} ({why})", flush=True)
    engine = LocalEngine.from_pretrained(path, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                         max_tokens_in_flight=max_tokens_in_flight, seed=seed)
    state = ServerState(engine, load_tokenizer(path), path, api_key)
    config = uvicorn.Config(build_app(state, model), host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    try:
        RelayServer(config, state).run()
    finally:
        engine.close()
