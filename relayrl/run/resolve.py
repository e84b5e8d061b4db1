"""Every automatic choice of a run, made once at start-up from the config and the hardware (`resolve`).

What the components read afterwards: the config's sections with each "auto" replaced by its value, and
`Config.device` for run.device, which stays as set in its section ("auto" resolves again where the run resumes,
maybe on another machine). `Config.resolved` records, for every key decided here, what was asked, the value and
why; the run's config.yaml carries it beside the sections. The choices and their reasons are printed as before:
the precision line (the device in it), the rollout-correction line, and gradient checkpointing in the trainer's
memory line (relayrl.run.build).

Decided here, before any weight is read: run.device, engine.dtype, model.train_dtype, model.autocast_bf16
(relayrl.run.precision), algo.rollout_correction.enabled, model.gradient_checkpointing (the training floor from
the parameters the model folder stores), engine.kv_dtype (the engine's dtype), engine.weight_sync_backend (remote
engines), and engine.attention on a GPU (sdpa: the C kernel reads CPU memory). One choice stays with the local
engine because it depends on the loaded model: engine.attention "auto" on a CPU uses the C kernel where it builds
and fits the model (checked on one real decode step, relayrl.engine.local), else SDPA; config.yaml says so. The
keys of the other engine kind (kv_dtype and attention with remote engines, weight_sync_backend with local ones) stay
as set: nothing reads them.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.distributed as dist

from relayrl.common.device import device_memory_bytes, resolve_device
from relayrl.common.memory import memory_is_tight
from relayrl.config.schema import Config
from relayrl.run.precision import model_parameters, resolve_precision
from relayrl.weights.weight_group import resolve_backend

SET = "set in the config"


def resolve(cfg: Config, quiet: bool = False) -> Config:
    """`cfg` with every automatic choice made (module doc) and recorded in `cfg.resolved`; `quiet` (a producer
    process, a follower rank) prints nothing. A config resolved before (a producer's, a run's config.yaml) is
    resolved anew from its sections: the record in it is replaced."""
    device = resolve_device(cfg.run.device)  # the only call: later code reads cfg.device
    record: dict[str, dict[str, Any]] = {}
    note(record, "run.device", cfg.run.device, str(device), SET if cfg.run.device != "auto" else
         "auto: cuda where a CUDA device is usable, else cpu")
    m = cfg.model  # the parameter count, read once for the two choices that follow from the training floor
    wanted = not m.lora_rank and "auto" in (m.train_dtype, m.gradient_checkpointing)
    params = model_parameters(m.path) if wanted else None
    cfg = resolve_precision(cfg, device, params, record, quiet)
    cfg = _checkpointing(cfg, device, params, record)
    cfg = _engine(cfg, device, record)
    return dataclasses.replace(cfg, resolved=record)


def note(record: dict[str, dict[str, Any]], key: str, asked: Any, value: Any, why: str) -> None:
    """One entry of `Config.resolved`: the key as the config set it, what it resolved to, and why."""
    record[key] = {"asked": asked, "value": value, "why": why}


def _checkpointing(cfg: Config, device: torch.device, params: int | None, record: dict) -> Config:
    """model.gradient_checkpointing "auto" -> on when the training floor is a large share of the trainer device's
    memory (relayrl.common.memory.memory_is_tight), the floor counted from the parameters the model folder stores:
    16 bytes each with fp32 weights, 8 with bf16 ones (model.train_dtype, resolved already). LoRA trains small
    adapters: their floor is never tight. FSDP GPU ranks each hold 1/world of it; CPU ranks share the RAM."""
    m = cfg.model
    asked, on, why = m.gradient_checkpointing, bool(m.gradient_checkpointing), SET
    if asked == "auto":
        floor = (16 if m.train_dtype == "float32" else 8) * (params or 0)
        if cfg.train.engine == "fsdp" and device.type == "cuda":
            floor //= dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        total = device_memory_bytes(device)
        on = memory_is_tight(floor, total)
        share = f"{floor / total:.0%} of {total / 1e9:.1f} GB" if total else "of unknown memory"
        why = ("auto: LoRA trains small adapters" if m.lora_rank else
               f"auto: training floor {floor / 1e9:.2f} GB = {share}")
    note(record, "model.gradient_checkpointing", asked, on, why)
    return dataclasses.replace(cfg, model=dataclasses.replace(m, gradient_checkpointing=on))


def _engine(cfg: Config, device: torch.device, record: dict) -> Config:
    """engine.kv_dtype, engine.attention (local engines) and engine.weight_sync_backend (remote ones)."""
    e = cfg.engine
    kv, attention, backend = e.kv_dtype, e.attention, e.weight_sync_backend
    if e.kind == "local":
        kv = e.dtype if e.kv_dtype == "auto" else e.kv_dtype
        note(record, "engine.kv_dtype", e.kv_dtype, kv, "auto: the engine's dtype" if e.kv_dtype == "auto" else SET)
        why = SET
        if attention == "auto" and device.type != "cpu":
            attention, why = "sdpa", f"auto: the C kernel reads CPU memory and the engine is on {device}"
        elif attention == "auto":
            why = ("auto: decided by the engine once its model loads: the C kernel where it builds and fits the "
                   "model (checked on one decode step), else sdpa")
        note(record, "engine.attention", e.attention, attention, why)
    else:
        backend = resolve_backend(backend) if backend == "auto" else backend
        why = "auto: nccl where CUDA is available, else gloo" if e.weight_sync_backend == "auto" else SET
        note(record, "engine.weight_sync_backend", e.weight_sync_backend, backend, why)
    return dataclasses.replace(cfg, engine=dataclasses.replace(e, kv_dtype=kv, attention=attention,
                                                               weight_sync_backend=backend))
