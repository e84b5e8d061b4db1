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

from relayrl.common.device import DEVICE_SETTINGS, valid_device_setting
from relayrl.config.algo import AlgoConfig
from relayrl.config.engine import EngineConfig
from relayrl.config.loader import check, fill_missing, load_config
from relayrl.config.presets import DEFAULT_MAX_NEW_TOKENS, PRESETS, int_at
from relayrl.config.rules import check_rules
from relayrl.config.trackers import DEFAULT_TRACKERS, WandbConfig, tracker_problem


@dataclass
class ModelConfig:
    # a local HF folder, an alias prepared on first use (smollm2), or a hub id org/name[@revision] (downloaded into
    # the HF cache on first use; run.offline: cache only)
    path: str = "smollm2"
    # the trainer's weights, gradients and AdamW moments: float32 (16 bytes/param), or bfloat16 (8 bytes/param:
    # twice the model in the same memory; each update rounded stochastically, relayrl.trainer.optim; fast only where
    # bf16 is native; the local trainer only); auto: float32 unless its floor is half the device's memory or more
    # and bf16 is native there (relayrl.common.hardware.resolve_train_dtype)
    train_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # bf16 autocast for trainer forward/backward (fp32 master weights); auto: on where bf16 is native (a GPU
    # with bf16, a CPU with AVX512-BF16 or AMX: faster fits, docs/benchmarks.md), off where it is emulated (AVX2 CPUs)
    autocast_bf16: bool | Literal["auto"] = "auto"
    # recompute each layer in backward: activations of one layer, ~30% more compute; auto: on when the training
    # floor (16 bytes per trainable fp32 parameter, 8 per bf16 one) is at least a fifth of the trainer device's
    # memory (relayrl.common.memory)
    gradient_checkpointing: bool | Literal["auto"] = "auto"
    # what a checkpointed layer keeps instead of recomputing (relayrl.trainer.checkpointing): nothing; mlp = the MLP's
    # gate/up outputs (2/3 of the recompute's matmul work, 2 x intermediate values per token and layer); matmuls =
    # every matmul output (only elementwise work and attention run again)
    checkpoint_saves: Literal["nothing", "mlp", "matmuls"] = "nothing"
    # LoRA (peft): train low-rank adapters only; only they travel to the engines (relayrl/trainer/lora.py)
    lora_rank: int = 0  # 0: off (full-parameter training)
    lora_alpha: float = 16.0  # the adapter's scaling is lora_alpha / lora_rank
    lora_dropout: float = 0.0  # dropout on the adapters' input while training
    # linear layers to adapt, by name or name suffix (checked against the model when it loads)
    lora_target_modules: list[str] = field(default_factory=lambda: [
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])

    def validate(self) -> None:
        # relayrl.models loads torch and transformers (seconds): imported only when a config is checked, so that
        # importing the schema (the CLI's --help, --help-config) stays instant
        from relayrl.models import MODEL_ALIASES
        from relayrl.models.hub import looks_like_repo_id

        check(self.lora_rank >= 0, "lora_rank", "must be >= 0 (0: LoRA off)")
        check(self.lora_alpha > 0, "lora_alpha", "must be > 0")
        check(0 <= self.lora_dropout < 1, "lora_dropout", "must be in [0, 1)")
        check(self.lora_rank == 0 or (bool(self.lora_target_modules) and all(self.lora_target_modules)),
              "lora_target_modules", "must name at least one linear layer (e.g. q_proj) when lora_rank > 0")
        if self.path in MODEL_ALIASES:
            return
        p = Path(self.path).expanduser()
        if not p.exists() and looks_like_repo_id(self.path):
            return  # a hub id: Config.validate finds or fetches it, knowing run.offline
        check(p.is_dir(), "path", f"model folder {self.path!r} does not exist (or use an alias: "
                                  f"{', '.join(MODEL_ALIASES)})")
        check((p / "config.json").is_file(), "path", f"model folder {self.path!r} has no config.json")


