"""Build the components of a run from its config, cheapest checks first.

Everything that can fail because of user input (datasets, reward function and its kwargs, output folder,
agent class) is checked before any model weights are loaded, so a typo costs seconds, not minutes; such
errors are ConfigErrors naming the key to fix. A new run whose build fails leaves no folder behind
(unless it holds a launched server's log, which explains the failure).
"""

from __future__ import annotations

import inspect
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch

from relayrl.agents import AGENTS, Agent
from relayrl.common.device import device_memory_bytes
from relayrl.common.errors import InputError
from relayrl.common.files import check_writable
from relayrl.common.memory import fit_allocator_to, tune_allocator
from relayrl.common.net import free_port
from relayrl.config import ConfigError, dump_yaml
from relayrl.config.schema import Config
from relayrl.data import DataManager, PromptBuilder, load_rows
from relayrl.data.images import IMAGES, check_model_takes_images
from relayrl.engine.base import SamplingParams
from relayrl.engine.dialects import dialect_class
from relayrl.engine.local import LocalEngine, tokenizer_decode
from relayrl.engine.remote import RemoteEngine
from relayrl.engine.rollout import RolloutController
from relayrl.judge import Judge, arguments_problem, reward_function
from relayrl.models import (
    eos_token_ids,
    is_vlm_folder,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from relayrl.models.vision import load_processor
from relayrl.run import checkpoint
from relayrl.run.components import Components
from relayrl.run.env import Env
from relayrl.run.launcher import ManagedServer, check_launch, make_server
from relayrl.run.lock import LOCK_FILE, RunLock
from relayrl.run.placement import ray_placement, rendezvous_host
from relayrl.run.producer import ProducerHandle
from relayrl.run.resolve import resolve
from relayrl.run.sources import InProcessRollouts
from relayrl.scheduler import AsyncScheduler, SyncScheduler, group_filter
from relayrl.tracking.metrics import MetricsLogger
from relayrl.tracking.trajectories import TrajectoryLogger
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.estimators import estimator_for
from relayrl.trainer.fsdp import FSDPEngine, ReplicatedEngine
from relayrl.trainer.lora import BaseReference
from relayrl.trainer.losses import loss_for

# a run folder's inputs/: the rows and pickled objects relayrl.api was given in memory, written before the build
# (the config names them there, so a producer process or a Ray rebuild reads them too); a folder holding only
# inputs/ is not taken, it is the run's own
INPUTS = "inputs"


def new_run_dir(cfg: Config) -> Path:
    """output_dir/name, or name-2, name-3... if taken (not created here: `_run_folder` does, once it is used)."""
    base = Path(cfg.run.output_dir) / cfg.run.name
    path, n = base, 1
    while path.exists() and any(e.name != INPUTS for e in path.iterdir()):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def agent_class(kind: str) -> type[Agent]:
    """The class agent.kind names (registered, or by import path); something else than a class is a ConfigError."""
    cls = AGENTS.get(kind, "agent.kind")
    if not isinstance(cls, type):
        raise ConfigError(f"{kind!r} is a {type(cls).__name__}, not an agent class (subclass relayrl.agents.Agent)",
                          key="agent.kind")
    return cls


def check_user_code(cfg: Config, rows: list[dict] | None = None) -> type[Agent]:
    """Import the agent, group filter, reward functions, advantage estimator and policy loss the config names, and
    check judge.kwargs (and, for TRL-style functions, the fields of `rows`) against each reward function's
    signature: unknown or missing arguments would otherwise fail in every worker call, i.e. train on nothing but
    rejected samples. Group-relative estimators need data.group_size >= 2: the config cannot ask the estimator
    itself (the trainer sits above it). Returns the agent class."""
    agent_cls = agent_class(cfg.agent.kind)
    if cfg.engine.kind == "remote":  # the dialect, and what it can do with the launched servers and weight sync
        dialect_class(cfg.engine.backend, launch=cfg.engine.launch, weight_sync=cfg.engine.weight_sync)
    loss_for(cfg.algo)
    if estimator_for(cfg.algo).group_relative and cfg.data.group_size < 2:
        raise ConfigError(f"must be >= 2 for group-relative advantages (algo.preset={cfg.algo.preset}, "
                          f"adv_estimator={cfg.algo.adv_estimator}); set algo.adv_mean/adv_std to batch or none for "
                          "group_size 1", key="data.group_size")
    try:
        group_filter(cfg.scheduler.group_filter)
    except (ImportError, ValueError) as e:
        raise ConfigError(str(e), key="scheduler.group_filter") from None
    _check_rewards(cfg, rows)
    _check_agent_kwargs(agent_cls, cfg.agent.kwargs)
    if cfg.eval.agent_kwargs:
        _check_agent_kwargs(agent_cls, cfg.agent.kwargs | cfg.eval.agent_kwargs, "eval.agent_kwargs")
    return agent_cls


def _check_rewards(cfg: Config, rows: list[dict] | None) -> None:
    """Each judge.reward_fn entry imports, and its arguments fit (a ConfigError names the entry or the kwarg)."""
    specs = cfg.judge.reward_fn if isinstance(cfg.judge.reward_fn, list) else [cfg.judge.reward_fn]
    columns = {k for row in rows[:1000] for k in row} if rows else None  # a field any row has reaches the reward
    for i, spec in enumerate(specs):
        key = f"judge.reward_fn[{i}]" if isinstance(cfg.judge.reward_fn, list) else "judge.reward_fn"
        problem = arguments_problem(reward_function(spec, key), spec, cfg.judge.kwargs, columns)
        if problem is not None:
            name, why = problem
            raise ConfigError(why, key=f"judge.kwargs.{name}" if name else key)


def _check_agent_kwargs(agent_cls: type[Agent], kwargs: dict, key: str = "agent.kwargs") -> None:
    """Unknown agent.kwargs (or eval.agent_kwargs, merged over them) fail here, not after the models load (unless
    the agent takes **kwargs)."""
    try:
        params = inspect.signature(agent_cls.__init__).parameters
    except (TypeError, ValueError):
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)][5:]
    for name in kwargs:  # the first five are self, rollout_ctl, tokenizer, sampling, judge: build passes them
        if name not in named:
            hint = f"its options are {', '.join(named)}" if named else "it takes no options"
            raise ConfigError(f"unknown option for agent {agent_cls.__name__}; {hint}", key=f"{key}.{name}")
    if issubclass(agent_cls, Agent):  # an Agent's own check of its option values (Agent.check_kwargs)
        try:
            agent_cls.check_kwargs(kwargs)
        except InputError as e:
            message = str(e)
            if key != "agent.kwargs" and message.startswith("agent.kwargs."):  # the value came from `key`
                raise InputError(key + message[len("agent.kwargs"):]) from None
            raise


