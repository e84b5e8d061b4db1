"""`TrainEngine`: one process holding the policy, its optimizer, and a logprob forward.

The engine knows nothing about RL: it computes per-token logprobs (and entropies) of target tokens
and runs an optimizer step over micro-batches with a loss function the algorithm supplies. Logits
are computed only at trained positions (hidden states are gathered before the LM head), which on
small models with big vocabularies saves a large share of the forward cost and memory.

Devices: the engine computes where its model is (`self.device`): each micro-batch, packed on the CPU, is moved
there just before its forward, autocast follows the device type, and logprobs come back on the CPU, where the
controller keeps the per-token data (old logprobs, advantages, weights) that the loss combines them with.
Gradients flow back through that copy to the device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

import torch

from relayrl.common.device import avoid_cudnn_attention, model_device
from relayrl.common.memory import training_floor, trim_memory
from relayrl.config.schema import ModelConfig, TrainConfig
from relayrl.models import fused, load_model
from relayrl.models.attention import install as install_attention
from relayrl.models.attention import segments_pay_off
from relayrl.models.moe import Replay
from relayrl.trainer import embedding
from relayrl.trainer.algo import reduce_stats
from relayrl.trainer.checkpointing import Saves, checkpoint_kwargs
from relayrl.trainer.logprobs import token_logprobs, weight_grad_into_param
from relayrl.trainer.lora import adapter_tensors, is_lora
from relayrl.trainer.lora import wrap as wrap_lora
from relayrl.trainer.optim import adamw
from relayrl.trainer.packer import MicroBatch
from relayrl.trainer.vision import pixel_inputs, with_images

LossFn = Callable[[MicroBatch, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, dict[str, float]]]


class TrainEngine:
    # whether each process holds only a shard of the weights and optimizer (FSDPEngine): a checkpoint then writes
    # every rank's shard (relayrl.run.checkpoint_dist) instead of one trainer.pt
    sharded = False

    def __init__(self, model: torch.nn.Module, *, lr: float = 1e-6, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, grad_clip: float = 1.0, temperature: float = 1.0,
                 autocast_bf16: bool = False, gradient_checkpointing: bool = False,
                 optimizer_state_dtype: str = "float32", checkpoint_saves: Saves = "nothing"):
        """gradient_checkpointing: resolved (model.gradient_checkpointing "auto" is decided at start-up from the
        training floor, relayrl.run.resolve). checkpoint_saves: what checkpointed layers keep for backward
        (relayrl.trainer.checkpointing)."""
        check_resolved(gradient_checkpointing=gradient_checkpointing, autocast_bf16=autocast_bf16)
        self.model = model
        self.device = model_device(model)
        avoid_cudnn_attention(self.device)
        params = [p for p in model.parameters() if p.requires_grad]
        # eval mode except inside train_step: a local engine may generate on this very model (shared weights),
        # and dropout, LoRA dropout and gradient checkpointing belong to training only
        self.model.eval()
        self._trainable = bool(params)
        self.floor_bytes, self.floor_params = training_floor(params)
        self.gradient_checkpointing = gradient_checkpointing
        if self.gradient_checkpointing:
            self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs=checkpoint_kwargs(model, checkpoint_saves))
        # shared-prompt rows attend without their dense mask where the model runs SDPA and that pays off on this
        # device (relayrl.models.segments; on a GPU SDPA's fused kernels with the dense mask are faster)
        self.segments = install_attention(model) and segments_pay_off(self.device)
        embedding.install(model)  # its backward adds the used rows into weight.grad (relayrl.trainer.embedding)
        fused.install(model)  # RMSNorm and SwiGLU in one pass each where the tensors are fp32 on the CPU
        self.temperature = temperature if temperature > 0 else 1.0
        self.grad_clip = grad_clip
        self.autocast_bf16 = autocast_bf16
        # fused AdamW (one kernel per step, CPU and CUDA), or bf16 moments (relayrl.trainer.optim)
        self.optimizer = (adamw(params, state_dtype=optimizer_state_dtype, lr=lr, betas=betas,
                                weight_decay=weight_decay) if params else None)
        # MoE: forwards replay the engine's routed experts (algo.routing_replay; set by the TrainController)
        self.routing_replay = False
        self.last_replay: Replay | None = None  # the last forward's replay, with its agreement counts
        self._replay: Replay | None = None  # the micro-step's, open through its backward
        self.pixels = pixel_inputs(model)  # a vision-language policy's image processor (relayrl.trainer.vision)

    @classmethod
    def from_config(cls, path: str, m: ModelConfig, t: TrainConfig, *, temperature: float,
                    device: str | None) -> TrainEngine:
        """The policy's engine from the model and train sections, resolved (relayrl.run.resolve), on `device`."""
        return cls.from_pretrained(path, dtype=m.train_dtype, lora=m, device=device, **cls.config_kwargs(m, t),
                                   temperature=temperature, optimizer_state_dtype=t.optimizer_state_dtype)

    @staticmethod
    def config_kwargs(m: ModelConfig, t: TrainConfig) -> dict:
        """The keyword arguments the model and train sections give every trainer engine (FSDPEngine's too)."""
        return dict(lr=t.lr, betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                    autocast_bf16=m.autocast_bf16, gradient_checkpointing=m.gradient_checkpointing,
                    checkpoint_saves=m.checkpoint_saves)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "float32", lora=None, device: str | torch.device | None = None,
                        **kwargs) -> TrainEngine:
        """`lora`: settings with lora_rank > 0 (ModelConfig) wrap the model with peft, so that only the
        adapters are trainable and in the optimizer (relayrl.trainer.lora). `device`: where the model loads
        (relayrl.common.device.resolve_device; None: the CPU)."""
        model = load_model(path, dtype=dtype, device=device)
        if lora is not None and lora.lora_rank > 0:
            model = wrap_lora(model, lora)
        return cls(model, **kwargs)

    def logprobs(self, mb: MicroBatch, with_entropy: bool = False, entropy_grad: bool = False,
                 replay: bool | None = None):
        """Logprobs of mb.targets under log_softmax(logits / temperature); entropy per token if asked.

        The LM head runs in chunks of rows (relayrl.trainer.logprobs), so [tokens x vocab] logits are
        never held whole, in training or in the old-policy and reference passes. Computed on the model's
        device, returned on the CPU (module doc). `replay`: whether an MoE forward uses the engine's routed
        experts (None: self.routing_replay)."""
        with bf16_autocast(self.device, self.autocast_bf16), self.replaying(mb, replay):
            logp, entropy = self._token_logprobs(mb.to(self.device), with_entropy, entropy_grad)
        return logp.cpu(), None if entropy is None else entropy.cpu()

    def _token_logprobs(self, mb: MicroBatch, with_entropy: bool, entropy_grad: bool):
        inputs = decoder_inputs(mb, self.segments)
        if mb.images is not None:  # a vision-language batch: the decoder takes merged embeddings
            inputs = with_images(self.model, inputs, mb.images, self.pixels)
        hidden = self.model.get_decoder()(**inputs).last_hidden_state
        return head_logprobs(self.model, hidden[mb.rows, mb.cols], mb.targets, self.temperature,
                             with_entropy, entropy_grad)

    @contextlib.contextmanager
    def replaying(self, mb: MicroBatch, replay: bool | None = None):
        """Replay mb's routed experts in the forwards inside (relayrl.models.moe.Replay) when asked and recorded. A
        micro-step keeps it open through its backward, which recomputes checkpointed layers: their routers must
        choose as in the forward."""
        if self._replay is not None:
            yield
            return
        on = self.routing_replay if replay is None else replay
        routes = mb.routed.flatten(0, 1) if on and mb.routed is not None else None
        with Replay(self.model, routes) as self._replay:
            try:
                yield
            finally:
                self.last_replay, self._replay = self._replay, None

    def forward_logprobs_all(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """forward_logprobs of every micro-batch of a batch (data-parallel engines share the work out)."""
        return [self.forward_logprobs(mb) for mb in mbs]

    @torch.no_grad()
    def forward_logprobs(self, mb: MicroBatch, replay: bool | None = None) -> torch.Tensor:
        """Logprobs without dropout (e.g. model.lora_dropout): old and reference logprobs must be deterministic."""
        training = self.model.training
        self.model.eval()
        try:
            return self.logprobs(mb, replay=replay)[0]
        finally:
            self.model.train(training)

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *,
                   with_entropy: bool = True, entropy_grad: bool = False) -> dict[str, float]:
        """One optimizer step over all micro-batches; loss_fn's weights make the sum the exact batch loss."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        with self.training_mode():
            per_mb = [self._micro_step(mb, loss_fn, with_entropy, entropy_grad) for mb in micro_batches
                      if mb.num_tokens > 0]
        stats = reduce_stats(per_mb, mean=False)  # loss weights already make these batch-level values
        stats.update(self._clip_and_step())
        stats["train_step_s"] = time.perf_counter() - t0
        return stats

    @contextlib.contextmanager
    def training_mode(self):
        """The model in train mode for the forward/backward passes of a step, back in eval mode after."""
        self.model.train(self._trainable)
        try:
            yield
        finally:
            self.model.eval()

    def _micro_step(self, mb: MicroBatch, loss_fn: LossFn, with_entropy: bool, entropy_grad: bool) -> dict:
        """Forward and backward of one micro-batch; gradients accumulate until `_clip_and_step`.

        With gradient checkpointing the heap is trimmed after the forward and after the backward (on the
        CPU: glibc's malloc_trim). Their temporaries are blocks of one to tens of MB, which glibc keeps in its heap once
        freed, and micro-batches of varying lengths leave holes the next one cannot reuse, so resident memory creeps
        up micro-batch after micro-batch; trimmed, the training peak is lower (bench/memory.py train_memory_trace). The
        price is page faults: every block the next pass allocates is fresh memory, so small ops slow down and a fit
        takes somewhat longer (docs/benchmarks.md, "Where a fit paged: the head's chunks, the embedding's gradient,
        the trims"). So the trims come with checkpointing, the setting that
        already trades time for memory; without it the fit keeps its heap."""
        trim = self.device.type == "cpu" and self.gradient_checkpointing  # a GPU's activations are not in the heap
        with self.replaying(mb):
            with weight_grad_into_param():  # loss.backward() below: the head may write weight.grad itself
                logp, entropy = self.logprobs(mb, with_entropy, entropy_grad)
            loss, mb_stats = loss_fn(mb, logp, entropy)
            if trim:
                trim_memory()
            loss.backward()
        if trim:
            trim_memory()
        return mb_stats

    def _clip_and_step(self) -> dict[str, float]:
        return clip_and_step(self.model, self.optimizer, self.grad_clip)

    def named_parameters(self):
        """Weights to relay to inference engines: every parameter, or only the LoRA adapters of a peft model
        (the engines merge them into their base weights)."""
        if is_lora(self.model):
            return adapter_tensors(self.model)
        return ((name, p.detach()) for name, p in self.model.named_parameters())


def head_logprobs(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
                  with_entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Logprobs (and entropies) of `targets` from final hidden states [N, H] through the model's LM head:
    chunked for a plain bias-free linear head, else (a peft-wrapped head, a bias) the head's own forward."""
    head = model.get_output_embeddings()
    if type(head) is torch.nn.Linear and head.bias is None:
        return token_logprobs(hidden, head.weight, targets, temperature=temperature, with_entropy=with_entropy,
                              entropy_grad=entropy_grad)
    logits = head(hidden).float()
    lsm = torch.log_softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
    logp = lsm.gather(-1, targets[:, None]).squeeze(-1)
    if not with_entropy:
        return logp, None
    with contextlib.nullcontext() if entropy_grad else torch.no_grad():
        return logp, -(lsm.exp() * lsm).sum(-1)


def bf16_autocast(device: torch.device, enabled: bool):
    """bf16 autocast on `device` for the policy's and the critic's forward (a no-op unless `enabled`), without
    autocast's weight cache: the cache keeps a bf16 copy of every weight a forward casts until the forward ends,
    and a forward uses each weight once, so it saves no cast and holds the whole model's bf16 copy (0.27 GB at
    135M) at the forward's end, on top of the activations."""
    if not enabled:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16, cache_enabled=False)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, grad_clip: float) -> dict[str, float]:
    """Clip the accumulated gradients (grad_clip <= 0: measure only), step unless their norm is not finite
    (one bad batch must not poison the weights), and clear them. Shared by the policy and the critic."""
    stats: dict[str, float] = {}
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP2: the norm over every rank's shard
        grad_norm = grad_norm.full_tensor()
    stats["grad_norm"] = float(grad_norm)
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        stats["skipped_nonfinite_step"] = 1.0
    optimizer.zero_grad(set_to_none=True)
    return stats


def decoder_inputs(mb: MicroBatch, segments: bool) -> dict:
    """The decoder's keyword arguments for `mb`; with `segments` (the model runs relayrl's attention), shared-prompt
    rows also carry their layout, which transformers passes down to every attention call."""
    extra = {"relayrl_segments": mb.layout} if segments and mb.layout is not None else {}
    return {"input_ids": mb.input_ids, "attention_mask": mb.attention_mask, "position_ids": mb.position_ids,
            "use_cache": False, **extra}


def check_resolved(**settings: object) -> None:
    """Trainer settings are booleans here: their "auto" is decided once at start-up (relayrl.run.resolve)."""
    for name, value in settings.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r} (\"auto\" is resolved at start-up: "
                            "relayrl.run.resolve)")
