"""LocalEngine on a real tiny model: exactness against plain HF forwards, batching, stops, weights."""

import asyncio
import collections
import concurrent.futures
import sys
import threading
import time

import pytest
import torch
from engines_for_tests import HaltingEngine

from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import eos_token_ids, load_model, load_tokenizer


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, dtype="float32")


@pytest.fixture
def engine(model, tiny_path):
    eng = LocalEngine(model, eos_token_ids=eos_token_ids(load_tokenizer(tiny_path), tiny_path), max_batch_size=4)
    yield eng
    eng.close()


def full_forward_logprobs(model, prompt, output, temperature=1.0):
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(output)[:, None]).squeeze(-1)


PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30] * 17, [5, 6, 7, 8, 9], [40, 41, 42], [7], [50, 51, 52, 53]]


def test_greedy_matches_hf_generate_token_for_token(engine, model):
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    outs = engine.generate(PROMPTS, params)  # 7 requests through 4 slots: requests join and leave
    for prompt, out in zip(PROMPTS, outs):
        ref = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert out.output_ids == ref[0, len(prompt):].tolist()
        assert out.finish_reason == "length"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_full_forward(engine, model, temperature):
    params = SamplingParams(max_new_tokens=20, temperature=temperature, ignore_eos=True)
    for prompt, out in zip(PROMPTS, engine.generate(PROMPTS, params)):
        ref = full_forward_logprobs(model, prompt, out.output_ids, temperature)
        assert torch.allclose(torch.tensor(out.logprobs), ref, atol=1e-5)


def test_group_shares_one_prefill(engine):
    params = SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True)
    engine.generate([[3, 4, 5, 6]] * 4, params)
    assert engine.stats["prefills"] == 1
    # a late member of the same group (its twin still running) reuses the running KV too
    futures = [engine.submit([9, 9, 9], SamplingParams(max_new_tokens=30, ignore_eos=True))]
    futures.append(engine.submit([9, 9, 9], SamplingParams(max_new_tokens=3, ignore_eos=True)))
    concurrent.futures.wait(futures)
    assert engine.stats["prefills"] <= 3


def test_seeded_requests_are_reproducible_whatever_the_batch(engine):
    params = SamplingParams(max_new_tokens=15, temperature=1.0, seed=1234, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], params)[0].output_ids
    crowd = engine.generate([[9, 9]] * 3 + [[5, 6, 7]], SamplingParams(max_new_tokens=15, ignore_eos=True))
    mixed = engine.generate([[5, 6, 7]], params)[0].output_ids
    assert alone == mixed
    assert len(crowd) == 4


def test_stop_tokens_and_finish_reasons(engine, model):
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_at = greedy.output_ids[3]
    first = greedy.output_ids.index(stop_at)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, temperature=0, ignore_eos=True,
                                                      stop_token_ids=(stop_at,)))[0]
    assert out.output_ids == greedy.output_ids[: first + 1]  # the stop token is included
    assert out.finish_reason == "stop"
    one = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True))[0]
    assert len(one.output_ids) == 1 and one.finish_reason in ("length", "stop")


def test_max_seq_len_bounds_generation(model):
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=2, max_seq_len=12)
    try:
        out = eng.generate([[1, 2, 3, 4, 5]], SamplingParams(max_new_tokens=50, temperature=0))[0]
        assert len(out.output_ids) + 5 <= 12 and out.finish_reason == "length"
        with pytest.raises(ValueError, match="max_seq_len"):
            eng.submit(list(range(12)), SamplingParams())
    finally:
        eng.close()


def test_top_k_one_and_tiny_top_p_are_greedy(engine):
    greedy = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True))
    k1 = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, top_k=1, ignore_eos=True))
    p0 = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=10, top_p=1e-6, ignore_eos=True))
    assert greedy[0].output_ids == k1[0].output_ids == p0[0].output_ids


def test_sampling_follows_the_model_distribution(engine, model):
    prompt = [5, 6, 7]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    n = 3000
    outs = engine.generate([prompt] * n, SamplingParams(max_new_tokens=1, ignore_eos=True))
    counts = collections.Counter(o.output_ids[0] for o in outs)
    top = probs.topk(3)
    for p, tok in zip(top.values.tolist(), top.indices.tolist()):
        sd = (p * (1 - p) / n) ** 0.5
        assert abs(counts[tok] / n - p) < 5 * sd + 1e-3


