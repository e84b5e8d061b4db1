"""`ppo_clip`: the clipped PPO surrogate with its KL and entropy terms (relayrl.trainer.algo.policy_loss), the loss
of every preset: GRPO, DAPO (clip-higher), GSPO (algo.ratio_level=sequence), PPO."""

from __future__ import annotations

import torch

from relayrl.config.algo import AlgoConfig
from relayrl.trainer.algo import LossInputs, policy_loss
from relayrl.trainer.losses.base import LOSSES


@LOSSES.register("ppo_clip")
def ppo_clip(logp: torch.Tensor, entropy: torch.Tensor | None, inputs: LossInputs,
             algo: AlgoConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """algo's clip range, ratio level, KL estimator and entropy bonus; the KL to the reference is a loss term only
    under algo.kl_mode=loss (in reward mode it is in the advantages, and kl_ref is only logged)."""
    return policy_loss(logp, entropy, inputs, clip_low=algo.clip_low, clip_high=algo.clip_high,
                       kl_coef=algo.kl_coef if algo.kl_mode == "loss" else 0.0, kl_estimator=algo.kl_estimator,
                       entropy_coef=algo.entropy_coef, ratio_level=algo.ratio_level)