def sampling_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    s = cfg.sampling
    t = s.temperature if temperature is None else temperature
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=t, top_p=s.top_p if t else 1.0,
                          top_k=s.top_k if t else 0, stop_token_ids=tuple(s.stop_token_ids), ignore_eos=s.ignore_eos)


@dataclass(frozen=True)
class Role:
    """What a role of `build` puts in its process: each step of the build asks a flag, never the role's name."""

    name: str
    trains: bool  # the policy's trainer is in this process (a resume restores it)
    train_data: bool  # reads data.train (else evaluation only: data.eval is required)
    rollouts: bool  # engines, agents, judge and prompts in this process (else in a producer process it starts)
    owns_folder: bool  # makes, locks and writes the run folder, logs, prints the start-up choices, checks launches


# colocated: everything in this process; eval: what evaluation needs (no trainer, no train data); trainer: the
# policy being trained plus a producer process that builds the "producer" role (engines, agents, judge, prompts,
# no trainer) in the trainer's folder (scheduler.placement=separate)
ROLES = {r.name: r for r in (Role("colocated", trains=True, train_data=True, rollouts=True, owns_folder=True),
                             Role("eval", trains=False, train_data=False, rollouts=True, owns_folder=True),
                             Role("producer", trains=False, train_data=True, rollouts=True, owns_folder=False),
                             Role("trainer", trains=True, train_data=True, rollouts=False, owns_folder=True))}


