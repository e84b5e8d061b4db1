"""Every algorithm preset: how it expands (and how key=value beats it), and its advantages and loss on one
small hand-made batch, checked against numbers computed by hand in the comments.

The batch: group g0 = three samples with 2, 3 and 4 trained tokens and rewards 1, 0, 1; group g1 = two
samples with 1 and 2 tokens and rewards 1, 0.5 (12 tokens). sampling.max_new_tokens = 10.
"""

import math
import statistics
import typing

import pytest
import torch
import yaml

from relayrl.config import ConfigError, dump_yaml, to_dict
from relayrl.config.presets import PRESETS
from relayrl.config.schema import AlgoConfig, load_run_config
from relayrl.models import load_model
from relayrl.sample import Sample
from relayrl.trainer.algo import reduce_stats
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine

LENGTHS = [2, 3, 4, 1, 2]
REWARDS = [1.0, 0.0, 1.0, 1.0, 0.5]
GROUPS = ["g0", "g0", "g0", "g1", "g1"]


def close(got, want, tol=1e-5):
    got = [float(x) for x in (torch.cat(got) if isinstance(got, list) else got)]
    assert got == pytest.approx([float(x) for x in want], abs=tol), (got, want)


def config(preset, *extra, tiny="smollm2"):
    return load_run_config(None, [f"model.path={tiny}", "data.train.source=unused.jsonl", f"algo.preset={preset}",
                                  "sampling.max_new_tokens=10", *extra])


def controller(tiny_path, preset, *extra, ref=False):
    cfg = config(preset, *extra, tiny=tiny_path)
    ref_engine = TrainEngine(load_model(tiny_path).requires_grad_(False)) if ref else None
    return TrainController(TrainEngine(load_model(tiny_path)), cfg.algo, cfg.train, pad_id=0,
                           max_new_tokens=cfg.sampling.max_new_tokens, ref_engine=ref_engine)


def samples():
    out = []
    for i, (n, r, g) in enumerate(zip(LENGTHS, REWARDS, GROUPS)):
        s = Sample(prompt_ids=[1, 2] if g == "g0" else [3, 4, 5], group_id=g, index=i)
        s.append_generated([10 + i + t for t in range(n)], [-1.0] * n, [0] * n, "stop")
        s.reward = r
        out.append(s)
    return out


def advantages(ctl, **per_token):
    """Pack the batch, set per-token fields by hand (old_logp, ref_logp, values), compute advantages."""
    batch = ctl.packer.pack(samples())
    batch.per_token.update({k: [torch.tensor(v, dtype=torch.float32) for v in vs] for k, vs in per_token.items()})
    return ctl.compute_advantages(batch)


def loss_fn(ctl, batch):
    """The controller's loss function for one update over the whole batch."""
    everything = list(range(len(batch.samples)))
    ctl._set_weights(batch, everything)
    return ctl._loss_fn(batch, 1.0 / sum(batch.lengths))


def loss(ctl, batch, new_logp):
    """The preset's loss over all micro-batches, with per-sample new logprobs given by hand."""
    fn = loss_fn(ctl, batch)
    total, parts = 0.0, []
    for mb in batch.micro_batches:
        logp = torch.cat([torch.tensor(new_logp[i], dtype=torch.float32) for i in mb.sample_idx]).requires_grad_()
        value, stats = fn(mb, logp, None)
        total, parts = total + float(value.detach()), parts + [stats]
    return total, reduce_stats(parts, mean=False)


def per_token(values):
    return [[v] * n for v, n in zip(values, LENGTHS)]


# ---- expansion --------------------------------------------------------------------------------------------
def test_every_preset_is_a_valid_name_and_expands():
    assert set(typing.get_args(typing.get_type_hints(AlgoConfig)["preset"])) == set(PRESETS) | {"custom"}
    for name in PRESETS:
        cfg = config(name)
        for section, knobs in PRESETS[name].items():
            for key, value in knobs.items():
                want = value(to_dict(cfg)) if callable(value) else value
                assert getattr(getattr(cfg, section), key) == want, (name, section, key)


