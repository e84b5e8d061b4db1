"""Rollout routing replay on the trainer's side: the setting's check and the per-step routing metrics.

The replay itself is in the forward (TrainEngine.replaying, relayrl.models.moe.Replay). What a step reports, for a
batch whose samples carry routed experts (an MoE policy on an engine that records them):
  train/routing_agreement            share of (token, MoE layer) pairs where the trainer's router, on its own, picks
                                     the set of experts the engine used;
  train/logprob_diff_engine_replay   mean |trainer logprob - engine logprob| per trained token, experts replayed;
  train/logprob_diff_engine_noreplay the same with the trainer's router choosing.
Both diffs come from no-grad forwards at the weights the step starts from, one with and one without the replay,
whichever of them the training forward uses: two extra forwards of the batch per step, spent only on MoE batches.
"""

from __future__ import annotations

import torch

from relayrl.common.errors import InputError
from relayrl.models.moe import is_moe
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import TrainBatch


def enable(engine: TrainEngine, routing_replay: bool) -> None:
    """Turn the replay on for `engine`'s forwards; algo.routing_replay on a dense model is the user's error."""
    if routing_replay and not is_moe(engine.model):
        raise InputError(f"algo.routing_replay: true needs a mixture-of-experts policy; "
                         f"{type(engine.model).__name__} has no router relayrl knows (set it to false)")
    engine.routing_replay = routing_replay


@torch.no_grad()
def routing_metrics(engine: TrainEngine, batch: TrainBatch) -> dict[str, float]:
    """The module docstring's metrics over the micro-batches that carry routed experts ({} when none do). Needs the
    engine's logprobs per trained token in batch.per_token["behav_logp"] (TrainController.compute_advantages)."""
    diffs, tokens, agreed, compared = {True: 0.0, False: 0.0}, 0, 0, 0
    for mb in batch.micro_batches:
        if mb.routed is None or mb.num_tokens == 0:
            continue
        behav = batch.gather("behav_logp", mb)
        for replay in (True, False):
            logp = engine.forward_logprobs(mb, replay=replay)
            diffs[replay] += float((logp - behav).abs().sum())
            if replay:
                agreed, compared = agreed + engine.last_replay.agreed, compared + engine.last_replay.compared
        tokens += mb.num_tokens
    if not tokens:
        return {}
    return {"train/routing_agreement": agreed / max(1, compared),
            "train/logprob_diff_engine_replay": diffs[True] / tokens,
            "train/logprob_diff_engine_noreplay": diffs[False] / tokens}
