"""TrainEngine/TrainController on a real tiny model: logprob parity with the engine, micro-batch
exactness of the loss and gradients, weight relay."""

import copy
import threading
import time

import pytest
import torch
from engines_for_tests import PROMPTS, rollout

from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import load_model
from relayrl.sample import Sample
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer
from relayrl.weights.snapshot import Weights


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path)


@pytest.mark.parametrize("budget", [1, 40, 10_000])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("share", [False, True])
def test_trainer_logprobs_equal_engine_logprobs(model, budget, temperature, share):
    samples = rollout(model, temperature)
    engine = TrainEngine(copy.deepcopy(model), temperature=temperature)
    batch = Packer(budget, pad_id=0, share_prompt=share, row_tokens=40).pack(samples)
    if budget == 1:
        assert len(batch.micro_batches) == len(Packer(1, 0, share, row_tokens=40).rows(samples))
    if share:  # rows of up to 40 tokens still hold several samples of a group
        assert any(mb.position_ids is not None for mb in batch.micro_batches)
    for mb in batch.micro_batches:
        batch.scatter("logp", mb, engine.forward_logprobs(mb))
    for s, lp in zip(samples, batch.per_token["logp"]):
        assert torch.allclose(lp, torch.tensor(s.logprobs), atol=2e-5), s.uid


def test_packer_targets_are_the_response_tokens(model):
    samples = rollout(model)
    batch = Packer(60, pad_id=0).pack(samples)
    for mb in batch.micro_batches:
        got = mb.targets.tolist()
        want = [t for i in mb.sample_idx for t in samples[i].response_ids]
        assert got == want
        # the position before each target holds the previous token of the real sequence
        for r, c, t in zip(mb.rows.tolist(), mb.cols.tolist(), got):
            assert int(mb.input_ids[r, c + 1]) == t
        assert mb.padded_tokens <= max(60, mb.input_ids.shape[1])
    assert sorted(i for mb in batch.micro_batches for i in mb.sample_idx) == list(range(len(samples)))


def test_shared_prompt_rows_see_only_prompt_and_own_response(model):
    samples = rollout(model, group=3, max_new=5)
    mb = Packer(10_000, pad_id=0, share_prompt=True).pack(samples[:3]).micro_batches[0]
    p, lens = len(samples[0].prompt_ids), [len(s.response_ids) for s in samples[:3]]
    assert mb.input_ids.shape == (1, p + sum(lens)) and mb.real_tokens == p + sum(lens)
    mask = mb.attention_mask[0, 0]
    second = p + lens[0]  # first position of response 2
    assert mask[second, :p].all() and not mask[second, p:second].any() and mask[second, second]
    assert mb.position_ids[0, second].item() == p  # each response starts right after the prompt
    assert mb.cols.tolist().count(p - 1) == 3  # the prompt's last token predicts every first token


def _fit(model, samples, budget, preset_kw, sgd=False, share=False):
    ctl = TrainController(TrainEngine(copy.deepcopy(model), lr=1e-2), AlgoConfig(**preset_kw),
                          TrainConfig(micro_batch_tokens=budget, lr=1e-2, share_prompt=share, row_tokens=50),
                          pad_id=0, max_new_tokens=16)
    if sgd:  # weight change = -gradient, so comparing weights compares gradients (Adam's first step is
        # sign-like and amplifies float noise in near-zero gradients)
        ctl.engine.optimizer = torch.optim.SGD(ctl.engine.model.parameters(), lr=1.0)
    metrics = ctl.fit(samples)
    return ctl, metrics


@pytest.mark.parametrize("padded_budget", [20, 100_000])  # many micro-batches, or one: packing alone
@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_update_is_independent_of_micro_batching(model, agg, padded_budget):
    """Padded (one sample per row) and packed (shared-prompt rows) give the same loss and gradients."""
    samples = rollout(model)
    small, m_small = _fit(model, samples, padded_budget, {"loss_agg": agg}, sgd=True)
    big, m_big = _fit(model, samples, 100_000, {"loss_agg": agg}, sgd=True, share=True)
    assert m_big["train/shared_prompt_saving"] > 0.1 and m_small["train/shared_prompt_saving"] == 0
    assert m_big["train/micro_batches"] == 1
    assert (m_small["train/micro_batches"] > 1) == (padded_budget == 20)
    assert m_small["train/loss"] == pytest.approx(m_big["train/loss"], abs=1e-6)
    assert m_small["train/grad_norm"] == pytest.approx(m_big["train/grad_norm"], rel=1e-4)
    for (n, a), (_, b) in zip(small.engine.model.named_parameters(), big.engine.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), n


