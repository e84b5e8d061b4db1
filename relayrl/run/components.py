"""`Components`: what a built run is made of, and the few things done to it as a whole (save, close)."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from relayrl.common.errors import close_all
from relayrl.config.schema import Config
from relayrl.data.manager import DataManager
from relayrl.engine.rollout import RolloutController
from relayrl.judge import Judge
from relayrl.models import save_pretrained_atomic
from relayrl.run.env import Env
from relayrl.run.launcher import ManagedServer
from relayrl.run.lock import RunLock
from relayrl.run.sources import RolloutSource
from relayrl.tracking.metrics import MetricsLogger
from relayrl.tracking.trajectories import TrajectoryLogger
from relayrl.trainer.controller import TrainController
from relayrl.trainer.lora import is_lora, merged_state_dict


@dataclass
class Components:
    """A run for one role (see `relayrl.run.build.build`): the trainer side, and a `RolloutSource` for the rest.

    `rollouts` is in-process (`InProcessRollouts`) or a producer process (`ProducerHandle`); the loops and
    checkpointing only use its protocol. `rollout_ctl`, `env`, `data`, `eval_data` and `judge` are the source's parts in
    this process, for tests and benches (None for a producer process's trainer)."""

    cfg: Config
    run_dir: Path
    tokenizer: object
    rollouts: RolloutSource
    train_ctl: TrainController | None  # None when only evaluating
    logger: MetricsLogger | None  # None in a producer process: the trainer logs
    trajectories: TrajectoryLogger | None = None
    servers: list[ManagedServer] = field(default_factory=list)  # inference servers this run launched
    step: int = 0  # the last finished training step: a resumed run continues after it
    lock: RunLock | None = None  # the run folder's (relayrl.run.lock), released last by close(); None in a producer

    @property
    def rollout_ctl(self) -> RolloutController | None:
        return self.rollouts.rollout_ctl

    @property
    def env(self) -> Env | None:
        return self.rollouts.env

    @property
    def data(self) -> DataManager | None:
        return self.rollouts.data

    @property
    def eval_data(self) -> DataManager | None:
        return self.rollouts.eval_data

    @property
    def judge(self) -> Judge | None:
        return self.rollouts.judge

    def save_model(self, path: Path) -> Path:
        """Write the trained policy as a plain HF folder (loads with from_pretrained), atomically. A full or
        read-only disk is an OSError naming `path` (see `write_failure`)."""
        model = self.train_ctl.engine.model
        full = self.train_ctl.full_state_dict()  # FSDP: the shards gathered (all ranks); else None, the model's own
        try:
            if is_lora(model):  # LoRA: the adapters merged into the base weights, no peft needed to load it
                return save_pretrained_atomic(model.get_base_model(), self.tokenizer, path,
                                              state_dict=merged_state_dict(model, full))
            return save_pretrained_atomic(model, self.tokenizer, path, state_dict=full)
        except Exception as e:
            failure = write_failure(e, path.parent, f"cannot write the model to {path}")
            if failure is None:
                raise
            raise failure from e

    def close(self) -> None:
        """Release everything, rollouts first (they may be using the rest), each part even if another fails."""
        close_all([self.rollouts.close, self.logger and self.logger.close, *(s.stop for s in self.servers),
                   self.lock and self.lock.release])


_FULL_BYTES = 16 * 2**20  # free space below this after a failed write: the disk is full


def write_failure(e: Exception, folder: Path, what: str) -> OSError | None:
    """`e`, raised while writing into `folder`, as an OSError whose message starts with `what` when the cause is
    the disk: full, read-only or not writable; None when it is something else (re-raise `e`). torch.save and
    safetensors report a full disk as a RuntimeError / SafetensorError without an errno, so the file system
    is asked."""
    if isinstance(e, OSError) and e.errno:
        return OSError(e.errno, f"{what}: {e.strerror}")
    try:
        stat = os.statvfs(folder)
        free = shutil.disk_usage(folder).free
    except OSError as gone:
        return OSError(gone.errno, f"{what}: {gone.strerror}")
    if stat.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, f"{what}: {os.strerror(errno.EROFS)}")
    if not os.access(folder, os.W_OK):
        return OSError(errno.EACCES, f"{what}: {os.strerror(errno.EACCES)}")
    if free < _FULL_BYTES:
        return OSError(errno.ENOSPC, f"{what}: {os.strerror(errno.ENOSPC)} ({free / 2**20:.1f} MiB free)")
    return None
