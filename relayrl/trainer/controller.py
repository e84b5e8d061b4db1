"""`TrainController`: fit(batch) = old logprobs, ref logprobs, values, advantages, then train.

Each step of `fit` is also public (seed 002's low-level API), so a custom loop can reorder or
replace any of them. State between the steps lives in a `TrainBatch` (relayrl.trainer.packer).
"""

from __future__ import annotations

import time

import torch

from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.sample import Sample
from relayrl.trainer.algo import (
    LossInputs,
    behav_weights,
    compute_advantages,
    policy_loss,
    reduce_stats,
    token_weights,
)
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import MicroBatch, Packer, TrainBatch


class TrainController:
    def __init__(self, engine: TrainEngine, algo: AlgoConfig, train: TrainConfig, *, pad_id: int,
                 max_new_tokens: int, ref_engine: TrainEngine | None = None):
        self.engine, self.ref_engine = engine, ref_engine
        self.algo, self.train_cfg = algo, train
        self.packer = Packer(train.micro_batch_tokens, pad_id, train.share_prompt, train.row_tokens)
        self.max_new_tokens = max_new_tokens
        self.version = 0
        self._behav_stats: dict[str, float] = {}

    # ---- high-level API ---------------------------------------------------------------------
    def fit(self, samples: list[Sample]) -> dict[str, float]:
        t0 = time.perf_counter()
        samples = [s for s in samples if s.num_trained_tokens > 0]
        if not samples:
            raise ValueError("fit() got a batch with no trainable tokens")
        batch = self.packer.pack(samples)
        batch = self.compute_old_logprobs(batch)
        batch = self.compute_ref_logprobs(batch)
        batch = self.compute_values(batch)
        batch = self.compute_advantages(batch)
        metrics = self.train(batch)
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics["perf/train_tokens_per_s"] = sum(len(s.input_ids) for s in samples) / metrics["time/train_s"]
        return metrics

    # ---- low-level API ----------------------------------------------------------------------
    def needs_old_logprobs(self) -> bool:
        """One plain update per batch is on-policy: old logprobs equal the detached new ones, skip the pass.
        Decoupled PPO always recomputes them: they are the proximal policy."""
        return self.algo.decoupled or self.train_cfg.epochs > 1 or self.train_cfg.minibatches > 1

    def compute_old_logprobs(self, batch: TrainBatch) -> TrainBatch:
        if self.needs_old_logprobs():
            self._forward_into(self.engine, batch, "old_logp")
        return batch

    def compute_ref_logprobs(self, batch: TrainBatch) -> TrainBatch:
        if self.ref_engine is not None:
            self._forward_into(self.ref_engine, batch, "ref_logp")
        return batch

    def compute_values(self, batch: TrainBatch) -> TrainBatch:
        return batch  # critic-free algorithms; PPO with a value model plugs in here

    def compute_advantages(self, batch: TrainBatch) -> TrainBatch:
        """Group-relative advantages of sample rewards, or of turn returns when an agent set `Turn.reward`.

        With per-turn returns, every (sample, turn) of a group is one entry of the group statistics, and
        each turn's tokens get that turn's advantage; a one-turn sample reduces to plain GRPO.
        """
        a = self.algo
        entries = []  # (sample index, turn index or None, reward)
        for i, s in enumerate(batch.samples):
            if s.turns and all(t.reward is not None for t in s.turns):
                entries += [(i, j, float(t.reward)) for j, t in enumerate(s.turns)]
            else:
                entries.append((i, None, float(s.reward or 0.0)))
        adv = compute_advantages(torch.tensor([e[2] for e in entries]),
                                 [batch.samples[e[0]].group_id for e in entries], mean=a.adv_mean, std=a.adv_std,
                                 leave_one_out=a.adv_leave_one_out)
        per_sample: list[dict] = [{} for _ in batch.samples]
        for (i, j, _), v in zip(entries, adv.tolist()):
            per_sample[i][j] = v
        batch.per_token["advantages"] = [_token_values(s, v) for s, v in zip(batch.samples, per_sample)]
        batch.per_token["behav_logp"] = [torch.tensor([lp for lp, m in zip(s.logprobs, s.loss_mask) if m])
                                         for s in batch.samples]
        if a.decoupled:
            w, capped = behav_weights(batch.flat("old_logp"), batch.flat("behav_logp"), batch.lengths,
                                      cap=a.behav_weight_cap, mode=a.behav_weight_mode, level=a.behav_weight_level)
            batch.per_token["behav_weight"] = list(w.split(batch.lengths))
            self._behav_stats = {"train/behav_weight_mean": float(w.mean()), "train/behav_weight_max": float(w.max()),
                                 "train/behav_capped_frac": float(capped.float().mean())}
        return batch

    def train(self, batch: TrainBatch) -> dict[str, float]:
        cfg = self.train_cfg
        n = len(batch.samples)
        order = list(range(n))
        per_update = []
        for _ in range(cfg.epochs):
            for part in _split(order, cfg.minibatches):
                sub = self._sub_batch(batch, part)
                per_update.append(self.engine.train_step(sub.micro_batches, self._loss_fn(sub),
                                                         entropy_grad=self.algo.entropy_coef != 0))
        metrics = {f"train/{k}": v for k, v in reduce_stats(per_update, mean=True).items()}
        metrics.update(self._batch_metrics(batch))
        metrics.update(self._behav_stats)
        self.version += 1
        return metrics

    def sync_weights(self, rollout_ctl) -> None:
        """Relay the new weights to every inference engine behind `rollout_ctl`."""
        rollout_ctl.update_weights(self.engine.named_parameters, self.version)

    # ---- internals ----------------------------------------------------------------------------
    def _forward_into(self, engine: TrainEngine, batch: TrainBatch, key: str) -> None:
        for mb in batch.micro_batches:
            batch.scatter(key, mb, engine.forward_logprobs(mb))

    def _sub_batch(self, batch: TrainBatch, idx: list[int]) -> TrainBatch:
        samples = [batch.samples[i] for i in idx]
        sub = self.packer.pack(samples) if len(idx) < len(batch.samples) else batch
        if sub is not batch:
            sub.per_token = {k: [v[i] for i in idx] for k, v in batch.per_token.items()}
        return sub

    def _loss_fn(self, batch: TrainBatch):
        a = self.algo
        lengths = batch.lengths
        weights = token_weights(lengths, a.loss_agg, self.max_new_tokens)
        batch.per_token["weights"] = list(weights.split(lengths))
        stat_weight = 1.0 / max(1, sum(lengths))

        def loss_fn(mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None):
            inp = LossInputs(old_logp=batch.gather("old_logp", mb), advantages=batch.gather("advantages", mb),
                             weights=batch.gather("weights", mb), stat_weight=stat_weight,
                             ref_logp=batch.gather("ref_logp", mb), behav_weight=batch.gather("behav_weight", mb))
            loss, stats = policy_loss(logp, entropy, inp, clip_low=a.clip_low, clip_high=a.clip_high,
                                      kl_coef=a.kl_coef, kl_estimator=a.kl_estimator,
                                      entropy_coef=a.entropy_coef)
            behav = batch.gather("behav_logp", mb)
            diff = (logp.detach() - behav).abs()
            stats["logprob_diff_engine_abs"] = float(diff.sum()) * stat_weight
            stats["logprob_diff_engine_max"] = float(diff.max())
            return loss, stats

        return loss_fn

    def _batch_metrics(self, batch: TrainBatch) -> dict[str, float]:
        adv = torch.cat(batch.per_token["advantages"])
        forwarded = sum(mb.real_tokens for mb in batch.micro_batches)
        return {"train/adv_mean": float(adv.mean()), "train/adv_abs_mean": float(adv.abs().mean()),
                "train/samples": float(len(batch.samples)), "train/tokens": float(sum(batch.lengths)),
                "train/micro_batches": float(len(batch.micro_batches)),
                "train/pad_frac": 1.0 - forwarded / max(1, sum(mb.padded_tokens for mb in batch.micro_batches)),
                # share of sequence tokens whose forward/backward was saved by sharing prompts
                "train/shared_prompt_saving": 1.0 - forwarded / max(1, sum(len(s.input_ids) for s in batch.samples))}


def _token_values(sample: Sample, values: dict[int | None, float]) -> torch.Tensor:
    """Per trained token: the sample's value (key None) or its turn's value (key = turn index)."""
    if None in values:
        return torch.full((sample.num_trained_tokens,), values[None])
    by_position = torch.zeros(len(sample.response_ids))
    for j, turn in enumerate(sample.turns):
        by_position[turn.start: turn.end] = values[j]
    return by_position[torch.tensor(sample.loss_mask, dtype=torch.bool)]


def _split(items: list[int], parts: int) -> list[list[int]]:
    size = -(-len(items) // parts)
    return [items[i: i + size] for i in range(0, len(items), size)]
