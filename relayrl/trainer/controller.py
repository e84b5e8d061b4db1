"""`TrainController`: fit(batch) = old logprobs, ref logprobs, values, advantages, then train.

Each step of `fit` is also public (the low-level API), so a custom loop can reorder or
replace any of them. State between the steps lives in a `TrainBatch` (relayrl.trainer.packer).
The controller owns what the algorithm needs beyond the policy engine: the advantage estimator and the policy loss
that algo.adv_estimator and algo.policy_loss name (relayrl.trainer.estimators, relayrl.trainer.losses), the PPO
critic (built here when the estimator needs one, so callers need not know about it) and the learning-rate schedule.
"""

from __future__ import annotations

import logging
import time

import torch

from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.sample import Sample
from relayrl.trainer import routing
from relayrl.trainer.algo import (
    LossInputs,
    behav_weights,
    explained_variance,
    kl_estimate,
    mismatch_kl,
    overlong_penalty,
    reduce_stats,
    rollout_correction,
    shape_rewards,
    token_weights,
    value_loss,
    whiten,
)
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.estimators import AdvantageInputs, estimator_for
from relayrl.trainer.lora import is_lora
from relayrl.trainer.losses import loss_for
from relayrl.trainer.packer import MicroBatch, Packer, TrainBatch
from relayrl.trainer.schedule import LRSchedule
from relayrl.trainer.value import Critic
from relayrl.weights.snapshot import Weights

logger = logging.getLogger(__name__)


