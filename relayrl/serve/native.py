"""SGLang-compatible native API over a `LocalEngine`: /generate, weight reloads, pause / abort, health.

relayrl's RemoteEngine is a client of this API and of real SGLang servers alike, so requests and responses
follow SGLang's shapes (`input_ids` + `sampling_params` in; `text`, `output_ids`, `meta_info` out, with
`finish_reason` as `{"type": "stop", "matched": id}` (the stop string when one of `sampling_params.stop` ended
it: `text` is cut right before it, `output_ids` keep every sampled token), `{"type": "length", "length": n}` or
`{"type": "abort", "message": ...}` and logprobs as `[[logprob, token_id, null], ...]`).

Logprobs, as SGLang gives them (with `return_logprob: true`): `output_token_logprobs`; `input_token_logprobs` from
prompt token `logprob_start_len` on (-1, the default: none; the first prompt token's logprob is null, nothing
comes before it); with `top_logprobs_num: k`, `output_top_logprobs` / `input_top_logprobs`, k entries per token
(null for the first prompt token); each entry `[logprob, token_id, text]`, the text null unless
`return_text_in_logprobs`. `max_new_tokens: 0` with prompt logprobs scores the prompt alone (lm-eval's
loglikelihood). Prompt logprobs come from one forward over the prompt at temperature 1 (LocalEngine.submit_score:
the trainer's logprobs of those tokens).

Routes: POST /generate, /update_weights_from_disk (only under --weights-root: `relayrl.serve.weights_disk`),
/pause_generation, /continue_generation, /abort_request,
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
- sampling options this engine cannot honour (stop_regex, penalties, grammars, min_p) are rejected with
  400 instead of being ignored, because silently sampling from a different distribution corrupts RL data;
  options that only touch the returned extras (top_logprobs_num, skip_special_tokens, ...) are accepted;
- no streaming; no `token_ids_logprob` (400);
- `image_data` (base64 or data URLs, per prompt one or a list) goes with `input_ids` as the model's processor
  expanded them, taken as they are (token-in/token-out); image URLs are not fetched (relayrl.serve.images);
- every field is checked against the server's limits (`relayrl.serve.parsing`), and samples wait in the
  server's fair queue (`relayrl.serve.admission`) rather than in the engine's first-come one.
Logprobs are those of the temperature-scaled distribution before top-k/top-p (the trainer's convention).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Depends, HTTPException, Request
from fastapi.responses import JSONResponse

from relayrl.engine.base import GenOutput, SamplingParams
from relayrl.engine.scoring import Scored
from relayrl.engine.stops import cut_at_stop
from relayrl.serve.errors import (
    ApiError,
    BadRequest,
    api_error_response,
    error_response,
    internal_error,
    log_error,
    read_json,
)
from relayrl.serve.limits import flag, rid
from relayrl.serve.parsing import Job, LogprobAsk, parse_generate
from relayrl.serve.security import key_check
from relayrl.serve.state import ServerState
from relayrl.serve.weights_disk import update_from_disk
from relayrl.serve.weights_dist import weight_routes


# ---- responses ------------------------------------------------------------------------------------------
def finish_reason(out: GenOutput) -> dict[str, Any]:
    if out.finish_reason == "stop":
        return {"type": "stop", "matched": out.stop_string if out.stop_string is not None else out.output_ids[-1]}
    if out.finish_reason == "length":
        return {"type": "length", "length": len(out.output_ids)}
    return {"type": "abort", "message": "request aborted"}


def generate_response(job: Job, out: GenOutput, state: ServerState, scored: Scored | None = None) -> dict[str, Any]:
    """SGLang's answer for one sample; `scored`: its prompt's logprobs when the job asks for them."""
    meta: dict[str, Any] = {
        "id": job.rid, "finish_reason": finish_reason(out), "prompt_tokens": out.prompt_len,
        "completion_tokens": len(out.output_ids),
        "weight_version": out.versions[-1] if out.versions else state.engine.version,
        "output_token_versions": list(out.versions)}
    if job.logprobs.output:
        meta.update(logprob_meta(job.logprobs, job.prompt, out, scored, state.tokenizer))
    text = output_text(state.tokenizer, out, job.params.stop_strings if job.trim_stop else (), job.skip_special_tokens)
    return {"text": text, "output_ids": list(out.output_ids), "meta_info": meta}


def logprob_meta(ask: LogprobAsk, prompt: list[int], out: GenOutput, scored: Scored | None,
                 tok: Any) -> dict[str, Any]:
    """The logprob fields of meta_info (module doc). Prompt position p's logprob is scored[p - 1]: the score of
    the token at p given those before it."""
    def entries(logprobs: list[float | None], ids: list[int]) -> list[list[Any]]:
        texts = [tok.decode([t]) for t in ids] if ask.text else [None] * len(ids)
        return [[lp, t, text] for lp, t, text in zip(logprobs, ids, texts)]

    def alternatives(alts: list[tuple[int, float]] | None) -> list[list[Any]] | None:
        return entries([lp for _, lp in alts], [t for t, _ in alts]) if alts else None

    meta: dict[str, Any] = {"output_token_logprobs": entries(out.logprobs, out.output_ids)}
    start = ask.input_start if ask.input_start is not None and scored is not None else len(prompt)
    positions, (lps, alts) = range(start, len(prompt)), scored or ([], [])
    meta["input_token_logprobs"] = entries([lps[p - 1] if p else None for p in positions], prompt[start:])
    if ask.top:
        meta["input_top_logprobs"] = [alternatives(alts[p - 1]) if p else None for p in positions]
        meta["output_top_logprobs"] = [alternatives(a) for a in out.top_logprobs or []]
    return meta


def submit_scores(state: ServerState, asks: list[tuple[list[int], int]]) -> list[asyncio.Future]:
    """Score each (prompt, top_k) in the engine, between two of its steps (LocalEngine.submit_score, temperature 1);
    cancelling a future withdraws its scoring."""
    state.check_open()
    return [asyncio.wrap_future(state.engine.submit_score(prompt, top)) for prompt, top in asks]


def output_text(tok: Any, out: GenOutput, stops: tuple[str, ...], skip_special_tokens: bool = True) -> str:
    """The output's text, cut right before the stop string that ended it (OpenAI's and SGLang's semantics); the
    output's token ids keep every sampled token (relayrl.engine.stops)."""
    text = tok.decode(out.output_ids, skip_special_tokens=skip_special_tokens)
    return cut_at_stop(text, stops) if out.stop_string is not None else text


