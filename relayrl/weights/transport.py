"""Weight transports: how new policy weights travel from the trainer to the rollout side.

- in-process: the engines load the trainer's tensors as they are (`RolloutController.load_weights`);
- disk: the trainer writes `ROOT/v{version}/model.safetensors` (to a temp folder, renamed when complete)
  and then the version number to `ROOT/LATEST` (atomically); the rollout side polls LATEST and loads. It
  works across processes and, on a shared file system, machines; inference servers can load the folder;
- dist: a torch.distributed broadcast from the trainer (rank 0) to the rollout process (rank 1) over gloo, from
  host copies (two processes on one GPU cannot share an NCCL group), in the fixed order of the model's parameters,
  sent on a thread while the trainer goes on.

Senders are called by the trainer after each update; receivers run a thread on the rollout side and call
`apply(named_tensors, version)` for each new version.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from relayrl.common.files import atomic_write_text
from relayrl.models.store import atomic_build
from relayrl.weights.weight_group import WeightGroup

Named = Iterable[tuple[str, torch.Tensor]]
Apply = Callable[[Named, int], None]


def save_weights_version(root: Path, named_tensors: Named, version: int) -> Path:
    """Write ROOT/v{version}/model.safetensors atomically (a reader sees no folder or a complete one).

    Tensors that share storage (tied weights) are cloned: safetensors refuses to save shared storage.
    A folder left by an earlier run under the same version is replaced: the version sent now is the truth.
    """
    tensors, seen = {}, set()
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        tensors[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return atomic_build(Path(root) / f"v{version}", lambda tmp: save_file(tensors, str(tmp / "model.safetensors")),
                         force=True)


class DiskSender:
    def __init__(self, root: str | os.PathLike, keep: int = 2):
        self.root, self.keep = Path(root), keep
        self.root.mkdir(parents=True, exist_ok=True)

    def send(self, named_tensors: Named, version: int) -> Path:
        target = save_weights_version(self.root, named_tensors, version)
        atomic_write_text(self.root / "LATEST", f"{version}\n")
        for old in self.root.glob("v*"):  # keep the newest few: a reader may still be loading one
            if old.name[1:].isdigit() and int(old.name[1:]) <= version - self.keep:
                shutil.rmtree(old, ignore_errors=True)
        return target

    def close(self) -> None:
        pass


class DiskReceiver:
    """Polls ROOT/LATEST on a thread and applies each new version once."""

    def __init__(self, root: str | os.PathLike, apply: Apply, poll_s: float = 0.2):
        self.root, self.apply, self.poll_s = Path(root), apply, poll_s
        self.version = -1
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relayrl-weights-disk", daemon=True)
        self._thread.start()

    def latest(self) -> int:
        try:
            return int((self.root / "LATEST").read_text().strip())
        except (OSError, ValueError):
            return -1

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            v = self.latest()
            if v > self.version:
                try:
                    self.apply(load_file(str(self.root / f"v{v}" / "model.safetensors")).items(), v)
                    self.version = v
                except FileNotFoundError:
                    continue  # rotated away while we looked: the next LATEST will do
                except BaseException as e:
                    self.error = e
                    return

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


class DistSender:
    """Rank 0 of a 2-process group: broadcasts [version] then every tensor, in parameter order.

    `send` copies the tensors into buffers kept for the run (pinned host memory when they live on a GPU; the copies
    go on the current CUDA stream, so they see this step's update and not the next one's) and broadcasts from a
    thread: the trainer's next step runs while the weights travel. A blocking broadcast of even a small model in
    fp32 is a large share of a short async step on a GPU (docs/benchmarks.md, "On a GPU", the fourth and fifth runs).
    One send is in flight at most, so versions arrive in order; a failed send raises at the next `send` (or `wait`). The
    price is one host copy of the weights in the wire dtype.

    The group is a private one (`relayrl.weights.weight_group.WeightGroup`), never torch.distributed's default group:
    a sender's last message must not land in another group created later in the same process."""

    def __init__(self, address: str, world: int = 2, dtype: torch.dtype = torch.float32):
        self.dtype = dtype
        self.group = _group(address, rank=0, world=world)
        self._buffers: list[torch.Tensor] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def send(self, named_tensors: Named, version: int) -> None:
        self.wait()  # the buffers are free again, and the previous version is out first
        snapshot, ready = self._snapshot(named_tensors)
        self._thread = threading.Thread(target=self._broadcast, args=(snapshot, version, ready),
                                        name="relayrl-weights-send", daemon=True)
        self._thread.start()

    def _snapshot(self, named_tensors: Named) -> tuple[list[tuple[str, torch.Tensor]], Any]:
        """Copy each tensor into its host buffer; returns the copies and a CUDA event marking them done (or None)."""
        tensors = [(n, t.detach()) for n, t in named_tensors]
        on_gpu = any(t.is_cuda for _, t in tensors)
        if [(b.shape, b.dtype) for b in self._buffers] != [(t.shape, self.dtype) for _, t in tensors]:
            self._buffers = [torch.empty(t.shape, dtype=self.dtype, pin_memory=on_gpu) for _, t in tensors]
        for buf, (_, t) in zip(self._buffers, tensors, strict=True):
            buf.copy_(t, non_blocking=t.is_cuda)
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        return [(n, buf) for buf, (n, _) in zip(self._buffers, tensors, strict=True)], ready

    def _broadcast(self, snapshot: list[tuple[str, torch.Tensor]], version: int, ready: Any) -> None:
        try:
            if ready is not None:
                ready.synchronize()
            self.group.broadcast([("version", torch.tensor([version], dtype=torch.long))])
            self.group.broadcast(snapshot)
        except BaseException as e:  # noqa: BLE001 - raised in the trainer's thread by the next send / wait
            self._error = e

    def wait(self) -> None:
        """Block until the send in flight is out; raise if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"sending weights failed: {error}") from error

    def close(self) -> None:
        """Finish the send in flight, tell the receivers to stop (if they are still there), drop the connections."""
        try:
            self.wait()
            self.group.broadcast([("stop", torch.tensor([-1], dtype=torch.long))])
        except RuntimeError:  # the receiver is gone already (its process ended): nothing left to tell
            pass
        finally:
            self.group.close()


class DistReceiver:
    """Rank 1: receives each version in the sender's wire dtype, shaped like `template`, and applies it."""

    def __init__(self, address: str, template: Named, apply: Apply, rank: int = 1, world: int = 2,
                 dtype: torch.dtype = torch.float32):
        self.apply = apply
        self.specs = [(n, dtype, tuple(t.shape)) for n, t in template]
        self.version = -1
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(address, rank, world), name="relayrl-weights-dist",
                                        daemon=True)
        self._thread.start()

    def _run(self, address: str, rank: int, world: int) -> None:
        group = None
        try:
            group = _group(address, rank=rank, world=world)
            self._ready.set()
            while True:
                version = int(group.receive([("version", torch.long, (1,))])[0][1].item())
                if version < 0:
                    break
                self.apply(group.receive(self.specs), version)
                self.version = version
        except BaseException as e:
            self.error = e
            self._ready.set()
        finally:
            if group is not None:
                group.close()

    def close(self, timeout: float = 30.0) -> None:
        """Wait for the sender's end-of-stream (it comes with the trainer's stop); the thread is a daemon, so
        a trainer that never connected costs `timeout` seconds, not a hang."""
        self._thread.join(timeout)


def _group(address: str, rank: int, world: int):
    """A gloo group of its own at host:port; a peer that died leaves the other waiting at most 300 s."""
    host, port = address.rsplit(":", 1)
    return WeightGroup(host, int(port), rank=rank, world_size=world, backend="gloo", group_name="relayrl-transport",
                       timeout=300.0)