def test_load_weights_changes_outputs_and_stamps_versions(tiny_path):
    model = load_model(tiny_path)  # its own copy: the update below changes weights in place
    engine = LocalEngine(model, eos_token_ids=[], max_batch_size=2)
    params = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)
    before = engine.generate([[5, 6, 7]], params)[0]
    assert set(before.versions) == {0}
    noisy = [(n, p + 0.5 * torch.randn_like(p)) for n, p in model.named_parameters()]
    engine.load_weights(noisy, version=3)
    after = engine.generate([[5, 6, 7]], params)[0]
    assert set(after.versions) == {3} and engine.version == 3
    assert after.output_ids != before.output_ids or after.logprobs != before.logprobs
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights([("nope.weight", torch.zeros(1))], version=4)
    engine.close()


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_a_bf16_engine_follows_fp32_updates_below_half_a_bf16_step(tiny_path, rounding):
    """fp32 master weights moved by a quarter of a bf16 step: rounded to nearest the bf16 engine keeps every
    weight (it would sample from the first policy until updates add up to half a step); rounded stochastically
    about a quarter of them move up one step, so the engine's weights follow the master's on average."""
    engine = LocalEngine(load_model(tiny_path, dtype="bfloat16"), eos_token_ids=[], weight_rounding=rounding)
    start = {n: p.detach().float() for n, p in engine.model.named_parameters()}
    ulp = {n: torch.where(w == 0, 0.0, 2.0 ** (torch.frexp(w).exponent - 8).float()) for n, w in start.items()}
    master = [(n, w + 0.25 * ulp[n]) for n, w in start.items()]  # a fresh tensor each: not the engine's own
    engine.load_weights(master, version=1)
    moved = total = 0
    drift, target = 0.0, 0.0
    for n, p in engine.model.named_parameters():
        d = p.detach().float() - start[n]
        assert ((d == 0) | (d.abs() <= 2 * ulp[n])).all()  # at most one bf16 step, never further
        moved += int((d != 0).sum())
        total += d.numel()
        drift, target = drift + float(d.abs().sum()), target + float(0.25 * ulp[n].sum())
    engine.close()
    if rounding == "nearest":
        assert moved == 0
    else:
        assert 0.2 < moved / total < 0.3 and drift == pytest.approx(target, rel=0.1)


@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
@pytest.mark.parametrize("how", ["from_pretrained", "make_engines"])
def test_a_bf16_engine_on_an_fp32_checkpoint_keeps_updates_below_half_a_bf16_step(tiny_path, tmp_path, tiny_run,
                                                                                   rounding, how):
    """A trained model saved in fp32, a quarter of a bf16 step away from bf16 weights: loaded rounded to nearest the
    engine would be the untrained model; as weight sync does, about a quarter of the weights move up one step (both
    the serve path, from_pretrained, and relayrl train/eval's, make_engines)."""
    from relayrl.run.build import make_engines
    from relayrl.run.resolve import resolve

    start_model = load_model(tiny_path, dtype="bfloat16")
    start = {n: p.detach().float() for n, p in start_model.named_parameters()}
    ulp = {n: torch.where(w == 0, 0.0, 2.0 ** (torch.frexp(w).exponent - 8).float()) for n, w in start.items()}
    trained = load_model(tiny_path, dtype="float32")
    with torch.no_grad():
        for n, p in trained.named_parameters():
            p.copy_(start[n] + 0.25 * ulp[n])
    folder = tmp_path / "trained"
    trained.save_pretrained(folder)
    load_tokenizer(tiny_path).save_pretrained(folder)
    if how == "from_pretrained":
        engine = LocalEngine.from_pretrained(str(folder), dtype="bfloat16", weight_rounding=rounding)
    else:
        cfg = tiny_run(**{"model.path": str(folder), "engine.dtype": "bfloat16", "engine.weight_rounding": rounding})
        engine, = make_engines(resolve(cfg, quiet=True), str(folder), [], tmp_path / "run", [])
    moved = sum(int((p.detach().float() != start[n]).sum()) for n, p in engine.model.named_parameters())
    total = sum(p.numel() for p in engine.model.parameters())
    engine.close()
    if rounding == "nearest":
        assert moved == 0
    else:
        assert 0.2 < moved / total < 0.3


def test_bf16_weight_rounding_is_checked(tiny_path):
    with pytest.raises(ValueError, match="weight_rounding"):
        LocalEngine(load_model(tiny_path), eos_token_ids=[], weight_rounding="up")


def test_pause_holds_generation_until_resume(engine):
    engine.pause()
    fut = engine.submit([5, 6, 7], SamplingParams(max_new_tokens=3, ignore_eos=True))
    with pytest.raises(concurrent.futures.TimeoutError):
        fut.result(timeout=0.3)
    engine.resume()
    assert len(fut.result(timeout=10).output_ids) == 3


