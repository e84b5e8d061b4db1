"""SGLang's weight-broadcast routes for `relayrl serve`: the trainer sends new weights over a process group.

- POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name,
  backend}: join the trainer's group (it is rank 0; this server is rank_offset). Blocks until every rank
  has joined. relayrl extension: `timeout` (seconds, default 600) bounds the join and every receive.
- POST /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache, weight_version,
  abort_all_requests}: receive one broadcast per tensor from rank 0, in the order of `names`, then load
  them all at once at a token boundary (the same `LocalEngine.update_weights` as /update_weights_from_disk,
  LoRA adapters included and merged, so a failed or partial transfer never leaves the engine half-updated)
  and bump the weight version. The received tensors are checked first (`weights_disk.check_tensors`: NaN or
  infinite values, a dtype that cannot hold the parameter): a bad update is a 400 and the old weights keep serving.
- POST /destroy_weights_update_group {group_name}.

Answers are SGLang's {"success", "message"}: 200 on success, 400 otherwise (503 when the server shuts
down meanwhile). A bad field is refused before
anything is received, with a message that starts with the field (`names[3]: ...`). A receive that fails
(trainer gone, timeout) also drops the group: a broken group cannot be resynchronised, and dropping it lets
the trainer build a fresh one under the same name. Blocking calls run on daemon threads: the event loop
keeps answering /health meanwhile, and a receive waiting on a vanished trainer cannot hold up shutdown.
Unlike SGLang, load_format (flattened_bucket) is not supported.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch
from fastapi import Request
from fastapi.responses import JSONResponse

from relayrl.serve.errors import BadRequest, log_error
from relayrl.serve.limits import number
from relayrl.serve.state import ServerState
from relayrl.serve.weights_disk import check_tensors, weight_version
from relayrl.trainer.lora import adapter_set_error, adapter_shape_error, is_adapter_name
from relayrl.weights.weight_group import DEFAULT_GROUP, WeightGroup, on_daemon_thread, parse_dtype

DEFAULT_TIMEOUT = 600.0
Route = Callable[[Request, Any], Awaitable[Any]]
Spec = tuple[str, torch.dtype, tuple[int, ...]]


@dataclass
class _Joined:
    group: WeightGroup
    lock: asyncio.Lock  # one transfer at a time: two interleaved receives would swap tensors


def _answer(success: bool, message: str, status: int | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse({"success": success, "message": message, **extra},
                        status_code=status or (200 if success else 400))


class _ShuttingDown(Exception):
    pass


async def _in_daemon_thread(state: ServerState, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a call that may block for a whole group timeout. asyncio.to_thread's pool threads are joined at
    exit, so a receive waiting on a vanished trainer would hold the server's shutdown for that long; and the
    request stops waiting once the server shuts down, instead of holding uvicorn's graceful shutdown."""
    waiting = asyncio.wrap_future(on_daemon_thread(lambda: fn(*args)))
    while not state.closing:
        done, _ = await asyncio.wait({waiting}, timeout=0.5)
        if done:
            return waiting.result()
    raise _ShuttingDown


def _text(body: dict[str, Any], key: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or not value:
        raise BadRequest(key, "must be a non-empty string" if key in body else "missing")
    return value


def _integer(body: dict[str, Any], key: str, low: int, high: int | None = None) -> int:
    value = number(body, key, None, int, low=low, high=high)
    if value is None:
        raise BadRequest(key, "missing")
    return value


def parse_init(body: dict[str, Any]) -> dict[str, Any]:
    """The WeightGroup arguments of an /init_weights_update_group body (BadRequest naming a bad field)."""
    address, port = _text(body, "master_address"), _integer(body, "master_port", 1, 65535)
    rank_offset = _integer(body, "rank_offset", 1)  # rank 0 is the trainer
    world_size, name = _integer(body, "world_size", rank_offset + 1), _text(body, "group_name", DEFAULT_GROUP)
    backend = body.get("backend", "nccl")  # SGLang's default
    if backend not in ("gloo", "nccl"):
        raise BadRequest("backend", f"must be gloo or nccl, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise BadRequest("backend", "nccl needs a CUDA device and this server has none: use gloo")
    timeout = number(body, "timeout", DEFAULT_TIMEOUT, float)
    if timeout <= 0:
        raise BadRequest("timeout", f"must be > 0, got {timeout}")
    return {"master_address": address, "master_port": port, "rank": rank_offset, "world_size": world_size,
            "backend": backend, "group_name": name, "timeout": timeout}


def _listed(body: dict[str, Any], key: str, count: int | None) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list) or not value:
        raise BadRequest(key, "must be a non-empty list")
    if count is not None and len(value) != count:
        raise BadRequest(key, f"has {len(value)} entries for {count} names")
    return value


def parse_update(body: dict[str, Any], state: ServerState) -> list[Spec]:
    """(name, dtype, shape) per tensor, checked against the served model before anything is received."""
    served = state.engine.model.state_dict()
    names = _listed(body, "names", None)
    dtypes, shapes = _listed(body, "dtypes", len(names)), _listed(body, "shapes", len(names))
    specs, seen = [], set()
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        adapter = isinstance(name, str) and is_adapter_name(name)  # LoRA: see weights_disk
        if not isinstance(name, str) or (name not in served and not adapter):
            raise BadRequest(f"names[{i}]", f"the served model has no parameter {name!r}")
        if name in seen:
            raise BadRequest(f"names[{i}]", f"{name!r} is listed twice")
        seen.add(name)
        try:
            dt = parse_dtype(dtype)
        except ValueError as e:
            raise BadRequest(f"dtypes[{i}]", str(e)) from None
        if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape):
            raise BadRequest(f"shapes[{i}]", f"must be a list of integers, got {shape!r}")
        if adapter:
            if bad := adapter_shape_error(name, tuple(shape), served):
                raise BadRequest(f"shapes[{i}]", f"{name}: {bad}")
        elif tuple(shape) != tuple(served[name].shape):
            raise BadRequest(f"shapes[{i}]", f"{shape} != the served {name!r} {list(served[name].shape)}")
        specs.append((name, dt, tuple(shape)))
    if bad := adapter_set_error({name: shape for name, _, shape in specs}):
        raise BadRequest("names", bad)
    return specs