class TrainController:
    def __init__(self, engine: TrainEngine, algo: AlgoConfig, train: TrainConfig, *, pad_id: int,
                 max_new_tokens: int, ref_engine: TrainEngine | None = None, critic: Critic | None = None):
        self.engine, self.ref_engine = engine, ref_engine
        self.algo, self.train_cfg = algo, train
        self.packer = Packer(train.micro_batch_tokens, pad_id, train.share_prompt, train.row_tokens)
        self.max_new_tokens = max_new_tokens
        self.version = 0
        self.estimator, self.policy_loss = estimator_for(algo), loss_for(algo)  # an InputError names a bad key
        self.critic = critic
        if critic is None and self.estimator.needs_critic:  # PPO: the controller owns its value model
            self.critic = self._build_critic()
        self.schedule = LRSchedule(train.lr_schedule, warmup=train.warmup_steps, total=train.total_steps,
                                   min_ratio=train.min_lr_ratio)
        self._step_stats: dict[str, float] = {}  # advantage-side metrics of the batch being fitted
        routing.enable(engine, algo.routing_replay)  # MoE: replay the engine's experts (relayrl.trainer.routing)

    # ---- high-level API ---------------------------------------------------------------------
    def fit(self, samples: list[Sample]) -> dict[str, float]:
        t0 = time.perf_counter()
        samples, dropped = self.drop_small_groups([s for s in samples if s.num_trained_tokens > 0])
        if not samples:  # e.g. a group filter dropped every group: skip the update, keep the run going
            logger.warning("step skipped: the batch has no trainable tokens (every group filtered or empty)")
            return {"train/skipped": 1.0, "time/train_s": time.perf_counter() - t0, **dropped}
        batch = self.packer.pack(samples)
        batch = self.compute_old_logprobs(batch)
        batch = self.compute_ref_logprobs(batch)
        batch = self.compute_values(batch)
        batch = self.compute_advantages(batch)
        routed = routing.routing_metrics(self.engine, batch)  # MoE batches only: before the update changes the router
        metrics = self.train(batch) | dropped | routed
        metrics["time/train_s"] = time.perf_counter() - t0
        metrics["perf/train_tokens_per_s"] = sum(len(s.input_ids) for s in samples) / metrics["time/train_s"]
        return metrics

    def uses_groups(self) -> bool:
        """Whether advantages compare a sample with its group (GRPO, RLOO, ...): then a group needs 2 samples."""
        return self.estimator.group_relative

    def drop_small_groups(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        """Leave out groups with fewer than 2 samples when advantages are group-relative: a lone sample has no
        baseline but itself (RLOO's leave-one-out mean does not exist). Rejected or failed samples can leave
        any group with one survivor; that must cost the group, counted, never the run."""
        if not self.uses_groups():
            return samples, {}
        sizes: dict[str, int] = {}
        for s in samples:
            sizes[s.group_id] = sizes.get(s.group_id, 0) + 1
        small = {g for g, n in sizes.items() if n < 2}
        kept = [s for s in samples if s.group_id not in small]
        return kept, {"train/groups_dropped_small": float(len(small)),
                      "train/samples_dropped_small": float(len(samples) - len(kept))}

    # ---- low-level API ----------------------------------------------------------------------
    def needs_old_logprobs(self) -> bool:
        """One update per batch is on-policy: old logprobs equal the detached new ones, skip the pass. So is
        decoupled PPO's proximal policy then (the policy before this step's one update is the one being
        trained): its logprobs come from the training forward (`_loss_fn`), a forward pass saved, unless
        algo.recompute_prox. KL in the reward needs them first: it is KL(pi_old || pi_ref) measured by the
        trainer, not by an engine with other numerics."""
        several_updates = self.train_cfg.epochs > 1 or self.train_cfg.minibatches > 1
        return (several_updates or self._kl_in_reward()
                or (self.algo.decoupled and self.algo.recompute_prox))

    def compute_old_logprobs(self, batch: TrainBatch) -> TrainBatch:
        if self.needs_old_logprobs():
            self._forward_into(self.engine, batch, "old_logp")
        return batch

    def compute_ref_logprobs(self, batch: TrainBatch) -> TrainBatch:
        if self.ref_engine is not None:
            self._forward_into(self.ref_engine, batch, "ref_logp")
        return batch

    def compute_values(self, batch: TrainBatch) -> TrainBatch:
        """Critic values V(s_t) per trained token, on the policy's micro-batches (PPO only)."""
        if self.critic is not None:
            for mb in batch.micro_batches:
                batch.scatter("values", mb, self.critic.forward_values(mb))
        return batch

    def compute_advantages(self, batch: TrainBatch) -> TrainBatch:
        """Per-token advantages: shaped scalar rewards -> the estimator (algo.adv_estimator: group baseline/scale,
        then per-token return or GAE, with the KL to the reference when it is in the reward) -> batch whitening over
        tokens.

        Scalar rewards are sample rewards, or per-turn rewards when an agent set them on every turn: then every
        (sample, turn) is one entry of the group statistics (grouped by turn index: algo.turn_baseline), and the
        estimator says which per-turn reward it reads (relayrl.trainer.estimators).
        """
        a = self.algo
        self._step_stats = {}
        batch.per_token["behav_logp"] = [torch.tensor([lp for lp, m in zip(s.logprobs, s.loss_mask) if m])
                                         for s in batch.samples]
        out = self.estimator.estimate(self._advantage_inputs(batch))
        adv = out.advantages
        if out.returns is not None and "values" in batch.per_token:  # the critic's targets
            batch.per_token["returns"] = out.returns
            returns = torch.cat(out.returns)
            self._step_stats |= {"train/explained_var": explained_variance(batch.flat("values"), returns),
                                 "train/return_mean": float(returns.mean())}
        flat = whiten(torch.cat(adv), mean=a.adv_mean in ("batch", "group_batch"), std=a.adv_std == "batch")
        batch.per_token["advantages"] = list(flat.split(batch.lengths))
        if "old_logp" in batch.per_token:  # otherwise the loss measures and weighs with its own forward's
            old, behav = batch.flat("old_logp"), batch.flat("behav_logp")
            self._step_stats["train/mismatch_kl"] = float(mismatch_kl(behav, old).mean())
            if self.weighs_behaviour():
                w, stats = self._behav_weights(old, behav, batch.lengths, 1.0 / max(1, len(old)),
                                               1.0 / len(batch.samples))
                batch.per_token["behav_weight"] = list(w.split(batch.lengths))
                self._step_stats |= {f"train/{k}": v for k, v in stats.items()}
        return batch

    def corrects_rollouts(self) -> bool:
        """Whether algo.rollout_correction weighs tokens: "auto" is decided at start, where the engine and trainer
        precisions are known (relayrl.run.precision.resolve_precision); one left in a controller built by hand is
        off."""
        return self.algo.rollout_correction.enabled is True

    def weighs_behaviour(self) -> bool:
        """Whether the loss weighs tokens by pi_prox / pi_behav: the rollout correction, or decoupled PPO's weight."""
        return self.corrects_rollouts() or self.algo.decoupled

    def _behav_weights(self, prox: torch.Tensor, behav: torch.Tensor, lengths: list[int], token_share: float,
                       sample_share: float) -> tuple[torch.Tensor, dict[str, float]]:
        """The behaviour weight of each token and its diagnostics (shares of batch means, see Correction.stats).
        With the rollout correction on it is the weight, decoupled PPO or not: both are pi_prox / pi_behav, and
        applying two bounds to one ratio would weigh the same mismatch twice (docs/algorithms.md)."""
        a = self.algo
        if self.corrects_rollouts():
            c = a.rollout_correction
            corr = rollout_correction(prox, behav, lengths, level=c.level, mode=c.mode, upper=c.upper, lower=c.lower,
                                      veto=c.veto)
            return corr.weight, corr.stats(token_share, sample_share)
        w, capped = behav_weights(prox, behav, lengths, cap=a.behav_weight_cap, mode=a.behav_weight_mode,
                                  level=a.behav_weight_level)
        return w, {"behav_weight_mean": float(w.sum()) * token_share,
                   "behav_weight_max": float(w.max()) if w.numel() else 0.0,
                   "behav_capped_frac": float(capped.sum()) * token_share}

    def train(self, batch: TrainBatch) -> dict[str, float]:
        cfg = self.train_cfg
        lrs = self.schedule.apply(self._optimizers())
        order, lengths = list(range(len(batch.samples))), batch.lengths
        per_update, skipped = [], [0, 0]
        for _ in range(cfg.epochs):
            for part in _split(order, cfg.minibatches):
                self._set_weights(batch, part)
                live = self._contributing(batch, part)
                stat_weight = 1.0 / max(1, sum(lengths[i] for i in live))  # diagnostics: trained-token means
                left_out = set(part) - set(live)
                skipped[1] += sum(lengths[i] for i in left_out)
                skipped[0] += len(left_out)
                sub = self._sub_batch(batch, live)
                stats = self.engine.train_step(sub.micro_batches, self._loss_fn(sub, stat_weight),
                                               entropy_grad=self.algo.entropy_coef != 0)
                if self.critic is not None:
                    stats |= self.critic.train_step(sub.micro_batches, self._value_loss_fn(sub))
                per_update.append(stats)
        metrics = {f"train/{k}": v for k, v in reduce_stats(per_update, mean=True).items()}
        metrics.update(self._batch_metrics(batch))
        metrics.update(self._step_stats)
        updates = max(1, len(per_update))
        metrics["train/samples_skipped_zero_adv"] = skipped[0] / updates
        metrics["train/tokens_skipped_zero_adv"] = skipped[1] / updates
        metrics["train/lr"] = lrs[0]
        if self.critic is not None:
            metrics["train/critic_lr"] = lrs[-1]
        self.schedule.step()
        self.version += 1
        return metrics

    def _contributing(self, batch: TrainBatch, part: list[int]) -> list[int]:
        """The samples of an update that can move the weights: those with a nonzero advantage on some token.

        A sample whose advantages are all 0 has a policy term of 0 * (ratio terms) on every token, so its
        forward and backward add exactly nothing to the gradient, while its tokens still count in the loss
        weights' denominator (`_set_weights` is given the whole update). Late in a GRPO run most groups are
        all right (or all wrong) and their samples are a large share of the step. Kept when something else
        reads them: a KL-to-reference or entropy term in the loss, or a critic trained on the same samples. An
        update with no contributing sample keeps them all, so the optimizer still steps on exact zero
        gradients (Adam's moments decay) as it would have."""
        a = self.algo
        kl_in_loss = a.kl_mode == "loss" and a.kl_coef != 0 and self.ref_engine is not None
        if self.critic is not None or a.entropy_coef != 0 or kl_in_loss:
            return part
        live = [i for i in part if bool(batch.per_token["advantages"][i].any())]
        return live or part

    def weights(self) -> Weights:
        """The policy's weights as of now, for the rollout side to load (it drives the engines, not the trainer):
        every parameter, or a LoRA model's adapters (TrainEngine.named_parameters)."""
        return Weights(self.engine.named_parameters, self.version)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """The policy's weights whole, for an export: None, since this process's model holds them whole (its own
        state_dict serves); a sharded trainer's controller gathers them (relayrl.trainer.leader.LeaderController)."""
        return None

    def state_dict(self) -> dict:
        """Training state beyond the policy weights (saved as an HF folder): policy optimizer, LR schedule,
        version, and the critic with its optimizer. Tensors are references: save (torch.save) before
        training on."""
        state = {"version": self.version, "lr_schedule": self.schedule.state_dict(),
                 "policy_optimizer": self.engine.optimizer.state_dict()}
        if is_lora(self.engine.model):  # the trained weights are the adapters: the HF export is merged
            state["lora"] = {n: p.detach() for n, p in self.engine.model.named_parameters() if p.requires_grad}
        if self.critic is not None:
            state["critic"] = self.critic.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        if ("critic" in state) != (self.critic is not None):
            raise ValueError("checkpoint and config disagree on the critic (algo.adv_estimator gae needs one)")
        if ("lora" in state) != is_lora(self.engine.model):
            raise ValueError("checkpoint and config disagree on LoRA (model.lora_rank): resume with the same setting")
        if "lora" in state:
            params = dict(self.engine.model.named_parameters())
            with torch.no_grad():
                for name, value in state["lora"].items():
                    params[name].copy_(value)
        self.version = int(state["version"])
        self.schedule.load_state_dict(state["lr_schedule"])
        self.engine.optimizer.load_state_dict(state["policy_optimizer"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])

    # ---- internals ----------------------------------------------------------------------------
    def _build_critic(self) -> Critic:
        """PPO's value model: a fresh copy of the policy's model (or algo.critic_path) with a scalar head."""
        path = self.algo.critic_path or getattr(self.engine.model, "name_or_path", "")
        if not path:
            raise ValueError("algo.critic_path: the policy model has no path to build the critic from; set it")
        t = self.train_cfg
        return Critic.from_pretrained(path, dtype=next(self.engine.model.parameters()).dtype, lr=self.algo.critic_lr,
                                      betas=t.betas, weight_decay=t.weight_decay, grad_clip=t.grad_clip,
                                      autocast_bf16=self.engine.autocast_bf16, device=self.engine.device)

    def _optimizers(self) -> list:
        return [self.engine.optimizer] + ([self.critic.optimizer] if self.critic is not None else [])

    def _kl_in_reward(self) -> bool:
        return self.algo.kl_mode == "reward" and self.algo.kl_coef > 0 and self.ref_engine is not None

    def _advantage_inputs(self, batch: TrainBatch) -> AdvantageInputs:
        """The estimator's inputs: each sample's shaped reward (entry turn None), or each turn's when every turn has
        the estimator's `turn_reward` value ("reward": the turn return, "step_reward": its own); critic values; the
        KL for the reward.

        Turn entries are grouped with the same turn of the group's other samples (algo.turn_baseline=turn): the
        k-th attempt's state is "k-1 attempts failed", so only other k-th attempts estimate its value. Pooled with
        turn 1's returns (which carry the later failures' penalties), a failed last retry would score above the
        mean and be reinforced."""
        a, turn_key = self.algo, self.estimator.turn_reward
        entries = []  # (sample index, turn index or None, reward, generated tokens)
        for i, s in enumerate(batch.samples):
            if s.turns and all(getattr(t, turn_key) is not None for t in s.turns):
                entries += [(i, j, float(getattr(t, turn_key)), t.end - t.start) for j, t in enumerate(s.turns)]
            else:
                longest = max((t.end - t.start for t in s.turns), default=s.num_trained_tokens)
                entries.append((i, None, float(s.reward or 0.0), longest))
        penalty = overlong_penalty(torch.tensor([float(e[3]) for e in entries]), self.max_new_tokens,
                                   a.overlong_buffer, a.overlong_penalty)
        rewards = shape_rewards(torch.tensor([e[2] for e in entries]) + penalty, scale=a.reward_scale,
                                bias=a.reward_bias, clip=a.reward_clip)
        by_turn = a.turn_baseline == "turn"
        groups = [f"{batch.samples[i].group_id}\x00{j}" if by_turn and j is not None else batch.samples[i].group_id
                  for i, j, _, _ in entries]
        if a.overlong_buffer:
            self._step_stats |= {"train/overlong_frac": float((penalty < 0).float().mean()),
                                 "train/overlong_penalty_mean": float(penalty.mean())}
        self._step_stats["train/reward_shaped_mean"] = float(rewards.mean())
        return AdvantageInputs(batch.samples, rewards, [(i, j) for i, j, _, _ in entries], groups,
                               values=batch.per_token.get("values"), kl=self._reward_kl(batch))

    def _reward_kl(self, batch: TrainBatch) -> list[torch.Tensor] | None:
        """Per-token KL(pi_old || pi_ref) estimates for the reward (None when KL is not in the reward)."""
        if not self._kl_in_reward():
            return None
        old = batch.per_token.get("old_logp") or batch.per_token["behav_logp"]
        kl = [kl_estimate(o, r, self.algo.kl_estimator) for o, r in zip(old, batch.per_token["ref_logp"])]
        self._step_stats["train/kl_reward_mean"] = float(torch.cat(kl).mean())
        return kl

    def _forward_into(self, engine: TrainEngine, batch: TrainBatch, key: str) -> None:
        for mb, logp in zip(batch.micro_batches, engine.forward_logprobs_all(batch.micro_batches), strict=True):
            batch.scatter(key, mb, logp)

    def _sub_batch(self, batch: TrainBatch, idx: list[int]) -> TrainBatch:
        samples = [batch.samples[i] for i in idx]
        sub = self.packer.pack(samples) if len(idx) < len(batch.samples) else batch
        if sub is not batch:
            sub.per_token = {k: [v[i] for i in idx] for k, v in batch.per_token.items()}
        return sub

    def _set_weights(self, batch: TrainBatch, part: list[int]) -> None:
        """Loss weights of the update over samples `part`, normalised over all of them (including any that
        `_contributing` leaves out, so leaving them out changes nothing)."""
        a = self.algo
        all_lengths = batch.lengths  # a property: one list, not one per sample
        lengths = [all_lengths[i] for i in part]
        keep = [batch.samples[i].finish_reason != "length" for i in part] if a.overlong_filter else None
        weights = token_weights(lengths, a.loss_agg, self.max_new_tokens, keep)
        if keep is not None:
            self._step_stats["train/overlong_filtered_frac"] = 1.0 - sum(keep) / len(keep)
        store = batch.per_token.setdefault("weights", [torch.zeros(0)] * len(batch.samples))
        for i, w in zip(part, weights.split(lengths)):
            store[i] = w

    def _loss_fn(self, batch: TrainBatch, stat_weight: float):
        def loss_fn(mb: MicroBatch, logp: torch.Tensor, entropy: torch.Tensor | None):
            seq_lengths = [batch.samples[i].num_trained_tokens for i in mb.sample_idx]
            behav, behav_w, extra = batch.gather("behav_logp", mb), batch.gather("behav_weight", mb), {}
            old = batch.gather("old_logp", mb)
            if old is None:  # one update per batch: pi_old (pi_prox) is this forward's policy
                extra["mismatch_kl"] = float(mismatch_kl(behav, logp.detach()).sum()) * stat_weight
                if self.weighs_behaviour():
                    behav_w, weight_stats = self._behav_weights(logp.detach(), behav, seq_lengths, stat_weight,
                                                                1.0 / len(batch.samples))
                    extra |= weight_stats
            inp = LossInputs(old_logp=old, advantages=batch.gather("advantages", mb),
                             weights=batch.gather("weights", mb), stat_weight=stat_weight,
                             ref_logp=batch.gather("ref_logp", mb), behav_weight=behav_w, seq_lengths=seq_lengths)
            loss, stats = self.policy_loss(logp, entropy, inp, self.algo)
            stats |= extra
            diff = (logp.detach() - behav).abs()
            stats["logprob_diff_engine_abs"] = float(diff.sum()) * stat_weight
            stats["logprob_diff_engine_max"] = float(diff.max())
            return loss, stats

        return loss_fn

    def _value_loss_fn(self, batch: TrainBatch):
        """Clipped value loss against the GAE returns, a token mean over this (sub-)batch."""
        weight = 1.0 / max(1, sum(batch.lengths))

        def loss_fn(mb: MicroBatch, values: torch.Tensor):
            return value_loss(values, batch.gather("values", mb), batch.gather("returns", mb), weight=weight,
                              clip=self.algo.value_clip)

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


def _split(items: list[int], parts: int) -> list[list[int]]:
    size = -(-len(items) // parts)
    return [items[i: i + size] for i in range(0, len(items), size)]