def build(cfg: Config, *, role: str = "colocated", run_dir: Path | None = None) -> Components:
    """The components of a run for one role (`ROLES`), cheapest checks first; the producer role is built in the
    trainer's `run_dir`."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {tuple(ROLES)}, got {role!r}")
    r = ROLES[role]
    tune_allocator()  # before any thread allocates or any model loads
    cfg = resolve(cfg, quiet=not r.owns_folder)  # every "auto" decided once; components read only the result
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # cheap checks first: data, agent class, reward function, output folder
    train_rows = load_rows(cfg.data.train, "data.train", cfg.data.prompt) if r.train_data else None
    eval_rows = load_rows(cfg.data.eval, "data.eval", cfg.data.prompt)[: cfg.eval.size] if cfg.data.eval else None
    if not r.train_data and not eval_rows:
        raise ConfigError("evaluation needs an eval dataset", key="data.eval")
    _check_images(cfg, train_rows, eval_rows)  # an image for a text-only model: before any model loads
    agent_cls = check_user_code(cfg, train_rows or eval_rows)  # before any model loads
    if r.owns_folder:  # (a producer's trainer checked them)
        check_launch(cfg.engine)  # engine.server_args on the launched server's own parser
    if not r.rollouts:
        return _build_trainer(cfg)
    judge = Judge.from_config(cfg.judge)
    judge.start(train_rows or eval_rows)  # worker start-up and the reward trial overlap model loading
    try:
        return _build_with_judge(cfg, train_rows, eval_rows, agent_cls, judge, r, run_dir)
    except BaseException:
        judge.close()
        raise


def _check_images(cfg: Config, train_rows, eval_rows) -> None:
    """Rows with images need a vision-language model (relayrl.data.images); only its config.json is read."""
    if not any(row.get(IMAGES) for row in (train_rows or []) + (eval_rows or [])):
        return
    path = resolve_model_path(cfg.model.path)
    for rows, key in ((train_rows, "data.train"), (eval_rows, "data.eval")):
        check_model_takes_images(rows or [], key, is_vlm_folder(path), cfg.model.path)


def _run_folder(cfg: Config, resume: bool) -> tuple[Path, Path | None, Path | bool, RunLock]:
    """A new run folder; or, resuming, the run's own folder (its logs after the checkpoint moved aside) and that
    checkpoint. The third value says what `discard_new_run` may undo: False when resuming (nothing), True for
    a folder that existed empty (its contents), else the topmost folder this call created. The fourth is the
    folder's lock (relayrl.run.lock), taken before anything there is moved or written; the caller releases it."""
    if resume:
        run_dir = checkpoint.resume_dir(cfg)
        lock = RunLock.acquire(run_dir)
        try:
            run_dir, ckpt = checkpoint.resume_target(cfg)
            checkpoint.prepare_resume(run_dir, ckpt)
        except BaseException:
            lock.release()
            raise
        created: Path | bool = False
    else:
        while True:  # a new run that started at the same moment may have locked the folder picked: take the next
            run_dir, ckpt = new_run_dir(cfg), None
            created = next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), True)
            check_writable(run_dir, "run.output_dir")
            try:
                lock = RunLock.acquire(run_dir)
                break
            except InputError:
                continue
    try:
        dump_yaml(cfg, str(run_dir / "config.yaml"))
    except BaseException:
        discard_new_run(run_dir, created)
        lock.release()
        raise
    return run_dir, ckpt, created, lock


# what a build writes into a new run folder before training: removed again if the build fails
_SCAFFOLD = ("config.yaml", "tensorboard", "wandb", "mlruns", "checkpoints", "weights", ".write_test", INPUTS,
             LOCK_FILE)


def discard_new_run(run_dir: Path, created: Path | bool) -> None:
    """Undo a new run folder whose build failed (see `_run_folder` for `created`), so a failed start leaves
    nothing behind. Kept as it is when it holds anything else (a launched server's log names the cause)."""
    entries = list(run_dir.iterdir()) if run_dir.is_dir() and created is not False else []
    if any(e.name not in _SCAFFOLD for e in entries):
        return
    for e in entries:
        shutil.rmtree(e, ignore_errors=True) if e.is_dir() else e.unlink(missing_ok=True)
    if isinstance(created, Path):  # the folders this build made, innermost first, while empty
        for folder in [run_dir, *run_dir.parents]:
            if not folder.is_dir() or any(folder.iterdir()):
                break
            folder.rmdir()
            if folder == created:
                break