@dataclass
class SamplingConfig:
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS  # tokens generated per engine call (per turn for multi-turn agents)
    temperature: float = 1.0  # sampling temperature; trainer logprobs use the same one; 0: greedy
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this much probability (1: off)
    top_k: int = 0  # sample among the k most likely tokens (0: off)
    stop_token_ids: list[int] = field(default_factory=list)  # extra tokens that end a generation (eos always does)
    # generate exactly max_new_tokens, past eos (vLLM's ignore_eos): fixed lengths for benchmarks; the samples, and
    # what is trained, then go on past the answer
    ignore_eos: bool = False

    def validate(self) -> None:
        check(self.max_new_tokens >= 1, "max_new_tokens", "must be >= 1")
        check(self.temperature >= 0, "temperature", "must be >= 0 (0 = greedy)")
        check(0 < self.top_p <= 1, "top_p", "must be in (0, 1]")


@dataclass
class DatasetConfig:
    # "gsm8k:train|test" (shipped) | "reasoning_gym:<task>" | a file (.jsonl/.json, optionally .gz/.xz/.bz2;
    # .parquet/.csv/.tsv/.arrow) or a folder of such files or a save_to_disk folder | a Hugging Face hub id
    # "org/name[@revision]" (or "hf:org/name"), downloaded into the HF cache on first use | "package.module:function"
    source: str = ""
    subset: str | None = None  # hub id / folder: the dataset config ("main" for openai/gsm8k); None: the default
    split: str | None = None  # hub id / folder: the split to read (e.g. train, test); None: the only split
    size: int | None = None  # rows to use (reasoning_gym: rows to generate)
    seed: int = 0  # reasoning_gym generation seed
    kwargs: dict[str, Any] = field(default_factory=dict)  # reasoning_gym / function arguments
    columns: dict[str, str] = field(default_factory=dict)  # rename row fields first, {old: new}
    map: str | None = None  # "package.module:function" applied to each row after `columns` (None return: drop it)
    # the row field holding the prompt (after columns and map): text, or a list of chat messages (TRL's
    # conversational format; a final assistant turn is the reference answer); None: question, prompt or messages,
    # the first the row has
    prompt_key: str | None = None
    # the row field holding the reference answer (passed to the reward); a message-list prompt's final assistant
    # turn stands in when the row has none; None: rows need no answer (the reward reads other columns)
    answer_key: str | None = "answer"
    system: str | None = None  # a system message for this dataset's prompts (None: data.prompt.system)

    def validate(self) -> None:
        check(bool(self.source), "source", "is required (e.g. gsm8k:train, reasoning_gym:basic_arithmetic)")
        check(self.size is None or self.size >= 1, "size", "must be >= 1")
        check(self.map is None or ":" in self.map, "map", "must look like 'package.module:function'")
        for key in ("subset", "split"):
            check(getattr(self, key) is None or not self.source.startswith(("gsm8k:", "reasoning_gym:")), key,
                  "applies to hub ids and data folders only (gsm8k:<split> names its split)")


@dataclass
class PromptConfig:
    system: str | None = None  # a system message put before every prompt (data.train/eval.system override it)
    # appended to each prompt's last user message; None: the source's own, the boxed-answer instruction for
    # gsm8k: and reasoning_gym: sources and nothing for your data (the task says how to answer)
    suffix: str | None = None
    chat_template: bool = True  # wrap prompts in the tokenizer's chat template (false: raw text)


@dataclass
class DataConfig:
    train: DatasetConfig = field(default_factory=DatasetConfig)  # the training prompts
    eval: DatasetConfig | None = None  # held-out prompts for evaluation (None: no evaluation)
    prompt: PromptConfig = field(default_factory=PromptConfig)  # how a row becomes the prompt the model sees
    batch_size: int = 8  # prompts per training step
    group_size: int = 8  # samples per prompt
    shuffle: bool = True  # shuffle the training prompts each epoch (seeded by run.seed)

    def validate(self) -> None:
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        check(self.group_size >= 1, "group_size", "must be >= 1")