def test_preset_knobs_in_other_sections_and_user_overrides_win():
    cfg = config("dapo")
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.algo.loss_agg) == (0.2, 0.28, "token_mean")
    assert cfg.scheduler.group_filter == "mixed" and cfg.algo.overlong_buffer == 10 // 5  # a fifth of max_new
    cfg = config("dapo", "algo.clip_high=0.3", "scheduler.group_filter=none", "algo.overlong_buffer=3")
    assert (cfg.algo.clip_low, cfg.algo.clip_high, cfg.scheduler.group_filter) == (0.2, 0.3, "none")
    assert cfg.algo.overlong_buffer == 3
    cfg = config("ppo", "train.minibatches=1", "algo.lam=1.0")
    assert (cfg.algo.adv_estimator, cfg.train.minibatches, cfg.algo.lam) == ("gae", 1, 1.0)
    cfg = config("gspo")
    assert (cfg.algo.ratio_level, cfg.algo.clip_low, cfg.algo.clip_high) == ("sequence", 3e-4, 4e-4)
    assert config("custom").algo.adv_estimator == "return"  # custom: the dataclass defaults


def test_saved_config_shows_the_expanded_knobs_and_reloads_identically(tmp_path):
    cfg = load_run_config("examples/arithmetic_grpo.yaml", ["algo.preset=ppo", "algo.critic_lr=3e-6",
                                                              "run.steps=7"])
    dump_yaml(cfg, str(tmp_path / "config.yaml"))  # what build() writes into the run folder
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["algo"]["adv_estimator"] == "gae" and saved["algo"]["lam"] == 0.95
    assert saved["algo"]["critic_lr"] == 3e-6 and saved["train"]["minibatches"] == 2
    assert saved["train"]["total_steps"] == 7  # derived from run.steps
    assert load_run_config(str(tmp_path / "config.yaml")) == cfg


def test_total_steps_defaults_to_run_steps_unless_set():
    assert config("grpo", "run.steps=9").train.total_steps == 9
    assert config("grpo").train.total_steps == 20  # RunConfig.steps default
    assert config("grpo", "run.steps=9", "train.total_steps=4").train.total_steps == 4


@pytest.mark.parametrize("bad, message", [
    (["algo.preset=ppoo"], "algo.preset: expected one of"),
    (["algo.gamma=1.5"], "algo.gamma: must be in [0, 1]"),
    (["algo.kl_mode=rewards"], "did you mean 'reward'"),
    (["train.lr_schedule=cosin"], "did you mean 'cosine'"),
    (["algo.overlong_buffer=10"], "algo.overlong_buffer: must be < sampling.max_new_tokens (10)"),
    (["algo.critic_path=/nonexistent"], "algo.critic_path: '/nonexistent' is not a model folder"),
    (["algo.value_clip=0"], "algo.value_clip: must be > 0"),
    (["train.min_lr_ratio=2"], "train.min_lr_ratio: must be in [0, 1]"),
    (["run.steps=abc"], "run.steps: expected int"),  # not blamed on the derived train.total_steps
])
def test_bad_algorithm_config_names_the_key(bad, message):
    with pytest.raises(ConfigError) as e:
        config("grpo", *bad)
    assert message in str(e.value)


# ---- advantages and loss per preset -------------------------------------------------------------------------
def test_grpo(tiny_path):
    ctl = controller(tiny_path, "grpo")
    batch = advantages(ctl)
    # g0: mean 2/3, unbiased std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3); g1: mean .75, std sqrt(.125)
    pos0, neg0 = (1 / 3) / math.sqrt(1 / 3), -(2 / 3) / math.sqrt(1 / 3)
    a1 = 0.25 / math.sqrt(0.125)
    close(batch.per_token["advantages"], sum(per_token([pos0, neg0, pos0, a1, -a1]), []))
    # on-policy: ratio 1, loss = -sum_t A_t / 12 = -(2 pos0 + 3 neg0 + 4 pos0 + a1 - 2 a1) / 12 = a1 / 12
    value, stats = loss(ctl, batch, per_token([-1.0] * 5))
    assert value == pytest.approx(a1 / 12, abs=1e-6) and stats["clip_frac"] == 0


