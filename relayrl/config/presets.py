"""Algorithm presets: each expands into explicit knobs of the run config (docs/algorithms.md cites the papers).

Kept apart from the dataclasses so the table reads on its own; a value may be a function of the merged config
data, evaluated when the presets are expanded (`relayrl.config.schema.expand_presets`).
"""

from __future__ import annotations

from typing import Any, Literal

DEFAULT_MAX_NEW_TOKENS = 128  # sampling.max_new_tokens when a config does not set it


def int_at(data: dict[str, Any], section: str, key: str, default: int) -> int | None:
    """data[section][key] if it is an int (a bad value is reported at its own key, not at a derived one)."""
    part = data.get(section)
    value = part.get(key, default) if isinstance(part, dict) else default
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _dapo_overlong_buffer(data: dict[str, Any]) -> int:
    """DAPO punishes the last 4096 of 20480 tokens: a fifth of sampling.max_new_tokens."""
    max_new = int_at(data, "sampling", "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    return max_new // 5 if max_new else 0


# Each preset is a partial config (section -> knobs); a value may be a function of the merged config data,
# evaluated at expansion. docs/algorithms.md explains every knob and cites the papers.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # group-normalised advantages, token-level mean loss (as AReaL/DAPO aggregate)
    "grpo": {"algo": {"adv_mean": "group", "adv_std": "group", "adv_leave_one_out": False,
                      "loss_agg": "token_mean"}},
    # Dr.GRPO: no std normalisation, token sums normalised by a constant length
    "dr_grpo": {"algo": {"adv_mean": "group", "adv_std": "none", "adv_leave_one_out": False,
                         "loss_agg": "seq_mean_token_sum_norm"}},
    # RLOO: leave-one-out group baseline, no std normalisation
    "rloo": {"algo": {"adv_mean": "group", "adv_std": "none", "adv_leave_one_out": True,
                      "loss_agg": "token_mean"}},
    # REINFORCE++: k1 KL to the reference in the per-token reward, return whitened over the batch's tokens
    "reinforce_pp": {"algo": {"adv_estimator": "return", "adv_mean": "batch", "adv_std": "batch",
                              "adv_leave_one_out": False, "loss_agg": "token_mean", "kl_mode": "reward",
                              "kl_estimator": "k1", "kl_coef": 0.001}},
    # REINFORCE++-baseline: group-mean baseline, then whitened over the batch's tokens (its paper's global
    # normalisation: the batch mean too, which shifts the advantages once KL is in the reward)
    "reinforce_pp_baseline": {"algo": {"adv_estimator": "return", "adv_mean": "group_batch", "adv_std": "batch",
                                       "adv_leave_one_out": False, "loss_agg": "token_mean", "kl_mode": "reward",
                                       "kl_estimator": "k1", "kl_coef": 0.001}},
    # GSPO: sequence-level ratio (geometric mean over tokens), tiny sequence clip, sequence-mean loss;
    # two minibatches per batch so the second update is off-policy and the clip matters
    "gspo": {"algo": {"adv_mean": "group", "adv_std": "group", "adv_leave_one_out": False,
                      "ratio_level": "sequence", "clip_low": 3e-4, "clip_high": 4e-4,
                      "loss_agg": "seq_mean_token_mean"},
             "train": {"minibatches": 2}},
    # DAPO: clip-higher, token-level loss, soft overlong punishment, dynamic sampling (mixed groups only)
    "dapo": {"algo": {"adv_mean": "group", "adv_std": "group", "adv_leave_one_out": False, "clip_low": 0.2,
                      "clip_high": 0.28, "loss_agg": "token_mean", "overlong_buffer": _dapo_overlong_buffer,
                      "overlong_penalty": 1.0},
             "scheduler": {"group_filter": "mixed"}},
    # PPO: critic + GAE, advantages whitened over the batch's tokens, KL (if kl_coef > 0) in the reward
    "ppo": {"algo": {"adv_estimator": "gae", "gamma": 1.0, "lam": 0.95, "adv_mean": "batch", "adv_std": "batch",
                     "adv_leave_one_out": False, "loss_agg": "token_mean", "clip_low": 0.2, "clip_high": 0.2,
                     "kl_mode": "reward", "kl_estimator": "k1", "value_clip": 0.2},
            "train": {"minibatches": 2}},
}
PresetName = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "dapo", "ppo",
                     "custom"]