@dataclass
class JudgeConfig:
    # module:function scoring (response text, row) -> reward, or written as TRL's (prompts, completions,
    # **columns) -> list[float | None]; or a list of such functions, whose rewards add up (see reward_weights); a
    # built-in may be named instead (relayrl.judge.REWARDS: math, llm_judge, reward_model)
    reward_fn: str | list[str] = "relayrl.judge.math:math_reward"
    reward_weights: list[float] | None = None  # one weight per reward_fn entry (null: all 1.0), as TRL's
    kwargs: dict[str, Any] = field(default_factory=dict)  # reward_fn keyword arguments (checked at start)
    timeout: float = 10.0  # seconds per reward call (a batch, for TRL-style functions); past it costs its samples
    batch_size: int = 32  # most samples per call of a TRL-style (batched) reward function
    workers: int = 2  # reward worker processes
    memory_mb: int = 4096  # address-space cap per reward worker (RLIMIT_AS; CUDA in a worker needs 0: none)
    max_abs_reward: float | None = 1e4  # |reward| above this rejects the sample (null: only NaN/inf are rejected)

    def validate(self) -> None:
        check(self.timeout > 0, "timeout", "must be > 0 seconds")
        check(self.workers >= 1, "workers", "must be >= 1")
        check(self.batch_size >= 1, "batch_size", "must be >= 1")
        fns = self.reward_fn if isinstance(self.reward_fn, list) else [self.reward_fn]
        check(bool(fns), "reward_fn", "names no function: give 'module:function' or a list of them")
        check(self.reward_weights is None or len(self.reward_weights) == len(fns), "reward_weights",
              f"has {len(self.reward_weights or [])} weights for {len(fns)} reward function(s): one per function")


@dataclass
class AgentConfig:
    kind: str = "single_turn"  # a built-in name or "package.module:AgentClass"
    timeout: float | None = 600.0  # seconds per trajectory; a hung agent costs that sample only
    kwargs: dict[str, Any] = field(default_factory=dict)  # keyword arguments for the agent class


@dataclass
class SchedulerConfig:
    mode: Literal["sync", "async"] = "sync"  # async: a producer keeps generating while the trainer trains
    max_staleness: int = 1  # async: policy versions a trained token may lag behind the trainer
    max_concurrency: int = 64  # async: prompt groups generating at once
    # start over_sample x batch_size more groups than a batch needs; a batch is the first to finish. sync cancels the
    # rest; async keeps them running (partial rollouts) for the next batch, which needs max_staleness >= 1
    over_sample: float = 0.0
    group_filter: str = "none"  # none | mixed (drop groups whose rewards are all equal) | package.module:fn
    max_attempts_factor: float = 4.0  # groups tried per batch group when a filter drops groups
    partial_rollout: Literal["continue", "requeue"] = "continue"  # sequences in flight at a weight update
    # async: a prompt whose groups expired this many times is set aside for a tail batch, not generated again first
    # (0: off)
    tail_batch_candidate_step: int = 0
    # async: once this many prompts are set aside they run as a tail batch, first, and no other group starts until
    # they finish (<= data.batch_size; 0: off)
    tail_batch_trigger_size: int = 0
    placement: Literal["colocated", "separate"] = "colocated"  # separate: rollouts in their own process (async)
    transport: Literal["disk", "dist"] = "disk"  # separate: how weights reach it (safetensors | torch.distributed)
    producer_threads: int = 1  # separate: torch threads of the producer process

    def validate(self) -> None:
        check(self.max_staleness >= 0, "max_staleness", "must be >= 0")
        check(self.max_concurrency >= 1, "max_concurrency", "must be >= 1")
        check(self.over_sample >= 0, "over_sample", "must be >= 0")
        check(self.mode == "sync" or self.over_sample == 0 or self.max_staleness >= 1, "over_sample",
              "with mode=async needs max_staleness >= 1: the extra groups are trained in the next batch, one version "
              "later (or use mode=sync, which cancels them)")
        check(self.tail_batch_candidate_step >= 0, "tail_batch_candidate_step", "must be >= 0 (0: off)")
        check(self.tail_batch_trigger_size >= 0, "tail_batch_trigger_size", "must be >= 0 (0: off)")
        check(self.tail_batch_candidate_step or not self.tail_batch_trigger_size, "tail_batch_candidate_step",
              "must be > 0 with tail_batch_trigger_size set: the expiries that set a prompt aside for the tail batch")
        check(self.tail_batch_trigger_size or not self.tail_batch_candidate_step, "tail_batch_trigger_size",
              "must be > 0 with tail_batch_candidate_step set: the prompts set aside that start a tail batch")
        check(self.mode == "async" or not self.tail_batch_trigger_size, "tail_batch_trigger_size",
              "needs scheduler.mode=async (only an async producer's groups expire)")
        check(self.max_attempts_factor >= 1, "max_attempts_factor", "must be >= 1")
        check(self.placement == "colocated" or self.mode == "async", "placement",
              "separate placement needs scheduler.mode=async (a producer that runs beside the trainer)")