def test_dr_grpo(tiny_path):
    ctl = controller(tiny_path, "dr_grpo")
    batch = advantages(ctl)
    adv = [1 / 3, -2 / 3, 1 / 3, 0.25, -0.25]  # r - group mean, no std
    close(batch.per_token["advantages"], sum(per_token(adv), []))
    # weights 1 / (5 sequences * 10 max_new_tokens): loss = -(2/3 - 2 + 4/3 + .25 - .5) / 50 = .25 / 50
    assert loss(ctl, batch, per_token([-1.0] * 5))[0] == pytest.approx(0.005, abs=1e-7)


def test_rloo(tiny_path):
    ctl = controller(tiny_path, "rloo")
    batch = advantages(ctl)
    adv = [1 - 0.5, 0 - 1, 1 - 0.5, 1 - 0.5, 0.5 - 1]  # r_i - mean of the others in the group
    close(batch.per_token["advantages"], sum(per_token(adv), []))
    # -(2 * .5 - 3 + 4 * .5 + .5 - 2 * .5) / 12 = .5 / 12
    assert loss(ctl, batch, per_token([-1.0] * 5))[0] == pytest.approx(0.5 / 12, abs=1e-7)


# per-token k1 = old - ref
KL = [[0.2, 0.0], [0.0, 0.1, -0.1], [0.0, 0.0, 0.0, 0.4], [0.3], [0.0, 0.0]]


def _kl_inputs():
    old = per_token([-1.0] * 5)
    return {"old_logp": old, "ref_logp": [[o - d for o, d in zip(os_, ds)] for os_, ds in zip(old, KL)]}


def test_reinforce_pp_whitens_the_kl_shaped_return(tiny_path):
    ctl = controller(tiny_path, "reinforce_pp", "algo.kl_coef=0.1", ref=True)
    assert ctl.needs_old_logprobs()  # KL in the reward is measured on the trainer's old logprobs
    batch = advantages(ctl, **_kl_inputs())
    # G_t = R - 0.1 * (KL still to come from t): s0 [1 - .02, 1], s1 [0, 0, .01], s2 [1 - .04] * 4, s3 [1 - .03],
    # s4 [.5, .5]; then (G - mean) / std over the 12 tokens
    g = [0.98, 1.0, 0.0, 0.0, 0.01, 0.96, 0.96, 0.96, 0.96, 0.97, 0.5, 0.5]
    mean, std = statistics.fmean(g), statistics.stdev(g)
    close(batch.per_token["advantages"], [(x - mean) / std for x in g])
    # KL is in the reward, not in the loss: on-policy loss = -mean(A) = 0, kl_ref (k1 of new vs ref) only logged
    value, stats = loss(ctl, batch, per_token([-1.0] * 5))
    assert value == pytest.approx(0.0, abs=1e-6)
    assert stats["kl_ref"] == pytest.approx(sum(map(sum, KL)) / 12, abs=1e-6)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens_over_the_batch(tiny_path):
    ctl = controller(tiny_path, "reinforce_pp_baseline", "algo.kl_coef=0.1", ref=True)
    batch = advantages(ctl, **_kl_inputs())
    # group baselines 2/3 and .75, then the KL still to come, then the paper's global normalisation:
    # minus the batch's token mean (-0.45 / 12: sample baselines weigh tokens unequally, and the KL), over the std
    g = [1 / 3 - 0.02, 1 / 3, -2 / 3, -2 / 3, -2 / 3 + 0.01, *[1 / 3 - 0.04] * 4, 0.25 - 0.03, -0.25, -0.25]
    mean, std = statistics.fmean(g), statistics.stdev(g)
    assert mean == pytest.approx(-0.45 / 12)
    close(batch.per_token["advantages"], [(x - mean) / std for x in g])
    value, _ = loss(ctl, batch, per_token([-1.0] * 5))
    assert value == pytest.approx(-sum((x - mean) / std for x in g) / 12, abs=1e-6)  # centred: about 0


