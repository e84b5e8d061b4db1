"""LocalEngine's KV cache byte budget (engine.kv_cache_gb) on a real tiny model: requests beyond what the budget
holds wait their turn and finish exactly as in an unbounded engine, and the cache never outgrows the budget."""

import pytest

from relayrl.config import ConfigError
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model
from relayrl.run.build import make_engines
from relayrl.run.resolve import resolve

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30] * 17, [5, 6, 7, 8, 9], [40, 41, 42], [7], [50, 51, 52, 53]]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, dtype="float32")


def _watch(eng: LocalEngine) -> dict:
    """Record the largest batch and cache size seen at every admission and decode step."""
    seen = {"active": 0, "bytes": 0}
    admit, decode = eng._admit, eng._decode_step

    def note():
        seen["active"] = max(seen["active"], len(eng._active))
        seen["bytes"] = max(seen["bytes"], eng.cache.nbytes())

    def spy_admit(new):
        admit(new)
        note()

    def spy_decode():
        note()
        decode()

    eng._admit, eng._decode_step = spy_admit, spy_decode
    return seen


def _run(model, budget, prompts, params_list):
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8, kv_cache_bytes=budget)
    seen = _watch(eng)
    try:
        futures = [eng.submit(p, sp) for p, sp in zip(prompts, params_list)]
        return [f.result(timeout=120) for f in futures], seen, eng.cache.bytes_per_token
    finally:
        eng.close()


def test_a_budget_of_k_sequences_completes_n_requests_exactly(model):
    params = [GREEDY if i % 2 else SamplingParams(max_new_tokens=20, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    free, free_seen, per_token = _run(model, None, PROMPTS, params)
    assert free_seen["active"] > 2  # unbounded, more than k run together
    k = 2
    budget = k * 64 * per_token  # every request needs one 64-position slot (prompt + 20 rounded up)
    held, seen, _ = _run(model, budget, PROMPTS, params)
    assert [o.output_ids for o in held] == [o.output_ids for o in free]
    for a, b in zip(held, free):
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.finish_reason == b.finish_reason == "length"
    assert seen["active"] == k  # k at a time, the rest queued
    assert 0 < seen["bytes"] <= budget


def test_a_longer_request_waits_for_an_idle_engine_and_the_cache_reshapes(model):
    prompts = [[5, 6, 7]] * 3 + [[9] * 70] + [[5, 6, 7]] * 3  # the long one needs 128 positions
    params = [SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True)] * 7
    free, _, per_token = _run(model, None, prompts, params)
    budget = 3 * 64 * per_token  # three short ones, or the long one alone (128 x 2 > 3 x 64)
    held, seen, _ = _run(model, budget, prompts, params)
    assert [o.output_ids for o in held] == [o.output_ids for o in free]
    assert seen["bytes"] <= budget


def test_a_request_larger_than_the_budget_fails_clearly(model):
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=4, kv_cache_bytes=1000)
    try:
        with pytest.raises(ValueError, match="engine.kv_cache_gb"):
            eng.submit([5, 6, 7], GREEDY)
        assert eng.num_running() == 0
    finally:
        eng.close()
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LocalEngine(model, eos_token_ids=[], kv_cache_bytes=0)


def test_kv_cache_gb_reaches_the_engine_and_is_checked(tiny_run):
    cfg = tiny_run(**{"engine.kv_cache_gb": 0.001})
    (eng,) = make_engines(resolve(cfg, quiet=True), cfg.model.path, [], None, [])
    try:
        assert eng.kv_cache_bytes == 1_000_000
        out = eng.generate([[5, 6, 7]] * 6, SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert len(out) == 6 and eng.cache.nbytes() <= 1_000_000
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="kv_cache_gb"):
        tiny_run(**{"engine.kv_cache_gb": 0})
