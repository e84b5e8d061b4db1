"""One run of bench/scaling.py, in its own process (so that its peak RSS is its own): build relayrl's colocated
step at a model shape with random weights, run it, and account for its memory part by part.

The parent (bench/scaling.py) starts `scaling.py --child SPEC` and reads the JSON this returns.
"""

from __future__ import annotations

import os
import random
import resource
import sys
import tempfile
import threading
import time
from pathlib import Path

GB = 1e9
ALLOCATOR_ENV = ("GLIBC_TUNABLES", "THP_MEM_ALLOC_ENABLE")  # recorded with every MALLOC_* variable


def meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            out[key] = int(rest.split()[0]) * 1024
    return out


class MemGuard:
    """Ends this process before the machine runs out of memory (it is shared: the OOM killer could pick another
    process): exit code 3 when MemAvailable drops under `floor` bytes."""

    EXIT = 3

    def __init__(self, floor: float, interval: float = 0.05):
        self.floor, self.interval = floor, interval
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            avail = meminfo()["MemAvailable"]
            if avail < self.floor:
                print(f"MemGuard: MemAvailable {avail / GB:.2f} GB < {self.floor / GB:.2f} GB, stopping this run",
                      file=sys.stderr, flush=True)
                os._exit(self.EXIT)
            time.sleep(self.interval)