def test_gspo_clips_whole_sequences_on_their_geometric_mean_ratio(tiny_path):
    ctl = controller(tiny_path, "gspo")
    batch = advantages(ctl, old_logp=per_token([0.0] * 5))
    pos0, neg0, a1 = (1 / 3) / math.sqrt(1 / 3), -(2 / 3) / math.sqrt(1 / 3), 0.25 / math.sqrt(0.125)
    close(batch.per_token["advantages"], sum(per_token([pos0, neg0, pos0, a1, -a1]), []))  # GRPO's
    # log-ratios per token; s = exp(mean over the sequence); clip range [1 - 3e-4, 1 + 4e-4]
    new = [[2e-4, 4e-4],  # s = e^3e-4, A > 0, inside: l = -s A
           [1e-3, 0.0, -1e-4],  # s = e^3e-4, A < 0, inside: l = -s A
           [1e-3, 1e-3, 1e-3, 1e-3],  # s = e^1e-3 > 1.0004, A > 0: clipped, l = -1.0004 A
           [-1e-3],  # s = e^-1e-3 < .9997 with A > 0: min(s A, .9997 A) = s A, not clipped
           [-5e-4, -5e-4]]  # s = e^-5e-4 < .9997 with A < 0: clipped, l = -.9997 A
    s = math.exp(3e-4)
    per_seq = [-s * pos0, -s * neg0, -1.0004 * pos0, -math.exp(-1e-3) * a1, -0.9997 * -a1]
    value, stats = loss(ctl, batch, new)
    assert value == pytest.approx(sum(per_seq) / 5, abs=1e-7)  # sequence mean of per-sequence losses
    assert stats["clip_frac"] == pytest.approx((4 + 2) / 12)  # whole sequences clip together
    assert stats["ratio_max"] == pytest.approx(math.exp(1e-3), abs=1e-7)


def test_gspo_gradient_is_the_sequence_ratio_times_the_mean_token_gradient(tiny_path):
    ctl = controller(tiny_path, "gspo")
    batch = advantages(ctl, old_logp=per_token([0.0] * 5))
    fn = loss_fn(ctl, batch)
    new = [[2e-4, 4e-4], [1e-3, 0.0, -1e-4], [1e-3] * 4, [-1e-3], [-5e-4, -5e-4]]
    grads = {}
    for mb in batch.micro_batches:
        logp = torch.cat([torch.tensor(new[i]) for i in mb.sample_idx]).requires_grad_()
        fn(mb, logp, None)[0].backward()
        for i, g in zip(mb.sample_idx, logp.grad.split([LENGTHS[i] for i in mb.sample_idx])):
            grads[i] = g.tolist()
    adv = [float(a[0]) for a in batch.per_token["advantages"]]
    # d/dlogp_t of (1/5) * -s A with s = exp(mean_t logp_t): -s A / (5 n); zero for clipped sequences
    s = math.exp(3e-4)
    assert grads[0] == pytest.approx([-s * adv[0] / 10] * 2, abs=1e-7)
    assert grads[1] == pytest.approx([-s * adv[1] / 15] * 3, abs=1e-7)
    assert grads[2] == [0.0] * 4 and grads[4] == [0.0] * 2


