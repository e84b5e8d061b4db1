"""The configuration of a relayrl run: one typed dataclass per component.

Load with `load_run_config(path, overrides)`; every key can be overridden on the command line as
`section.key=value`. Algorithm presets (`algo.preset`) expand into the explicit knobs below; keys
set explicitly (in YAML or on the command line) win over the preset, and the run directory keeps the
expanded config so a run always records what it actually used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from relayrl.config.loader import check, load_config

PRESETS: dict[str, dict[str, Any]] = {
    # group-normalised advantages, token-level mean loss (as AReaL/DAPO aggregate)
    "grpo": {"adv_mean": "group", "adv_std": "group", "adv_leave_one_out": False, "loss_agg": "token_mean"},
    # Dr.GRPO: no std normalisation, token sums normalised by a constant length
    "dr_grpo": {"adv_mean": "group", "adv_std": "none", "adv_leave_one_out": False,
                "loss_agg": "seq_mean_token_sum_norm"},
    # RLOO: leave-one-out group baseline, no std normalisation
    "rloo": {"adv_mean": "group", "adv_std": "none", "adv_leave_one_out": True, "loss_agg": "token_mean"},
}


@dataclass
class ModelConfig:
    path: str = "smollm2"  # a local HF folder, or an alias prepared on first use (smollm2)
    train_dtype: Literal["float32", "bfloat16"] = "float32"
    autocast_bf16: bool = False  # bf16 autocast for trainer forward/backward (fp32 master weights)
    gradient_checkpointing: bool = False

    def validate(self) -> None:
        from relayrl.models import MODEL_ALIASES

        if self.path in MODEL_ALIASES:
            return
        p = Path(self.path).expanduser()
        check(p.is_dir(), "path", f"model folder {self.path!r} does not exist (or use an alias: "
                                  f"{', '.join(MODEL_ALIASES)})")
        check((p / "config.json").is_file(), "path", f"model folder {self.path!r} has no config.json")


@dataclass
class EngineConfig:
    kind: Literal["local"] = "local"
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    max_batch_size: int = 64  # sequences decoded together
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    num_engines: int = 1
    max_tokens_in_flight: int | None = None  # admit requests while sum(prompt + max_new_tokens) fits
    prefix_cache_size: int = 64  # finished trajectories whose KV is kept for their next turn
    kv_on_update: Literal["recompute", "keep"] = "recompute"  # KV of running sequences after a weight update

    def validate(self) -> None:
        check(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        check(self.num_engines >= 1, "num_engines", "must be >= 1")
        check(self.max_tokens_in_flight is None or self.max_tokens_in_flight >= 1, "max_tokens_in_flight",
              "must be >= 1")


@dataclass
class SamplingConfig:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: list[int] = field(default_factory=list)

    def validate(self) -> None:
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")


@dataclass
class DatasetConfig:
    # "gsm8k:train" | "reasoning_gym:<task>" | a .jsonl/.json file | "package.module:function"
    source: str = ""
    size: int | None = None  # rows to use (reasoning_gym: rows to generate)
    seed: int = 0  # reasoning_gym generation seed
    kwargs: dict[str, Any] = field(default_factory=dict)  # reasoning_gym / function arguments
    prompt_key: str = "question"
    answer_key: str = "answer"

    def validate(self) -> None:
        check(bool(self.source), "source", "is required (e.g. gsm8k:train, reasoning_gym:basic_arithmetic)")
        check(self.size is None or self.size >= 1, "size", "must be >= 1")


@dataclass
class PromptConfig:
    system: str | None = None
    suffix: str = "\nPut your final answer within \\boxed{}."
    chat_template: bool = True


@dataclass
class DataConfig:
    train: DatasetConfig = field(default_factory=DatasetConfig)
    eval: DatasetConfig | None = None
    prompt: PromptConfig = field(default_factory=PromptConfig)
    batch_size: int = 8  # prompts per training step
    group_size: int = 8  # samples per prompt
    shuffle: bool = True

    def validate(self) -> None:
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.group_size >= 1, "group_size", "must be >= 1")


@dataclass
class JudgeConfig:
    reward_fn: str = "relayrl.judge.math:math_reward"
    kwargs: dict[str, Any] = field(default_factory=dict)
    timeout: float = 10.0
    workers: int = 2

    def validate(self) -> None:
        check(self.timeout > 0, "timeout", "must be > 0 seconds")
        check(self.workers >= 1, "workers", "must be >= 1")


@dataclass
class AgentConfig:
    kind: str = "single_turn"  # a built-in name or "package.module:AgentClass"
    timeout: float | None = 600.0  # seconds per trajectory; a hung agent costs that sample only
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class SchedulerConfig:
    mode: Literal["sync", "async"] = "sync"  # async: a producer keeps generating while the trainer trains
    max_staleness: int = 1  # async: policy versions a trained token may lag behind the trainer
    max_concurrency: int = 64  # async: prompt groups generating at once
    over_sample: float = 0.0  # sync: start (1 + over_sample) x batch_size groups, keep the first to finish
    group_filter: str = "none"  # none | mixed (drop groups whose rewards are all equal) | package.module:fn
    max_attempts_factor: float = 4.0  # groups tried per batch group when a filter drops groups
    partial_rollout: Literal["continue", "requeue"] = "continue"  # sequences in flight at a weight update

    def validate(self) -> None:
        check(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        check(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        check(self.over_sample >= 0, "over_sample", "must be >= 0")
        check(self.max_attempts_factor >= 1, "max_attempts_factor", "must be >= 1")


@dataclass
class AlgoConfig:
    preset: Literal["grpo", "dr_grpo", "rloo", "custom"] = "grpo"
    adv_mean: Literal["group", "batch", "none"] = "group"
    adv_std: Literal["group", "batch", "none"] = "group"
    adv_leave_one_out: bool = False
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0  # > 0 loads a frozen reference model and adds KL to the loss
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0
    # decoupled PPO (AReaL): clip around recomputed proximal logprobs, weight tokens by pi_prox / pi_behav
    decoupled: bool = False
    behav_weight_cap: float | None = 5.0  # None: no cap
    behav_weight_mode: Literal["clamp", "mask"] = "mask"  # tokens above the cap: weight clamped, or dropped
    behav_weight_level: Literal["token", "sequence"] = "token"  # sequence: geometric mean over the sequence

    def validate(self) -> None:
        check(self.clip_low >= 0 and self.clip_high >= 0, "clip_low", "clip ranges must be >= 0")
        check(self.kl_coef >= 0, "kl_coef", "must be >= 0")


@dataclass
class TrainConfig:
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.999)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    micro_batch_tokens: int = 4096  # padded tokens per forward/backward
    share_prompt: bool = True  # a GRPO group's samples share one copy of their prompt in a row
    row_tokens: int = 1024  # longest shared row (attention cost grows with its square)
    epochs: int = 1  # optimizer passes over each batch
    minibatches: int = 1  # optimizer steps per pass

    def validate(self) -> None:
        check(self.lr > 0, "lr", "must be > 0")
        check(self.micro_batch_tokens >= 1, "micro_batch_tokens", "must be >= 1")
        check(self.epochs >= 1, "epochs", "must be >= 1")
        check(self.minibatches >= 1, "minibatches", "must be >= 1")


@dataclass
class EvalConfig:
    every: int = 0  # steps between evaluations (0: only at start and end)
    size: int = 64  # held-out prompts
    n: int = 1  # samples per prompt (pass@k, maj@k need n >= k)
    temperature: float = 0.0
    at_start: bool = True
    at_end: bool = True


@dataclass
class RunConfig:
    name: str = "run"
    steps: int = 20
    seed: int = 0
    output_dir: str = "runs"  # the run writes to output_dir/name
    tensorboard: bool = True
    threads: int | None = None  # torch intra-op threads (default: all cores)
    print_samples: int = 1  # responses shown per step in the console
    log_trajectories: bool = True  # RUN_DIR/trajectories/<version>/{samples.txt,monitor.jsonl}
    save_final: bool = True  # RUN_DIR/model: the trained policy as a plain HF folder (for relayrl eval)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    data: DataConfig = field(default_factory=DataConfig)
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        a = self.algo
        if "group" in (a.adv_mean, a.adv_std):
            check(self.data.group_size >= 2, "data.group_size",
                  f"must be >= 2 for group-relative advantages (algo.preset={a.preset}); "
                  "set algo.adv_mean/adv_std to batch or none for group_size 1")

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def expand_presets(data: dict[str, Any]) -> dict[str, Any]:
    """Fill algo knobs that the user did not set from the named preset."""
    algo = data.setdefault("algo", {}) if isinstance(data.get("algo", {}), dict) else data["algo"]
    preset = algo.get("preset", AlgoConfig.preset)
    for key, value in PRESETS.get(preset, {}).items():
        algo.setdefault(key, value)
    return data


def load_run_config(path: str | None, overrides: list[str] = ()) -> Config:
    return load_config(Config, path, list(overrides), presets_hook=expand_presets)
