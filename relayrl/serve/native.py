"""SGLang-compatible native API over a `LocalEngine`: /generate, weight reloads, pause / abort, health.

relayrl's RemoteEngine is a client of this API and of real SGLang servers alike, so requests and responses
follow SGLang's shapes (`input_ids` + `sampling_params` in; `text`, `output_ids`, `meta_info` out, with
`finish_reason` as `{"type": "stop", "matched": id}`, `{"type": "length", "length": n}` or
`{"type": "abort", "message": ...}` and logprobs as `[[logprob, token_id, null], ...]`).

Routes: POST /generate, /update_weights_from_disk, /pause_generation, /continue_generation, /abort_request,
/flush_cache; GET /health (open even with an API key), /health_generate, /get_model_info,
/get_weight_version, /get_load; and the weight-broadcast routes of `relayrl.serve.weights_dist`
(/init_weights_update_group, /update_weights_from_distributed, /destroy_weights_update_group). A batch
(`input_ids` as a list of lists) or `sampling_params.n > 1` is
answered with a list, prompt-major; a seeded group of n gets seeds seed, seed+1, ... so its samples differ
yet repeat exactly. Only requests that name a `rid` can be aborted by it (an unnamed request gets a fresh
id in meta_info.id) and keep their KV cache parked for the trajectory's next turn.

relayrl extension: `meta_info.output_token_versions`, the policy version that sampled each token, which is
what partial-rollout training needs. Differences from SGLang, on purpose:
- `weight_version` is an int (a numeric string is accepted on input);
- `/pause_generation` defaults to mode "in_place" (running requests keep their state and continue after
  `/continue_generation`); mode "abort" aborts them first, "retract" behaves like "in_place";
- sampling options this engine cannot honour (stop strings, penalties, grammars, min_p) are rejected with
  400 instead of being ignored, because silently sampling from a different distribution corrupts RL data;
  options that only touch the returned extras (top_logprobs_num, skip_special_tokens, ...) are accepted;
- no streaming, no prompt logprobs (`input_token_logprobs`), no top-k logprobs.
Logprobs are those of the temperature-scaled distribution before top-k/top-p (the trainer's convention).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from relayrl.engine.base import GenOutput, SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.serve.openai_api import error_response

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_NEUTRAL = {"min_new_tokens": 0, "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1,
            "min_p": 0}
_UNSUPPORTED = ("stop", "stop_regex", "regex", "json_schema", "ebnf", "structural_tag", "logit_bias",
                "custom_params")
_EXTRAS_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")
_KNOWN = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "seed",
          "sampling_seed", "n", *_NEUTRAL, *_UNSUPPORTED, *_EXTRAS_ONLY}


class BadRequest(ValueError):
    """A client error; the message starts with the offending field so clients can fix their request."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")


