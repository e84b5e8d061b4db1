"""Separate placement: rollouts run in their own process beside the trainer, as AReaL's
rollout workers do, so generation and training do not compete for one interpreter's GIL.

The producer process owns the engines, agents, judge, prompts and an AsyncScheduler. Once built it says "ready"
and produces from the trainer's "start" on (the training loop's clock starts then); it sends finished
groups to the trainer over a queue and receives new weights through a transport (disk or
torch.distributed). The trainer process owns only the policy being trained. Staleness stays bounded the
same way as in one process: admission uses the version the producer's engines hold, and the trainer
expires any group staler than the bound (the producer then regenerates its prompt).

Shutdown: the trainer sends "stop" and joins; a producer that fails sends its traceback first, so the
trainer raises with the real error. The producer ignores SIGINT (Ctrl-C is the trainer's to handle)
and exits when the trainer process disappears.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path

import torch

from relayrl.common import logs
from relayrl.config import from_dict, to_dict
from relayrl.config.schema import Config
from relayrl.run.placement import ray_placement
from relayrl.sample import Sample
from relayrl.scheduler.asynchronous import take_fresh
from relayrl.trainer.lora import adapter_template
from relayrl.weights.transport import DiskReceiver, DiskSender, DistReceiver, DistSender


class ProducerHandle:
    """The trainer's side of a producer process."""

    def __init__(self, cfg: Config, run_dir: Path, build: Callable, dist_address: str | None = None):
        """`build` is `relayrl.run.build.build`, which builds this handle: passed in (the spawned process gets
        it pickled by name) so that this module stays below the builder."""
        self.cfg, self.weights_root = cfg, run_dir / "weights"
        args = (to_dict(cfg), str(run_dir), cfg.scheduler.transport, dist_address, build)
        placement = ray_placement()
        if placement is not None:  # launcher=ray: an actor on the producer's bundle; Ray ties its life to ours
            self.proc, self.to_trainer, self.from_trainer = placement.producer(producer_main, (*args, None))
        else:
            ctx = mp.get_context("spawn")
            self.to_trainer, self.from_trainer = ctx.Queue(), ctx.Queue()
            self.proc = ctx.Process(target=producer_main, name="relayrl-producer",  # not daemon: it has children
                                    args=(*args, os.getpid(), self.to_trainer, self.from_trainer))
            self.proc.start()
        self.dist_address = dist_address
        self.sender: DiskSender | DistSender | None = None  # made at the first send: a DistSender's rendezvous
        # waits for the producer's receiver, which exists only once the producer has built its engines
        self._groups: deque[list[Sample]] = deque()
        self._counters: dict[str, float] = {}  # the producer's engine totals, as of its last group
        self._evals: deque[dict] = deque()
        self._ready = False  # the producer has built its engines and waits for `start`
        self._started = False
        self._stop_sent = False

    # ---- messages ---------------------------------------------------------------------------------
    def _pump(self, timeout: float) -> None:
        """Receive one message (or none within timeout); a dead producer raises with its error."""
        try:
            kind, payload = self.to_trainer.get(timeout=timeout)
        except queue.Empty:
            if not self.proc.is_alive():
                raise RuntimeError(f"the producer process exited with code {self.proc.exitcode}") from None
            return
        if kind == "ready":
            self._ready = True
        elif kind == "group":
            group, self._counters = payload
            self._groups.append(group)
        elif kind == "eval":
            self._evals.append(payload)
        elif kind == "error":
            raise RuntimeError(f"the producer process failed:\n{payload}")

    def _take(self, n: int) -> list[list[Sample]]:
        while len(self._groups) < n:
            self._pump(0.5)
        while not self.to_trainer.empty():  # what else has arrived: the counters then say where the producer is
            self._pump(0.0)  # now, not where it was when it finished this batch's last group (maybe versions ago)
        return [self._groups.popleft() for _ in range(n)]

    # ---- the trainer's calls: the RolloutSource protocol (relayrl.run.sources) ------------------------
    def start(self) -> None:
        """Wait until the producer has built its engines, then let it produce. Why wait here: the training loop's
        clock starts after this call, so a step's time is production and training, never the producer process
        loading its model (a colocated run builds its engines before the loop too), which would otherwise make the
        first step look many times longer than the rest (bench/learning.py async_vs_sync)."""
        while not self._ready:
            self._pump(0.5)
        if not self._started:
            self._started = True
            self.from_trainer.put(("start", None))

    def stop(self) -> None:
        """Nothing to do: the producer keeps producing until `close`."""

    def release_memory(self) -> int:
        return 0  # the engines live in the producer process

    def engine_counters(self) -> dict[str, float]:
        return dict(self._counters)

    def paused(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def state_dict(self) -> dict:
        raise RuntimeError("a run with scheduler.placement=separate cannot be checkpointed: its data position "
                           "and engines live in the producer process")

    def load_state_dict(self, state: dict) -> None:
        self.state_dict()

    def push_weights(self, train_ctl) -> None:
        self.send_weights(train_ctl.engine.named_parameters(), train_ctl.version)

    def next_batch(self, version: int) -> tuple[list[Sample], dict]:
        s = self.cfg.scheduler
        return take_fresh(self._take, self.cfg.data.batch_size, version, s.max_staleness,
                          lambda group: self.from_trainer.put(("expire", group[0].data)))

    def send_weights(self, named_tensors, version: int) -> None:
        if self.sender is None:
            if self.cfg.scheduler.transport == "dist":
                self.sender = DistSender(self.dist_address, dtype=_wire_dtype(self.cfg))
            else:
                self.sender = DiskSender(self.weights_root)
        self.sender.send(named_tensors, version)

    def evaluate(self) -> dict[str, float]:
        self.from_trainer.put(("eval", None))
        while not self._evals:
            self._pump(0.5)
        return self._evals.popleft()

    def close(self, timeout: float = 30.0) -> None:
        """Let the weights in flight arrive (the producer still applies them), ask the producer to finish, end the
        weight channel, join; kill it if it does not exit."""
        if isinstance(self.sender, DistSender):  # blocking calls, on a thread: a wedged producer costs `timeout`
            closer = threading.Thread(target=self._close_dist, args=(self.sender,), daemon=True)
            closer.start()
            closer.join(timeout if self.proc.is_alive() else 1.0)
        self._stop()
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)

    def _close_dist(self, sender: DistSender) -> None:
        with contextlib.suppress(RuntimeError):  # a failed last send: the stop and the kill below still come
            sender.wait()
        self._stop()
        sender.close()  # the receiver thread waits in a broadcast for the next version: this ends it

    def _stop(self) -> None:
        if self.proc.is_alive() and not self._stop_sent:
            self._stop_sent = True
            self.from_trainer.put(("stop", None))


