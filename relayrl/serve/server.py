"""`relayrl serve`: one model in a `LocalEngine`, served over HTTP by uvicorn.

One FastAPI app carries two APIs over the same engine (so they share its continuous batch):
- the SGLang-compatible native API (`relayrl.serve.native`): token ids in and out, weight reloads,
  pause / abort; relayrl's RemoteEngine is its client;
- the OpenAI-compatible API (`/v1/chat/completions`, `/v1/completions`, `/v1/models`) for agents and tools
  written against the `openai` package. Chat renders messages with the tokenizer's chat template; `tools`
  are described in the template (or a system prompt when it has no tool support) and calls in the template's
  format come back as OpenAI `tool_calls`, with `tool_choice`; `response_format` other than text is refused
  (`relayrl.serve.chat_tools`); `return_token_ids: true` adds `prompt_token_ids` / `token_ids` (vLLM's
  extension). Image content parts (`image_url`, a base64 data URL) go to a vision-language model, checked and
  expanded by its processor (`relayrl.serve.images`; URLs are not fetched). `stream: true` streams token by
  token as OpenAI's server-sent events (`relayrl.serve.streaming`;
  completions' `echo` is not streamed: 400). The served model is named by
  --served-model-name (several aliases; default the --model argument) in /v1/models and responses; a request
  naming another `model` gets 404 (`relayrl.serve.openai_api`). `stop` strings end generation in the engine
  (relayrl.engine.stops): the returned text is cut before the stop string, `token_ids` keep every sampled
  token. Options that would change what is sampled and that the engine cannot honour (penalties, logit_bias,
  best_of > 1) are refused with 400. Logprobs as OpenAI returns them (`relayrl.serve.openai_params`): top
  alternatives per token (`top_logprobs`, completions `logprobs: k`) come from the distribution the sampled
  token's logprob is taken from; completions `echo` returns the prompt first, and with logprobs its tokens'
  logprobs (at temperature 1, one forward over the prompt: LocalEngine.submit_score), `max_tokens: 0` scoring
  the prompt alone.

Hostile clients: every field of every request is checked against the server's limits before any of it
reaches the engine (`relayrl.serve.limits`, `parsing`, `openai_params`); requests wait in a fair queue in
front of the engine, so no request's size holds up another's (`relayrl.serve.admission`); errors name the
field and never carry internal details (`relayrl.serve.errors`); weights load only from under --weights-root
(`relayrl.serve.weights_disk`) and every weight update is checked (finite, shape, dtype) before the engine
sees it; a non-loopback address needs an API key or --insecure, and with a key the interactive docs are off;
requests a web page could send (not JSON, a foreign Host or Origin) are refused (`relayrl.serve.security`);
connections are capped and idle ones closed (`relayrl.serve.connections`); tool schemas are checked whole
(`relayrl.serve.tool_schema`); special tokens typed in chat messages can be made text
(`relayrl.serve.special_tokens`). docs/security.md lists what is refused, and how.

Lifecycle: the engine is loaded before the server binds, the ready line is printed once it accepts
requests, and SIGTERM / SIGINT shut down gracefully: new generations get 503, running ones finish at once
with finish_reason "abort", the engine is closed in the lifespan shutdown and the process exits with 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from PIL import Image

from relayrl.common.device import resolve_device
from relayrl.common.hardware import resolve_dtype
from relayrl.common.logs import third_party_level
from relayrl.engine.base import GenOutput, SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.scoring import Scored
from relayrl.models import load_tokenizer, resolve_model_path
from relayrl.serve import openai_params
from relayrl.serve.chat_tools import ChatTools, ToolChoice
from relayrl.serve.connections import (
    ConnectionLimits,
    Connections,
    check_max_connections,
    default_max_connections,
    listen_backlog,
    protocol_class,
    quiet_accept_errors,
)
from relayrl.serve.errors import BadRequest
from relayrl.serve.images import ServeImages, read_images
from relayrl.serve.limits import ServerLimits, flag
from relayrl.serve.native import health, native_router, output_text, submit_scores
from relayrl.serve.openai_api import Alternatives, chat_response, completion_logprobs, make_openai_app
from relayrl.serve.security import ServeRefused, SiteGuard, SitePolicy, check_options
from relayrl.serve.special_tokens import Escaped, encode, special_texts
from relayrl.serve.state import ServerState
from relayrl.serve.streaming import (
    Answer,
    ChatChunks,
    Choice,
    Chunks,
    CompletionChunks,
    IncrementalText,
    Stream,
    stream_options,
)


def _finish(out: GenOutput) -> str:
    return {"length": "length", "abort": "abort"}.get(out.finish_reason, "stop")


class EngineBackend:
    """The ChatBackend of `make_openai_app` over the served engine; every request stands alone and is checked
    whole (`relayrl.serve.openai_params`) before any of it reaches the engine."""

    def __init__(self, state: ServerState, model_name: str, escape_special_tokens: bool = False):
        self.state, self.model_name, self.tok = state, model_name, state.tokenizer  # the first served name
        self.limits = state.limits
        self.tools = ChatTools(self.tok)
        self.specials = special_texts(self.tok) if escape_special_tokens else ()

    def _render(self, messages: list[dict[str, Any]], tools: list[dict] | None, prefill: str = "",
                images: tuple[Image.Image, ...] = ()) -> list[int]:
        """Render with the chat template (generation prompt added, then `prefill`: the assistant turn's opening)
        and tokenize, as RecordingBackend does; with --escape-special-tokens the client's special-token text
        stays text (relayrl.serve.special_tokens). A vision-language model's image placeholders are then expanded
        into their images' tokens (relayrl.serve.images)."""
        try:
            escaped = Escaped([messages, tools], self.specials) if self.specials else None
        except RecursionError:
            raise BadRequest("messages", "nest too deeply") from None
        if escaped is not None:
            messages, tools = escaped.value
        messages, kw = self.tools.template_inputs(messages, tools)
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        except Exception as e:
            raise openai_params.render_error(e) from None
        text, spans = escaped.restore(text + prefill) if escaped is not None else (text + prefill, [])
        ids = encode(self.tok, text, spans)
        if self.state.images is None:
            return ids
        if not images:  # image tokens typed as text would reach the engine without images
            self.state.images.check_prompt(ids, (), "messages")
            return ids
        return self.state.images.expand(ids, images, "messages")

    async def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict] | None,
                              prefill: str = "", images: tuple[Image.Image, ...] = ()) -> list[int]:
        openai_params.check_size([messages, tools], self.limits, "messages")
        ids = await self.state.in_tokenizer_thread(self._render, messages, tools, prefill, images)
        return self.limits.check_prompt(ids, "messages")

    def samples(self, jobs: list[tuple[list[int], SamplingParams, int]]) -> list[tuple[list[int], SamplingParams,
                                                                                       None]]:
        """n samples of each prompt, checked against --max-n and the in-flight budget; a seeded request gives
        sample i seed+i, so the n choices differ but stay reproducible."""
        flat = [(prompt, p if p.seed is None else dataclasses.replace(p, seed=p.seed + i), None)
                for prompt, p, n in jobs for i in range(n)]
        self.limits.check_samples(len(flat), "n")
        self.limits.check_cost(sum(len(q) + p.max_new_tokens for q, p, _ in flat), "max_tokens")
        return flat

    async def sample(self, jobs: list[tuple[list[int], SamplingParams, int]],
                     images: tuple[bytes, ...] = ()) -> list[list[GenOutput]]:
        """The `samples` of the jobs, all as one request of the server's queue (the engine prefills a prompt
        once); `images`: the prompts' images (a chat request's one prompt)."""
        flat = self.samples(jobs)
        futures = self.state.submit(flat, images=[images] * len(flat) if images else None)
        try:
            outs = list(await asyncio.gather(*futures))
        finally:
            for f in futures:  # the client went away (or another sample failed): stop the rest
                f.cancel()
        it = iter(outs)
        return [[next(it) for _ in range(n)] for _, _, n in jobs]

    async def generate(self, jobs: list[tuple[list[int], SamplingParams | None, int]]) -> list[list[GenOutput]]:
        """`sample`, where a prompt without params (completions' max_tokens 0 with echo) gets n empty outputs."""
        running = [job for job in jobs if job[1] is not None]
        outs = iter(await self.sample(running) if running else [])
        return [next(outs) if params is not None else [GenOutput([], [], [], "length", len(prompt))] * n
                for prompt, params, n in jobs]

    async def score(self, prompts: list[list[int]], top: int) -> list[Scored]:
        """Each prompt's token logprobs and `top` alternatives (relayrl.serve.native.submit_scores)."""
        futures = submit_scores(self.state, [(prompt, top) for prompt in prompts])
        try:
            return list(await asyncio.gather(*futures))
        finally:
            for f in futures:
                f.cancel()

    def token_texts(self, ids: list[int]) -> list[str]:
        return [self.tok.decode([t]) for t in ids]

    def alternatives(self, alts: list[tuple[int, float]]) -> Alternatives:
        return list(zip(self.token_texts([t for t, _ in alts]), [lp for _, lp in alts]))

    async def chat(self, body: dict[str, Any], session: str | None) -> dict[str, Any] | Stream:
        streamed = stream_options(body)
        asked = openai_params.logprob_options(body, chat=True)
        takes_images = self.state.images is not None  # a text-only model: an image part is a 400 naming it
        messages = openai_params.messages(body.get("messages"), self.limits, takes_images)
        messages, found = openai_params.take_images(messages)
        tools = openai_params.tools(body.get("tools"))
        tool_choice = self.tools.choice(body.get("tool_choice"), tools, flag(body, "parallel_tool_calls", True))
        read = await read_images(found, self.state.images)  # each checked, or a 400 naming its part
        images = tuple(data for data, _ in read)
        prompt = await self.chat_prompt_ids(messages, tools, tool_choice.prefill, tuple(img for _, img in read))
        params, n = openai_params.sampling(body, self.limits, len(prompt))
        params = dataclasses.replace(params, top_logprobs=asked.top)
        want_lp, with_ids = asked.wanted, bool(body.get("return_token_ids"))
        if streamed is not None:
            return self.chat_stream(prompt, params, n, tool_choice, asked, with_ids, streamed, images)
        outs = (await self.sample([(prompt, params, n)], images))[0]
        cid, choices = f"chatcmpl-{uuid.uuid4().hex}", []
        for i, out in enumerate(outs):
            text = output_text(self.tok, out, params.stop_strings)
            content, calls, finish = self.tools.reply(tool_choice, out, text, params.stop_strings, _finish(out))
            reply = chat_response(cid, self.model_name, content, calls, finish, prompt, out.output_ids,
                                  out.logprobs if want_lp else None,
                                  self.token_texts(out.output_ids) if want_lp else None, with_ids,
                                  [self.alternatives(a) for a in out.top_logprobs or []] if asked.top else None)
            choices.append({**reply["choices"][0], "index": i})
        return {**reply, "choices": choices, "usage": _usage([len(prompt)], outs)}

    async def completion_prompts(self, prompt: Any) -> tuple[list[list[int]], list[str]]:
        """`prompt` as a string, token ids, or a batch of either: as token ids, and as text (what `echo` returns:
        the string sent, or the ids decoded); text is tokenized off the event loop."""
        checked = openai_params.completion_prompts(prompt, self.limits)
        texts = [p for p in checked if isinstance(p, str)]
        tokenized = iter(await self.state.tokenize(texts) if texts else [])
        ids = [self.limits.check_prompt(next(tokenized), f"prompt[{i}]") if isinstance(p, str) else p
               for i, p in enumerate(checked)]
        for i, p in enumerate(ids if self.state.images is not None else []):  # completions take no images
            self.state.images.check_prompt(p, (), f"prompt[{i}]")
        return ids, [p if isinstance(p, str) else self.tok.decode(p) for p in checked]

    def completion_logprobs(self, prompt: list[int], text: str, out: GenOutput, scored: Scored | None) -> dict:
        """A choice's logprobs: the generated tokens', after the prompt's when it was scored (echo)."""
        tokens, lps = self.token_texts(out.output_ids), list(out.logprobs)
        top = [self.alternatives(a) for a in out.top_logprobs] if out.top_logprobs else [[] for _ in lps]
        if scored is None:
            return completion_logprobs(tokens, lps, top, len(text))
        prompt_lps, prompt_top = scored
        return completion_logprobs(self.token_texts(prompt) + tokens, [None, *prompt_lps, *lps],
                                   [None, *map(self.alternatives, prompt_top), *top], 0)

    async def complete(self, body: dict[str, Any], session: str | None) -> dict[str, Any] | Stream:
        streamed = stream_options(body)
        asked = openai_params.logprob_options(body, chat=False)
        if streamed is not None and asked.echo:
            raise BadRequest("echo", "is not supported with stream: true", "unsupported_value")
        prompts, texts = await self.completion_prompts(body.get("prompt"))
        jobs = [(p, *openai_params.completion_sampling(body, self.limits, len(p), asked)) for p in prompts]
        jobs = [(p, None if params is None else dataclasses.replace(params, top_logprobs=asked.top), n)
                for p, params, n in jobs]
        with_ids = bool(body.get("return_token_ids"))
        if streamed is not None:
            return self.completion_stream(jobs, texts, asked, with_ids, streamed)
        per_prompt = await self.generate(jobs)
        scores = await self.score(prompts, asked.top) if asked.score_prompt else [None] * len(prompts)
        choices = []
        for (prompt, params, _), text, outs, scored in zip(jobs, texts, per_prompt, scores):
            for out in outs:
                completion = "" if params is None else output_text(self.tok, out, params.stop_strings)
                choice: dict[str, Any] = {"index": len(choices), "finish_reason": _finish(out), "logprobs": None,
                                          "text": text + completion if asked.echo else completion}
                if asked.wanted:
                    choice["logprobs"] = self.completion_logprobs(prompt, text, out, scored)
                if with_ids:
                    choice["prompt_token_ids"], choice["token_ids"] = prompt, list(out.output_ids)
                choices.append(choice)
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices,
                "usage": _usage([len(p) for p in prompts], [o for outs in per_prompt for o in outs])}

    # ---- streamed answers (relayrl.serve.streaming) -----------------------------------------------------------
    def stream(self, cid: str, chunks: Chunks, jobs: list[tuple[list[int], SamplingParams, int]], usage: bool,
               marker: str | None = None, images: tuple[bytes, ...] = ()) -> Stream:
        """Submit the jobs' samples, each with a listener, and return their stream (its first byte goes out only
        after this returns: every refusal came before)."""
        flat = self.samples(jobs)
        choices = [Choice(i, prompt, p, IncrementalText(self.decode, p.stop_strings, marker))
                   for i, (prompt, p, _) in enumerate(flat)]
        stream = Stream(cid, self.model_name, chunks, choices, usage, sum(len(prompt) for prompt, _, _ in jobs))
        return stream.start(self.state.submit(flat, [stream.listener(i) for i in range(len(flat))],
                                              [images] * len(flat) if images else None))

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def answer(self, asked: openai_params.Logprobs, with_ids: bool) -> Answer:
        return Answer(self.token_texts, self.alternatives, asked.wanted, bool(asked.top), with_ids)

    def chat_stream(self, prompt: list[int], params: SamplingParams, n: int, tool_choice: ToolChoice,
                    asked: openai_params.Logprobs, with_ids: bool, usage: bool,
                    images: tuple[bytes, ...] = ()) -> Stream:
        """Content streams up to where a tool call starts (`call_start`); the calls come parsed at the end."""
        def reply(out: GenOutput, p: SamplingParams) -> tuple[str | None, list[dict[str, Any]] | None, str]:
            text = output_text(self.tok, out, p.stop_strings)
            return self.tools.reply(tool_choice, out, text, p.stop_strings, _finish(out))

        return self.stream(f"chatcmpl-{uuid.uuid4().hex}", ChatChunks(self.answer(asked, with_ids), reply),
                           [(prompt, params, n)], usage, self.tools.call_start(tool_choice), images)

    def completion_stream(self, jobs: list[tuple[list[int], SamplingParams | None, int]], texts: list[str],
                          asked: openai_params.Logprobs, with_ids: bool, usage: bool) -> Stream:
        """Text offsets of logprobs start after each prompt's text, as in the non-streamed answer."""
        def final(out: GenOutput, p: SamplingParams) -> tuple[str, str]:
            return output_text(self.tok, out, p.stop_strings), _finish(out)

        running = [(prompt, params, n) for prompt, params, n in jobs if params is not None]  # None only with echo
        offsets, k = {}, 0
        for (_, _, n), text in zip(jobs, texts):
            offsets |= {k + i: len(text) for i in range(n)}
            k += n
        chunks = CompletionChunks(self.answer(asked, with_ids), final, offsets=offsets)
        return self.stream(f"cmpl-{uuid.uuid4().hex}", chunks, running, usage)