@dataclass
class ServerState:
    """What the routes share: the engine, its tokenizer, and the server's lifecycle flags."""

    engine: LocalEngine
    tokenizer: Any
    model_path: str
    api_key: str | None = None
    closing: bool = False  # set at shutdown: new generations get 503, running ones are aborted
    paused: bool = False

    def generate(self, prompt: list[int], params: SamplingParams, rid: str | None = None) -> asyncio.Future:
        """Submit to the engine now, not when an awaiting task first runs: once `closing` is set no request
        can slip in after the shutdown's abort. engine.submit only enqueues, so the event loop never blocks."""
        self.check_open()
        return asyncio.wrap_future(self.engine.submit(prompt, params, rid))

    @property
    def vocab_size(self) -> int:
        return int(self.engine.model.get_input_embeddings().num_embeddings)

    def check_open(self) -> None:
        if self.closing:
            raise HTTPException(status_code=503, detail="server is shutting down")

    def check_prompt(self, ids: Any, field: str = "input_ids") -> list[int]:
        """Validate one prompt here: a bad token id would otherwise fail the whole running batch."""
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest(field, "must be a list of token ids (or, for a batch, a list of such lists)")
        if not ids:
            raise BadRequest(field, "is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRequest(field, f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if len(ids) >= self.engine.max_seq_len:
            raise BadRequest(field, f"prompt of {len(ids)} tokens does not fit max_seq_len={self.engine.max_seq_len}")
        return ids


# ---- request parsing ----------------------------------------------------------------------------------
def number(raw: dict[str, Any], key: str, default: Any, kind: type, where: str = "") -> Any:
    """raw[key] as an int or float (default when absent or null); the error names `where.key`."""
    value = raw.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
        field = f"{where}.{key}" if where else key
        raise BadRequest(field, f"must be {'an integer' if kind is int else 'a number'}, got {value!r}")
    return kind(value)


def _check_supported(raw: dict[str, Any], where: str) -> None:
    for key, value in raw.items():
        if key in _NEUTRAL and value is not None and value != _NEUTRAL[key]:
            raise BadRequest(f"{where}.{key}", f"is not supported (only {_NEUTRAL[key]})")
        if key in _UNSUPPORTED and value:
            hint = "; use stop_token_ids" if key == "stop" else ""
            raise BadRequest(f"{where}.{key}", f"is not supported{hint}")
        if key not in _KNOWN:
            raise BadRequest(f"{where}.{key}", "unknown sampling parameter")


def parse_sampling(raw: Any, where: str = "sampling_params") -> tuple[SamplingParams, int]:
    """SGLang sampling_params -> (SamplingParams, n). top_k <= 0 (SGLang's -1) means off."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest(where, "must be an object")
    _check_supported(raw, where)
    stop = raw.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(isinstance(t, int) for t in stop):
        raise BadRequest(f"{where}.stop_token_ids", "must be a list of token ids")
    seed = number(raw, "seed", None, int, where)
    seed = number(raw, "sampling_seed", None, int, where) if seed is None else seed
    n = number(raw, "n", 1, int, where)
    if n < 1:
        raise BadRequest(f"{where}.n", f"must be >= 1, got {n}")
    try:
        params = SamplingParams(
            max_new_tokens=number(raw, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS, int, where),
            temperature=number(raw, "temperature", 1.0, float, where),
            top_p=number(raw, "top_p", 1.0, float, where),
            top_k=max(number(raw, "top_k", 0, int, where), 0),
            stop_token_ids=tuple(stop), ignore_eos=bool(raw.get("ignore_eos", False)), seed=seed)
    except ValueError as e:  # SamplingParams names the parameter
        raise BadRequest(where, str(e)) from None
    return params, n


def _prompts(body: dict[str, Any], state: ServerState) -> tuple[list[list[int]], bool]:
    """(prompts, is_batch) from input_ids (the main path) or text (tokenized here)."""
    ids = body.get("input_ids")
    if ids is None and body.get("text") is not None:
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text", "must be a string or a list of strings")
        ids = [state.tokenizer(t)["input_ids"] for t in texts]
        ids = ids if isinstance(text, list) else ids[0]
    if ids is None:
        raise BadRequest("input_ids", "missing (send input_ids, or text)")
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        return [state.check_prompt(p, f"input_ids[{i}]") for i, p in enumerate(ids)], True
    return [state.check_prompt(ids)], False


def _per_prompt(value: Any, count: int, field: str) -> list[Any]:
    """SGLang lets most fields be one value for the batch or a list with one value per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise BadRequest(field, f"has {len(value)} entries for {count} prompts")
    return value


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    rid: str
    engine_rid: str | None  # only client-named requests are abortable / keep their KV for the next turn
    logprobs: bool
    skip_special_tokens: bool = True  # for `text` only; output_ids always hold every token


def parse_generate(body: Any, state: ServerState) -> tuple[list[Job], bool]:
    """One Job per sample (prompt-major when sampling_params.n > 1) and whether to answer with a list."""
    if not isinstance(body, dict):
        raise BadRequest("body", "must be a JSON object")
    if body.get("stream"):
        raise BadRequest("stream", "streaming is not supported")
    prompts, batch = _prompts(body, state)
    raw_params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
    rids = _per_prompt(body.get("rid"), len(prompts), "rid") if batch else [body.get("rid")]
    logprobs = _per_prompt(body.get("return_logprob", False), len(prompts), "return_logprob")
    jobs: list[Job] = []
    for i, (prompt, raw, rid, lp) in enumerate(zip(prompts, raw_params, rids, logprobs)):
        where = f"sampling_params[{i}]" if isinstance(body.get("sampling_params"), list) else "sampling_params"
        params, n = parse_sampling(raw, where)
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid", "must be a string or a list of strings")
        skip = bool((raw or {}).get("skip_special_tokens", True))
        for k in range(n):  # a seeded group gets seeds seed..seed+n-1: distinct samples, still reproducible
            seeded = params if params.seed is None or k == 0 else dataclasses.replace(params, seed=params.seed + k)
            jobs.append(Job(prompt, seeded, rid or uuid.uuid4().hex, rid, bool(lp), skip))
    return jobs, batch or len(jobs) > 1


# ---- responses ------------------------------------------------------------------------------------------
def finish_reason(out: GenOutput) -> dict[str, Any]:
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.output_ids[-1]}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    return {"type": "abort", "message": "request aborted"}