@dataclass
class TrainConfig:
    lr: float = 1e-6  # the policy's AdamW learning rate (peak, after warm-up)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    weight_decay: float = 0.0  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # clip the global gradient norm to this (<= 0: measure only)
    # the policy's AdamW moments: float32 (fused kernel), or bfloat16 (12 instead of 16 bytes/param; second
    # moment rounded stochastically; the local engine only; a PPO critic keeps fp32)
    optimizer_state_dtype: Literal["float32", "bfloat16"] = "float32"
    micro_batch_tokens: int = 4096  # padded tokens per forward/backward
    share_prompt: bool = True  # a GRPO group's samples share one copy of their prompt in a row
    row_tokens: int = 1024  # longest shared row (attention cost grows with its square)
    epochs: int = 1  # optimizer passes over each batch
    minibatches: int = 1  # optimizer steps per pass
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"  # over training steps (fit calls)
    warmup_steps: int = 0  # linear warmup from lr / warmup_steps
    total_steps: int | None = None  # where linear/cosine reach min_lr_ratio * lr; filled from run.steps
    min_lr_ratio: float = 0.0  # cosine/linear schedules end at lr * min_lr_ratio
    # local: one process (TrainEngine); fsdp: FSDP2 across torchrun processes (relayrl.trainer.fsdp.FSDPEngine)
    engine: Literal["local", "fsdp"] = "local"
    world_size: int = 1  # fsdp: trainer processes; `relayrl train` starts them with torchrun unless run under it
    fsdp_mixed_precision: bool = False  # fsdp: bf16 forward/backward, fp32 gradient reduction and master weights

    def validate(self) -> None:
        check(self.lr > 0, "lr", "must be > 0")
        check(self.world_size >= 1, "world_size", "must be >= 1")
        check(self.world_size == 1 or self.engine == "fsdp", "world_size", "more than one process needs "
              "train.engine=fsdp")
        check(not self.fsdp_mixed_precision or self.engine == "fsdp", "fsdp_mixed_precision",
              "needs train.engine=fsdp (the local engine's bf16 option is model.autocast_bf16)")
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        check(self.total_steps is None or self.total_steps >= 1, "total_steps", "must be >= 1")
        check(self.lr_schedule == "constant" or self.total_steps is not None, "total_steps",
              f"lr_schedule={self.lr_schedule} needs total_steps (the loader fills it from run.steps)")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")
        check(self.optimizer_state_dtype == "float32" or self.engine == "local", "optimizer_state_dtype",
              "bfloat16 moments need train.engine=local (FSDP2 shards its own fp32 AdamW): "
              "add train.optimizer_state_dtype=float32")
        check(self.micro_batch_tokens >= 1, "micro_batch_tokens", "must be >= 1")
        check(self.epochs >= 1, "epochs", "must be >= 1")
        check(self.minibatches >= 1, "minibatches", "must be >= 1")


