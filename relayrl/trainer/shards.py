"""Every rank's shard of a sharded trainer's checkpoint (train.engine=fsdp), written and read in parallel with
torch.distributed.checkpoint; the rest of the checkpoint format is relayrl.run.checkpoint_dist's (rank 0).
These are collectives: rank 0 calls them through LeaderController, the other ranks through leader.follow.

A LoRA policy (model.lora_rank > 0) saves only what trains, the adapters and their optimizer state: its frozen base
is model.path's, which the resumed run loads again, as a one-process LoRA checkpoint does (relayrl.run.checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from relayrl.trainer.controller import TrainController
from relayrl.trainer.lora import is_lora

SHARDS = "trainer_shards"


def replicated_state(ctl: TrainController) -> dict:
    """What trainer.pt holds for a sharded trainer: the controller's state without what the shards hold (the policy
    optimizer; LoRA's adapters, left as an empty "lora" entry so that a resume still checks model.lora_rank)."""
    state = {k: v for k, v in ctl.state_dict().items() if k != "policy_optimizer"}
    if "lora" in state:
        state["lora"] = {}
    return state


def _state(ctl: TrainController) -> tuple[StateDictOptions, dict, dict]:
    """(options, model state, optimizer state) as DCP saves and loads them: with LoRA the trained parameters only.
    ignore_frozen_params alone keeps a frozen weight tied to another under its second name (the LM head); loading
    is then not strict (the base is absent by design), while DCP still fails on any key the checkpoint lacks."""
    model = ctl.engine.model
    lora = is_lora(model)
    options = StateDictOptions(ignore_frozen_params=lora, strict=not lora)
    model_sd, optim_sd = get_state_dict(model, ctl.engine.optimizer, options=options)
    if options.ignore_frozen_params:
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {n: t for n, t in model_sd.items() if n in trained}
    return options, model_sd, optim_sd


def _rng() -> dict[str, torch.Tensor]:
    """This rank's generators: LoRA dropout draws from them on every rank (rank 0's are in rng.pt as well)."""
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def save_shards(ctl: TrainController, folder: Path) -> list[dict] | None:
    """Write this rank's shard of the policy weights and optimizer state into folder/trainer_shards.
    Returns every rank's generators on rank 0 (None elsewhere), for trainer.pt.

    A collective: it returns on any rank only once every rank's files and DCP's metadata are written (the
    barrier makes that explicit), so rank 0 may then write the manifest.
    """
    rngs: list | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(_rng(), rngs, dst=0)
    _, model_sd, optim_sd = _state(ctl)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / SHARDS)
    dist.barrier()
    return rngs


def load_shards(ctl: TrainController, folder: Path) -> None:
    """Load the replicated trainer state, then this rank's slice of the saved weights and optimizer state.

    TrainController.load_state_dict restores version, LR schedule and critic; it expects a policy optimizer
    state, so it is given the optimizer's own (fresh) one, which the shards replace right after. DCP reads
    each rank's slice from whichever files hold it, so the saving world size need not be this one; it fills
    the state dict's tensors in place (for FSDP2 the parameters' and Adam's own shards), and set_state_dict
    is the documented way to apply them in any case. Each rank's generators are restored where the world size
    is the one saved; on another one the micro-batches go to other ranks anyway.
    """
    state = torch.load(folder / "trainer.pt", weights_only=True)
    ctl.load_state_dict({**state, "policy_optimizer": ctl.engine.optimizer.state_dict()})
    options, model_sd, optim_sd = _state(ctl)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=folder / SHARDS)
    set_state_dict(ctl.engine.model, ctl.engine.optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"], options=options)
    rngs = state.get("rank_rng") or []
    if len(rngs) == dist.get_world_size():
        torch.set_rng_state(rngs[dist.get_rank()]["torch"])
        if "cuda" in rngs[dist.get_rank()] and torch.cuda.is_available():
            torch.cuda.set_rng_state(rngs[dist.get_rank()]["cuda"])
    dist.barrier()
