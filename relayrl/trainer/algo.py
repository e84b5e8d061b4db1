"""Advantages, KL estimators, token weightings and the clipped policy loss: the whole algorithm.

Algorithms (GRPO, Dr.GRPO, RLOO, ...) are presets over the knobs of `AlgoConfig` (relayrl.config),
not classes. The loss is written as a per-token quantity times a per-token weight, so that summing
weight * loss over any split of the batch into micro-batches (or processes) gives exactly the same
objective: the weights, not the micro-batch sizes, decide the aggregation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# ---- advantages ---------------------------------------------------------------------------------
def group_index(group_ids: list[str]) -> torch.Tensor:
    """Map group ids to dense integers 0..G-1 in order of first appearance."""
    index: dict[str, int] = {}
    return torch.tensor([index.setdefault(g, len(index)) for g in group_ids])


def _group_stats(x: torch.Tensor, groups: torch.Tensor, unbiased: bool):
    n_groups = int(groups.max()) + 1
    count = torch.zeros(n_groups).index_add_(0, groups, torch.ones_like(x))
    mean = torch.zeros(n_groups).index_add_(0, groups, x) / count
    sq = torch.zeros(n_groups).index_add_(0, groups, (x - mean[groups]) ** 2)
    denom = (count - 1).clamp(min=1) if unbiased else count
    return count[groups], mean[groups], (sq / denom).sqrt()[groups]


def compute_advantages(rewards: torch.Tensor, group_ids: list[str], *, mean: str = "group",
                       std: str = "group", leave_one_out: bool = False, unbiased_std: bool = True,
                       eps: float = 1e-6) -> torch.Tensor:
    """Per-sample advantages from scalar rewards.

    mean: "group" | "batch" | "none" -- the baseline subtracted.
    leave_one_out: with mean="group", the baseline of sample i is the mean of the *other* samples
        of its group (RLOO): A_i = r_i - (sum_g - r_i) / (n - 1) = n / (n - 1) * (r_i - mean_g).
    std: "group" | "batch" | "none" -- the scale divided by (std + eps).
    """
    r = rewards.float()
    groups = group_index(group_ids)
    count, g_mean, g_std = _group_stats(r, groups, unbiased_std)
    if mean == "group":
        if leave_one_out:
            if bool((count < 2).any()):
                raise ValueError("leave-one-out baseline needs at least 2 samples per group")
            adv = (r - (g_mean * count - r) / (count - 1))
        else:
            adv = r - g_mean
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
    return adv


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
def token_weights(lengths: list[int], agg: str, norm_len: int | None = None) -> torch.Tensor:
    """Weight of each trained token such that loss = sum(weight * per_token_loss) over the batch.

    lengths: number of trained tokens per sample, in batch order; returns a flat tensor of
        sum(lengths) weights in the same order.
    agg: "token_mean" -- every token of the batch counts equally (DAPO, AReaL);
         "seq_mean_token_mean" -- mean over each sequence, then over sequences (original GRPO);
         "seq_mean_token_sum_norm" -- sum over each sequence / norm_len, mean over sequences (Dr.GRPO).
    """
    n_seq = len(lengths)
    total = sum(lengths)
    if total == 0:
        return torch.zeros(0)
    if agg == "token_mean":
        return torch.full((total,), 1.0 / total)
    if agg == "seq_mean_token_mean":
        return torch.cat([torch.full((n,), 1.0 / (n_seq * n)) for n in lengths if n > 0])
    if agg == "seq_mean_token_sum_norm":
        if not norm_len:
            raise ValueError("seq_mean_token_sum_norm needs norm_len (e.g. max_new_tokens)")
        return torch.full((total,), 1.0 / (n_seq * norm_len))
    raise ValueError(f"unknown loss aggregation {agg!r}")


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
        log_w = torch.cat([part.mean().expand(len(part)) if len(part) else part for part in log_w.split(lengths)])
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


# ---- policy loss ------------------------------------------------------------------------------
@dataclass
class LossInputs:
    """Per-token tensors (flat, trained tokens only) that the loss needs besides the new logprobs."""

    old_logp: torch.Tensor | None  # None: on-policy single update, use the detached new logprobs
    advantages: torch.Tensor
    weights: torch.Tensor  # loss weights (see token_weights)
    stat_weight: float  # 1 / trained tokens in the whole batch: diagnostics are plain token means
    ref_logp: torch.Tensor | None = None
    behav_weight: torch.Tensor | None = None  # decoupled PPO: pi_prox / pi_behav per token (capped)


def policy_loss(logp: torch.Tensor, entropy: torch.Tensor | None, inp: LossInputs, *, clip_low: float,
                clip_high: float, kl_coef: float = 0.0, kl_estimator: str = "k3",
                entropy_coef: float = 0.0) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate with separate low/high clip, plus optional KL-to-reference and entropy terms.

    Per token: l = -w * min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A) + kl_coef * KL - ent_coef * H,
    r = exp(logp - old_logp), w the decoupled-PPO behaviour weight (1 if not decoupled; then old_logp
    is the proximal policy). Returns (sum(weights * l), diagnostics); diagnostics are this
    micro-batch's share of batch-wide token means, so the caller just adds them up.
    """
    w, sw, adv = inp.weights, inp.stat_weight, inp.advantages
    old = logp.detach() if inp.old_logp is None else inp.old_logp
    log_ratio = logp - old
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


def reduce_stats(parts: list[dict[str, float]], *, mean: bool) -> dict[str, float]:
    """Combine diagnostics of several micro-batches or updates: keys ending in '_max' take the max,
    the others are summed (micro-batch shares of a batch value) or averaged (one value per update)."""
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = max(out.get(k, v), v) if k.endswith("_max") else out.get(k, 0.0) + v
    if mean and parts:
        out = {k: v if k.endswith("_max") else v / len(parts) for k, v in out.items()}
    return out