def test_dapo_overlong_penalty_and_clip_higher(tiny_path):
    ctl = controller(tiny_path, "dapo", "sampling.max_new_tokens=4", "algo.overlong_buffer=2")
    batch = advantages(ctl, old_logp=per_token([0.0] * 5))
    # penalty ramps over tokens 3..4: -(L - 2) / 2 clamped to [-1, 0] -> lengths 2,3,4,1,2 get 0,-.5,-1,0,0
    shaped = [1.0, -0.5, 0.0, 1.0, 0.5]
    assert ctl._step_stats["train/overlong_frac"] == pytest.approx(2 / 5)
    # g0: mean 1/6, deviations 5/6, -2/3, -1/6, unbiased std sqrt((25 + 16 + 1) / 36 / 2); g1 as in GRPO
    std0 = math.sqrt((25 + 16 + 1) / 36 / 2)
    a1 = 0.25 / math.sqrt(0.125)
    adv = [(r - 1 / 6) / std0 for r in shaped[:3]] + [a1, -a1]
    close(batch.per_token["advantages"], sum(per_token(adv), []))
    # log-ratio .3 on s0 (A > 0): e^.3 = 1.35 clipped at 1 + .28; -.3 on s1 (A < 0): e^-.3 = .74 clipped at .8
    new = [[0.3] * 2, [-0.3] * 3, [0.0] * 4, [0.0], [0.0] * 2]
    value, stats = loss(ctl, batch, new)
    want = (-2 * 1.28 * adv[0] - 3 * 0.8 * adv[1] - 4 * adv[2] - adv[3] - 2 * adv[4]) / 12
    assert value == pytest.approx(want, abs=1e-6)
    assert stats["clip_frac"] == pytest.approx(5 / 12)


def test_dapo_overlong_filter_drops_truncated_samples_from_the_loss(tiny_path):
    ctl = controller(tiny_path, "dapo", "algo.overlong_buffer=0", "algo.overlong_filter=true")
    batch = ctl.packer.pack(samples())
    batch.samples[2].finish_reason = "length"  # s2 (4 tokens) hit max_new_tokens
    batch.per_token["old_logp"] = [torch.zeros(n) for n in LENGTHS]
    ctl.compute_advantages(batch)  # the group statistics still see s2's reward
    adv = [float(a[0]) for a in batch.per_token["advantages"]]
    new = [[0.0] * n for n in LENGTHS]
    value, _ = loss(ctl, batch, new)
    kept = [i for i in range(5) if i != 2]  # token mean over the 8 tokens of the kept samples only
    assert value == pytest.approx(-sum(LENGTHS[i] * adv[i] for i in kept) / 8, abs=1e-6)
    close(batch.per_token["weights"][2], [0.0] * 4)
    assert ctl._step_stats["train/overlong_filtered_frac"] == pytest.approx(1 / 5)


def test_ppo_gae_advantages_and_returns(tiny_path):
    ctl = controller(tiny_path, "ppo")
    assert ctl.critic is not None  # the controller builds its critic from the policy's model path
    values = [[0.2, 0.4], [0.0] * 3, [0.0] * 4, [0.5], [0.0] * 2]
    batch = advantages(ctl, values=values)
    # gamma 1, lambda .95; reward on the last token; delta_t = r_t + V_{t+1} - V_t
    # s0: delta = [0 + .4 - .2, 1 - .4] = [.2, .6] -> A = [.2 + .95 * .6, .6]; s1: reward 0, V 0 -> 0
    # s2: delta = [0, 0, 0, 1] -> A_t = .95^(3 - t); s3: 1 - .5; s4: [.95 * .5, .5]
    raw = [0.2 + 0.95 * 0.6, 0.6, 0, 0, 0, 0.95 ** 3, 0.95 ** 2, 0.95, 1.0, 0.5, 0.475, 0.5]
    close(batch.per_token["returns"], [a + v for a, v in zip(raw, sum(values, []))])
    mean, std = statistics.fmean(raw), statistics.stdev(raw)
    close(batch.per_token["advantages"], [(a - mean) / std for a in raw])
    assert loss(ctl, batch, per_token([-1.0] * 5))[0] == pytest.approx(0.0, abs=1e-6)  # whitened: mean 0


def test_reward_scale_bias_clip(tiny_path):
    ctl = controller(tiny_path, "dr_grpo", "algo.reward_scale=2", "algo.reward_bias=-1", "algo.reward_clip=0.5")
    batch = advantages(ctl)
    # 2r - 1 = [1, -1, 1, 1, 0] clipped to +-.5 = [.5, -.5, .5, .5, 0]; minus group means 1/6 and .25
    adv = [0.5 - 1 / 6, -0.5 - 1 / 6, 0.5 - 1 / 6, 0.25, -0.25]
    close(batch.per_token["advantages"], sum(per_token(adv), []))