@dataclass
class EvalConfig:
    every: int = 0  # steps between evaluations (0: only at start and end)
    size: int = 64  # held-out prompts
    n: int = 1  # samples per prompt (pass@k, maj@k need n >= k)
    temperature: float = 0.0  # eval sampling temperature (0: greedy)
    at_start: bool = True  # evaluate before the first step
    at_end: bool = True  # evaluate after the last step
    # merged over agent.kwargs for evaluation only, e.g. {plant_first_answer: 0.0}: a training curriculum off
    agent_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunConfig:
    name: str = "run"  # the run folder is run.output_dir/name (name-2, ... if taken)
    steps: int = 20  # training steps (optimizer updates per step: train.epochs x train.minibatches)
    seed: int = 0  # seeds sampling, shuffling and initialisation: a run repeats exactly
    output_dir: str = "runs"  # the run writes to output_dir/name
    # where metrics go, any of: tensorboard (RUN_DIR/tensorboard), jsonl (RUN_DIR/metrics.jsonl, always written:
    # resume and plots read it), wandb (RUN_DIR/wandb; see run.wandb), mlflow (RUN_DIR/mlruns);
    # see docs/guide.md, "Tracking"
    trackers: list[str] = field(default_factory=lambda: list(DEFAULT_TRACKERS))
    # mlflow's tracking store: "" = a file store in RUN_DIR/mlruns; a local path, or a URI you choose (sqlite:, http:)
    mlflow_uri: str = ""
    tensorboard: bool = True  # deprecated alias: false drops tensorboard from run.trackers
    threads: int | None = None  # torch intra-op threads (default: all cores)
    # where the trainer and the local engines load their models: auto (cuda when available), cpu, cuda, cuda:N
    device: str = "auto"
    print_samples: int = 1  # responses shown per step in the console
    # rows (step, prompt, completion, reward) of each step's batch sent to the trackers: a wandb table, mlflow
    # artifacts samples/step_N.json, TensorBoard text (0: none); every sample is in RUN_DIR/trajectories anyway
    samples_per_step: int = 4
    log_trajectories: bool = True  # RUN_DIR/trajectories/<version>/{samples.txt,monitor.jsonl}
    save_final: bool = True  # RUN_DIR/model: the trained policy as a plain HF folder (for relayrl eval)
    # RUN_DIR/checkpoints/step_N every N steps and at the last step (0: none); see docs/checkpoints.md
    checkpoint_every: int = 0
    keep_checkpoints: int = 2  # complete checkpoints kept; older ones are deleted once a newer one is complete
    resume: str = ""  # "auto": the latest checkpoint of output_dir/name (none: start there); or a run or step_N folder
    offline: bool = False  # no network: hub ids (model.path, data.*.source) only from the local HF cache; wandb offline
    wandb: WandbConfig = field(default_factory=WandbConfig)  # wandb's project, entity, run name, tags and mode

    def validate(self) -> None:
        check(self.steps >= 0, "steps", "must be >= 0")
        # a plain folder name: '' or '.' would make output_dir itself the run folder (a resume moves everything in
        # it aside), '..', a separator or an absolute name would write outside output_dir
        check(self.name not in ("", ".", "..") and not any(c in self.name for c in "/\\\0"), "name",
              f"must be a plain folder name (no '/', '\\', not empty, '.' or '..'), got {self.name!r}")
        check(valid_device_setting(self.device), "device", f"must be {DEVICE_SETTINGS}, got {self.device!r}")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0 (0: no checkpoints)")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        check(self.samples_per_step >= 0, "samples_per_step", "must be >= 0 (0: none)")
        problem = tracker_problem(self.trackers)  # a missing package fails here, before any model loads
        check(problem is None, "trackers", problem or "")
        if self.resume not in ("", "auto"):
            check(Path(self.resume).expanduser().is_dir(), "resume",
                  f"{self.resume!r} is not a folder: use auto, a run folder or RUN_DIR/checkpoints/step_N")


@dataclass
class RayConfig:
    """`launcher=ray`: where the run's processes go (docs/ray.md). Every process is a Ray actor in one placement
    group: a bundle per trainer rank (train.world_size), per launched server (engine.launch, engine.num_engines)
    and, with scheduler.placement=separate, one for the producer."""

    address: str | None = None  # None: start a local Ray cluster for this run; "auto" or HOST:PORT: join one
    num_cpus: int | None = None  # the local cluster's CPUs (default: all of this machine's)
    num_gpus: int | None = None  # the local cluster's GPUs (default: all)
    trainer_cpus: float = 1.0  # per trainer rank
    trainer_gpus: float = 0.0  # per trainer rank
    rollout_cpus: float = 1.0  # per launched server, and for the producer
    rollout_gpus: float = 0.0  # per launched server, and for the producer
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"  # how bundles spread over nodes
    server_host: str = "127.0.0.1"  # launched servers bind here; "node": the IP of the node they run on
    placement_timeout: float = 120.0  # seconds the cluster may take to find room for every bundle
    stop_grace: float = 30.0  # seconds a stopped run gets to clean up before its actors are killed

    def validate(self) -> None:
        check(self.trainer_cpus > 0 or self.trainer_gpus > 0, "trainer_cpus", "a trainer rank needs CPUs or GPUs")
        check(self.rollout_cpus > 0 or self.rollout_gpus > 0, "rollout_cpus", "a rollout bundle needs CPUs or GPUs")
        for key in ("trainer_cpus", "trainer_gpus", "rollout_cpus", "rollout_gpus"):
            check(getattr(self, key) >= 0, key, "resources must be >= 0")
        check(self.num_cpus is None or self.num_cpus >= 1, "num_cpus", "must be >= 1")
        check(self.placement_timeout > 0, "placement_timeout", "must be > 0")


