"""`Sample` and `Status`: the one record that flows through every component.

A sample starts as a prompt (token ids plus the dataset row it came from), is grown by an agent with
engine output, scored by a judge, and finally turned into tensors by the Packer. Everything is plain
Python lists until then, so samples are cheap to copy, pickle, log and send over HTTP.

Per response token a sample carries: the logprob the sampling engine assigned (`logprobs`), the policy
version that produced it (`versions`), and whether the loss sees it (`loss_mask`). Tokens that the
agent inserted itself (feedback turns, tool results) have loss_mask 0, logprob 0.0 and version -1.

A mixture-of-experts policy's sample also carries `routed_experts`: the experts the engine's routers chose for
each position it ran, [positions, MoE layers, k] small ints (relayrl.engine.routing), which the trainer replays
(algo.routing_replay). The latest engine call's array covers every position before its last token (the call's
prompt holds the earlier turns), so each call replaces it.

A vision-language policy's sample carries its prompt's `images`: the image files' bytes, in the order of the
prompt's image placeholders (which the model's processor expanded into image tokens in prompt_ids). The engine and
the trainer each turn them into pixels with the model's image processor; the bytes are far smaller than the pixels
(relayrl.trainer.vision says why they are kept instead).
"""

from __future__ import annotations

import enum
import itertools
import uuid
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # only annotations: the sandbox's own interpreter imports relayrl without numpy
    import numpy as np

NO_VERSION = -1  # version of tokens that no policy produced (prompt continuations, tool output)


class Status(enum.StrEnum):
    """Where a sample is in its life: one status at a time, so a sample that is not trained on says why."""

    INIT = "init"  # prompt only, not yet generated
    COMPLETED = "completed"  # generated and judged: may be trained on
    ABORTED = "aborted"  # generation interrupted (may be resumed or re-queued)
    FAILED = "failed"  # agent or engine error: never trained on, counted
    ARCHIVED = "archived"  # consumed by the trainer
    EXPIRED = "expired"  # too stale to train on
    SKIPPED = "skipped"  # dropped by a filter (e.g. a group whose rewards are all equal)
    REJECTED = "rejected"  # no trustworthy reward (judge failed, NaN, out of range): never trained on, counted


@dataclass
class Turn:
    """One engine call inside a trajectory: the response slice it produced and its policy versions."""

    start: int  # index into response_ids where this turn's generated tokens begin
    end: int  # exclusive end of the generated tokens
    version_start: int
    version_end: int
    finish_reason: str
    reward: float | None = None  # this turn's (discounted) return when an agent rewards turns separately
    step_reward: float | None = None  # this turn's own reward (GAE places it on the turn's last token)


_counter = itertools.count()


@dataclass
class Sample:
    """A prompt and everything produced for it. See the module docstring for the token-level fields."""

    prompt_ids: list[int]
    data: dict[str, Any] = field(default_factory=dict)  # the dataset row: answer, metadata, ...
    group_id: str = ""
    uid: str = field(default_factory=lambda: f"{uuid.uuid4().hex[:12]}-{next(_counter)}")
    index: int = 0  # position inside its group
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. correct, format; logged, not trained on
    status: Status = Status.INIT
    finish_reason: str | None = None
    error: str | None = None
    response_text: str = ""
    seed: int | None = None  # sampling seed: the same sample gets the same tokens however it is batched
    routed_experts: np.ndarray | None = None  # MoE only: [positions, MoE layers, k] uint8/int16 (module docstring)
    images: list[bytes] = field(default_factory=list)  # a vision-language prompt's image files (module docstring)

    # ---- growth -------------------------------------------------------------------------------
    def append_generated(self, ids: list[int], logprobs: list[float], versions: list[int], finish: str,
                         routed_experts: np.ndarray | None = None) -> None:
        """Append tokens an engine sampled; they are trained on and form one turn. `routed_experts`: the engine call's
        (GenOutput.routed_experts), which covers this sample's earlier positions too and so replaces the kept one."""
        if not (len(ids) == len(logprobs) == len(versions)):
            raise ValueError(f"lengths differ: ids={len(ids)} logprobs={len(logprobs)} versions={len(versions)}")
        if routed_experts is not None:
            self.routed_experts = routed_experts
        start = len(self.response_ids)
        self.response_ids += ids
        self.logprobs += logprobs
        self.versions += versions
        self.loss_mask += [1] * len(ids)
        v0 = versions[0] if versions else NO_VERSION
        v1 = versions[-1] if versions else NO_VERSION
        self.turns.append(Turn(start, len(self.response_ids), v0, v1, finish))
        self.finish_reason = finish

    def append_context(self, ids: list[int]) -> None:
        """Append tokens the agent wrote (feedback, tool results): seen by the model, not trained on."""
        self.response_ids += ids
        self.logprobs += [0.0] * len(ids)
        self.versions += [NO_VERSION] * len(ids)
        self.loss_mask += [0] * len(ids)

    def mask_turn(self, j: int) -> None:
        """Keep turn j in the sequence (the model saw it) but out of the loss: an agent that trains only some of
        its turns (e.g. the retries after feedback) calls this. The turn keeps its slice and reward."""
        t = self.turns[j]
        self.loss_mask[t.start: t.end] = [0] * (t.end - t.start)

    # ---- views --------------------------------------------------------------------------------
    @property
    def input_ids(self) -> list[int]:
        """The full token sequence the engine saw and produced: what the trainer trains on."""
        return self.prompt_ids + self.response_ids

    @property
    def num_trained_tokens(self) -> int:
        return sum(self.loss_mask)

    def version_range(self) -> tuple[int, int]:
        """Oldest and newest policy version among generated tokens (NO_VERSION if none)."""
        vs = [v for v, m in zip(self.versions, self.loss_mask) if m]
        return (min(vs), max(vs)) if vs else (NO_VERSION, NO_VERSION)

    def staleness(self, current_version: int) -> int:
        """How many policy versions the oldest generated token is behind `current_version`."""
        oldest, _ = self.version_range()
        return 0 if oldest == NO_VERSION else current_version - oldest

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["status"] = self.status.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Sample:
        d = dict(d)
        d["status"] = Status(d.get("status", "init"))
        d["turns"] = [Turn(**t) for t in d.get("turns", [])]
        return cls(**d)
