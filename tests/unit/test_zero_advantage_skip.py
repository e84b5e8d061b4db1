"""Samples whose advantages are all 0 are left out of the forward/backward, and the update is the same.

Batch, in order: samples of group g0 (rewards 1, 0, 1: a signal) and g1 (0.1, 0.1: none, both advantages exactly 0)
interleaved as g0 g1 g0 g1 g0, with 2, 3, 4, 5 and 6 trained tokens.
"""

import copy

import pytest
import torch

from relayrl.config.schema import load_run_config
from relayrl.models import load_model
from relayrl.sample import Sample
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine


def make_samples(rewards=(1.0, 0.1, 0.0, 0.1, 1.0)):
    out = []
    for i, (n, r, g) in enumerate(zip([2, 3, 4, 5, 6], rewards, ["g0", "g1", "g0", "g1", "g0"])):
        s = Sample(prompt_ids=[1, 2] if g == "g0" else [3, 4, 5], group_id=g, index=i)
        s.append_generated([10 + i + t for t in range(n)], [-1.0] * n, [0] * n, "stop")
        s.reward = r
        out.append(s)
    return out


def controllers(tiny_path, *extra, ref=False):
    """Two controllers on equal copies of one model: the real one, and one made to train every sample."""
    cfg = load_run_config(None, [f"model.path={tiny_path}", "data.train.source=unused.jsonl", "algo.preset=grpo",
                                 "sampling.max_new_tokens=10", "train.lr=1e-3", *extra])
    model = load_model(tiny_path)
    out = []
    for _ in range(2):
        ref_engine = TrainEngine(copy.deepcopy(model).requires_grad_(False)) if ref else None
        out.append(TrainController(TrainEngine(copy.deepcopy(model), lr=1e-3), cfg.algo, cfg.train, pad_id=0,
                                   max_new_tokens=10, ref_engine=ref_engine))
    out[1]._contributing = lambda batch, part: part  # the reference: every sample forwarded and backpropagated
    return out


def record_gradients(ctl) -> list[dict[str, torch.Tensor]]:
    """The accumulated gradients of every optimizer step the controller makes, as it makes it. Gradients, not
    weights after the step: Adam's first step moves a weight by ~lr * sign(grad), so a gradient that is 0 up to
    rounding (a key bias's, which softmax ignores) would move by +-lr either way."""
    steps, step = [], ctl.engine._clip_and_step

    def recorded():
        steps.append({n: p.grad.clone() for n, p in ctl.engine.model.named_parameters() if p.grad is not None})
        return step()

    ctl.engine._clip_and_step = recorded
    return steps


@pytest.mark.parametrize("extra", [[], ["train.minibatches=2"]])
def test_leaving_zero_advantage_samples_out_gives_the_same_update(tiny_path, extra):
    skip, full = controllers(tiny_path, *extra)
    g_skip, g_full = record_gradients(skip), record_gradients(full)
    m_skip, m_full = skip.fit(make_samples()), full.fit(make_samples())
    # per update: g1's two samples (3 + 5 tokens); with two minibatches ([0, 1, 2], [3, 4]) one in each
    assert m_skip["train/samples_skipped_zero_adv"] == (2 if not extra else 1)
    assert m_skip["train/tokens_skipped_zero_adv"] == (8 if not extra else 4)
    assert m_full["train/samples_skipped_zero_adv"] == 0
    assert m_skip["train/loss"] == pytest.approx(m_full["train/loss"], abs=1e-7)
    assert len(g_skip) == len(g_full) == (2 if extra else 1)
    for a, b in zip(g_skip, g_full):
        assert a.keys() == b.keys()
        assert max(float(g.abs().max()) for g in b.values()) > 1e-3  # a real gradient
        for name in a:
            assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-7), name


@pytest.mark.parametrize("extra, ref", [(["algo.entropy_coef=0.01"], False),
                                        (["algo.kl_coef=0.1", "algo.kl_mode=loss"], True)])
def test_samples_are_kept_when_another_loss_term_reads_them(tiny_path, extra, ref):
    skip, _ = controllers(tiny_path, *extra, ref=ref)
    assert skip.fit(make_samples())["train/samples_skipped_zero_adv"] == 0


def test_an_update_without_any_signal_still_steps_on_every_sample(tiny_path):
    skip, _ = controllers(tiny_path)
    metrics = skip.fit(make_samples((1.0, 0.1, 1.0, 0.1, 1.0)))
    assert metrics["train/samples_skipped_zero_adv"] == 0
    assert metrics["train/grad_norm"] == 0.0