def test_a_pause_waits_for_the_step_in_progress_only_while_other_threads_keep_the_gil_busy(model):
    """pause() (a weight update's first move) takes the step lock between two steps. The worker never blocks
    between its steps, so it used to take the lock straight back: with one busy Python thread in the process a
    pause sat through up to 17 steps (3 and 7 in other runs), and a GPU producer's updates waited up to 1.8 s.
    The worker now lets callers already waiting go before its next step: at most the step in progress ends first."""
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8)
    stop, interval = threading.Event(), sys.getswitchinterval()

    def busy() -> None:  # a Python thread holding the GIL between switches (an agent loop, a tokenizer)
        while not stop.is_set():
            sum(i * i for i in range(1000))

    spinner = threading.Thread(target=busy, daemon=True)
    futures = [eng.submit([5, 6, 7, i], SamplingParams(max_new_tokens=100_000, ignore_eos=True)) for i in range(8)]
    sys.setswitchinterval(0.0002)  # steps of milliseconds, as on a GPU; the GIL changes hands often
    spinner.start()
    try:
        while eng.stats["steps"] < 5:
            time.sleep(0.01)
        during = []
        for _ in range(30):  # counted from the pause's arrival at the lock: a descheduled caller (a loaded
            eng.pause()  # machine) must not count the steps it missed before it asked
            during.append(eng.waited_steps)
            eng.resume()
            time.sleep(0.01)
    finally:
        stop.set()
        sys.setswitchinterval(interval)
        eng.abort()
        eng.close()
    assert max(during) <= 1, during
    assert all(f.result(timeout=10).finish_reason == "abort" for f in futures)


def test_a_flood_of_callers_between_steps_does_not_stop_generation(model):
    """Callers waiting for the step lock go before the worker's next step, but only those already waiting: four
    threads calling flush_cache() in a loop (a client aborting in a loop) leave the engine stepping. Giving every
    caller priority while any waited stopped it outright (0 steps in a second, against ~300 alone)."""
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8)
    stop, calls = threading.Event(), []

    def flood() -> None:
        while not stop.is_set():
            eng.flush_cache()
            calls.append(1)

    futures = [eng.submit([5, 6, 7, i], SamplingParams(max_new_tokens=100_000, ignore_eos=True)) for i in range(8)]
    threads = [threading.Thread(target=flood) for _ in range(4)]
    try:
        while eng.stats["steps"] < 5:
            time.sleep(0.01)
        for t in threads:
            t.start()
        before = eng.stats["steps"]
        time.sleep(1.0)
        stepped = eng.stats["steps"] - before
    finally:
        stop.set()
        for t in threads:
            t.join()
        eng.abort()
        eng.close()
    assert stepped >= 20 and len(calls) >= 20, (stepped, len(calls))
    assert all(f.result(timeout=10).finish_reason == "abort" for f in futures)


def test_bad_requests_fail_clearly(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.submit([], SamplingParams())
    with pytest.raises(ValueError, match="max_new_tokens"):
        SamplingParams(max_new_tokens=0)


def test_next_turn_reuses_the_parked_kv_and_stays_exact(model, tiny_path):
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=4)
    try:
        p = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True)
        prompt = [5, 6, 7, 8]
        out1 = eng.submit(prompt, p, rid="traj-1").result()
        turn2 = prompt + out1.output_ids + [9, 10, 11]  # e.g. a feedback turn appended as token ids
        out2 = eng.submit(turn2, p, rid="traj-1").result()
        assert eng.stats["reused_tokens"] == len(prompt) + len(out1.output_ids) - 1
        assert torch.allclose(torch.tensor(out2.logprobs), full_forward_logprobs(model, turn2, out2.output_ids),
                              atol=1e-5)
        other = eng.submit([1, 2] + out1.output_ids, p, rid="traj-1").result()  # not an extension: no reuse
        assert eng.stats["reused_tokens"] == len(prompt) + len(out1.output_ids) - 1 and len(other.output_ids) == 8
    finally:
        eng.close()