def test_fit_moves_logprobs_toward_positive_advantages(model):
    samples = rollout(model)
    ctl, metrics = _fit(model, samples, 4096, {})
    assert ctl.version == 1
    assert metrics["train/logprob_diff_engine_max"] < 1e-4  # on-policy: the trainer saw the engine's policy
    batch = Packer(4096, pad_id=0).pack(samples)
    gains = {}
    for mb in batch.micro_batches:
        batch.scatter("new", mb, ctl.engine.forward_logprobs(mb))
    for s, new in zip(samples, batch.per_token["new"]):
        gains.setdefault(s.reward > 0, []).append(float((new - torch.tensor(s.logprobs)).mean()))
    assert sum(gains[True]) / len(gains[True]) > sum(gains[False]) / len(gains[False])


def test_multiple_minibatches_recompute_old_logprobs(model):
    samples = rollout(model)
    ctl = TrainController(TrainEngine(copy.deepcopy(model), lr=1e-3), AlgoConfig(),
                          TrainConfig(minibatches=2, epochs=2), pad_id=0, max_new_tokens=16)
    metrics = ctl.fit(samples)
    assert ctl.needs_old_logprobs()
    assert metrics["train/approx_kl_old"] > 0  # later updates are off-policy w.r.t. the old logprobs
    assert ctl.version == 1


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_decoupled_ppo_with_one_update_takes_prox_logprobs_from_the_training_forward(model, level):
    """One update per batch: pi_prox is the policy being trained, so the separate forward for its logprobs is
    skipped and the loss weighs tokens with its own forward's. The update, and the reported weights, must be
    the recomputing path's. Behaviour logprobs are shifted so weights spread around 1 and some pass the cap."""
    samples = rollout(model)
    for k, s in enumerate(samples):
        s.logprobs = [lp + (-0.9 if k % 2 == 0 or (k + t) % 3 == 0 else 0.4) for t, lp in enumerate(s.logprobs)]
    results = {}
    for recompute in (False, True):
        algo = AlgoConfig(decoupled=True, recompute_prox=recompute, behav_weight_cap=2.0, behav_weight_level=level)
        ctl = TrainController(TrainEngine(copy.deepcopy(model), lr=1e-2), algo, TrainConfig(micro_batch_tokens=40),
                              pad_id=0, max_new_tokens=16)
        ctl.engine.optimizer = torch.optim.SGD(ctl.engine.model.parameters(), lr=1.0)  # weight change = gradient
        forwards = []
        plain = ctl.engine.forward_logprobs_all
        ctl.engine.forward_logprobs_all = lambda mbs, f=forwards, run=plain: f.append(len(mbs)) or run(mbs)
        assert ctl.needs_old_logprobs() == recompute
        results[recompute] = ctl.fit(samples), ctl.engine.model, forwards
    (m_own, own, f_own), (m_re, re, f_re) = results[False], results[True]
    assert f_own == [] and len(f_re) == 1  # the saved pass
    assert m_re["train/behav_capped_frac"] > 0 and m_re["train/behav_weight_max"] <= 2.0
    for key in ("train/behav_weight_mean", "train/behav_weight_max", "train/behav_capped_frac"):
        assert m_own[key] == pytest.approx(m_re[key], abs=1e-5), key
    for (n, a), (_, b) in zip(own.named_parameters(), re.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), n


def _logprobs(engine: TrainEngine, samples) -> list[torch.Tensor]:
    batch = Packer(4096, pad_id=0).pack(samples)
    for mb in batch.micro_batches:
        batch.scatter("logp", mb, engine.forward_logprobs(mb))
    return batch.per_token["logp"]


