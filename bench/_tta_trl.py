"""The TRL side of bench/time_to_accuracy.py: `trl.GRPOTrainer` on the run config's settings, evaluated every K
steps by relayrl's own evaluator so that its pass@1 is measured exactly as the relayrl runs measure theirs.

The evaluator is relayrl's eval role (`build(cfg, role="eval")`: a LocalEngine, the config's agent, judge, eval set
and Evaluator). At each eval the TRL policy's weights are copied into that engine (`RolloutController.load_weights`,
the call a relayrl weight sync makes), then `rollouts.evaluate()` runs: the same code path as a relayrl run's eval.
"""

from __future__ import annotations

import dataclasses
import json
import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import _common

from relayrl.common.device import device_memory_bytes, resolve_device
from relayrl.common.imports import import_from_path
from relayrl.common.memory import checkpointing_on
from relayrl.config.schema import Config
from relayrl.data import load_rows
from relayrl.data.datasets import system_and_suffix
from relayrl.data.formats import prompt_messages
from relayrl.models import resolve_model_path
from relayrl.run.build import build
from relayrl.run.resolve import resolve
from relayrl.weights.snapshot import Weights


def trl_dataset(cfg: Config):
    """The training prompts as TRL conversational rows: the messages relayrl's PromptBuilder makes (system +
    question + suffix, through the same chat template), and the whole row as JSON for the reward function."""
    from datasets import Dataset  # optional heavy dependency (bench extra): only the TRL side needs it

    system, suffix = system_and_suffix(cfg.data.prompt, cfg.data.train)
    rows = load_rows(cfg.data.train)
    return Dataset.from_list([{"prompt": prompt_messages(r, system, suffix), "row": json.dumps(r)} for r in rows])


def reward_fn(cfg: Config) -> Callable:
    """The run's judge (judge.reward_fn with judge.kwargs) as a TRL reward function."""
    fn, kwargs = import_from_path(cfg.judge.reward_fn), dict(cfg.judge.kwargs)

    def judge_reward(prompts, completions, row, **_):
        return [float(fn(c[-1]["content"], json.loads(r), **kwargs)["reward"]) for c, r in zip(completions, row)]

    return judge_reward


def settings_problem(cfg: Config, micro_batch: int) -> str | None:
    """What in cfg the TRL side cannot mirror (None: all of it), checked before any side starts."""
    total = cfg.data.batch_size * cfg.data.group_size
    if total % micro_batch:
        return f"--trl-micro-batch {micro_batch} must divide data.batch_size * data.group_size = {total}"
    if cfg.train.lr_schedule != "constant" or cfg.train.warmup_steps:
        return "the TRL side mirrors train.lr_schedule=constant without warm-up only"
    if not cfg.data.prompt.chat_template:
        return "the TRL side needs data.prompt.chat_template=true (TRL applies the chat template)"
    return None