async def run_jobs(request: Request, state: ServerState,
                   jobs: list[Job]) -> tuple[list[GenOutput], list[Scored | None]]:
    """Generate all jobs as one request (the engine batches them) and score the prompts whose logprobs are asked
    (each distinct one once); a client that hangs up cancels them, which frees their slots at the next step instead
    of generating for nobody. A job that only scores gets an empty output."""
    generating = [j for j in jobs if j.generate]
    scoring = list(dict.fromkeys((tuple(j.prompt), j.logprobs.top) for j in jobs if j.logprobs.input_start is not None))
    tasks = state.submit([(j.prompt, j.params, j.engine_rid) for j in generating],
                         images=[j.images for j in generating]) if generating else []
    try:
        tasks += submit_scores(state, [(list(prompt), top) for prompt, top in scoring])
        while True:
            _, pending = await asyncio.wait(tasks, timeout=1.0)
            if not pending:
                outs = iter(t.result() for t in tasks[: len(generating)])
                scores = dict(zip(scoring, (t.result() for t in tasks[len(generating):])))
                return ([next(outs) if j.generate else GenOutput([], [], [], "length", len(j.prompt)) for j in jobs],
                        [scores.get((tuple(j.prompt), j.logprobs.top)) for j in jobs])
            if await request.is_disconnected():
                raise HTTPException(status_code=499, detail="client disconnected")
    finally:
        for t in tasks:
            t.cancel()


# ---- routes ---------------------------------------------------------------------------------------------
def _json_body(fn: Callable[[Request, Any], Awaitable[Any]], state: ServerState) -> Callable[[Request], Awaitable[Any]]:
    """Parse the (optional) JSON body within the size limit and answer a refusal with the error shape; any
    other exception is an internal error: "internal error" and a request id, the details in the log."""
    async def route(request: Request) -> Any:
        try:
            return await fn(request, await read_json(request, state.limits.max_body_bytes, empty={}))
        except ApiError as e:
            return api_error_response(e)
        except HTTPException:
            raise
        except Exception as e:
            return internal_error(request, e)

    return route


def native_router(state: ServerState) -> APIRouter:
    """All native routes; every one but /health needs the API key when one is set."""
    engine = state.engine
    router = APIRouter(dependencies=[Depends(key_check(state.api_key))])

    async def generate(request: Request, body: Any) -> Any:
        jobs, as_list = await parse_generate(body, state.limits, state.tokenize, state.images)
        outs, scores = await run_jobs(request, state, jobs)
        answers = [generate_response(j, o, state, s) for j, o, s in zip(jobs, outs, scores)]
        return JSONResponse(answers if as_list else answers[0])  # plain JSON: skips FastAPI's slow encoder walk

    async def update_weights_from_disk(request: Request, body: Any) -> Any:
        status, answer = await update_from_disk(body, state)
        return JSONResponse(answer, status_code=status)

    async def pause_generation(request: Request, body: Any) -> Any:
        mode = body.get("mode") or "in_place"
        if mode not in ("in_place", "retract", "abort"):
            raise BadRequest("mode", f"must be in_place, retract or abort, got {str(mode)[:40]!r}")
        aborted = await state.abort() if mode == "abort" else 0
        await asyncio.to_thread(engine.pause)
        state.paused = True
        return {"success": True, "message": "generation paused", "mode": mode, "aborted": aborted}

    async def continue_generation(request: Request, body: Any) -> Any:
        engine.resume()
        state.paused = False
        return {"success": True, "message": "generation continued"}

    async def abort_request(request: Request, body: Any) -> Any:
        name = rid(body.get("rid"))
        aborted = await state.abort(None if flag(body, "abort_all", False) else name)
        return {"success": True, "aborted": aborted}

    async def flush_cache(request: Request, body: Any) -> Any:
        await asyncio.to_thread(engine.flush_cache)
        return {"success": True, "message": "cache flushed"}

    for fn in (generate, update_weights_from_disk, pause_generation, continue_generation, abort_request,
               flush_cache, *weight_routes(state)):
        router.add_api_route(f"/{fn.__name__}", _json_body(fn, state), methods=["POST"], name=fn.__name__)

    async def get_model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "weight_version": engine.version, "max_seq_len": engine.max_seq_len}

    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": engine.version}

    async def health_generate_route() -> Any:
        return await health_generate(state)

    async def get_load() -> list[dict[str, Any]]:
        """SGLang's load report (one entry per data-parallel rank; here one), for load-aware routing."""
        return [{"dp_rank": 0, "num_reqs": state.num_requests(), "weight_version": engine.version}]

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
    except (TimeoutError, RuntimeError) as e:  # the client sees a request id, the log has the details
        return error_response(503, f"generation failed (request id {log_error('GET /health_generate', e)}; "
                              "details are in the server log)")
    return {"status": "ok", "output_ids": out.output_ids}