@pytest.mark.parametrize("kv_on_update", ["recompute", "keep"])
def test_weights_change_mid_sequence_partial_rollout(tiny_path, kv_on_update):
    model = load_model(tiny_path)
    eng = HaltingEngine(model, eos_token_ids=[], max_batch_size=2, kv_on_update=kv_on_update, halt_at=10)
    try:
        fut = eng.submit([5, 6, 7], SamplingParams(max_new_tokens=40, ignore_eos=True, seed=1))
        assert eng.halted.wait(30)  # 10 tokens generated with version 0
        new = [(n, p + 0.3 * torch.randn_like(p)) for n, p in model.named_parameters()]
        eng.load_weights(new, version=1)
        eng.resume()
        out = fut.result(timeout=30)
    finally:
        eng.close()
    assert out.versions[0] == 0 and out.versions[-1] == 1 and len(out.output_ids) == 40
    switch = out.versions.index(1)
    assert set(out.versions[:switch]) == {0} and set(out.versions[switch:]) == {1}
    # tokens after the switch were sampled by the new weights; with "recompute" the KV of the prefix was
    # rebuilt by them too, so their logprobs are exactly the new model's on the full sequence
    ref = full_forward_logprobs(model, [5, 6, 7], out.output_ids)
    after = torch.tensor(out.logprobs[switch:]) - ref[switch:]
    if kv_on_update == "recompute":
        assert after.abs().max() < 1e-4
    else:
        assert after.abs().max() > 1e-4  # stale KV of the old weights: close, not equal


def test_abort_returns_partial_outputs(tiny_path):
    engine = HaltingEngine(load_model(tiny_path), eos_token_ids=[], max_batch_size=4, halt_at=6)
    futs = [engine.submit([5, 6, 7], SamplingParams(max_new_tokens=500, ignore_eos=True), rid=f"r{i}")
            for i in range(3)]
    assert engine.halted.wait(30)  # paused between two steps: aborts are deterministic
    assert engine.abort("r1") == 1
    out = futs[1].result(timeout=10)
    assert out.finish_reason == "abort" and 0 < len(out.output_ids) < 500
    assert engine.abort() == 2
    assert all(f.result(timeout=10).finish_reason == "abort" for f in futs)
    engine.close()


def test_cancelled_requests_free_their_slot(engine):
    async def go():
        task = asyncio.create_task(engine.agenerate([5, 6], SamplingParams(max_new_tokens=10_000, ignore_eos=True)))
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.2)
        return await engine.agenerate([5, 6], SamplingParams(max_new_tokens=3, ignore_eos=True))

    assert len(asyncio.run(go()).output_ids) == 3
    assert engine.num_running() == 0


def test_tokens_in_flight_budget_limits_the_batch(model):
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8, max_tokens_in_flight=40)
    try:
        peak = []
        orig = eng._decode_step

        def spy():
            peak.append(len(eng._active))
            orig()

        eng._decode_step = spy
        eng.generate([[5, 6, 7, 8]] * 6, SamplingParams(max_new_tokens=16, ignore_eos=True))
        assert max(peak) == 2  # each request may use 4 + 16 tokens: two fit in 40
    finally:
        eng.close()


def test_load_weights_from_disk(tiny_path, tmp_path):
    from relayrl.models import save_pretrained_atomic

    model = load_model(tiny_path)
    changed = load_model(tiny_path)
    with torch.no_grad():
        for p in changed.parameters():
            p.add_(0.1)
    save_pretrained_atomic(changed, load_tokenizer(tiny_path), tmp_path / "v1")
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=2)
    eng.load_weights_from_disk(str(tmp_path / "v1"), version=1)
    for (n, a), (_, b) in zip(model.named_parameters(), changed.named_parameters()):
        assert torch.equal(a, b), n
    assert eng.version == 1
    with pytest.raises(FileNotFoundError):
        eng.load_weights_from_disk(str(tmp_path), version=2)
    eng.close()


def test_inverse_cdf_sampling_matches_probabilities_and_never_picks_zero_probability_tokens():
    from relayrl.engine.sampling import _inverse_cdf

    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0))
    tokens = _inverse_cdf(probs.expand(n, -1), u)
    counts = torch.bincount(tokens, minlength=6).float() / n
    assert counts[[0, 2, 5]].sum() == 0  # including u = 0 and the largest u
    for tok in (1, 3, 4):
        sd = (probs[tok] * (1 - probs[tok]) / n) ** 0.5
        assert abs(counts[tok] - probs[tok]) < 5 * sd
    edge = _inverse_cdf(probs.expand(2, -1), torch.tensor([0.0, 1.0 - 2 ** -24]))
    assert edge.tolist() == [1, 4]


def test_seeded_rows_sample_the_same_tokens_whatever_shares_their_batch(engine):
    seeded = SamplingParams(max_new_tokens=8, seed=123, ignore_eos=True)
    alone = engine.generate([[5, 6, 7]], seeded)[0]
    futures = [engine.submit([9, 9], SamplingParams(max_new_tokens=8, ignore_eos=True)),
               engine.submit([5, 6, 7], seeded), engine.submit([4], SamplingParams(max_new_tokens=3, seed=7))]
    crowd = futures[1].result(timeout=60)
    assert crowd.output_ids == alone.output_ids and crowd.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