def _build_trainer(cfg: Config) -> Components:
    """The trainer of separate placement; its producer process starts first so both load models at once. A resume
    restores the trainer, then hands the producer its state before it produces (relayrl.run.producer)."""
    run_dir, ckpt, created, lock = _run_folder(cfg, resume=bool(cfg.run.resume))
    if cfg.run.resume:  # the versions an interrupted attempt relayed: a new producer would load the newest of them
        shutil.rmtree(run_dir / "weights", ignore_errors=True)
    host = rendezvous_host()
    try:
        producer = ProducerHandle(cfg, run_dir, build, dist_address=f"{host}:{free_port(host)}")
    except BaseException:
        discard_new_run(run_dir, created)
        lock.release()
        raise
    c = None
    try:
        model_path = resolve_model_path(cfg.model.path)
        tokenizer = load_tokenizer(model_path)
        train_ctl = _train_controller(cfg, model_path, _pad_id(tokenizer, eos_token_ids(tokenizer, model_path)))
        trajectories = TrajectoryLogger(run_dir, tokenizer) if cfg.run.log_trajectories else None
        c = Components(cfg, run_dir, tokenizer, producer, train_ctl, MetricsLogger.for_run(run_dir, cfg),
                       trajectories=trajectories)
        checkpoint.prepare(c, ckpt)  # room for checkpoints; resume: weights, optimizer, the producer's state, RNGs
    except BaseException:
        if c is None:
            producer.close()
        else:
            c.close()  # the producer and the trackers
        discard_new_run(run_dir, created)
        lock.release()
        raise
    c.lock = lock
    return c


def build_follower(cfg: Config) -> TrainController:
    """A rank > 0 of train.engine=fsdp: only its shard of the trainer (see relayrl.trainer.leader)."""
    tune_allocator()
    cfg = resolve(cfg, quiet=True)
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    return _train_controller(cfg, model_path, _pad_id(tokenizer, eos_token_ids(tokenizer, model_path)))


def _pad_id(tokenizer, eos: list[int]) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)


def _build_with_judge(cfg: Config, train_rows, eval_rows, agent_cls, judge: Judge, role: Role,
                      run_dir: Path | None) -> Components:
    if not role.owns_folder:  # a producer process: the trainer owns the folder
        return _assemble(cfg, train_rows, eval_rows, agent_cls, judge, role, run_dir, None)
    run_dir, ckpt, created, lock = _run_folder(cfg, resume=role.trains and bool(cfg.run.resume))
    try:
        c = _assemble(cfg, train_rows, eval_rows, agent_cls, judge, role, run_dir, ckpt)
    except BaseException:
        discard_new_run(run_dir, created)
        lock.release()
        raise
    c.lock = lock
    return c


