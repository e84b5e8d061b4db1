"""Rewards, advantages (group/batch, returns, GAE), KL estimators, token weights, the clipped policy loss
and the value loss: the whole algorithm.

Algorithms (GRPO, Dr.GRPO, RLOO, REINFORCE++, GSPO, DAPO, PPO) are presets over the knobs of
`AlgoConfig` (relayrl.config), not classes; docs/algorithms.md maps each preset to the functions here.
The loss is written as a per-token quantity times a per-token weight, so that summing weight * loss
over any split of the batch into micro-batches (or processes) gives exactly the same objective: the
weights, not the micro-batch sizes, decide the aggregation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


# ---- advantages ---------------------------------------------------------------------------------
def group_index(group_ids: list[str]) -> torch.Tensor:
    """Map group ids to dense integers 0..G-1 in order of first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids])


def _group_stats(x: torch.Tensor, groups: torch.Tensor, unbiased: bool):
    n_groups = int(groups.max()) + 1
    count = torch.zeros(n_groups, dtype=x.dtype).index_add_(0, groups, torch.ones_like(x))
    mean = torch.zeros(n_groups, dtype=x.dtype).index_add_(0, groups, x) / count
    sq = torch.zeros(n_groups, dtype=x.dtype).index_add_(0, groups, (x - mean[groups]) ** 2)
    denom = (count - 1).clamp(min=1) if unbiased else count
    return count[groups], mean[groups], (sq / denom).sqrt()[groups]