def _random_load_model(path, dtype="float32", device=None):
    """relayrl.models.load_model for a folder with only config.json: the same model class, random weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.models import DTYPES

    dtype = DTYPES[dtype] if isinstance(dtype, str) else dtype
    config = AutoConfig.from_pretrained(str(path), local_files_only=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.to(device or "cpu").eval()


def malloc_trim() -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _build(spec: dict, tmp: str):
    """The config and the parts `relayrl.run.loop.train_steps` builds, on a random-weight model."""
    import torch
    from transformers import AutoConfig

    import relayrl.engine.local
    import relayrl.run.build
    import relayrl.trainer.engine
    from relayrl.config.schema import load_run_config
    from relayrl.engine.rollout import RolloutController
    from relayrl.run.build import _train_controller, make_engines, shares_weights
    from relayrl.run.resolve import resolve

    for module in (relayrl.run.build, relayrl.trainer.engine, relayrl.engine.local):  # random weights, real classes
        module.load_model = _random_load_model
    shape = spec["shape"]
    model_dir = Path(tmp) / "model"
    AutoConfig.for_model(**spec["hf_config"]).save_pretrained(model_dir)
    over = [f"model.path={model_dir}", f"sampling.max_new_tokens={shape['new_tokens']}",
            f"data.group_size={max(2, shape['group'])}", f"data.batch_size={shape['prompts']}",
            f"run.output_dir={tmp}", *spec["overrides"]]
    cfg = resolve(load_run_config(None, over))
    if cfg.run.threads:  # as relayrl.run.build.build does
        torch.set_num_threads(cfg.run.threads)
    train_ctl = _train_controller(cfg, str(model_dir), spec["hf_config"]["pad_token_id"])
    shared = train_ctl.engine.model if shares_weights(cfg) else None
    engines = make_engines(cfg, str(model_dir), [spec["hf_config"]["eos_token_id"]], Path(tmp), [],
                           shared_model=shared)
    rollout_ctl = RolloutController(engines, partial_rollout=cfg.scheduler.partial_rollout)
    rollout_ctl.load_weights(train_ctl.weights())  # the engine samples from the trainer's weights, as after a load
    return cfg, train_ctl, rollout_ctl, engines[0]


def _count_saved_tensors(trainer) -> dict[str, int]:
    """Wrap the trainer's micro-step to record the largest set of tensors autograd saves (counted as
    `bench/memory.py parts` counts them), split into bf16 weight copies and the rest. Returns the dict the wrapper
    keeps up to date."""
    import torch

    act = {"bytes": 0, "weight_copies": 0}
    plain_micro = trainer._micro_step
    w_shapes = {tuple(p.shape) for p in trainer.model.parameters() if p.dim() == 2}
    w_shapes |= {s[::-1] for s in w_shapes}

    def micro_step(mb, *rest):
        seen: dict[int, tuple[int, bool]] = {}

        def pack(t):
            if not isinstance(t, torch.nn.Parameter) and t.device.type == "cpu":
                st = t.untyped_storage()
                copy = t.dtype != torch.float32 and tuple(t.shape) in w_shapes
                seen[st.data_ptr()] = (st.nbytes(), copy)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = plain_micro(mb, *rest)
        act["bytes"] = max(act["bytes"], sum(n for n, _ in seen.values()))
        act["weight_copies"] = max(act["weight_copies"], sum(n for n, c in seen.values() if c))
        return out

    trainer._micro_step = micro_step
    return act


def _samples(outs, prompts: list[list[int]], group: int, step: int, rng: random.Random) -> list:
    from relayrl.sample import Sample

    samples = []
    for k, out in enumerate(outs):
        s = Sample(prompt_ids=prompts[k // group], group_id=f"s{step}p{k // group}", index=k % group)
        s.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
        s.reward = float(rng.random() < 0.5)
        samples.append(s)
    return samples


def _step(spec: dict, cfg, parts, sampler, rng: random.Random, step: int, trim) -> tuple[dict, list, int]:
    """One colocated GRPO step: rollout, release the engine's memory, fit, weight sync; times and RSS."""
    from _common import rss_bytes

    from relayrl.common.threads import release_openmp_threads
    from relayrl.engine.base import SamplingParams

    train_ctl, rollout_ctl, engine = parts
    shape, vocab = spec["shape"], spec["hf_config"]["vocab_size"]
    params = SamplingParams(max_new_tokens=shape["new_tokens"], temperature=cfg.sampling.temperature,
                            ignore_eos=True)
    prompts = [[rng.randrange(3, vocab) for _ in range(shape["prompt_len"])] for _ in range(shape["prompts"])]
    sampler.phase = "rollout"
    release_openmp_threads()  # this thread waits while the engine's worker decodes (as Env.run does)
    t0 = time.perf_counter()
    outs = engine.generate([p for p in prompts for _ in range(shape["group"])], params)
    rollout_s = time.perf_counter() - t0
    kv = engine.cache.nbytes()
    samples = _samples(outs, prompts, shape["group"], step, rng)
    rss_end_rollout = rss_bytes()
    sampler.phase = "train"
    t0 = time.perf_counter()
    released = rollout_ctl.release_memory(weights=not cfg.model.lora_rank) if cfg.engine.release_during_train else 0
    trim()
    rss_released = rss_bytes()
    m = train_ctl.fit(samples)
    train_s = time.perf_counter() - t0
    rss_end_train = rss_bytes()
    trim()
    sampler.phase = "weight_sync"
    t0 = time.perf_counter()
    rollout_ctl.load_weights(train_ctl.weights())
    sync_s = time.perf_counter() - t0
    trim()
    record = {"rollout_s": rollout_s, "train_s": train_s, "weight_sync_s": sync_s,
              "step_s": rollout_s + train_s + sync_s, "tokens": sum(len(s.input_ids) for s in samples),
              "generated_tokens": sum(len(s.response_ids) for s in samples),
              "released_gb": released / GB, "rss_end_rollout_gb": rss_end_rollout / GB,
              "rss_after_release_gb": rss_released / GB, "rss_end_train_gb": rss_end_train / GB,
              "rss_after_sync_gb": rss_bytes() / GB, "loss": m.get("train/loss")}
    print(f"  step {step}: rollout {rollout_s:.1f}s, train {train_s:.1f}s, sync {sync_s:.2f}s, "
          f"rss {rss_bytes() / GB:.2f} GB", file=sys.stderr, flush=True)
    return record, samples, kv


