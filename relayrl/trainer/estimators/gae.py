"""`gae`: PPO's generalised advantage estimation with a critic; docs/algorithms.md, "Advantages" and "Critic"."""

from __future__ import annotations

import torch

from relayrl.trainer.algo import gae, turn_end_rewards
from relayrl.trainer.estimators.base import ESTIMATORS, AdvantageEstimator, AdvantageInputs, Advantages


@ESTIMATORS.register("gae")
class GAEEstimator(AdvantageEstimator):
    """GAE over per-token rewards: the sample's (group-step) reward on its last trained token, or each turn's own
    reward (`Turn.step_reward`) on the turn's last generated token, minus kl_coef * KL on every token when KL is in
    the reward. GAE discounts with algo.gamma itself, so turns read their own rewards, not their returns."""

    needs_critic = True
    turn_reward = "step_reward"

    def estimate(self, inp: AdvantageInputs) -> Advantages:
        a = self.algo
        if inp.values is None:
            raise ValueError("algo.adv_estimator=gae needs critic values: run compute_values first")
        rewards = []
        for i, (s, o) in enumerate(zip(inp.samples, inp.per_sample(self.group_baseline(inp)))):
            if None in o:
                r = torch.zeros(s.num_trained_tokens)
                r[-1] = o[None]
            else:
                r = turn_end_rewards(s.loss_mask, [(t.start, t.end) for t in s.turns], [o[j] for j in range(len(o))])
            rewards.append(r - a.kl_coef * inp.kl[i] if inp.kl is not None else r)
        adv, returns = gae(rewards, inp.values, a.gamma, a.lam)
        return Advantages(adv, returns)