def test_the_engine_loads_the_weights_the_trainer_exposes(model):
    """TrainController.weights(): the trained tensors and their version, a fresh pass per call (each engine reads
    its own). The rollout side loads them and the engine then samples with the trainer's logprobs."""
    ctl, _ = _fit(model, rollout(model), 4096, {})
    weights = ctl.weights()
    names = [n for n, _ in ctl.engine.model.named_parameters()]
    assert weights.version == ctl.version == 1
    assert [n for n, _ in weights.named_tensors()] == [n for n, _ in weights.named_tensors()] == names
    eng = LocalEngine(copy.deepcopy(model), eos_token_ids=[], max_batch_size=8, seed=1)
    rc = RolloutController([eng])
    try:
        rc.load_weights(weights)
        assert eng.version == rc.version == 1
        for (n, a), (_, b) in zip(ctl.engine.model.named_parameters(), eng.model.named_parameters(), strict=True):
            assert torch.equal(a, b), n
        samples = []
        for g, prompt in enumerate(PROMPTS):
            for out in eng.generate([prompt] * 2, SamplingParams(max_new_tokens=8)):
                samples.append(Sample(prompt_ids=list(prompt), group_id=f"g{g}"))
                samples[-1].append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
    finally:
        eng.close()
    assert all(v == 1 for s in samples for v in s.versions)
    for s, lp in zip(samples, _logprobs(ctl.engine, samples), strict=True):
        assert torch.allclose(lp, torch.tensor(s.logprobs), atol=2e-5), s.uid
    before = torch.cat(_logprobs(TrainEngine(copy.deepcopy(model)), samples))
    assert (before - torch.cat([torch.tensor(s.logprobs) for s in samples])).abs().max() > 0.05  # the load mattered


def test_a_weight_update_counts_the_wait_for_the_engine_to_stop(model):
    """RolloutController.stats: weight_pause_s is the part of weight_update_s spent waiting for the engines to
    stop at a token boundary; an engine held mid-step for 0.3 s makes the update wait that long."""
    eng = LocalEngine(copy.deepcopy(model), eos_token_ids=[], max_batch_size=2)
    rc = RolloutController([eng])
    held = threading.Event()

    def long_step() -> None:
        with eng._step_lock:  # what the engine's worker holds while it runs a step
            held.set()
            time.sleep(0.3)

    worker = threading.Thread(target=long_step)
    try:
        worker.start()
        held.wait()
        rc.load_weights(Weights(lambda: list(model.named_parameters()), 1))
        worker.join()
        assert 0.25 <= rc.stats["weight_pause_s"] <= rc.stats["weight_update_s"]
        assert eng.version == 1
    finally:
        eng.close()


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_reference_kl_is_zero_at_start_and_grows(model, estimator):
    samples = rollout(model)
    ref = TrainEngine(copy.deepcopy(model).requires_grad_(False))
    assert ref.optimizer is None and not ref.model.training
    ctl = TrainController(TrainEngine(copy.deepcopy(model), lr=1e-2), AlgoConfig(kl_coef=0.1, kl_estimator=estimator),
                          TrainConfig(lr=1e-2), pad_id=0, max_new_tokens=16, ref_engine=ref)
    first = ctl.fit(samples)
    second = ctl.fit(samples)
    assert first["train/kl_ref"] == pytest.approx(0.0, abs=1e-6)
    assert abs(second["train/kl_ref"]) > 1e-4


def test_a_batch_with_nothing_to_train_skips_the_step(model):
    """A group filter may drop every group of a step: the step is skipped, not the run."""
    before = [p.detach().clone() for p in model.parameters()]
    ctl, metrics = _fit(model, [], 100, {})
    assert metrics["train/skipped"] == 1.0 and ctl.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, ctl.engine.model.parameters()))


@pytest.mark.parametrize("checkpointing", [True, False])
def test_with_checkpointing_the_heap_is_trimmed_after_each_forward_and_backward(model, monkeypatch, checkpointing):
    """Freed activation blocks go back to the OS between micro-batch phases (the README job's peak: 3.13 ->
    2.65 GB, docs/benchmarks.md): one trim after each forward (no gradient yet) and one after each backward. Only
    with gradient checkpointing: the trims cost page faults (a fit 5% slower), the same trade of time for memory."""
    import relayrl.trainer.engine as engine_module

    calls = []
    plain = engine_module.trim_memory

    def recording_trim():
        calls.append(any(p.grad is not None for p in ctl.engine.model.parameters()))
        plain()

    monkeypatch.setattr(engine_module, "trim_memory", recording_trim)
    engine = TrainEngine(copy.deepcopy(model), lr=1e-2, gradient_checkpointing=checkpointing)
    ctl = TrainController(engine, AlgoConfig(), TrainConfig(micro_batch_tokens=20), pad_id=0, max_new_tokens=16)
    metrics = ctl.fit(rollout(model))
    n = int(metrics["train/micro_batches"])
    assert n > 1 and len(calls) == (2 * n if checkpointing else 0)
    if checkpointing:
        assert calls[:2] == [False, True]  # the first forward has made no gradient yet, its backward has
