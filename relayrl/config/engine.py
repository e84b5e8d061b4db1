"""The `engine` section of a run's configuration: where rollouts are generated (local engines in this process, or
inference servers over HTTP) and how weights reach them. Its own module because it is the largest section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from relayrl.common.net import check_address
from relayrl.config.loader import check


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
    # remote engines: servers at `addresses`, or num_engines servers started by the run (`launch`)
    backend: Literal["sglang", "vllm"] = "sglang"  # sglang: SGLang's native API (also `relayrl serve`)
    addresses: list[str] = field(default_factory=list)  # e.g. ["http://10.0.0.5:30000"]
    launch: Literal["none", "relayrl", "vllm"] = "none"  # start the servers as subprocesses, stop them at exit
    vllm_python: str = ".venv-vllm/bin/python"  # launch=vllm: the interpreter of vLLM's own virtualenv
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
                  "engine.kind=remote needs either addresses (running servers) or launch=relayrl|vllm, not both")
            check(self.launch != "relayrl" or self.backend == "sglang", "backend",
                  "launch=relayrl serves the sglang-native API: set backend=sglang")
            check(self.launch != "vllm" or self.backend == "vllm", "backend", "launch=vllm needs backend=vllm")
            check(self.weight_sync == "disk" or self.backend == "sglang", "weight_sync",
                  "distributed needs backend=sglang (SGLang's broadcast routes, also served by relayrl serve): "
                  "vLLM's weight-transfer routes use their own NCCL rendezvous, which relayrl does not speak; "
                  "use weight_sync=disk with vLLM")
            for a in self.addresses:
                try:
                    check_address(a)
                except ValueError as e:
                    check(False, "addresses", str(e))
        check(self.max_tokens_in_flight is None or self.max_tokens_in_flight >= 1, "max_tokens_in_flight",
              "must be >= 1")
        check(self.weight_sync == "disk" or self.kind == "remote", "weight_sync",
              "distributed sends weights to inference servers: it needs kind=remote")
