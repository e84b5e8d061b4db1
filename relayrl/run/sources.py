"""Where a run's rollouts come from, behind one protocol, so the training loop and checkpointing never ask which.

Two sources exist: `InProcessRollouts` (engines, agents, judge and prompts in the trainer's process; synchronous
or with an asynchronous producer thread) and `relayrl.run.producer.ProducerHandle` (a separate producer
process, scheduler.placement=separate). The loop asks a source for the next batch, hands it the trained
weights, and asks it to evaluate; a checkpoint pauses it and stores its `state_dict()`. What sync and async
differ in is the source's: an async one hands out batches within the staleness bound with their staleness
(`overlap_metrics`), and says so (`overlaps_training`) for the loop's measuring and memory.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from relayrl.agents.base import Agent
from relayrl.common.errors import close_all
from relayrl.common.memory import trim_memory
from relayrl.config.schema import Config
from relayrl.data.manager import DataManager
from relayrl.engine.base import InferenceEngine
from relayrl.engine.rollout import RolloutController
from relayrl.judge import Judge
from relayrl.run.env import Env
from relayrl.run.evaluator import Evaluator
from relayrl.sample import Sample
from relayrl.scheduler import AsyncScheduler
from relayrl.scheduler.asynchronous import expiries
from relayrl.weights.snapshot import Weights

logger = logging.getLogger(__name__)


def overlap_metrics(batch: list[Sample], version: int, engine_version: float, taken: dict[str, float]
                    ) -> dict[str, float]:
    """What an asynchronous source adds to a batch's metrics: how many versions behind the trainer the oldest token
    of each sample is (min / mean / max); how many versions the engines' weights were behind the trainer's as the
    batch was taken (in transit to a producer process: it admits by the version it holds, so a lag shrinks what it
    may start); and as the step's rollout time, the trainer's wait for the batch (`taken`'s)."""
    lags = [s.staleness(version) for s in batch]
    return {"staleness/min": float(min(lags)), "staleness/mean": sum(lags) / len(lags),
            "staleness/max": float(max(lags)), "rollout/engine_version_lag": version - engine_version,
            "time/rollout_s": taken["time/wait_for_batch_s"]}


class RolloutSource(Protocol):
    """What the loop and checkpointing need from the rollout side, wherever it runs."""

    # the parts in this process (tests, benches and the producer process's own program reach into them); None on a
    # trainer whose rollouts run in a producer process (ProducerHandle)
    rollout_ctl: RolloutController | None
    env: Env | None
    data: DataManager | None
    eval_data: DataManager | None
    judge: Judge | None

    @property
    def overlaps_training(self) -> bool:
        """Whether rollouts run on while the trainer trains (an asynchronous producer). The loop then measures the
        engines' work over the whole step and leaves their memory alone; a synchronous source's engines work
        during `next_batch` only and idle, their memory free for training, until the next `load_weights`."""

    def start(self) -> None:
        """Begin producing ahead of the trainer (asynchronous runs); a no-op where nothing runs ahead."""

    def stop(self) -> None:
        """Stop producing ahead (the counterpart of `start`)."""

    def next_batch(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        """The next training batch for a trainer at `version`, and the rollout metrics of producing it (where
        rollouts overlap training, with `overlap_metrics`: how stale the batch is)."""

    def load_weights(self, weights: Weights) -> None:
        """Give the engines the trainer's weights (`TrainController.weights()`), stamped with their version."""

    def release_memory(self) -> int:
        """Give back engine memory the trainer can use until the next `load_weights`; bytes freed."""

    def engine_counters(self) -> dict[str, float]:
        """The engines' running totals (`RolloutController.engine_counters`), wherever the engines run, with the
        rollout side's own: seconds spent loading weights, seconds an async producer was held by the staleness
        bound, and (not a total) the weights' version the engines hold."""

    def evaluate(self) -> dict[str, float]:
        """Generate and score the held-out set with the current weights (empty if there is none)."""

    def paused(self) -> contextlib.AbstractContextManager:
        """A context in which `state_dict()` is consistent (nothing draws prompts meanwhile)."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to continue exactly: data position, scheduler counters, engine RNGs."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore `state_dict()`'s output into a freshly built source."""

    def close(self) -> None:
        """Release every process and thread the source started."""


@dataclass
class InProcessRollouts:
    """Engines, agents, judge and prompts in this process: colocated (sync) training, and async in one process."""

    cfg: Config
    rollout_ctl: RolloutController
    judge: Judge
    env: Env
    data: DataManager | None  # None when only evaluating
    eval_agent: Agent | None = None
    eval_data: DataManager | None = None
    evaluator: Evaluator = field(default_factory=Evaluator)

    @property
    def overlaps_training(self) -> bool:
        return isinstance(self.env.scheduler, AsyncScheduler)

    def start(self) -> None:
        if self.overlaps_training:
            self.env.start_producer(self.data)

    def stop(self) -> None:
        if self.overlaps_training:
            self.env.stop_producer()

    def next_batch(self, version: int) -> tuple[list[Sample], dict[str, float]]:
        if self.overlaps_training:  # the producer thread runs ahead: take what is fresh enough
            batch, metrics = self.env.get_batch(self.data, version)
            return batch, metrics | overlap_metrics(batch, version, float(self.rollout_ctl.version), metrics)
        metrics = self.env.produce_batch(self.data, self.cfg.data.batch_size)
        return self.data.get_batch(), metrics

    def load_weights(self, weights: Weights) -> None:
        self.rollout_ctl.load_weights(weights)
        self.env.notify_version()

    def engine_counters(self) -> dict[str, float]:
        stats = self.rollout_ctl.stats
        out = self.rollout_ctl.engine_counters() | {"weight_update_s": stats["weight_update_s"],
                                                    "weight_pause_s": stats["weight_pause_s"],
                                                    "weight_stage_s": stats["weight_stage_s"],
                                                    "version": float(self.rollout_ctl.version)}
        if self.overlaps_training:
            out["held_s"] = self.env.scheduler.held_s
        return out

    def release_memory(self) -> int:
        """Colocated sync RL: the engines here idle until the weight sync, so their KV cache and weights (not
        LoRA base weights: only adapters are synced) make room for training (engine.release_during_train)."""
        return self._release(weights=not self.cfg.model.lora_rank)

    def _release(self, weights: bool) -> int:
        """Give back the engines' KV cache (and weights) where nothing generates until the next rollout: sync
        runs with engine.release_during_train; an async producer keeps using them."""
        if self.overlaps_training or not self.cfg.engine.release_during_train:
            return 0
        freed = self.rollout_ctl.release_memory(weights=weights)
        trim_memory()
        return freed

    def evaluate(self) -> dict[str, float]:
        if self.eval_data is None:
            return {}
        self.eval_data.reset()
        stats = self.env.produce_batch(self.eval_data, len(self.eval_data), agent=self.eval_agent)
        metrics = self.evaluator.evaluate(self.eval_data.get_batch())
        self._release(weights=False)  # the KV cache idles until the next rollout: not held through a checkpoint
        # failed (raised or timed out: agent.timeout) and rejected samples are not in the eval means: counted here
        if failed := int(stats["rollout/failed"]):
            # what fails is not a random subset (slow, long answers time out first, and they are mostly wrong), so
            # on a loaded machine the survivors' pass rate can be far above what the same evaluation gives idle
            logger.warning("eval: %d samples failed or timed out (agent.timeout=%s s); the pass rates are over the "
                           "%d that finished and lean toward fast answers", failed, self.cfg.agent.timeout,
                           int(metrics.get("eval/samples", 0)))
        return metrics | {"eval/rejected": stats.get("judge/rejected", 0.0), "eval/failed": stats["rollout/failed"]}

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Async: stop the producer thread and requeue what it generated but nobody trained (so the data state
        counts every drawn prompt as trained or still to generate), then start it again. Sync: nothing runs."""
        if not self.overlaps_training or not self.env.producing:
            yield
            return
        self.stop()
        try:
            for group in self.data.replay_buffer.take():
                self.data.requeue(group[0].data, expiries(group))  # a checkpoint keeps the tail count
                self.env.scheduler.manager.on_expire()
            yield
        finally:
            self.start()

    def _seeded(self) -> list[InferenceEngine]:
        """The engines whose sampling generator a checkpoint keeps (LocalEngine); a server's is its own (its
        rng_state is None). Checkpoints list the generators of these alone, in order."""
        return [e for e in self.rollout_ctl.engines if e.rng_state() is not None]

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"data": self.data.state_dict(), "engines": [e.rng_state() for e in self._seeded()]}
        if self.overlaps_training:  # groups trained so far: the base of the staleness admission rule
            manager = self.env.scheduler.manager
            state["async"] = {"accepted": manager.accepted, "stats": dict(self.env.scheduler.stats)}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data.load_state_dict(state["data"])
        for engine, s in zip(self._seeded(), state.get("engines", [])):
            engine.set_rng_state(s)
        if self.overlaps_training and "async" in state:
            self.env.scheduler.manager.accepted = state["async"]["accepted"]
            self.env.scheduler.stats.update(state["async"]["stats"])

    def close(self) -> None:
        """Release each part even if another fails (the scheduler thread first: it uses the rest)."""
        agents = [self.env.agent.close] + ([self.eval_agent.close] if self.eval_agent is not None else [])
        close_all([self.env.close, *agents, self.rollout_ctl.close, self.judge.close])

