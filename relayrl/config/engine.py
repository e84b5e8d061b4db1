"""The `engine` section of a run's configuration: where rollouts are generated (local engines in this process, or
inference servers over HTTP) and how weights reach them. Its own module because it is the largest section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from relayrl.common.net import check_address
from relayrl.config.loader import check

# the flags relayrl puts on each launched server's command line itself (relayrl.run.launcher), so engine.server_args
# must not pass them again: flag -> the config key that sets it (None: relayrl chooses it). SGLang's tensor
# parallelism (--tp-size) and the like are not among them: they go in server_args
SERVER_FLAGS: dict[str, dict[str, str | None]] = {
    "relayrl": {"--model": "model.path", "--host": None, "--port": None, "--api-key": "engine.api_key",
                "--insecure": None, "--dtype": "engine.dtype", "--seed": "run.seed",
                "--max-batch-size": "engine.max_batch_size", "--max-seq-len": "engine.max_seq_len",
                "--max-tokens-in-flight": "engine.max_tokens_in_flight", "--weights-root": "engine.weights_dir"},
    "vllm": {"--model": "model.path", "--host": None, "--port": None, "--api-key": "engine.api_key",
             "--dtype": "engine.dtype", "--seed": "run.seed", "--max-model-len": "engine.max_seq_len"},
    "sglang": {"--model-path": "model.path", "--model": "model.path", "--host": None, "--port": None,
               "--api-key": "engine.api_key", "--dtype": "engine.dtype", "--random-seed": "run.seed",
               "--context-length": "engine.max_seq_len"},
}


def flag_name(arg: str) -> str:
    """A command-line token as the flag it sets: `--max_model_len=8` -> `--max-model-len` (vLLM takes underscores)."""
    return arg.split("=", 1)[0].replace("_", "-") if arg.startswith("--") else arg


def reserved_flag_problem(launch: str, args: list[str]) -> str | None:
    """Why `args` cannot follow relayrl's own flags on `launch`'s command line (None: they may)."""
    for arg in args:
        flag = flag_name(arg)
        if flag in ("-h", "--help"):
            return f"{arg}: the server would print its help and exit"
        if flag in SERVER_FLAGS[launch]:
            key = SERVER_FLAGS[launch][flag]
            return f"{flag} is set by relayrl itself" + (f" (from {key}; set that instead)" if key else "")
    return None


@dataclass
class EngineConfig:
    kind: Literal["local", "remote"] = "local"  # remote: inference servers over HTTP (RemoteEngine)
    # auto: bfloat16 where bf16 is native (GPUs with it, AVX512-BF16/AMX CPUs with a bf16-autocast trainer), else
    # float32 (relayrl.common.hardware)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_batch_size: int = 64  # sequences decoded together
    max_seq_len: int | None = None  # default: the model's max_position_embeddings
    num_engines: int = 1  # local engines in this process, or servers to launch (engine.launch)
    max_tokens_in_flight: int | None = None  # admit requests while sum(prompt + max_new_tokens) fits
    kv_cache_gb: float | None = None  # each local engine's KV cache budget, GB (1e9 B); requests beyond it queue
    # local engines' KV cache: auto = the engine's dtype; bfloat16 under a float32 engine halves the cache (twice the
    # sequences or context in the same memory, half the bytes each decode step reads) at the price of rounding the
    # keys and values to bf16 (how far logprobs move: docs/benchmarks.md, "A bf16 KV cache under an fp32 engine")
    kv_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    prefix_cache_size: int = 64  # finished trajectories whose KV is kept for their next turn
    # local engines: prompts that arrive together are prefilled in forwards of up to this many (padded) tokens, their
    # shared start once (relayrl.engine.prefill); 0: one prompt per forward, nothing shared
    prefill_tokens: int = 2048
    kv_on_update: Literal["recompute", "keep"] = "recompute"  # KV of running sequences after a weight update
    # colocated synchronous runs: local engines give back their KV cache and weights while the trainer trains
    # (the weight sync after the step restores them), so generation's and training's peaks never add up
    release_during_train: bool = True
    # one model object for engine and trainer when both run in the same dtype (sync, colocated, one local engine,
    # a local full-parameter trainer): no second copy of the weights, and the weight sync copies nothing
    share_trainer_weights: bool = True
    # decode-step attention of local engines: kernel = relayrl's C kernel (built once with the system compiler),
    # sdpa = PyTorch's; auto = the kernel when it builds and fits the model, else sdpa
    attention: Literal["auto", "kernel", "sdpa"] = "auto"
    # local engines on a GPU: replay each decode step as a CUDA graph (one launch instead of hundreds; the batch is
    # padded to a bucket). No effect on CPU. relayrl.engine.decode_graphs
    cuda_graphs: bool = True
    # fp32 trainer weights into a bf16 engine: stochastic = rounded up or down at random so the engine's policy
    # follows the trainer's from the first step (rounded to nearest, most weights keep their bf16 value for many
    # steps at RL learning rates); remote servers are then sent bf16 (dtype bfloat16); also how a local engine loads
    # a model stored in fp32 (relayrl eval/serve of a trained model); nearest = plain casts
    weight_rounding: Literal["stochastic", "nearest"] = "stochastic"
    # local engines generating when an update arrives: move it to their device and round it into their dtype first,
    # still generating, then pause only for a copy (costs one copy of the weights in the engine's dtype meanwhile;
    # on a GPU, skipped when that does not fit). false: move and round with the engine paused
    stage_weights: bool = True
    # remote engines: servers at `addresses`, or num_engines servers started by the run (`launch`), spoken to in
    # `backend`'s API: a dialect registered in relayrl.engine.dialects (sglang: SGLang's native API, also `relayrl
    # serve`; vllm: vLLM's OpenAI server) or "package.module:Class" (a Dialect subclass of your own). The config
    # layer cannot import the engine, so the name, and whether it fits engine.launch and engine.weight_sync, is
    # checked at start-up (relayrl.engine.dialects.dialect_class)
    backend: str = "sglang"
    addresses: list[str] = field(default_factory=list)  # e.g. ["http://10.0.0.5:30000"]
    # start the servers as subprocesses (their logs in RUN_DIR/servers/), stop them at exit: `relayrl serve`, vLLM's
    # OpenAI server, or SGLang (CUDA only); the command lines: relayrl.run.launcher, docs/guide.md
    launch: Literal["none", "relayrl", "vllm", "sglang"] = "none"
    # launched servers: more command-line arguments, appended as written (["--tp-size", 2, "--enable-lora"]), checked
    # before any model loads against the server's own parser (relayrl serve; vLLM's when vllm_python exists). Flags
    # relayrl sets itself (SERVER_FLAGS: model, host, port, API key, and those with a key here) are refused
    server_args: list[str | int | float] = field(default_factory=list)
    vllm_python: str = ".venv-vllm/bin/python"  # launch=vllm: the interpreter of vLLM's own virtualenv
    sglang_python: str | None = None  # launch=sglang: the interpreter SGLang is installed in (default: this one)
    api_key: str | None = None  # sent as a bearer token to the servers, and required by launched ones
    weights_dir: str | None = None  # where new weights are written for the servers (default RUN_DIR/weights)
    request_timeout: float = 600.0  # seconds per generation request
    retries: int = 3  # per request, with exponential backoff, before EngineUnavailable
    launch_timeout: float = 300.0  # seconds a launched server may take to become healthy
    # how new weights reach remote servers: disk (a safetensors folder in weights_dir, which they must be able
    # to read) or distributed (broadcast over a torch process group, trainer rank 0; SGLang's protocol)
    weight_sync: Literal["disk", "distributed"] = "disk"
    weight_sync_backend: Literal["auto", "nccl", "gloo"] = "auto"  # distributed: auto = nccl with CUDA, else gloo

    @property
    def launched_servers(self) -> int:
        """How many inference servers the run itself starts (and stops)."""
        return self.num_engines if self.kind == "remote" and self.launch != "none" else 0

    def validate(self) -> None:
        check(self.max_batch_size >= 1, "max_batch_size", "must be >= 1")
        check(self.kv_cache_gb is None or self.kv_cache_gb > 0, "kv_cache_gb", "must be > 0 (or null: no budget)")
        check(self.num_engines >= 1, "num_engines", "must be >= 1")
        check(self.prefill_tokens >= 0, "prefill_tokens", "must be >= 0 (0: one prompt per forward)")
        check(self.retries >= 0, "retries", "must be >= 0")
        check(self.request_timeout > 0, "request_timeout", "must be > 0")
        if self.kind == "remote":
            check(bool(self.addresses) != (self.launch != "none"), "addresses",
                  "engine.kind=remote needs either addresses (running servers) or launch=relayrl|vllm|sglang, not both")
            for a in self.addresses:
                try:
                    check_address(a)
                except ValueError as e:
                    check(False, "addresses", str(e))
        check(self.max_tokens_in_flight is None or self.max_tokens_in_flight >= 1, "max_tokens_in_flight",
              "must be >= 1")
        check(self.weight_sync == "disk" or self.kind == "remote", "weight_sync",
              "distributed sends weights to inference servers: it needs kind=remote")
        self._check_server_args()

    def _check_server_args(self) -> None:
        """engine.server_args: for launched servers only, a command line that starts with a flag, no flag relayrl
        sets itself (the server's own parser is consulted later, before any model loads: relayrl.run.launcher)."""
        if not self.server_args:
            return
        check(self.launched_servers > 0, "server_args",
              "only for servers the run starts (engine.kind=remote with engine.launch=relayrl|vllm|sglang)")
        args = [str(a) for a in self.server_args]
        check(args[0].startswith("-"), "server_args", f"must start with a flag (--name), got {args[0]!r}")
        problem = reserved_flag_problem(self.launch, args)
        check(problem is None, "server_args", f"{problem}")

    @property
    def launch_args(self) -> list[str]:
        """engine.server_args as command-line strings (YAML reads `2` as a number)."""
        return [str(a) for a in self.server_args]
