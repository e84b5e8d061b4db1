"""SGLang-compatible native API over a `LocalEngine`: /generate, weight reloads, pause / abort, health.

relayrl's RemoteEngine is a client of this API and of real SGLang servers alike, so requests and responses
follow SGLang's shapes (`input_ids` + `sampling_params` in; `text`, `output_ids`, `meta_info` out, with
`finish_reason` as `{"type": "stop", "matched": id}`, `{"type": "length", "length": n}` or
`{"type": "abort", "message": ...}` and logprobs as `[[logprob, token_id, null], ...]`).

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
- sampling options this engine cannot honour (stop strings, penalties, grammars, min_p) are rejected with
  400 instead of being ignored, because silently sampling from a different distribution corrupts RL data;
  options that only touch the returned extras (top_logprobs_num, skip_special_tokens, ...) are accepted;
- no streaming, no prompt logprobs (`input_token_logprobs`), no top-k logprobs;
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
from relayrl.serve.parsing import Job, parse_generate
from relayrl.serve.security import key_check
from relayrl.serve.state import ServerState
from relayrl.serve.weights_disk import update_from_disk
from relayrl.serve.weights_dist import weight_routes


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
    """Generate all jobs as one request (the engine batches them); a client that hangs up cancels them,
    which frees their slots at the next step instead of generating for nobody."""
    tasks = state.submit([(j.prompt, j.params, j.engine_rid) for j in jobs])
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
        jobs, as_list = await parse_generate(body, state.limits, state.tokenize)
        outs = await run_jobs(request, state, jobs)
        answers = [generate_response(j, o, state) for j, o in zip(jobs, outs)]
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
