"""The algorithm's knobs (`algo.*`): advantages, policy loss, KL, critic, decoupled PPO.

Kept apart from relayrl.config.schema, which re-exports `AlgoConfig`. The estimator and the loss are named by a
registered name or an import path; the config layer cannot import the trainer, so those names are resolved and
checked at start-up by relayrl.run.build.check_user_code, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from relayrl.config.correction import RolloutCorrectionConfig
from relayrl.config.loader import check
from relayrl.config.presets import PresetName


@dataclass
class AlgoConfig:
    preset: PresetName = "grpo"  # custom: no preset, every knob as written
    # advantages: scalar reward -> estimator (group baseline/scale, then per-token return or GAE) -> batch whitening;
    # the estimator: a registered one (relayrl.trainer.estimators: return; gae, PPO with a critic) or
    # "package.module:Class" for your own (an AdvantageEstimator subclass), checked at start-up
    adv_estimator: str = "return"
    # group: per sample; batch: over the batch's tokens; group_batch: group, then batch (REINFORCE++-baseline)
    adv_mean: Literal["group", "batch", "group_batch", "none"] = "group"
    adv_std: Literal["group", "batch", "none"] = "group"  # divide advantages by the std of the group/batch
    adv_leave_one_out: bool = False  # RLOO: baseline = mean of the group's other samples
    # per-turn rewards (multi-turn agents): turn k's return is compared with the group's other k-th turns
    # ("turn"), or with every turn of the group ("pooled", which credits a failed last retry for beating turn 1)
    turn_baseline: Literal["turn", "pooled"] = "turn"
    gamma: float = 1.0  # GAE discount over response tokens
    lam: float = 0.95  # GAE lambda
    # reward shaping, in this order: + overlong penalty, * reward_scale, + reward_bias, clip to +-reward_clip
    reward_scale: float = 1.0
    reward_bias: float = 0.0  # added to every reward after scaling
    reward_clip: float | None = None  # clip rewards to +-this (None: no clip)
    overlong_buffer: int = 0  # DAPO: linear penalty over the last N tokens before max_new_tokens (0: off)
    overlong_penalty: float = 1.0  # the penalty at max_new_tokens
    overlong_filter: bool = False  # DAPO: truncated samples (finish reason "length") get no loss at all
    # policy loss: a registered loss (relayrl.trainer.losses: ppo_clip, the clipped surrogate the knobs below set) or
    # "package.module:function" for your own, called as fn(logp, entropy, inputs, algo) -> (loss, stats)
    policy_loss: str = "ppo_clip"
    # how per-token losses add up (relayrl.trainer.algo.token_weights): over the batch's tokens, per sequence then
    # over sequences, or per-sequence sums over max_new_tokens (Dr.GRPO)
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"] = "token_mean"
    ratio_level: Literal["token", "sequence"] = "token"  # sequence: GSPO's geometric-mean sequence ratio
    clip_low: float = 0.2  # PPO clip: the ratio may fall to 1 - clip_low
    clip_high: float = 0.2  # PPO clip: the ratio may rise to 1 + clip_high (DAPO: clip-higher)
    kl_coef: float = 0.0  # > 0 loads a frozen reference model
    kl_mode: Literal["loss", "reward"] = "loss"  # KL to the reference as a loss term, or per token in the reward
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # Schulman's estimators of KL(pi || ref)
    entropy_coef: float = 0.0  # entropy bonus weight in the loss (0: off)
    # critic (an estimator that needs one: gae)
    critic_path: str | None = None  # default: the policy's model
    critic_lr: float = 1e-5  # the critic's AdamW learning rate
    value_clip: float | None = 0.2  # None: unclipped value loss
    # decoupled PPO (AReaL): clip around recomputed proximal logprobs, weight tokens by pi_prox / pi_behav;
    # defaults to true with scheduler.mode=async and max_staleness > 0 (DERIVED), where samples are off-policy
    decoupled: bool = False
    behav_weight_cap: float | None = 5.0  # None: no cap
    behav_weight_mode: Literal["clamp", "mask"] = "mask"  # tokens above the cap: weight clamped, or dropped
    behav_weight_level: Literal["token", "sequence"] = "token"  # sequence: geometric mean over the sequence
    # with one update per batch (train.epochs = train.minibatches = 1) pi_prox is the policy being trained, so its
    # logprobs are the training forward's own (detached): true spends a separate forward on them anyway
    recompute_prox: bool = False
    # mixture-of-experts policies: the trainer's forwards use the experts the engine routed each token to (rollout
    # routing replay, R3), with gating weights from the trainer's own router (relayrl.models.moe); an error on a
    # dense model
    routing_replay: bool = False
    # importance weights for the engine/trainer mismatch, on by default where their precisions differ; with
    # decoupled PPO on, they are its behaviour weight (algo.behav_weight_* then unused)
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)

    def validate(self) -> None:
        check(self.clip_low >= 0, "clip_low", "clip ranges must be >= 0")
        check(self.clip_high >= 0, "clip_high", "clip ranges must be >= 0")
        check(self.kl_coef >= 0, "kl_coef", "must be >= 0")
        check(0 <= self.gamma <= 1, "gamma", "must be in [0, 1]")
        check(0 <= self.lam <= 1, "lam", "must be in [0, 1]")
        check(self.reward_clip is None or self.reward_clip > 0, "reward_clip", "must be > 0 (or null: no clip)")
        check(self.overlong_buffer >= 0, "overlong_buffer", "must be >= 0 (0 turns the penalty off)")
        check(self.critic_lr > 0, "critic_lr", "must be > 0")
        check(self.value_clip is None or self.value_clip > 0, "value_clip", "must be > 0 (or null: no clip)")
        if self.critic_path is not None:
            p = Path(self.critic_path).expanduser()
            check((p / "config.json").is_file(), "critic_path", f"{self.critic_path!r} is not a model folder "
                                                                "(no config.json)")
