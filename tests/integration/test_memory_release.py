"""Colocated memory: an engine gives back its KV cache and weights while the trainer trains, and runs on the
trainer's own weights when both use the same dtype (one copy, no copying at sync)."""

import pytest
import torch
from conftest import tiny_run_args, write_sums

from relayrl.config.schema import load_run_config
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model
from relayrl.run.build import build, shares_weights
from relayrl.run.loop import train_steps
from relayrl.run.resolve import resolve

GREEDY = SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)


def _engine(tiny_path, **kw):
    return LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], max_batch_size=4, **kw)


def test_released_engine_frees_kv_and_weights_and_comes_back_exact(tiny_path):
    eng = _engine(tiny_path)
    try:
        before = eng.generate([[5, 6, 7], [9, 10]], GREEDY)
        weights = {n: p.detach().clone() for n, p in eng.model.named_parameters()}
        assert eng.cache.nbytes() > 0
        freed = eng.release_memory()
        assert freed >= sum(t.numel() * 4 for t in weights.values())
        assert eng.cache.nbytes() == 0 and all(p.numel() == 0 for p in eng.model.parameters())
        eng.load_weights(weights.items(), version=1)
        after = eng.generate([[5, 6, 7], [9, 10]], GREEDY)
        assert [o.output_ids for o in after] == [o.output_ids for o in before]
        # equal to float rounding: where the LM head runs on oneDNN (relayrl.engine.linear) its sums may group
        # differently for a weight reallocated at another address; a wrong or missing weight differs by far more
        for a, b in zip(after, before):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=0, atol=1e-5)
    finally:
        eng.close()


def test_update_after_release_must_bring_every_weight(tiny_path):
    eng = _engine(tiny_path)
    try:
        weights = [(n, p.detach().clone()) for n, p in eng.model.named_parameters()]
        eng.release_memory()
        with pytest.raises(ValueError, match="released"):
            eng.load_weights(weights[1:], version=1)
    finally:
        eng.close()


def test_a_busy_engine_keeps_its_memory_and_finishes_its_requests(tiny_path):
    eng = _engine(tiny_path)
    try:
        eng.pause()  # a live request that has not finished
        future = eng.submit([5, 6, 7], GREEDY)
        assert eng.release_memory() == 0 and all(p.numel() > 0 for p in eng.model.parameters())
        eng.resume()
        assert len(future.result(timeout=60).output_ids) == GREEDY.max_new_tokens
        cancelled = eng.submit([8, 9], GREEDY)  # a request nobody waits for any more does not hold it back
        cancelled.cancel()
        assert eng.release_memory() > 0
    finally:
        eng.close()


def test_an_engine_on_borrowed_weights_never_releases_them(tiny_path):
    eng = _engine(tiny_path, owns_weights=False)
    try:
        eng.generate([[5, 6]], GREEDY)
        eng.release_memory()
        assert eng.cache.nbytes() == 0 and all(p.numel() > 0 for p in eng.model.parameters())
    finally:
        eng.close()


def _cfg(tiny_path, tmp_path, **extra):
    data = write_sums(tmp_path / "d.jsonl", 8)
    return load_run_config(None, tiny_run_args(tiny_path, data, tmp_path, **{"sampling.max_new_tokens": 6,
                                                                             "run.tensorboard": True, **extra}))


def test_same_dtype_sync_run_shares_one_model_between_engine_and_trainer(tiny_path, tmp_path):
    cfg = _cfg(tiny_path, tmp_path)
    resolved = lambda **extra: resolve(_cfg(tiny_path, tmp_path, **extra), quiet=True)  # noqa: E731
    assert shares_weights(resolved())  # as build asks it: dtypes resolved ("auto" -> fp32 weights here)
    assert not shares_weights(resolved(**{"scheduler.mode": "async"}))
    assert not shares_weights(resolved(**{"engine.dtype": "bfloat16"}))
    c = build(cfg)
    try:
        engine = c.rollout_ctl.engines[0]
        assert engine.model is c.train_ctl.engine.model and not engine.owns_weights
        train_steps(c)
        assert c.train_ctl.version == 2 and engine.version == 2
        assert not engine.model.training  # the trainer hands the model back in eval mode
    finally:
        c.close()


def test_colocated_step_releases_the_engine_while_training(tiny_path, tmp_path):
    c = build(_cfg(tiny_path, tmp_path, **{"engine.share_trainer_weights": False}))
    try:
        engine = c.rollout_ctl.engines[0]
        seen = {}
        fit = c.train_ctl.fit

        def spy(batch):  # what the engine holds while the trainer trains
            seen["kv"] = engine.cache.nbytes()
            seen["weights"] = sum(p.numel() for p in engine.model.parameters())
            return fit(batch)

        c.train_ctl.fit = spy
        train_steps(c)
        assert seen == {"kv": 0, "weights": 0}
        trained = dict(c.train_ctl.engine.model.named_parameters())
        for name, p in engine.model.named_parameters():  # restored by the sync, equal to the trained weights
            assert torch.equal(p, trained[name].detach()), name
    finally:
        c.close()


def _eval_run(tiny_path, tmp_path, **extra):
    """A colocated run's eval (4 prompts x 4 samples): its metrics and the engine's KV bytes after it."""
    tmp_path.mkdir()
    cfg = _cfg(tiny_path, tmp_path, **{"data.eval.source": write_sums(tmp_path / "e.jsonl", 4), "eval.size": 4,
                                       "eval.n": 4, "eval.temperature": 1.0, **extra})
    c = build(cfg)
    try:
        metrics = c.rollouts.evaluate()
        return metrics, c.rollout_ctl.engines[0].cache.nbytes()
    finally:
        c.close()


def test_eval_gives_back_its_kv_and_a_kv_budget_leaves_its_results_unchanged(tiny_path, tmp_path):
    free, kv_after = _eval_run(tiny_path, tmp_path / "free")
    assert kv_after == 0  # idle until the next rollout: not held through a checkpoint or the final save
    # 2 sequences of 64 positions at a time (tiny model: 2 layers x 2 x 2 kv heads x 16 x 4 bytes per position)
    held, _ = _eval_run(tiny_path, tmp_path / "held", **{"engine.kv_cache_gb": 2 * 64 * 512 / 1e9})
    assert held == free and free["eval/samples"] == 16
