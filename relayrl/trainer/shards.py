"""Every rank's shard of a sharded trainer's checkpoint (train.engine=fsdp), written and read in parallel with
torch.distributed.checkpoint; the rest of the checkpoint format is relayrl.run.checkpoint_dist's (rank 0).
These are collectives: rank 0 calls them through LeaderController, the other ranks through leader.follow."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from relayrl.trainer.controller import TrainController

SHARDS = "trainer_shards"


def save_shards(ctl: TrainController, folder: Path) -> None:
    """Write this rank's shard of the policy weights and optimizer state into folder/trainer_shards.

    A collective: it returns on any rank only once every rank's files and DCP's metadata are written (the
    barrier makes that explicit), so rank 0 may then write the manifest.
    """
    model_sd, optim_sd = get_state_dict(ctl.engine.model, ctl.engine.optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=folder / SHARDS)
    dist.barrier()


def load_shards(ctl: TrainController, folder: Path) -> None:
    """Load the replicated trainer state, then this rank's slice of the saved weights and optimizer state.

    TrainController.load_state_dict restores version, LR schedule and critic; it expects a policy optimizer
    state, so it is given the optimizer's own (fresh) one, which the shards replace right after. DCP reads
    each rank's slice from whichever files hold it, so the saving world size need not be this one; it fills
    the state dict's tensors in place (for FSDP2 the parameters' and Adam's own shards), and set_state_dict
    is the documented way to apply them in any case. The other ranks' random state is not saved: the trainer
    draws no random numbers.
    """
    state = torch.load(folder / "trainer.pt", weights_only=True)
    ctl.load_state_dict({**state, "policy_optimizer": ctl.engine.optimizer.state_dict()})
    model_sd, optim_sd = get_state_dict(ctl.engine.model, ctl.engine.optimizer)
    loaded = {"model": model_sd, "optim": optim_sd}
    dcp.load(loaded, checkpoint_id=folder / SHARDS)
    set_state_dict(ctl.engine.model, ctl.engine.optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    dist.barrier()
