"""The trainer part of a checkpoint when the trainer is sharded (train.engine=fsdp), docs/checkpoints.md.

Why a separate format for that part: an FSDP rank holds only its shard of the policy and of Adam's moments,
so no process can write `trainer.pt` as one process does without gathering the whole optimizer state onto
rank 0 (three times the model's size). Instead every rank writes its own shard with
torch.distributed.checkpoint (DCP) into `trainer_shards/`, in parallel; DCP's metadata records which slice
of which tensor each file holds, so a checkpoint loads into any number of ranks (it reshards).

    trainer_shards/   DCP: __R_0.distcp per rank R (its shard of the policy weights and optimizer state; with LoRA
                      of the adapters and their optimizer state only, the base being model.path's),
                      .metadata (written by rank 0 once every rank's files are written)
    trainer.pt        what every rank holds whole: version, LR schedule, PPO critic (not sharded: each rank
                      trains the same copy), each rank's generators (LoRA dropout draws on every rank), without
                      the policy optimizer (and with LoRA an empty "lora" entry: the adapters are in the shards)
    model/            the full policy as a plain HF folder (gathered one parameter at a time; LoRA: merged), as
                      with one process

Everything else (data position, RNG states, logs, config, manifest) is rank 0's, written by relayrl.run.checkpoint
as for one process; the manifest comes last and records `world_size`. Rank 0 tells the other ranks to
save or load through relayrl.trainer.leader, since every call here is a collective.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from relayrl.run.components import Components
from relayrl.trainer.leader import lead
from relayrl.trainer.shards import replicated_state


# ---- rank 0: relayrl.run.checkpoint's save and restore call these ----------------------------------------------
def write_trainer(c: Components, folder: Path) -> dict:
    """Write the trainer part of a checkpoint (every rank its shard; rank 0 the rest) into `folder`.
    Returns what the manifest records about it."""
    c.train_ctl = lead(c.train_ctl)  # the followers mirror the save and the gather
    rank_rng = c.train_ctl.save_checkpoint(folder)
    torch.save({**replicated_state(c.train_ctl), "rank_rng": rank_rng}, folder / "trainer.pt")
    c.save_model(folder / "model")  # gathered one parameter at a time (LoRA: the adapters, merged into the base)
    return {"world_size": dist.get_world_size()}


def read_trainer(c: Components, folder: Path, manifest: dict) -> None:
    """Load a sharded checkpoint's trainer part on every rank (resharding if the world size changed).

    At build time rank 0's trainer is not led yet; it is from here on, since this load and the weight relay
    that follows it are the run's first collectives.
    """
    c.train_ctl = lead(c.train_ctl)
    saved, now = manifest["world_size"], dist.get_world_size()
    if saved != now:
        print(f"resharding the trainer from {saved} ranks (checkpoint) to {now} (train.world_size)")
    c.train_ctl.load_checkpoint(folder)
