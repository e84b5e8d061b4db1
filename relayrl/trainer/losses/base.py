"""The policy-loss interface: what a loss receives and returns, and the registry algo.policy_loss names.

A policy loss is a function

    loss(logp, entropy, inputs, algo) -> (loss, stats)

called once per micro-batch, inside the engine's forward/backward:

- logp: the policy's log-probability of each trained token of the micro-batch (flat, with gradient);
- entropy: the policy's entropy per trained token, or None (it is computed when algo.entropy_coef != 0);
- inputs: a relayrl.trainer.algo.LossInputs, per token of the same tokens: advantages, loss weights, old logprobs
  (None: one update per batch, on-policy), reference logprobs (None without a reference model), behaviour weights
  (None without rollout correction or decoupled PPO), sequence lengths, and `stat_weight` (1 / trained tokens of
  the whole update);
- algo: the run's AlgoConfig, for the loss's own knobs.

It returns the scalar to backpropagate, `sum(inputs.weights * per_token_loss)`: the weights (algo.loss_agg) make the
sum over micro-batches (and processes) the update's whole objective, so a loss never takes a mean of its own. The
stats are floats logged as train/<key>: each micro-batch's share of an update-wide value (a token mean is
`sum(x) * inputs.stat_weight`), summed across micro-batches; keys ending in _max (_min) take the max (min) instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from relayrl.common.errors import InputError
from relayrl.common.registry import Registry
from relayrl.config.algo import AlgoConfig
from relayrl.trainer.algo import LossInputs

PolicyLoss = Callable[[torch.Tensor, torch.Tensor | None, LossInputs, AlgoConfig],
                      tuple[torch.Tensor, dict[str, float]]]

LOSSES: Registry[PolicyLoss] = Registry("policy loss")


def loss_for(algo: AlgoConfig) -> PolicyLoss:
    """The loss algo.policy_loss names (a registered name or "package.module:function"); an InputError naming the
    key if it names nothing, or something that is not callable."""
    fn = LOSSES.get(algo.policy_loss, "algo.policy_loss")
    if not callable(fn):
        raise InputError(f"algo.policy_loss: {algo.policy_loss!r} is a {type(fn).__name__}, not a function")
    return fn