def _assemble(cfg: Config, train_rows, eval_rows, agent_cls, judge: Judge, role: Role, run_dir: Path,
              ckpt: Path | None) -> Components:
    """Load the models and put the run together in its folder (the expensive part, after every cheap check)."""
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    eos = eos_token_ids(tokenizer, model_path)
    servers = launch_servers(cfg, model_path, run_dir)
    try:
        train_ctl = _train_controller(cfg, model_path, _pad_id(tokenizer, eos)) if role.trains else None
        shared = train_ctl.engine.model if train_ctl is not None and shares_weights(cfg) else None
        engines = make_engines(cfg, model_path, eos, run_dir, [s.url for s in servers], shared_model=shared)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    rollout_ctl = RolloutController(engines, partial_rollout=cfg.scheduler.partial_rollout)
    processor = load_processor(model_path) if is_vlm_folder(model_path) else None  # prompts with images
    agent = agent_cls(rollout_ctl, tokenizer, sampling_params(cfg), judge, **cfg.agent.kwargs)
    scheduler = make_scheduler(cfg, rollout_ctl)  # evaluation goes before an async producer's work (it preempts it)
    preempts = scheduler if isinstance(scheduler, AsyncScheduler) else None
    env = Env(agent, scheduler, SyncScheduler(cfg.agent.timeout, preempts=preempts))
    data = None
    if train_rows is not None:
        data = DataManager(train_rows, PromptBuilder(tokenizer, cfg.data.prompt, cfg.data.train, processor),
                           group_size=cfg.data.group_size, shuffle=cfg.data.shuffle, seed=cfg.run.seed)
    eval_agent = eval_data = None
    if eval_rows:
        eval_agent = agent_cls(rollout_ctl, tokenizer, sampling_params(cfg, cfg.eval.temperature), judge,
                               **(cfg.agent.kwargs | cfg.eval.agent_kwargs))
        eval_data = DataManager(eval_rows, PromptBuilder(tokenizer, cfg.data.prompt, cfg.data.eval, processor),
                                group_size=cfg.eval.n, shuffle=False)
    logger = MetricsLogger.for_run(run_dir, cfg) if role.owns_folder else None
    trajectories = TrajectoryLogger(run_dir, tokenizer) if cfg.run.log_trajectories and role.owns_folder else None
    judge.wait_ready()
    rollouts = InProcessRollouts(cfg, rollout_ctl, judge, env, data, eval_agent, eval_data)
    c = Components(cfg, run_dir, tokenizer, rollouts, train_ctl, logger, trajectories=trajectories, servers=servers)
    if role.trains:
        try:
            checkpoint.prepare(c, ckpt)  # room for checkpoints; resume: weights, optimizer, data, RNGs
        except BaseException:
            c.close()
            raise
    return c


def launch_servers(cfg: Config, model_path: str, run_dir: Path) -> list[ManagedServer]:
    """Start engine.num_engines servers when engine.launch asks for them, and wait until all are healthy.
    Under `launcher=ray` each server runs in a Ray actor on its own bundle of the run's placement group."""
    e = cfg.engine
    placement = ray_placement()
    servers = []
    weights = weights_dir(cfg, run_dir)  # the launched servers load new weights from under it only
    try:
        for i in range(e.launched_servers):
            log, seed = run_dir / "servers" / f"{e.launch}-{i}.log", cfg.run.seed + i
            lora = cfg.model.lora_rank  # a vLLM server loads the run's adapters (relayrl.engine.remote)
            server = (placement.server(i, e, model_path, log, seed, weights, lora) if placement
                      else make_server(e, model_path, log, seed=seed, weights_root=weights, lora_rank=lora))
            servers.append(server.start())
        for server in servers:  # they load their models in parallel
            server.wait_ready(e.launch_timeout)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def weights_dir(cfg: Config, run_dir: Path) -> str:
    """Where new weights are written for remote servers (engine.weights_dir, default RUN_DIR/weights)."""
    return cfg.engine.weights_dir or str(run_dir / "weights")


def shares_weights(cfg: Config) -> bool:
    """Whether the local engine can run on the trainer's own model (engine.share_trainer_weights): only when
    nothing generates while the trainer changes the weights (sync, one engine in this process) and both want the
    same tensors (same dtype, full-parameter training on the local trainer). `cfg` has its dtypes resolved
    (relayrl.run.resolve): an "auto" left in it never matches."""
    e = cfg.engine
    return (e.share_trainer_weights and e.kind == "local" and e.num_engines == 1 and cfg.scheduler.mode == "sync"
            and cfg.scheduler.placement != "separate" and e.dtype == cfg.model.train_dtype
            and not cfg.model.lora_rank and cfg.train.engine == "local")