def generate_response(job: Job, out: GenOutput, state: ServerState) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "id": job.rid, "finish_reason": finish_reason(out), "prompt_tokens": out.prompt_len,
        "completion_tokens": len(out.output_ids),
        "weight_version": out.versions[-1] if out.versions else state.engine.version,
        "output_token_versions": list(out.versions)}
    if job.logprobs:
        meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(out.logprobs, out.output_ids)]
    text = state.tokenizer.decode(out.output_ids, skip_special_tokens=job.skip_special_tokens)
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}


async def run_jobs(request: Request, state: ServerState, jobs: list[Job]) -> list[GenOutput]:
    """Generate all jobs concurrently (the engine batches them); a client that hangs up cancels them,
    which frees their slots at the next step instead of generating for nobody."""
    tasks = [state.generate(j.prompt, j.params, j.engine_rid) for j in jobs]
    try:
        while True:
            _, pending = await asyncio.wait(tasks, timeout=1.0)
            if not pending:
                return [t.result() for t in tasks]
            if await request.is_disconnected():
                raise HTTPException(status_code=499, detail="client disconnected")
    finally:
        for t in tasks:
            t.cancel()


# ---- weights --------------------------------------------------------------------------------------------
def _load_checked(state: ServerState, path: str) -> dict[str, Any]:
    """Read a folder's safetensors and check names and shapes *before* copying anything, so a wrong
    checkpoint is refused whole instead of leaving the engine with half-updated weights."""
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"model_path {path} is not a directory")
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    tensors = {k: v for f in files for k, v in load_file(str(f)).items()}
    current = state.engine.model.state_dict()
    for name, tensor in tensors.items():
        if name not in current:
            raise KeyError(f"the served model has no parameter {name!r}")
        if tuple(tensor.shape) != tuple(current[name].shape):
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != served {tuple(current[name].shape)}")
    return tensors


def _weight_version(body: dict[str, Any], state: ServerState) -> int:
    value = body.get("weight_version")
    if value is None:
        return state.engine.version + 1
    try:
        return int(value)
    except (TypeError, ValueError):
        raise BadRequest("weight_version", f"must be an integer, got {value!r}") from None


async def update_from_disk(body: dict[str, Any], state: ServerState) -> tuple[int, dict[str, Any]]:
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise BadRequest("model_path", "missing")
    version = _weight_version(body, state)
    if body.get("abort_all_requests"):
        await asyncio.to_thread(state.engine.abort)
    try:
        tensors = await asyncio.to_thread(_load_checked, state, path)
        await asyncio.to_thread(state.engine.update_weights, tensors.items(), version)
    except (OSError, KeyError, ValueError) as e:
        return 400, {"success": False, "message": f"{type(e).__name__}: {e}", "weight_version": state.engine.version}
    return 200, {"success": True, "message": f"loaded {len(tensors)} tensors from {path}", "weight_version": version}


# ---- routes ---------------------------------------------------------------------------------------------
def _json_body(fn: Callable[[Request, Any], Awaitable[Any]]) -> Callable[[Request], Awaitable[Any]]:
    """Parse the (optional) JSON body and turn BadRequest into SGLang's 400 {"error": {"message"}}."""
    async def route(request: Request) -> Any:
        raw = await request.body()
        try:
            body = json.loads(raw) if raw.strip() else {}
        except ValueError:
            return error_response(400, "body: request body is not JSON")
        if not isinstance(body, dict):
            return error_response(400, "body: must be a JSON object")
        try:
            return await fn(request, body)
        except BadRequest as e:
            return error_response(400, str(e))

    return route