def producer_main(cfg_dict: dict, run_dir: str, transport: str, dist_address: str | None, build: Callable,
                  trainer_pid: int | None, to_trainer, from_trainer) -> None:
    """Entry point of the producer process (trainer_pid None: a Ray actor, whose life Ray ties to the trainer's)."""
    logs.from_env()  # its engines' choices are logged here, at the run's level
    if trainer_pid is not None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _exit_with(trainer_pid)
    c = receiver = None
    try:
        cfg = from_dict(Config, cfg_dict)
        torch.set_num_threads(cfg.scheduler.producer_threads)
        c = build(cfg, role="producer", run_dir=Path(run_dir))
        receiver = _receiver(c, transport, Path(run_dir) / "weights", dist_address)
        to_trainer.put(("ready", None))
        _serve(c, receiver, to_trainer, from_trainer)
    except BaseException:
        to_trainer.put(("error", traceback.format_exc()))
        raise
    finally:  # the receiver first: a version still arriving is applied to engines that are still open
        if receiver is not None:
            receiver.close(timeout=5.0)
        if c is not None:
            c.close()


def _receiver(c, transport: str, root: Path, dist_address: str | None):
    def apply(named, version: int) -> None:
        tensors = list(named)
        c.rollout_ctl.update_weights(lambda: tensors, version)
        c.env.notify_version()

    if transport == "dist":
        model = c.rollout_ctl.engines[0].model  # LoRA: the trainer broadcasts only adapters, shaped from the config
        template = adapter_template(model, c.cfg.model) if c.cfg.model.lora_rank else model.named_parameters()
        return DistReceiver(dist_address, template, apply, dtype=_wire_dtype(c.cfg))
    return DiskReceiver(root, apply)


def _wire_dtype(cfg: Config) -> torch.dtype:
    return torch.bfloat16 if cfg.model.train_dtype == "bfloat16" else torch.float32


def _forward_groups(c, to_trainer) -> None:
    while True:
        try:
            for group in c.data.replay_buffer.take(1, timeout=0.5):
                to_trainer.put(("group", (group, c.rollouts.engine_counters())))
        except TimeoutError:
            continue
        except RuntimeError:  # the scheduler failed: _serve reports it
            return


def _serve(c, receiver, to_trainer, from_trainer) -> None:
    started = False
    while True:
        if receiver.error is not None:
            raise RuntimeError("receiving weights failed") from receiver.error
        if c.data.replay_buffer.error is not None:
            raise RuntimeError("the rollout scheduler failed") from c.data.replay_buffer.error
        try:
            kind, payload = from_trainer.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "stop":
            return
        if kind == "start" and not started:  # the trainer's loop begins: produce from now on
            started = True
            c.rollouts.start()
            threading.Thread(target=_forward_groups, args=(c, to_trainer), daemon=True).start()
        elif kind == "expire":
            c.data.requeue(payload)
            c.env.scheduler.manager.on_expire()
            c.env.notify_version()
        elif kind == "eval":
            to_trainer.put(("eval", c.rollouts.evaluate()))


def _exit_with(pid: int) -> None:
    """Leave when the trainer process is gone (even if it was SIGKILLed and ran no cleanup)."""
    def watch() -> None:
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)

    threading.Thread(target=watch, name="relayrl-trainer-watch", daemon=True).start()