def _parts(trainer, engine, runtime: int, act: dict, kv: int, vocab: int) -> dict[str, int]:
    """Bytes per part: what the training phase holds, and what the engine held before it gave it back."""
    import torch

    from relayrl.trainer.logprobs import working_bytes

    model_params = list(trainer.model.parameters())
    opt = sum(t.numel() * t.element_size() for s in trainer.optimizer.state.values() for t in s.values()
              if torch.is_tensor(t))
    engine_w = sum(p.numel() * p.element_size() for p in engine.model.parameters()) if engine.owns_weights else 0
    if engine.owns_weights and not engine_w:  # released and not restored: count what the sync restores
        engine_w = sum(p.numel() * torch.finfo(p.dtype).bits // 8 for p in engine.model.parameters())
    return {"runtime": runtime, "weights": sum(p.numel() * p.element_size() for p in model_params),
            "grads": sum(p.numel() * p.element_size() for p in model_params if p.requires_grad), "optimizer": opt,
            "activations": act["bytes"], "autocast_weight_copies": act["weight_copies"],
            "logits_chunk": working_bytes(vocab), "engine_weights": engine_w, "kv_cache": kv}


def _settings(spec: dict, cfg, engine, trainer) -> dict:
    import torch

    from relayrl.run.build import _memory_plan

    return {"memory_plan": _memory_plan(cfg, trainer), "engine_dtype": cfg.engine.dtype,
            "train_dtype": cfg.model.train_dtype,
            "autocast_bf16": cfg.model.autocast_bf16, "shared_weights": not engine.owns_weights,
            "release_during_train": cfg.engine.release_during_train,
            "micro_batch_tokens": cfg.train.micro_batch_tokens,
            "gradient_checkpointing": trainer.gradient_checkpointing,  # as the trainer decided ("auto" resolved)
            "gradient_checkpointing_setting": cfg.model.gradient_checkpointing,
            "attention": engine.attention, "threads": torch.get_num_threads(),
            "malloc_trim": bool(spec.get("malloc_trim")),
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_") or k in ALLOCATOR_ENV}}


def run_child(spec: dict) -> dict:
    from _common import PhaseSampler, rss_bytes

    MemGuard(spec["guard_gb"] * GB)
    runtime0 = rss_bytes()
    sampler = PhaseSampler(interval=0.01)
    import relayrl.run.build  # noqa: F401  (the runtime: what importing relayrl, torch and transformers costs)

    runtime = max(runtime0, rss_bytes())
    trim = malloc_trim if spec.get("malloc_trim") else (lambda: None)
    with tempfile.TemporaryDirectory(prefix="bench_scaling_") as tmp:
        sampler.phase = "build"
        t0 = time.perf_counter()
        cfg, train_ctl, rollout_ctl, engine = _build(spec, tmp)
        build_s = time.perf_counter() - t0
        after_build = rss_bytes()
        act = _count_saved_tensors(train_ctl.engine)
        rng, steps, kv = random.Random(0), [], 0
        for step in range(1, spec["steps"] + 1):
            record, samples, step_kv = _step(spec, cfg, (train_ctl, rollout_ctl, engine), sampler, rng, step, trim)
            steps.append(record)
            kv = max(kv, step_kv)
        mbs = train_ctl.packer.pack(samples).micro_batches
        engine.close()
    peaks = sampler.stop()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    trainer = train_ctl.engine
    parts = _parts(trainer, engine, runtime, act, kv, spec["hf_config"]["vocab_size"])
    # the training phase holds the trainer's weights, gradients, optimizer state and one micro-batch's
    # activations (the bf16 weight copies are part of those) at once; the engine gave its memory back
    expected_train = sum(parts[k] for k in ("runtime", "weights", "grads", "optimizer", "activations",
                                            "logits_chunk"))
    n_params = sum(p.numel() for p in trainer.model.parameters())
    # the 16 B/param floor of fp32 training is the yardstick of every run; bf16 weights have their own, half of it
    floor, last = 16 * n_params, steps[-1]
    return {"params": n_params, "floor_gb": floor / GB, "peak_rss_gb": peak / GB, "peak_over_floor": peak / floor,
            "own_floor_gb": trainer.floor_bytes / GB, "peak_over_own_floor": peak / trainer.floor_bytes,
            "rollout_s": last["rollout_s"], "train_s": last["train_s"], "weight_sync_s": last["weight_sync_s"],
            "step_s": last["step_s"], "tokens_per_step": last["tokens"],
            "tokens_per_s": last["tokens"] / last["step_s"], "generated_tokens_per_s":
                last["generated_tokens"] / last["rollout_s"], "train_tokens_per_s": last["tokens"] / last["train_s"],
            "build_s": build_s, "rss_after_build_gb": after_build / GB,
            "parts_gb": {k: v / GB for k, v in parts.items()}, "expected_train_peak_gb": expected_train / GB,
            "unexplained_gb": (peak - expected_train) / GB, "phase_peak_rss_gb": peaks, "steps": steps,
            "micro_batches": [{"rows": mb.input_ids.shape[0], "width": mb.input_ids.shape[1],
                               "trained_tokens": mb.num_tokens} for mb in mbs],
            "settings": _settings(spec, cfg, engine, trainer)}
