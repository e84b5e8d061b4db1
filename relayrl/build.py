"""Build the components of a run from its config, cheapest checks first.

Everything that can fail because of user input (datasets, reward function, output folder, agent
class) is checked before any model weights are loaded, so a typo costs seconds, not minutes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from relayrl.agents import AGENTS, Agent
from relayrl.config import dump_yaml
from relayrl.config.schema import Config
from relayrl.data import DataManager, PromptBuilder, load_rows
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.env import Env
from relayrl.evaluator import Evaluator
from relayrl.judge import Judge
from relayrl.metrics import MetricsLogger
from relayrl.models import eos_token_ids, load_model, load_tokenizer, resolve_model_path, save_pretrained_atomic
from relayrl.rollout import RolloutController
from relayrl.scheduler import AsyncScheduler, SyncScheduler, group_filter
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trajectories import TrajectoryLogger
from relayrl.utils import import_from_path


@dataclass
class Components:
    cfg: Config
    run_dir: Path
    tokenizer: object
    rollout_ctl: RolloutController
    judge: Judge
    env: Env
    data: DataManager | None
    train_ctl: TrainController | None
    logger: MetricsLogger
    eval_agent: Agent | None = None
    eval_data: DataManager | None = None
    evaluator: Evaluator = field(default_factory=Evaluator)
    trajectories: TrajectoryLogger | None = None

    def evaluate(self) -> dict[str, float]:
        """Generate the held-out set with the eval agent and score it (empty if no eval data)."""
        if self.eval_data is None:
            return {}
        self.eval_data.reset()
        self.env.produce_batch(self.eval_data, len(self.eval_data), agent=self.eval_agent)
        return self.evaluator.evaluate(self.eval_data.get_batch())

    def save_model(self, path: Path) -> Path:
        """Write the trained policy as a plain HF folder (loads with from_pretrained), atomically."""
        return save_pretrained_atomic(self.train_ctl.engine.model, self.tokenizer, path)

    def close(self) -> None:
        self.env.close()
        self.rollout_ctl.close()
        self.judge.close()
        self.logger.close()


def new_run_dir(cfg: Config) -> Path:
    """output_dir/name, or name-2, name-3... if taken; fails early if the folder is not writable."""
    base = Path(cfg.run.output_dir) / cfg.run.name
    path, n = base, 1
    while path.exists() and any(path.iterdir()):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / ".write_test").write_text("ok")
        (path / ".write_test").unlink()
    except OSError as e:
        raise OSError(f"run.output_dir: cannot write to {path}: {e}") from e
    return path


def agent_class(kind: str) -> type[Agent]:
    return AGENTS[kind] if kind in AGENTS else import_from_path(kind)


def sampling_params(cfg: Config, temperature: float | None = None) -> SamplingParams:
    s = cfg.sampling
    t = s.temperature if temperature is None else temperature
    return SamplingParams(max_new_tokens=s.max_new_tokens, temperature=t, top_p=s.top_p if t else 1.0,
                          top_k=s.top_k if t else 0, stop_token_ids=tuple(s.stop_token_ids))


def build(cfg: Config, *, train: bool = True) -> Components:
    """All components of a run; with train=False only what evaluation needs (no trainer, no train data)."""
    random.seed(cfg.run.seed)
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    # cheap checks first: data, agent class, reward function, output folder
    train_rows = load_rows(cfg.data.train) if train else None
    eval_rows = load_rows(cfg.data.eval)[: cfg.eval.size] if cfg.data.eval else None
    if not train and not eval_rows:
        raise ValueError("data.eval: evaluation needs an eval dataset")
    agent_cls = agent_class(cfg.agent.kind)
    group_filter(cfg.scheduler.group_filter)  # a bad filter path fails here, before any model loads
    judge = Judge(cfg.judge.reward_fn, cfg.judge.kwargs, timeout=cfg.judge.timeout, workers=cfg.judge.workers)
    judge.start()  # worker start-up overlaps model loading
    try:
        return _build_with_judge(cfg, train_rows, eval_rows, agent_cls, judge)
    except BaseException:
        judge.close()
        raise


def _build_with_judge(cfg: Config, train_rows, eval_rows, agent_cls, judge: Judge) -> Components:
    run_dir = new_run_dir(cfg)
    dump_yaml(cfg, str(run_dir / "config.yaml"))
    model_path = resolve_model_path(cfg.model.path)
    tokenizer = load_tokenizer(model_path)
    prompt_fn = PromptBuilder(tokenizer, cfg.data.prompt)
    eos = eos_token_ids(tokenizer, model_path)
    e = cfg.engine
    engine_kw = dict(eos_token_ids=eos, max_batch_size=e.max_batch_size, max_seq_len=e.max_seq_len,
                     max_tokens_in_flight=e.max_tokens_in_flight, prefix_cache_size=e.prefix_cache_size,
                     kv_on_update=e.kv_on_update)
    engines = [LocalEngine(load_model(model_path, dtype=e.dtype), seed=cfg.run.seed + i, **engine_kw)
               for i in range(e.num_engines)]
    rollout_ctl = RolloutController(engines, partial_rollout=cfg.scheduler.partial_rollout)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    train_ctl = _train_controller(cfg, model_path, pad_id) if train_rows is not None else None
    agent = agent_cls(rollout_ctl, tokenizer, sampling_params(cfg), judge, **cfg.agent.kwargs)
    env = Env(agent, make_scheduler(cfg, rollout_ctl), SyncScheduler(cfg.agent.timeout))
    data = None
    if train_rows is not None:
        data = DataManager(train_rows, prompt_fn, group_size=cfg.data.group_size, shuffle=cfg.data.shuffle,
                           seed=cfg.run.seed)
    eval_agent = eval_data = None
    if eval_rows:
        eval_agent = agent_cls(rollout_ctl, tokenizer, sampling_params(cfg, cfg.eval.temperature), judge,
                               **cfg.agent.kwargs)
        eval_data = DataManager(eval_rows, prompt_fn, group_size=cfg.eval.n, shuffle=False)
    logger = MetricsLogger(run_dir, tensorboard=cfg.run.tensorboard)
    trajectories = TrajectoryLogger(run_dir, tokenizer) if cfg.run.log_trajectories else None
    judge.wait_ready()
    return Components(cfg, run_dir, tokenizer, rollout_ctl, judge, env, data, train_ctl, logger,
                      eval_agent, eval_data, trajectories=trajectories)


def make_scheduler(cfg: Config, rollout_ctl: RolloutController) -> SyncScheduler | AsyncScheduler:
    s = cfg.scheduler
    keep = group_filter(s.group_filter)
    if s.mode == "async":
        return AsyncScheduler(cfg.data.batch_size, max_staleness=s.max_staleness, max_concurrency=s.max_concurrency,
                              agent_timeout=cfg.agent.timeout, group_filter=keep,
                              version_fn=lambda: rollout_ctl.version)
    return SyncScheduler(cfg.agent.timeout, over_sample=s.over_sample, group_filter=keep,
                         max_attempts_factor=s.max_attempts_factor)


def _train_controller(cfg: Config, model_path: str, pad_id: int) -> TrainController:
    t = cfg.train
    engine_kw = dict(temperature=cfg.sampling.temperature, autocast_bf16=cfg.model.autocast_bf16)
    train_engine = TrainEngine.from_pretrained(
        model_path, dtype=cfg.model.train_dtype, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay,
        grad_clip=t.grad_clip, gradient_checkpointing=cfg.model.gradient_checkpointing, **engine_kw)
    ref_engine = None
    if cfg.algo.kl_coef > 0:
        ref_model = load_model(model_path, dtype=cfg.model.train_dtype).requires_grad_(False)
        ref_engine = TrainEngine(ref_model, **engine_kw)
    return TrainController(train_engine, cfg.algo, cfg.train, pad_id=pad_id,
                           max_new_tokens=cfg.sampling.max_new_tokens, ref_engine=ref_engine)