def _usage(prompt_lens: list[int], outs: list[GenOutput]) -> dict[str, int]:
    prompt, completion = sum(prompt_lens), sum(len(o.output_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def build_app(state: ServerState, model_names: tuple[str, ...], site: SitePolicy,
              escape_special_tokens: bool = False) -> FastAPI:
    """The one app: OpenAI routes (a request's `model` one of `model_names`), native routes, and an open /health,
    behind the cross-site checks of `site` (relayrl.serve.security; CORS answers for its allowed origins only);
    the engine is closed on shutdown."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        state.closing = True
        await asyncio.to_thread(state.engine.close)
        state.close()

    backend = EngineBackend(state, model_names[0], escape_special_tokens)
    app = make_openai_app(backend, state.api_key, lifespan=lifespan,
                          max_body_bytes=state.limits.max_body_bytes, served_models=model_names, streaming=True)
    app.include_router(native_router(state))

    async def health_route() -> Any:
        return health(state)

    app.add_api_route("/health", health_route, methods=["GET"])
    if site.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(site.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type"])
    app.add_middleware(SiteGuard, policy=site)  # added last: runs first, before CORS answers a preflight
    return app


class RelayServer(uvicorn.Server):
    """uvicorn plus relayrl's lifecycle: a ready line once listening, running generations aborted as soon as
    a shutdown starts (uvicorn would otherwise wait for them to finish), and exit code 0 on SIGTERM/SIGINT."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    async def startup(self, sockets: list | None = None) -> None:
        quiet_accept_errors(asyncio.get_running_loop())
        await super().startup(sockets)
        if self.started and not self.should_exit:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
            print(f"relayrl serve: ready on http://{host}:{port}", flush=True)

    async def shutdown(self, sockets: list | None = None) -> None:
        self.state.closing = True  # from here on nothing reaches the engine
        await self.state.abort()  # what waits in the server's queue, then what runs
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


@dataclasses.dataclass(frozen=True)
class ServeOptions:
    """What `relayrl serve` is started with beyond the engine's own settings (see relayrl.serve.limits and
    relayrl.serve.security); None takes the default that follows the engine."""

    api_key: str | None = None
    insecure: bool = False  # listen on a non-loopback address without an API key
    weights_root: str | None = None  # /update_weights_from_disk reads only under it; None: the route is off
    max_n: int | None = None
    max_tokens: int | None = None
    max_prompt_tokens: int | None = None
    max_tokens_in_flight: int | None = None
    max_body_bytes: int | None = None
    kv_dtype: str = "auto"  # the engine's KV cache (LocalEngine kv_dtype)
    served_model_names: tuple[str, ...] = ()  # what a request's `model` may be; () : the --model argument
    allowed_hosts: tuple[str, ...] = ()  # Host names served besides IP literals, localhost and --host ("*": any)
    allowed_origins: tuple[str, ...] = ()  # browser origins allowed to call the API (CORS), "*": any
    max_connections: int | None = None  # None: half the open-files limit, at most 1024
    idle_timeout: float = 10.0  # seconds a connection may wait for a request's complete headers
    escape_special_tokens: bool = False  # special-token text in chat messages is tokenized as text


def _limits(engine: Any, max_batch_size: int, options: ServeOptions) -> ServerLimits:
    vocab = int(engine.model.get_input_embeddings().num_embeddings)
    try:
        return ServerLimits.for_engine(engine.max_seq_len, vocab, max_batch_size,
                                       max_prompt_tokens=options.max_prompt_tokens, max_tokens=options.max_tokens,
                                       max_n=options.max_n, budget=options.max_tokens_in_flight,
                                       max_body_bytes=options.max_body_bytes)
    except ValueError as e:
        raise ServeRefused(str(e)) from None


def _connection_limits(options: ServeOptions) -> ConnectionLimits:
    if not options.idle_timeout > 0:
        raise ServeRefused(f"--idle-timeout must be > 0 seconds, got {options.idle_timeout}")
    try:
        cap = check_max_connections(options.max_connections or default_max_connections())
    except ValueError as e:
        raise ServeRefused(str(e)) from None
    return ConnectionLimits(cap, options.idle_timeout)


def serve(model: str, *, host: str = "127.0.0.1", port: int = 30000, dtype: str = "auto",
          max_batch_size: int = 64, max_seq_len: int | None = None, seed: int = 0, log_level: str = "info",
          options: ServeOptions | None = None, device: str = "cpu") -> None:
    """Load `model` (a folder or an alias) and serve it until SIGTERM / SIGINT. Port 0 picks a free port
    (the ready line tells which). ServeRefused when the options do not allow starting. relayrl's own records
    (internal errors, with their request id and traceback) go where the caller's logging sends them (the CLI:
    relayrl.common.logs); uvicorn's follow `log_level` as any third-party library's do, so a request is not a
    line of the log unless debugging."""
    options = options or ServeOptions()
    names = tuple(options.served_model_names) or (model,)
    if not all(names):
        raise ServeRefused("--served-model-name: a name must not be empty")
    weights_root = check_options(host, options.api_key, options.insecure, options.weights_root)
    conns = Connections(_connection_limits(options))
    try:  # before the model loads: --device cuda on a machine without CUDA is one line, not a traceback
        where = resolve_device(device)
    except (RuntimeError, ValueError) as e:
        raise ServeRefused(f"--device: {e}") from None
    path = resolve_model_path(model)
    dtype, why = resolve_dtype(dtype, where.type)
    kv = "" if options.kv_dtype in ("auto", dtype) else f", KV cache {options.kv_dtype}"
    print(f"relayrl serve: {dtype}{kv} on {where} ({why})", flush=True)
    engine = LocalEngine.from_pretrained(path, dtype=dtype, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                         max_tokens_in_flight=options.max_tokens_in_flight, seed=seed,
                                         kv_dtype=options.kv_dtype, device=where)
    try:
        state = ServerState(engine, load_tokenizer(path), path, _limits(engine, max_batch_size, options),
                            options.api_key, weights_root, images=ServeImages.for_engine(engine, path))
        site = SitePolicy(host, bool(options.api_key), options.allowed_hosts, options.allowed_origins)
        config = uvicorn.Config(build_app(state, names, site, options.escape_special_tokens), host=host, port=port,
                                log_level=third_party_level(log_level), lifespan="on", http=protocol_class(conns),
                                backlog=listen_backlog(conns.limits.max_connections), timeout_graceful_shutdown=5,
                                server_header=False)
        RelayServer(config, state).run()
    finally:
        engine.close()