# the keys relayrl.run.resolve decides (Config.resolved)
RESOLVED_KEYS = ("run.device", "engine.dtype", "model.train_dtype", "model.autocast_bf16",
                 "algo.rollout_correction.enabled", "model.gradient_checkpointing", "engine.kv_dtype",
                 "engine.attention", "engine.weight_sync_backend")


@dataclass
class Config:
    launcher: Literal["local", "ray"] = "local"  # ray: every process of the run is a Ray actor (see RayConfig)
    model: ModelConfig = field(default_factory=ModelConfig)  # the policy: where it comes from, trainer precision, LoRA
    engine: EngineConfig = field(default_factory=EngineConfig)  # inference engines: in-process or HTTP servers
    sampling: SamplingConfig = field(default_factory=SamplingConfig)  # how responses are sampled in training rollouts
    data: DataConfig = field(default_factory=DataConfig)  # prompts: datasets, prompt building, batch and group size
    judge: JudgeConfig = field(default_factory=JudgeConfig)  # the reward function and its worker processes
    agent: AgentConfig = field(default_factory=AgentConfig)  # what makes a trajectory (single-turn, reflection, tools)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)  # sync or async, staleness, placement, filters
    algo: AlgoConfig = field(default_factory=AlgoConfig)  # advantages, loss, KL, critic: presets set these
    train: TrainConfig = field(default_factory=TrainConfig)  # optimizer, micro-batches, epochs, data-parallel trainer
    eval: EvalConfig = field(default_factory=EvalConfig)  # held-out evaluation during the run
    run: RunConfig = field(default_factory=RunConfig)  # the run folder, steps, seeds, logs, checkpoints
    ray: RayConfig = field(default_factory=RayConfig)  # launcher=ray: where the run's processes go
    # written by relayrl, never read as input: what start-up decided for each automatic choice (relayrl.run.resolve),
    # dotted key -> {asked, value, why}. A run's config.yaml carries it; a config that has one (a run's config.yaml
    # reused) loads, its entries checked, and start-up replaces them with its own decisions
    resolved: dict[str, dict[str, Any]] = field(default_factory=dict)

    def validate(self) -> None:
        self._check_resolved()
        check_rules(self)  # numeric ranges no section checks itself (eval.n, train.betas, ...), async + PPO
        a = self.algo  # data.group_size >= 2 for group-relative estimators: relayrl.run.build.check_user_code
        check(a.overlong_buffer < self.sampling.max_new_tokens, "algo.overlong_buffer",
              f"must be < sampling.max_new_tokens ({self.sampling.max_new_tokens}): the penalty ramps over the "
              "last overlong_buffer tokens before it")
        check(self.scheduler.tail_batch_trigger_size <= self.data.batch_size, "scheduler.tail_batch_trigger_size",
              f"is {self.scheduler.tail_batch_trigger_size}, larger than the batch (data.batch_size="
              f"{self.data.batch_size}): a tail batch is at most one batch of prompts")
        if self.train.engine == "fsdp":
            check(self.scheduler.placement == "colocated", "scheduler.placement",
                  "train.engine=fsdp runs with colocated placement (sync or async) for now")
        if self.scheduler.placement == "separate":
            check(self.scheduler.transport == "disk" or self.engine.kind == "local", "scheduler.transport",
                  "transport=dist broadcasts into the producer's own engines (engine.kind=local); remote engines "
                  "get weights from disk: use scheduler.transport=disk")
        if self.model.lora_rank:
            self._check_lora()
        self._fetch_hub_ids()

    def _check_resolved(self) -> None:
        """`resolved` as relayrl writes it: known keys, each with asked, value and why. A malformed one is refused
        (someone meant it to decide something, and it decides nothing); a well-formed one is replaced at start-up."""
        for key, entry in self.resolved.items():
            check(key in RESOLVED_KEYS, f"resolved.{key}", "not a choice relayrl resolves; `resolved` is written by "
                  "relayrl into a run's config.yaml (relayrl.run.resolve): remove it from your config")
            check(set(entry) == {"asked", "value", "why"}, f"resolved.{key}", "must have asked, value and why, as "
                  "relayrl writes it: remove `resolved` from your config")

    @property
    def device(self) -> str:
        """run.device as start-up resolved it ("cpu", "cuda", "cuda:N"; relayrl.run.resolve): what components read."""
        if "run.device" not in self.resolved:
            raise RuntimeError("the config is not resolved: pass it through relayrl.run.resolve.resolve first")
        return self.resolved["run.device"]["value"]

    def _fetch_hub_ids(self) -> None:
        """Hub ids are found in the HF cache or downloaded now, before compute is spent; run.offline: cache only."""
        from relayrl.models.hub import hub_dataset_id, hub_snapshot, looks_like_repo_id

        path = self.model.path
        if looks_like_repo_id(path) and not Path(path).expanduser().exists():
            try:
                folder = hub_snapshot(path, "model", offline=self.run.offline)
            except FileNotFoundError as e:
                check(False, "model.path", f"no folder {path!r}, and {e}")
            check((folder / "config.json").is_file(), "model.path", f"hub model {path!r} has no config.json")
        for key, data in (("data.train", self.data.train), ("data.eval", self.data.eval)):
            name = hub_dataset_id(data.source) if data else None
            if name:
                try:
                    hub_snapshot(name, "dataset", offline=self.run.offline)
                except FileNotFoundError as e:
                    local = "" if data.source.startswith("hf:") else f"no file or folder {data.source!r}, and "
                    check(False, f"{key}.source", f"{local}{e}")

    def _check_lora(self) -> None:
        """What LoRA (model.lora_rank > 0) does not support yet, refused before anything loads."""
        # remote engines: relayrl serve merges the adapters (by path or broadcast), vLLM loads them as PEFT adapters
        # (relayrl.engine.remote; a launched one starts with LoRA on, relayrl.run.launcher); SGLang's own adapter
        # routes are not spoken
        check(self.engine.launch != "sglang", "engine.launch", "LoRA (model.lora_rank > 0) with launch=sglang is "
              "not supported: use launch=relayrl or launch=vllm")
        check(self.engine.launch != "vllm" or self.model.lora_rank <= 512, "model.lora_rank",
              f"vLLM serves LoRA adapters up to rank 512, got {self.model.lora_rank}")

    @property
    def run_dir(self) -> Path:
        return Path(self.run.output_dir) / self.run.name