def make_engines(cfg: Config, model_path: str, eos: list[int], run_dir: Path, launched: list[str],
                 shared_model: torch.nn.Module | None = None) -> list[LocalEngine | RemoteEngine]:
    """LocalEngines in this process on run.device (on `shared_model`, the trainer's, when given), or one
    RemoteEngine per server address (checked healthy up front)."""
    e = cfg.engine
    if e.kind == "local":  # the tokenizer's decode: stop strings (agents' `stop`)
        if shared_model is not None:
            return [LocalEngine.from_config(e, shared_model, eos_token_ids=eos, seed=cfg.run.seed,
                                            decode=tokenizer_decode(model_path), owns_weights=False)]
        engines = [LocalEngine.from_config(e, load_model(model_path, dtype=e.dtype, device=cfg.device),
                                           eos_token_ids=eos, seed=cfg.run.seed + i,
                                           decode=tokenizer_decode(model_path))
                   for i in range(e.num_engines)]
        for engine in engines:  # a model relayrl trained, stored in fp32, into a bf16 engine: rounded as sync rounds
            engine.round_in_fp32_weights(model_path)
        return engines
    engines = RemoteEngine.from_config(e, e.addresses or launched, weights_dir(cfg, run_dir))
    try:
        for engine in engines:
            engine.wait_ready(timeout=30.0)
            engine.refresh_version()
    except BaseException:
        for engine in engines:
            engine.close()
        raise
    return engines


def make_scheduler(cfg: Config, rollout_ctl: RolloutController) -> SyncScheduler | AsyncScheduler:
    if cfg.scheduler.mode == "async":
        return AsyncScheduler.from_config(cfg.scheduler, cfg.data.batch_size, cfg.agent.timeout,
                                          lambda: rollout_ctl.version)
    return SyncScheduler.from_config(cfg.scheduler, cfg.agent.timeout)


def _memory_plan(cfg: Config, train_engine: TrainEngine) -> str:
    """Settle the allocator for this trainer and say, in one line, its floor and the memory settings in force (the
    "auto" ones decided by relayrl.common.memory.memory_is_tight from the floor and the device's memory: gradient
    checkpointing at start-up, relayrl.run.resolve; the allocator here, from the loaded trainer's floor)."""
    floor = train_engine.floor_bytes  # FSDP: the whole model's (its ranks share this machine's RAM)
    total = device_memory_bytes(train_engine.device)
    share = f" = {floor / total:.0%} of {total / 1e9:.1f} GB" if total else ""
    how = "auto" if cfg.resolved["model.gradient_checkpointing"]["asked"] == "auto" else "set"
    parts = [f"gradient checkpointing {'on' if train_engine.gradient_checkpointing else 'off'} ({how})"]
    if train_engine.device.type == "cpu":  # the trainer's heap: freed activations back to the OS at once or not
        parts.append(fit_allocator_to(floor))
    per_param = floor / max(train_engine.floor_params, 1)
    return (f"memory: training floor {floor / 1e9:.2f} GB ({per_param:.0f} bytes/trainable param){share}; "
            + "; ".join(parts))


def _train_controller(cfg: Config, model_path: str, pad_id: int) -> TrainController:
    """The policy's engine on run.device (FSDP: each rank's device, from its process group), the KL reference
    beside it on the same device."""
    t = cfg.train
    engine_kw = dict(temperature=cfg.sampling.temperature, autocast_bf16=cfg.model.autocast_bf16)
    # FSDP: this process's shard, on its process group's device (the group is up: relayrl.run.loop.train)
    cls = FSDPEngine if t.engine == "fsdp" else TrainEngine
    train_engine = cls.from_config(model_path, cfg.model, t, temperature=cfg.sampling.temperature, device=cfg.device)
    print(_memory_plan(cfg, train_engine))
    ref_engine = None
    if cfg.algo.kl_coef > 0 and cfg.model.lora_rank:  # the policy with its adapters off: no second copy
        ref_engine = BaseReference(train_engine)
    elif cfg.algo.kl_coef > 0:
        ref_model = load_model(model_path, dtype=cfg.model.train_dtype,
                               device=train_engine.device).requires_grad_(False)
        if t.engine == "fsdp":  # a whole copy per rank, each rank computing its share of the batch
            ref_engine = ReplicatedEngine(ref_model, **engine_kw)
        else:
            ref_engine = TrainEngine(ref_model, **engine_kw)
    return TrainController(train_engine, cfg.algo, cfg.train, pad_id=pad_id,
                           max_new_tokens=cfg.sampling.max_new_tokens, ref_engine=ref_engine)
