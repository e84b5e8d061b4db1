"""`FSDPEngine`: the TrainEngine sharded with torch FSDP2 across processes (gloo on CPU, NCCL on GPU).

Why a subclass: TrainController uses `forward_logprobs`, `train_step`, `named_parameters` and the
`optimizer` (LR schedule), so an engine with the same interface trains on N processes with the
controller unchanged.

How it runs (SPMD, torchrun style): every rank runs the same program and calls `ctl.fit(samples)`
with the *same* full batch (rank 0 makes it and sends it, e.g. with `dist.broadcast_object_list`).
Every rank then packs the same micro-batches, and the controller's loss weights are normalised
over the whole batch, so the token-level mean is global by construction. `train_step` trains only
this rank's share of the micro-batches (`balance_ranks`: balanced by padded tokens) and FSDP sums
(not averages) the gradients across ranks, so one and N processes give the same update. Ranks with
fewer micro-batches run empty steps (zero loss) because FSDP's collectives must match in number.
A step whose ranks hold different batches is refused before any collective runs. `forward_logprobs`
(old/ref logprobs) is called by every rank on every micro-batch: correct, but not data parallel yet.

Weight sync: `named_parameters()` gathers one parameter at a time (an all-gather of its shards), so
no rank holds more than one full parameter beyond its shard. Every rank must iterate it (it is a
collective); ranks other than 0 get nothing by default, so followers run
`for _ in engine.named_parameters(): pass` once per pass that rank 0 makes (one per rollout engine). A LoRA policy
(model.lora_rank > 0) is sharded like any other, frozen base and adapters alike, and gathers only its adapters
(relayrl.trainer.lora.adapter_tensors): they are all a sync sends, and the export merges them into the base read
from model.path (Components.save_model).

Plugging in: `relayrl train ... train.engine=fsdp train.world_size=N` starts N processes with torchrun
(relayrl.cli), rank 0 builds the whole run and the other ranks only their trainer shard (relayrl.run.build), and
relayrl.trainer.leader keeps their trainer calls in step. Under a torchrun of the user's own (several
machines) relayrl starts nothing and joins it. Parameters are DTensors: a final model is saved from
`dict(engine.named_parameters())` (Components.save_model does), not with `engine.model.save_pretrained`;
`engine.optimizer.state_dict()` holds only this rank's shard, so checkpoints save the trainer with
torch.distributed.checkpoint, every rank its shard (relayrl.run.checkpoint_dist; `sharded` selects that path).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from relayrl.common.memory import training_floor
from relayrl.config.schema import ModelConfig, TrainConfig
from relayrl.models.attention import install as install_attention
from relayrl.models.attention import segments_pay_off
from relayrl.trainer.algo import reduce_stats
from relayrl.trainer.checkpointing import Saves, checkpoint_kwargs
from relayrl.trainer.engine import LossFn, TrainEngine, check_resolved, decoder_inputs, head_logprobs
from relayrl.trainer.lora import adapter_tensors, is_lora
from relayrl.trainer.packer import MicroBatch, balance_ranks


def init_distributed(backend: str | None = None) -> tuple[int, int]:
    """Join the process group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT).

    NCCL when CUDA is available (each process on cuda:LOCAL_RANK), else gloo. Returns (rank, world size).
    """
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend)
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Leave the process group; the barrier first, since exiting without it sometimes aborts gloo."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


class _TrainedPositions(torch.nn.Module):
    """The FSDP root: decoder + LM head at trained positions in one forward.

    FSDP2 gathers a module's parameters in its forward hooks; the engine calls the decoder and the LM
    head separately, so they are wrapped in one module whose forward FSDP can hook.
    """

    def __init__(self, lm: torch.nn.Module):
        super().__init__()
        self.lm = lm
        # before sharding: shared-prompt rows without the dense mask, where that pays off (on CPUs)
        self.segments = install_attention(lm) and segments_pay_off(next(lm.parameters()).device)

    def forward(self, mb: MicroBatch, temperature: float, with_entropy: bool, entropy_grad: bool):
        hidden = self.lm.get_decoder()(**decoder_inputs(mb, self.segments)).last_hidden_state
        return head_logprobs(self.lm, hidden[mb.rows, mb.cols], mb.targets, temperature, with_entropy, entropy_grad)


class FSDPEngine(TrainEngine):
    sharded = True  # relayrl.run.checkpoint: weights and optimizer state are saved per rank (checkpoint_dist)

    def __init__(self, model: torch.nn.Module, *, mixed_precision: bool = False,
                 gradient_checkpointing: bool = False, checkpoint_saves: Saves = "nothing", **kwargs):
        """Shard `model` (fully_shard per decoder layer, then the root) across the process group.

        mixed_precision: bf16 parameters in forward/backward, fp32 gradient reduction and fp32 master
        weights in the optimizer (FSDP2's MixedPrecisionPolicy). gradient_checkpointing: resolved at start-up
        (relayrl.run.resolve counts an FSDP GPU rank's share of the floor, a CPU rank's whole floor).
        """
        check_resolved(gradient_checkpointing=gradient_checkpointing)
        if not dist.is_initialized():
            raise RuntimeError("FSDPEngine needs a process group: call relayrl.trainer.fsdp.init_distributed() "
                               "first (run under torchrun, or set RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT)")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        device = (torch.device("cuda", torch.cuda.current_device())
                  if dist.get_backend() == "nccl" else torch.device("cpu"))
        floor, n = training_floor(model.parameters())  # the whole model's, unsharded
        if gradient_checkpointing:  # before sharding, while the layers are plain modules
            model.activation_checkpointing_enable(**({} if checkpoint_saves == "nothing" else {
                "activation_checkpointing_kwargs": checkpoint_kwargs(model, checkpoint_saves)}))
        model.to(device)
        self.root = _shard(model, mixed_precision)
        super().__init__(model, **kwargs)  # TrainEngine moves micro-batches to self.device, returns logprobs on CPU
        self.device = device  # the backend's device, whatever a sharded parameter reports
        self.gradient_checkpointing, self.floor_bytes, self.floor_params = gradient_checkpointing, floor, n

    @classmethod
    def from_config(cls, path: str, m: ModelConfig, t: TrainConfig, *, temperature: float,
                    device: str | None = None) -> FSDPEngine:
        """This rank's shard from the resolved model and train sections, on its process group's device (`device`,
        the run's, is where the group was set up for: relayrl.run.loop)."""
        return cls.from_pretrained(path, dtype=m.train_dtype, lora=m, mixed_precision=t.fsdp_mixed_precision,
                                   temperature=temperature, **cls.config_kwargs(m, t))

    # ---- forward ------------------------------------------------------------------------------
    def _token_logprobs(self, mb: MicroBatch, with_entropy: bool, entropy_grad: bool):
        if mb.images is not None:  # the sharded root's forward takes token ids only (docs/design.md, VLM limits)
            raise ValueError("train.engine=fsdp does not take images yet: train a vision-language policy with "
                             "train.engine=local")
        return self.root(mb, self.temperature, with_entropy, entropy_grad)

    # ---- training -----------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], loss_fn: LossFn, *,
                   with_entropy: bool = True, entropy_grad: bool = False) -> dict[str, float]:
        """One optimizer step over the batch; this rank trains only its share of the micro-batches."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        mbs = [mb for mb in micro_batches if mb.num_tokens > 0]
        self._check_same_batch(mbs)
        split = balance_ranks(mbs, self.world_size)
        mine = [mbs[i] for i in split.ranks[self.rank]]
        with self.training_mode():
            per_mb = [self._micro_step(mb, loss_fn, with_entropy, entropy_grad) for mb in mine]
            for _ in range(split.steps - len(mine)):
                self._empty_step()
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, reduce_stats(per_mb, mean=False))
        stats = reduce_stats(parts, mean=False)  # micro-batch shares of batch values add up across ranks
        stats.update(self._clip_and_step())
        stats.update({k: v for k, v in split.stats.items() if k.startswith("dp_")})  # the controller has pad_frac
        stats["train_step_s"] = time.perf_counter() - t0
        return stats

    def forward_logprobs_all(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        """Old logprobs of the batch with each micro-batch computed once, on one rank (balanced as in
        training), then shared: N ranks do 1/N of the forward passes instead of all of them each."""
        return split_forward(mbs, self.forward_logprobs, self.rank, self.world_size, pad=self._empty_forward)

    @torch.no_grad()
    def _empty_forward(self) -> None:
        """A one-token forward: it joins every collective of a real forward (FSDP's weight gathers)."""
        self.logprobs(_one_token())

    def _empty_step(self) -> None:
        """A one-token forward/backward with zero loss: it joins every collective of a real step."""
        logp, _ = self.logprobs(_one_token())
        (logp.sum() * 0.0).backward()

    def _check_same_batch(self, mbs: list[MicroBatch]) -> None:
        """Refuse a step whose ranks hold different batches, before any FSDP collective runs.

        The loss weights assume every trained token of the batch is trained exactly once on some rank,
        and the ranks' splits must agree for FSDP's collectives to pair up: different batches (say, a
        non-deterministic packing) would give a silently wrong update or a hang, so they raise here.
        """
        mine = (len(mbs), tuple(mb.num_tokens for mb in mbs), tuple(mb.padded_tokens for mb in mbs))
        parts: list = [None] * self.world_size
        dist.all_gather_object(parts, mine)
        if any(p != mine for p in parts):
            raise RuntimeError("data-parallel ranks hold different batches (micro-batches per rank: "
                               f"{[p[0] for p in parts]}, trained tokens per rank: {[sum(p[1]) for p in parts]}); "
                               "every rank must call fit() with the same samples")

    # ---- weights ------------------------------------------------------------------------------
    def named_parameters(self, rank0_only: bool = True):
        """Full weights, one parameter gathered at a time (a collective: every rank must iterate).

        With rank0_only, other ranks take part in the gathers but get nothing, so they hold at most one
        full parameter beyond their shard only while it is being gathered.
        """
        if is_lora(self.model):  # LoRA: only the adapters travel (and are saved), gathered the same way
            for name, t in adapter_tensors(self.model):
                if self.rank == 0 or not rank0_only:
                    yield name, t
            return
        for name, p in self.model.named_parameters():
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            if self.rank == 0 or not rank0_only:
                yield name, full.detach()
            del full


class ReplicatedEngine(TrainEngine):
    """A frozen model held whole on every rank (the KL reference of an FSDP run): its forward passes involve no
    collective, and each rank computes only its share of a batch's micro-batches."""

    def forward_logprobs_all(self, mbs: list[MicroBatch]) -> list[torch.Tensor]:
        return split_forward(mbs, self.forward_logprobs, dist.get_rank(), dist.get_world_size())


def split_forward(mbs: list[MicroBatch], forward: Callable[[MicroBatch], torch.Tensor], rank: int, world: int,
                  pad: Callable[[], None] | None = None) -> list[torch.Tensor]:
    """forward() of every micro-batch, each run on one rank, the results shared with all ranks.

    The split is balance_ranks' (the same on every rank without talking); a rank with fewer micro-batches
    calls `pad` for each missing one, so engines whose forward is a collective stay in lockstep.
    """
    real = [i for i, mb in enumerate(mbs) if mb.num_tokens > 0]
    split = balance_ranks([mbs[i] for i in real], world)
    mine = {real[j]: forward(mbs[real[j]]).cpu() for j in split.ranks[rank]}
    if pad is not None:
        for _ in range(split.steps - len(split.ranks[rank])):
            pad()
    parts: list = [None] * world
    dist.all_gather_object(parts, mine)
    got = {i: t for part in parts for i, t in part.items()}
    return [got.get(i, torch.zeros(0)) for i in range(len(mbs))]


def _one_token() -> MicroBatch:
    one = torch.zeros((1, 1), dtype=torch.long)
    return MicroBatch([], one, torch.ones_like(one), torch.zeros(1, dtype=torch.long),
                      torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long))


def _shard(model: torch.nn.Module, mixed_precision: bool) -> _TrainedPositions:
    """fully_shard each decoder layer, then the root (embeddings, final norm, tied LM head); gradients
    are summed across ranks, since the loss weights already normalise over the whole batch."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: FSDPEngine expects the decoder's blocks in .layers")
    mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed_precision
          else MixedPrecisionPolicy())
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    root = _TrainedPositions(model)
    fully_shard(root, mp_policy=mp)
    for m in root.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return root