def expand_presets(data: dict[str, Any]) -> dict[str, Any]:
    """Fill the knobs the user did not set from the named preset (any section), then the derived defaults.

    Filling only absent keys is what lets `key=value` beat the preset; doing it before the dataclasses
    are built is what puts the expansion into the run's saved config.yaml.
    """
    algo = data.get("algo")
    preset = algo.get("preset", AlgoConfig.preset) if isinstance(algo, dict) else None
    if isinstance(preset, str) and preset in PRESETS:  # an unknown name is reported by the algo.preset check
        data = fill_missing(data, _evaluate(PRESETS[preset], data))
    return fill_missing(data, _evaluate(DERIVED, data))


def _run_steps(data: dict[str, Any]) -> int | None:
    steps = int_at(data, "run", "steps", RunConfig.steps)
    return steps if steps is not None and steps >= 1 else None  # a bad run.steps is reported at its own key


def _off_policy(data: dict[str, Any]) -> bool:
    """Async with room to run ahead: trained samples may come from older policies."""
    part = data.get("scheduler")
    mode = part.get("mode", SchedulerConfig.mode) if isinstance(part, dict) else SchedulerConfig.mode
    return mode == "async" and int_at(data, "scheduler", "max_staleness", SchedulerConfig.max_staleness) != 0


# defaults that depend on other keys: the LR schedule spans the run unless told otherwise; off-policy (async)
# samples get decoupled PPO unless algo.decoupled is set
DERIVED: dict[str, dict[str, Any]] = {"train": {"total_steps": _run_steps}, "algo": {"decoupled": _off_policy}}


def _evaluate(partial: dict[str, dict[str, Any]], data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {section: {k: v(data) if callable(v) else v for k, v in knobs.items()}
            for section, knobs in partial.items()}


def load_run_config(path: str | None, overrides: list[str] = ()) -> Config:
    return load_config(Config, path, list(overrides), presets_hook=expand_presets)