def _uniform_groups(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """Per sample: whether every reward of its group is the same value."""
    n_groups = int(groups.max()) + 1
    hi = torch.full((n_groups,), -torch.inf, dtype=x.dtype).scatter_reduce(0, groups, x, "amax")
    lo = torch.full((n_groups,), torch.inf, dtype=x.dtype).scatter_reduce(0, groups, x, "amin")
    return (hi == lo)[groups]


def compute_advantages(rewards: torch.Tensor, group_ids: list[str], *, mean: str = "group",
                       std: str = "group", leave_one_out: bool = False, unbiased_std: bool = True,
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from scalar rewards.

    mean: "group" | "batch" | "none" -- the baseline subtracted.
    leave_one_out: with mean="group", the baseline of sample i is the mean of the *other* samples
        of its group (RLOO): A_i = r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g).
    std: "group" | "batch" | "none" -- the scale divided by (std + eps).

    A group of one sample has no baseline but itself: its advantage is 0 under mean="group" (with or
    without leave-one-out), never an error, since a rejected or failed sample can leave any group with one
    survivor (the TrainController drops such groups before this; this is the last line of defence).

    A group whose rewards are all equal gets advantages of exactly 0 under mean="group". Computed naively in
    float32 they are not: eight rewards of 0.1 average to 0.1 plus a rounding error, and that error divided by
    (std ~ 1e-8) + eps is no longer small, a spurious push on every sample of a group that carries no signal. The
    statistics are computed in float64 and such groups set to 0 explicitly.
    """
    r = rewards.double()
    groups = group_index(group_ids)
    count, g_mean, g_std = _group_stats(r, groups, unbiased_std)
    if mean == "group":
        if leave_one_out:
            others = (g_mean * count - r) / (count - 1).clamp(min=1)
            adv = torch.where(count >= 2, r - others, torch.zeros_like(r))
        else:
            adv = r - g_mean
        adv = adv.masked_fill(_uniform_groups(r, groups), 0.0)
    elif mean == "batch":
        adv = r - r.mean()
    elif mean == "none":
        adv = r.clone()
    else:
        raise ValueError(f"unknown advantage mean mode {mean!r}")
    if std == "group":
        adv = adv / (g_std + eps)
    elif std == "batch":
        adv = adv / (r.std(unbiased=unbiased_std) + eps if len(r) > 1 else 1.0)
    elif std != "none":
        raise ValueError(f"unknown advantage std mode {std!r}")
    return adv.float()


# ---- reward shaping ---------------------------------------------------------------------------
def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft overlong punishment: 0 up to max_len - buffer tokens, then linear down to -factor at max_len.

    A hard penalty for truncation punishes a nearly finished answer as much as a runaway one; the ramp
    tells the policy "shorter" before it hits the limit.
    """
    if buffer <= 0:
        return torch.zeros(len(lengths))
    over = (lengths.float() - (max_len - buffer)) / buffer
    return -factor * over.clamp(0.0, 1.0)


def shape_rewards(r: torch.Tensor, *, scale: float = 1.0, bias: float = 0.0, clip: float | None = None) -> torch.Tensor:
    """r * scale + bias, clipped to [-clip, clip]: keeps reward magnitudes (and so advantages) in range."""
    r = r * scale + bias
    return r.clamp(-clip, clip) if clip is not None else r


# ---- token-level returns, GAE and batch whitening ----------------------------------------------
def discounted_cumsum(xs: list[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """y_t = x_t + factor * y_{t+1} for each sequence (y after the end is 0).

    Computed on one right-padded [B, T] block, so it costs T vector steps, not B * T scalar ones.
    """
    if not xs:
        return []
    padded = torch.nn.utils.rnn.pad_sequence([x.float() for x in xs], batch_first=True)  # zeros past the end
    out = torch.zeros_like(padded)
    running = torch.zeros(len(xs))
    for t in range(padded.shape[1] - 1, -1, -1):
        running = padded[:, t] + factor * running
        out[:, t] = running
    return [o[: len(x)] for o, x in zip(out, xs)]


def gae(rewards: list[torch.Tensor], values: list[torch.Tensor], gamma: float,
        lam: float) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Generalised advantage estimation per sequence: (advantages, returns = advantages + values).

    delta_t = r_t + gamma * V_{t+1} - V_t (V after the last token is 0: the episode ends there),
    A_t = sum_l (gamma * lam)^l * delta_{t+l}. lam trades the critic's bias (lam=0) for the Monte-Carlo
    return's variance (lam=1).
    """
    deltas = [r + gamma * torch.cat([v[1:], v.new_zeros(1)]) - v for r, v in zip(rewards, values)]
    adv = discounted_cumsum(deltas, gamma * lam)
    return adv, [a + v for a, v in zip(adv, values)]


def turn_end_rewards(loss_mask: list[int], turns: list[tuple[int, int]], rewards: list[float]) -> torch.Tensor:
    """Per trained token: each turn's reward on the turn's last generated token, 0 elsewhere (GAE's input).

    turns are (start, end) response slices. A turn with no tokens adds its reward to the last trained token
    before it (the first one if there is none), so no reward is lost.
    """
    out = torch.zeros(sum(loss_mask))
    if out.numel() == 0:
        return out
    trained_before = [0]
    for m in loss_mask:
        trained_before.append(trained_before[-1] + m)
    for (_, end), r in zip(turns, rewards):
        out[max(0, trained_before[end] - 1)] += r
    return out


def whiten(x: torch.Tensor, *, mean: bool, std: bool, eps: float = 1e-6) -> torch.Tensor:
    """Batch-level normalisation over all trained tokens: subtract the token mean, divide by the token std.

    Over tokens rather than samples, because with KL in the reward or GAE advantages differ within a
    sample (REINFORCE++, PPO).
    """
    if mean:
        x = x - x.mean()
    if std and x.numel() > 1:
        x = x / (x.std() + eps)
    return x


def explained_variance(values: torch.Tensor, returns: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns): 1 is a perfect critic, 0 no better than a constant."""
    var = float(returns.var()) if returns.numel() > 1 else 0.0
    return float("nan") if var == 0 else 1.0 - float((returns - values).var()) / var


# ---- KL estimators ----------------------------------------------------------------------------
def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi (Schulman's k1/k2/k3).

    With d = log pi - log pi_ref: k1 = d (unbiased, high variance), k2 = d^2 / 2 (biased, low
    variance), k3 = exp(-d) - 1 + d (unbiased, always >= 0).
    """
    d = logp - ref_logp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1 + d
    raise ValueError(f"unknown KL estimator {kind!r} (expected k1, k2 or k3)")


# ---- token weights ------------------------------------------------------------------------------
def token_weights(lengths: list[int], agg: str, norm_len: int | None = None,
                  keep: list[bool] | None = None) -> torch.Tensor:
    """Weight of each trained token such that loss = sum(weight * per_token_loss) over the batch.

    lengths: number of trained tokens per sample, in batch order; returns a flat tensor of
        sum(lengths) weights in the same order.
    agg: "token_mean" -- every token of the batch counts equally (DAPO, AReaL);
         "seq_mean_token_mean" -- mean over each sequence, then over sequences (original GRPO);
         "seq_mean_token_sum_norm" -- sum over each sequence / norm_len, mean over sequences (Dr.GRPO).
    keep: samples left out get weight 0 and do not count in the means (DAPO's overlong filtering), so the
        loss is the one of the kept samples alone.
    """
    if agg not in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        raise ValueError(f"unknown loss aggregation {agg!r}")
    if agg == "seq_mean_token_sum_norm" and not norm_len:
        raise ValueError("seq_mean_token_sum_norm needs norm_len (e.g. max_new_tokens)")
    keep = [True] * len(lengths) if keep is None else keep
    kept = [n for n, k in zip(lengths, keep) if k]
    n_seq, total = len(kept), sum(kept)
    if total == 0:
        return torch.zeros(sum(lengths))

    def weight(n: int) -> float:
        if agg == "token_mean":
            return 1.0 / total
        return 1.0 / (n_seq * (n if agg == "seq_mean_token_mean" else norm_len))

    return torch.cat([torch.full((n,), weight(n) if k else 0.0) for n, k in zip(lengths, keep)])


# ---- decoupled PPO: behaviour importance weights ----------------------------------------------
def behav_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, lengths: list[int], *,
                  cap: float | None, mode: str = "mask", level: str = "token") -> tuple[torch.Tensor, torch.Tensor]:
    """AReaL's decoupled-PPO weight pi_prox / pi_behav per trained token, and which tokens hit the cap.

    level "sequence" uses each sequence's geometric mean ratio for all its tokens. Above `cap`, mode
    "clamp" truncates the weight to the cap, "mask" sets it to 0 (the token still counts in the
    token-mean denominator, so masking shrinks the gradient instead of renormalising it).
    """
    log_w = prox_logp - behav_logp
    if level == "sequence":
        log_w = seq_mean(log_w, lengths)
    elif level != "token":
        raise ValueError(f"unknown behaviour-weight level {level!r}")
    w = torch.exp(log_w)
    capped = w > cap if cap is not None else torch.zeros_like(w, dtype=torch.bool)
    if mode == "clamp":
        w = w.clamp(max=cap) if cap is not None else w
    elif mode == "mask":
        w = w.masked_fill(capped, 0.0)
    else:
        raise ValueError(f"unknown behaviour-weight mode {mode!r}")
    return w, capped


# ---- rollout correction: the engine/trainer mismatch ------------------------------------------
# a sequence ratio is a sum of logs; past exp(+-20) it is reported (and truncated) at that value, while the bounds
# and the veto compare the exact logs
LOG_RATIO_LIMIT = 20.0


@dataclass
class Correction:
    """The rollout correction of a batch: weights pi_trainer / pi_engine per trained token, and what the veto and
    the bounds did (tokens of a vetoed sample count as vetoed only, not also as truncated or masked)."""

    weight: torch.Tensor  # per token, after the veto and the bounds: multiplies the token's policy loss
    ratio: torch.Tensor  # per token, before them (level sequence: its sequence's ratio on every token)
    truncated: torch.Tensor  # per token: the weight was moved to a bound
    masked: torch.Tensor  # per token: the weight was set to 0 by a bound
    vetoed: torch.Tensor  # per sequence: a token ratio fell below the veto, every token of it weighs 0

    def stats(self, token_share: float, sample_share: float) -> dict[str, float]:
        """Diagnostics as this part's shares of batch means (token_share: 1 / trained tokens of the batch,
        sample_share: 1 / its samples), so parts add up in `reduce_stats` as the loss's diagnostics do."""
        r = self.ratio
        return {"rollout_is_mean": float(r.sum()) * token_share,
                "rollout_is_min": float(r.min()) if r.numel() else 1.0,
                "rollout_is_max": float(r.max()) if r.numel() else 1.0,
                "rollout_is_truncated_frac": float(self.truncated.sum()) * token_share,
                "rollout_is_masked_frac": float(self.masked.sum()) * token_share,
                "rollout_is_vetoed_frac": float(self.vetoed.sum()) * sample_share}


def rollout_correction(trainer_logp: torch.Tensor, behav_logp: torch.Tensor, lengths: list[int], *,
                       level: str = "token", mode: str = "truncate", upper: float = 2.0, lower: float | None = None,
                       veto: float | None = None) -> Correction:
    """Importance weights between the trainer's logprobs (pi_old, or decoupled PPO's pi_prox) and the engine's
    (pi_behav) of the tokens the engine sampled.

    In this order: (1) log r_t = log pi_trainer - log pi_behav per token; level "sequence" gives every token of a
    sequence the sum of its log ratios, a product of ratios (not decoupled PPO's geometric mean: the product is
    the sequence's true likelihood ratio). (2) veto: a sequence with any token ratio r_t < veto weighs 0 on
    every token. (3) bounds: mode "truncate" moves weights outside [lower, upper] to the bound, "mask" sets them
    to 0 (lower None: no lower bound). Weights of 0 still count in the loss's token-mean denominator, so they
    shrink the gradient rather than renormalise it, as decoupled PPO's mask does.
    """
    if level not in ("token", "sequence"):
        raise ValueError(f"unknown rollout-correction level {level!r} (expected token or sequence)")
    if mode not in ("truncate", "mask"):
        raise ValueError(f"unknown rollout-correction mode {mode!r} (expected truncate or mask)")
    log_r = (trainer_logp - behav_logp).double()
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    log_w = log_r
    if level == "sequence":
        log_w = torch.zeros(len(lengths), dtype=log_r.dtype).index_add_(0, seq, log_r)[seq]
    vetoed = torch.zeros(len(lengths), dtype=torch.bool)
    if veto is not None:
        vetoed = torch.zeros(len(lengths)).index_add_(0, seq, (log_r < math.log(veto)).float()) > 0
    vetoed_tok = vetoed[seq]
    out = (log_w > math.log(upper)) | ((log_w < math.log(lower)) if lower is not None else False)
    ratio = torch.exp(log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT))
    if mode == "truncate":
        weight, truncated, masked = ratio.clamp(min=lower, max=upper), out & ~vetoed_tok, torch.zeros_like(out)
    else:
        weight, truncated, masked = ratio.masked_fill(out, 0.0), torch.zeros_like(out), out & ~vetoed_tok
    weight = weight.masked_fill(vetoed_tok, 0.0)
    dtype = trainer_logp.dtype
    return Correction(weight.to(dtype), ratio.to(dtype), truncated, masked, vetoed)


def mismatch_kl(behav_logp: torch.Tensor, trainer_logp: torch.Tensor) -> torch.Tensor:
    """Per token, the k3 estimate of KL(pi_behav || pi_trainer) from the engine's own samples: r - 1 - log r with
    r = pi_trainer / pi_behav, >= 0 and 0 only where the two agree."""
    return kl_estimate(behav_logp, trainer_logp, "k3")


# ---- policy loss ------------------------------------------------------------------------------
@dataclass
class LossInputs:
    """Per-token tensors (flat, trained tokens only) that the loss needs besides the new logprobs."""

    old_logp: torch.Tensor | None  # None: on-policy single update, use the detached new logprobs
    advantages: torch.Tensor
    weights: torch.Tensor  # loss weights (see token_weights)
    stat_weight: float  # 1 / trained tokens in the whole batch: diagnostics are plain token means
    ref_logp: torch.Tensor | None = None
    behav_weight: torch.Tensor | None = None  # pi_prox / pi_behav per token, bounded (rollout correction or decoupled)
    seq_lengths: list[int] | None = None  # trained tokens per sequence, in order (ratio_level="sequence")


def seq_mean(x: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """Each sequence's mean, repeated over its tokens."""
    return torch.cat([part.mean().expand(len(part)) if len(part) else part for part in x.split(lengths)])


def policy_loss(logp: torch.Tensor, entropy: torch.Tensor | None, inp: LossInputs, *, clip_low: float,
                clip_high: float, kl_coef: float = 0.0, kl_estimator: str = "k3", entropy_coef: float = 0.0,
                ratio_level: str = "token") -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate low/high clip, plus optional KL-to-reference and entropy terms.

    Per token: l = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * KL - ent_coef * H,
    r = exp(logp - old_logp), w the behaviour weight: the rollout correction's when it is on, else decoupled PPO's
    pi_prox / pi_behav, else 1. old_logp is the trainer's policy before this step (decoupled PPO's pi_prox), so
    the clip keeps the update near what the trainer computed, and w moves the engine's samples onto it. Returns
    (sum(weights * l), diagnostics); diagnostics are this micro-batch's share of batch-wide token means, so the
    caller just adds them up.

    ratio_level "sequence" is GSPO (in its GSPO-token form): every token's ratio has the value of its
    sequence's geometric-mean ratio s = exp(mean_t(logp - old_logp)) and the gradient s * grad(logp_t),
    so a whole sequence is clipped or not, and with seq_mean_token_mean weights the gradient is GSPO's.
    """
    w, sw, adv = inp.weights, inp.stat_weight, inp.advantages
    old = logp.detach() if inp.old_logp is None else inp.old_logp
    log_ratio = logp - old
    if ratio_level == "sequence":
        if inp.seq_lengths is None:
            raise ValueError("ratio_level='sequence' needs LossInputs.seq_lengths")
        log_ratio = seq_mean(log_ratio.detach(), inp.seq_lengths) + logp - logp.detach()
    elif ratio_level != "token":
        raise ValueError(f"unknown ratio level {ratio_level!r} (expected token or sequence)")
    ratio = torch.exp(log_ratio)
    surr1 = ratio * adv
    surr2 = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(surr1, surr2)
    if inp.behav_weight is not None:
        per_token = per_token * inp.behav_weight
    clipped = (surr2 < surr1).float()
    stats = {
        "pg_loss": float((w * per_token.detach()).sum()),
        "clip_frac": float(clipped.sum()) * sw,
        "approx_kl_old": float(kl_estimate(old, logp.detach(), "k3").sum()) * sw,
        "ratio_mean": float(ratio.detach().sum()) * sw,
        "ratio_max": float(ratio.detach().max()) if ratio.numel() else 0.0,
    }
    if inp.ref_logp is not None:
        kl = kl_estimate(logp, inp.ref_logp, kl_estimator)
        stats["kl_ref"] = float(kl.detach().sum()) * sw
        if kl_coef:
            per_token = per_token + kl_coef * kl
    if entropy is not None:
        stats["entropy"] = float(entropy.detach().sum()) * sw
        if entropy_coef:
            per_token = per_token - entropy_coef * entropy
    loss = (w * per_token).sum()
    stats["loss"] = float(loss.detach())
    return loss, stats


# ---- value loss (PPO critic) --------------------------------------------------------------------
def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, *, weight: float,
               clip: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2) per token.

    The clip keeps one update from moving the critic far from the values the advantages were computed
    with (as the policy clip does for the ratio). weight: 1 / trained tokens of the batch (a token mean
    that stays exact across micro-batches).
    """
    err = (values - returns) ** 2
    if clip is not None:
        clipped_values = old_values + (values - old_values).clamp(-clip, clip)
        err_clipped = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(err, err_clipped)
        clip_frac = float((err_clipped > err).float().sum()) * weight
    else:
        per_token, clip_frac = 0.5 * err, 0.0
    loss = weight * per_token.sum()
    return loss, {"value_loss": float(loss.detach()), "value_clip_frac": clip_frac,
                  "value_mean": float(values.detach().sum()) * weight}


def reduce_stats(parts: list[dict[str, float]], *, mean: bool) -> dict[str, float]:
    """Combine diagnostics of several micro-batches or updates: keys ending in '_max' ('_min') take the max
    (min), the others are summed (micro-batch shares of a batch value) or averaged (one value per update)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            if k.endswith("_max"):
                out[k] = max(out.get(k, v), v)
            elif k.endswith("_min"):
                out[k] = min(out.get(k, v), v)
            else:
                out[k] = out.get(k, 0.0) + v
    if mean and parts:
        out = {k: v if k.endswith(("_max", "_min")) else v / len(parts) for k, v in out.items()}
    return out