def _check_update_options(body: dict[str, Any]) -> None:
    if body.get("load_format") is not None:
        raise BadRequest("load_format", "is not supported (only one broadcast per tensor)")
    for key in ("flush_cache", "abort_all_requests"):
        if not isinstance(body.get(key, False), bool):
            raise BadRequest(key, "must be true or false")


def weight_routes(state: ServerState) -> list[Route]:
    """The three routes (named as their paths), for native_router to register with the API key check."""
    groups: dict[str, _Joined | None] = {}  # None: a join in progress

    async def init_weights_update_group(request: Request, body: dict[str, Any]) -> Any:
        try:
            kw = parse_init(body)
        except BadRequest as e:
            return _answer(False, str(e))
        name = kw["group_name"]
        if name in groups:
            return _answer(False, f"group_name: a weights update group named {name!r} already exists")
        groups[name] = None
        try:
            group = await _in_daemon_thread(state, lambda: WeightGroup(**kw))
        except _ShuttingDown:
            return _answer(False, "server is shutting down", status=503)
        except Exception as e:  # the details (addresses, torch's errors) go to the log, not to the client
            groups.pop(name, None)
            rid = log_error("POST /init_weights_update_group", e)
            return _answer(False, f"failed to join weights update group {name!r} (request id {rid}; details are in "
                                  "the server log)")
        groups[name] = _Joined(group, asyncio.Lock())
        return _answer(True, f"joined weights update group {name!r} as rank {group.rank} of {group.world_size}")

    async def update_weights_from_distributed(request: Request, body: dict[str, Any]) -> Any:
        name = body.get("group_name", DEFAULT_GROUP)
        try:
            _check_update_options(body)
            specs, version = parse_update(body, state), weight_version(body, state.engine.version)
            if groups.get(name) is None:
                raise BadRequest("group_name", f"no weights update group named {name!r} (call "
                                 "/init_weights_update_group first)")
        except BadRequest as e:
            return _answer(False, str(e))
        joined = groups[name]
        async with joined.lock:
            return await _receive_and_load(name, joined, specs, version, body)

    def _drop(name: str, joined: _Joined) -> None:
        if groups.get(name) is joined:
            del groups[name]
        joined.group.close()

    async def _receive_and_load(name: str, joined: _Joined, specs: list[Spec], version: int,
                                body: dict[str, Any]) -> Any:
        if body.get("abort_all_requests"):
            await state.abort()
        try:
            tensors = await _in_daemon_thread(state, joined.group.receive, specs)
        except _ShuttingDown:
            return _answer(False, "server is shutting down", status=503)
        except Exception as e:
            _drop(name, joined)
            rid = log_error("POST /update_weights_from_distributed", e)
            return _answer(False, f"receiving the weights failed, group {name!r} dropped (request id {rid}; details "
                                  "are in the server log)", weight_version=state.engine.version)
        try:  # a transfer that completed leaves the group in step: only this update is refused
            await asyncio.to_thread(check_tensors, tensors, state.engine.model.state_dict(), "names")
        except BadRequest as e:
            return _answer(False, str(e), weight_version=state.engine.version)
        await asyncio.to_thread(state.engine.load_weights, tensors, version)
        if body.get("flush_cache", True):
            await asyncio.to_thread(state.engine.flush_cache)
        return _answer(True, f"received {len(tensors)} tensors", weight_version=version)

    async def destroy_weights_update_group(request: Request, body: dict[str, Any]) -> Any:
        name = body.get("group_name", DEFAULT_GROUP)
        joined = groups.get(name)
        if joined is None:
            return _answer(False, f"group_name: no weights update group named {name!r}")
        _drop(name, joined)  # a receive in progress fails at its next tensor (or when its trainer stops)
        return _answer(True, f"destroyed weights update group {name!r}")

    return [init_weights_update_group, update_weights_from_distributed, destroy_weights_update_group]
