"""`return`: every trained token gets its sample's (or turn's) group-relative reward (GRPO, Dr.GRPO, RLOO,
REINFORCE++); docs/algorithms.md, "Advantages"."""

from __future__ import annotations

from relayrl.trainer.algo import discounted_cumsum
from relayrl.trainer.estimators.base import ESTIMATORS, AdvantageEstimator, AdvantageInputs, Advantages


@ESTIMATORS.register("return")
class ReturnEstimator(AdvantageEstimator):
    """The group step's value on each token of its sample or turn (per-turn entries read the turn's return,
    `Turn.reward`). With KL in the reward (REINFORCE++), token t also carries -kl_coef times the KL still to come
    from t on: the return of a per-token reward."""

    def estimate(self, inp: AdvantageInputs) -> Advantages:
        adv = inp.to_tokens(self.group_baseline(inp))
        if inp.kl is not None:
            adv = [o - self.algo.kl_coef * k for o, k in zip(adv, discounted_cumsum(inp.kl, 1.0))]
        return Advantages(adv)