def trl_checkpointing(cfg: Config) -> bool:
    """model.gradient_checkpointing as relayrl's trainer resolves it ("auto": on when the training floor, 16 bytes per
    parameter, is a large share of the device's memory), so that both sides train with the same memory setting."""
    from safetensors import safe_open

    if cfg.model.gradient_checkpointing != "auto":
        return bool(cfg.model.gradient_checkpointing)
    params = 0
    for f in sorted(Path(resolve_model_path(cfg.model.path)).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            params += sum(math.prod(h.get_slice(k).get_shape()) for k in h.keys())  # noqa: SIM118 - a safetensors handle, not a dict
    return checkpointing_on("auto", 16 * params, device_memory_bytes(resolve_device(cfg.run.device)))


def grpo_config(cfg: Config, out_dir: str, micro_batch: int):
    """GRPOConfig with the run config's group, batch, lr, optimizer, clip, KL, generation length and temperature."""
    from trl import GRPOConfig  # optional heavy dependency (bench extra)

    if problem := settings_problem(cfg, micro_batch):
        raise ValueError(problem)
    t, s, algo = cfg.train, cfg.sampling, cfg.algo
    total = cfg.data.batch_size * cfg.data.group_size
    args = GRPOConfig(
        output_dir=out_dir, use_cpu=resolve_device(cfg.run.device).type == "cpu", bf16=bool(cfg.model.autocast_bf16),
        fp16=False, seed=cfg.run.seed, data_seed=cfg.run.seed, use_vllm=False,
        gradient_checkpointing=trl_checkpointing(cfg), num_generations=cfg.data.group_size,
        per_device_train_batch_size=micro_batch, gradient_accumulation_steps=total // micro_batch,
        num_iterations=t.epochs, max_completion_length=s.max_new_tokens, temperature=s.temperature,
        top_p=s.top_p, top_k=s.top_k, beta=algo.kl_coef, epsilon=algo.clip_low, epsilon_high=algo.clip_high,
        learning_rate=t.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=t.weight_decay,
        adam_beta1=t.betas[0], adam_beta2=t.betas[1], max_grad_norm=t.grad_clip, max_steps=cfg.run.steps,
        shuffle_dataset=cfg.data.shuffle, report_to="none", save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, log_completions=False, dataloader_num_workers=0)
    if args.generation_batch_size != total:
        raise RuntimeError(f"TRL generates {args.generation_batch_size} completions per step, expected {total}")
    return args


class RelayEval:
    """relayrl's eval role for cfg; `__call__(model, step)` evaluates a torch model's current weights."""

    def __init__(self, cfg: Config, out_dir: str):
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, output_dir=out_dir, name="trl_eval"))
        self.c = build(cfg, role="eval")

    def __call__(self, model, step: int) -> dict[str, float]:
        model = getattr(model, "module", model)  # a wrapped model (DDP) keeps the HF names under .module
        self.c.rollout_ctl.load_weights(Weights(model.named_parameters, step))
        t0 = time.perf_counter()
        metrics = self.c.rollouts.evaluate()
        metrics["time/eval_s"] = time.perf_counter() - t0
        return metrics

    def close(self) -> None:
        self.c.close()


def make_callback(evaluate: RelayEval, every: int, should_stop: Callable[[list[dict]], str | None],
                  samples_per_step: int):
    """A TrainerCallback: step seconds summed from on_step_begin to on_step_end (generation, reward, loss, optimizer
    step), an eval before the first step and every `every` steps (never timed), and a stop when `should_stop` says."""
    from transformers import TrainerCallback  # optional heavy dependency (bench extra)

    class TimeToAccuracy(TrainerCallback):
        def __init__(self):
            self.points: list[dict] = []
            self.train_s, self.t0 = 0.0, 0.0

        def evaluate_now(self, model, step: int) -> None:
            m = evaluate(model, step)
            self.points.append(_common.curve_point(step, step * samples_per_step, self.train_s, m))
            print(f"[trl] eval @ step {step}: pass@1 {m['eval/pass@1']:.4f} ({m['time/eval_s']:.1f}s)", flush=True)

        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.train_s += time.perf_counter() - self.t0
            step = state.global_step
            if step % every == 0 or step >= state.max_steps:
                self.evaluate_now(model, step)
                control.should_training_stop = control.should_training_stop or should_stop(self.points) is not None

    return TimeToAccuracy()


def run_trl(cfg: Config, every: int, micro_batch: int, should_stop: Callable[[list[dict]], str | None]) -> dict:
    """Train with GRPOTrainer until should_stop or run.steps; returns the curve and the settings used."""
    from trl import GRPOTrainer  # optional heavy dependency (bench extra)

    cfg = resolve(cfg)
    samples_per_step = cfg.data.batch_size * cfg.data.group_size
    with tempfile.TemporaryDirectory(prefix="tta_trl_") as tmp:
        evaluate = RelayEval(cfg, tmp)
        try:
            args = grpo_config(cfg, tmp, micro_batch)
            cb = make_callback(evaluate, every, should_stop, samples_per_step)
            trainer = GRPOTrainer(model=cfg.model.path, reward_funcs=reward_fn(cfg), args=args,
                                  train_dataset=trl_dataset(cfg), callbacks=[cb])
            cb.evaluate_now(trainer.model, 0)  # the base policy, before the first step
            if should_stop(cb.points) is None:
                trainer.train()
        finally:
            evaluate.close()
    settings = {"model_dtype": str(trainer.model.dtype), "bf16_autocast": args.bf16, "loss_type": args.loss_type,
                "scale_rewards": str(args.scale_rewards), "gradient_checkpointing": args.gradient_checkpointing,
                "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "generation_batch_size": args.generation_batch_size, "engine_dtype": cfg.engine.dtype}
    return {"curve": cb.points, "optimizer_steps": trainer.state.global_step, "settings": settings}
