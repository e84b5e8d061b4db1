"""The run's numeric precision, one part of the start-up resolution (relayrl.run.resolve): the engine's dtype, the
trainer's weights and autocast, and whether the rollout correction is on (it is where the two sides' numerics
differ). Each choice is printed once with its reason, and config.yaml records the resolved values.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from relayrl.common.device import device_memory_bytes
from relayrl.common.hardware import resolve_autocast, resolve_dtype, resolve_train_dtype
from relayrl.config.schema import Config
from relayrl.models import resolve_model_path, stored_parameters


def resolve_precision(cfg: Config, device: torch.device, params: int | None, record: dict[str, dict],
                      quiet: bool = False) -> Config:
    """engine.dtype "auto" -> bf16 where bf16 is native (unless model.autocast_bf16 is false on a CPU), else
    float32; model.autocast_bf16 "auto" -> bf16 autocast in the trainer where bf16 is native (a bf16 GPU, a CPU
    with AVX512-BF16 or AMX), on the run's resolved `device` (relayrl.common.hardware); then the rollout
    correction. The choice and its reason are printed once (the first line of the run's start block,
    relayrl/tracking/progress.py) and entered in `record` (Config.resolved). `params`: the model's parameter count
    (`model_parameters`), None where unknown or not needed."""
    m = cfg.model
    train_dtype, train_why = _train_dtype(cfg, device, params)
    dtype, why = resolve_dtype(cfg.engine.dtype, device.type, m.autocast_bf16, train_dtype)
    autocast = resolve_autocast(m.autocast_bf16, dtype, device.type)
    record["engine.dtype"] = {"asked": cfg.engine.dtype, "value": dtype, "why": why}
    record["model.train_dtype"] = {"asked": m.train_dtype, "value": train_dtype, "why": train_why}
    record["model.autocast_bf16"] = {"asked": m.autocast_bf16, "value": autocast, "why": "set in the config" if
                                     m.autocast_bf16 != "auto" else f"auto: a {dtype} engine on {device.type}"}
    if not quiet:
        kv = "" if cfg.engine.kv_dtype in ("auto", dtype) else f" (KV cache {cfg.engine.kv_dtype})"
        trainer = ("bfloat16 weights, gradients and moments (each update rounded stochastically)"
                   if train_dtype == "bfloat16" else f"float32{' + bf16 autocast' if autocast else ''}")
        print(f"precision: engine {dtype}{kv}, trainer {trainer} on {device} ({why}; trainer weights: {train_why})")
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, dtype=dtype),
                              model=dataclasses.replace(m, autocast_bf16=autocast, train_dtype=train_dtype))
    return resolve_rollout_correction(cfg, record, quiet)


def resolve_rollout_correction(cfg: Config, record: dict[str, dict], quiet: bool = False) -> Config:
    """algo.rollout_correction.enabled "auto" -> on wherever the engine's logprobs come from other numerics than the
    trainer's (`precision_mismatch`), off where both compute in float32 in this process: there the two agree to
    rounding (tests/unit/test_trainer.py) and a weight would only add noise. Said in one line after the precision
    line; `cfg` has its dtypes resolved."""
    c = cfg.algo.rollout_correction
    mismatch = precision_mismatch(cfg)
    on = bool(mismatch) if c.enabled == "auto" else c.enabled
    why = "set in the config"
    if c.enabled == "auto":
        why = "auto: " + (", ".join(mismatch) or "engine and trainer both compute in float32 in this process")
    record["algo.rollout_correction.enabled"] = {"asked": c.enabled, "value": on, "why": why}
    if not quiet:
        if c.lower is not None:
            bounds = f"{'truncated to' if c.mode == 'truncate' else 'masked outside'} [{c.lower:g}, {c.upper:g}]"
        else:
            bounds = f"{'truncated at' if c.mode == 'truncate' else 'masked above'} {c.upper:g}"
        veto = f", samples vetoed below {c.veto:g}" if c.veto is not None else ""
        how = f": {c.level} ratios {bounds}{veto}" if on else ""
        print(f"rollout correction: {'on' if on else 'off'} ({why}){how}")
    return dataclasses.replace(cfg, algo=dataclasses.replace(cfg.algo, rollout_correction=dataclasses.replace(
        c, enabled=on)))


def precision_mismatch(cfg: Config) -> list[str]:
    """What makes the engine's logprobs differ from the trainer's beyond rounding order (empty: nothing): another
    program computing them, or any half-precision part on either side. `cfg` has its dtypes resolved."""
    e, m = cfg.engine, cfg.model
    found = ["remote servers sample"] if e.kind == "remote" else []
    if e.dtype != "float32":
        found.append(f"a {e.dtype} engine")
    if e.kv_dtype not in ("auto", "float32", e.dtype):  # a cache in the engine's own dtype adds nothing
        found.append(f"a {e.kv_dtype} KV cache")
    if m.train_dtype != "float32":
        found.append(f"{m.train_dtype} trainer weights")
    if m.autocast_bf16 or cfg.train.fsdp_mixed_precision:
        found.append("bf16 matmuls in the trainer")
    return found


def model_parameters(path: str) -> int | None:
    """How many parameters the model at `path` has, before any weight is read: from its safetensors headers, else
    from its config.json on the meta device (a folder of .bin weights, or a config alone, as benchmarks of random
    models write). None where neither says (an alias not prepared yet: SmolLM2, small)."""
    try:
        folder = resolve_model_path(path, prepare=False)
    except FileNotFoundError:
        return None
    params = stored_parameters(folder)
    if params is None:
        with contextlib.suppress(ValueError, KeyError, OSError), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder))
            params = sum(p.numel() for p in model.parameters())
    return params


def _train_dtype(cfg: Config, device: torch.device, params: int | None) -> tuple[str, str]:
    """model.train_dtype resolved (relayrl.common.hardware.resolve_train_dtype) from the parameters the model folder
    stores, before any weight is read. LoRA trains small adapters and FSDP shards torch's AdamW: fp32 there."""
    if cfg.model.train_dtype == "auto" and (cfg.model.lora_rank or cfg.train.engine != "local"):
        return "float32", "auto: fp32 for LoRA adapters and FSDP"
    return resolve_train_dtype(cfg.model.train_dtype, device.type, params, device_memory_bytes(device))