def native_router(state: ServerState) -> APIRouter:
    """All native routes; every one but /health needs the API key when one is set."""
    def check_key(request: Request) -> None:
        given, expected = request.headers.get("authorization", "").encode(), f"Bearer {state.api_key}".encode()
        if state.api_key is not None and not secrets.compare_digest(given, expected):
            raise HTTPException(status_code=401, detail="invalid API key")

    engine = state.engine
    router = APIRouter(dependencies=[Depends(check_key)])

    async def generate(request: Request, body: Any) -> Any:
        jobs, as_list = parse_generate(body, state)
        outs = await run_jobs(request, state, jobs)
        answers = [generate_response(j, o, state) for j, o in zip(jobs, outs)]
        return JSONResponse(answers if as_list else answers[0])  # plain JSON: skips FastAPI's slow encoder walk

    async def update_weights_from_disk(request: Request, body: Any) -> Any:
        status, answer = await update_from_disk(body, state)
        return JSONResponse(answer, status_code=status)

    async def pause_generation(request: Request, body: Any) -> Any:
        mode = body.get("mode") or "in_place"
        if mode not in ("in_place", "retract", "abort"):
            raise BadRequest("mode", f"must be in_place, retract or abort, got {mode!r}")
        aborted = await asyncio.to_thread(engine.abort) if mode == "abort" else 0
        await asyncio.to_thread(engine.pause)
        state.paused = True
        return {"success": True, "message": "generation paused", "mode": mode, "aborted": aborted}

    async def continue_generation(request: Request, body: Any) -> Any:
        engine.resume()
        state.paused = False
        return {"success": True, "message": "generation continued"}

    async def abort_request(request: Request, body: Any) -> Any:
        rid = body.get("rid") or None
        if rid is not None and not isinstance(rid, str):
            raise BadRequest("rid", "must be a string")
        aborted = await asyncio.to_thread(engine.abort, None if body.get("abort_all") else rid)
        return {"success": True, "aborted": aborted}

    async def flush_cache(request: Request, body: Any) -> Any:
        await asyncio.to_thread(engine.flush_cache)
        return {"success": True, "message": "cache flushed"}

    from relayrl.serve.weights_dist import weight_routes  # imports this module: loaded here, not at the top

    for fn in (generate, update_weights_from_disk, pause_generation, continue_generation, abort_request,
               flush_cache, *weight_routes(state)):
        router.add_api_route(f"/{fn.__name__}", _json_body(fn), methods=["POST"], name=fn.__name__)

    async def get_model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "weight_version": engine.version, "max_seq_len": engine.max_seq_len}

    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.version}

    async def health_generate_route() -> Any:
        return await health_generate(state)

    async def get_load() -> list[dict[str, Any]]:
        """SGLang's load report (one entry per data-parallel rank; here one), for load-aware routing."""
        return [{"dp_rank": 0, "num_reqs": engine.num_running(), "weight_version": engine.version}]

    router.add_api_route("/get_load", get_load, methods=["GET"])
    router.add_api_route("/get_model_info", get_model_info, methods=["GET"])
    router.add_api_route("/get_weight_version", get_weight_version, methods=["GET"])
    router.add_api_route("/health_generate", health_generate_route, methods=["GET"])
    return router


def health(state: ServerState) -> Any:
    if state.closing:
        return error_response(503, "server is shutting down")
    return {"status": "ok", "weight_version": state.engine.version}


async def health_generate(state: ServerState) -> Any:
    """Prove the engine steps: one greedy token (503 while paused, when it cannot)."""
    if state.closing or state.paused:
        return error_response(503, "server is shutting down" if state.closing else "generation is paused")
    try:
        out = await asyncio.wait_for(state.generate([0], SamplingParams(max_new_tokens=1, temperature=0)), 30)
    except (TimeoutError, RuntimeError) as e:
        return error_response(503, f"generation failed: {type(e).__name__}: {e}")
    return {"status": "ok", "output_ids": out.output_ids}
