"""LocalEngine's top alternatives (SamplingParams.top_logprobs) and prompt scoring (submit_score) on the real tiny
model, against plain HF forwards and against the trainer's own logprobs of the same tokens."""

import concurrent.futures

import pytest
import torch

from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.sample import Sample
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30] * 17, [40, 41, 42]]


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, dtype="float32")


@pytest.fixture
def engine(model, tiny_path):
    eng = LocalEngine(model, eos_token_ids=eos_token_ids(load_tokenizer(tiny_path), tiny_path), max_batch_size=4)
    yield eng
    eng.close()


def forward_log_softmax(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at every position of one plain HF forward [len(ids), vocab]."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float() / temperature, dim=-1)


def check_alternatives(alternatives: list[tuple[int, float]], lsm_row: torch.Tensor, k: int) -> None:
    """Sorted, k of them, and the top k of the reference row (ids may swap only where values tie)."""
    values, ids = lsm_row.topk(k)
    assert len(alternatives) == k
    got = [lp for _, lp in alternatives]
    assert got == sorted(got, reverse=True)
    assert got == pytest.approx(values.tolist(), abs=1e-5)
    for (tok, lp), ref_tok in zip(alternatives, ids.tolist()):
        assert tok == ref_tok or abs(float(lsm_row[ref_tok]) - lp) < 1e-5
        assert float(lsm_row[tok]) == pytest.approx(lp, abs=1e-5)


@pytest.mark.parametrize("temperature", [0.0, 0.4])
def test_top_alternatives_are_the_sampling_distributions_top_k(engine, model, temperature):
    k = 20
    asking = SamplingParams(max_new_tokens=16, temperature=temperature, ignore_eos=True, top_logprobs=k, seed=3)
    plain = SamplingParams(max_new_tokens=16, temperature=temperature, ignore_eos=True, seed=3)
    futures = [engine.submit(p, asking if i % 2 == 0 else plain) for i, p in enumerate(PROMPTS)]  # one batch
    outs = [f.result() for f in futures]
    seen_sampled = 0
    for i, (prompt, out) in enumerate(zip(PROMPTS, outs)):
        if i % 2:  # a request that did not ask gets none (and is not slowed by those that did)
            assert out.top_logprobs is None
            continue
        assert len(out.top_logprobs) == len(out.output_ids)
        lsm = forward_log_softmax(model, prompt + out.output_ids, temperature or 1.0)
        for j, (tok, lp, alts) in enumerate(zip(out.output_ids, out.logprobs, out.top_logprobs)):
            check_alternatives(alts, lsm[len(prompt) - 1 + j], k)
            listed = dict(alts)
            if tok in listed:  # the sampled token's logprob is its entry, to the bit: the same arithmetic
                assert listed[tok] == lp
                seen_sampled += 1
        if temperature == 0:
            assert [alts[0][0] for alts in out.top_logprobs] == out.output_ids  # greedy: the top one
    assert seen_sampled > 0, "no sampled token among the alternatives: nothing compared"
    # asking for alternatives does not change what is sampled
    again = [engine.submit(p, plain) for p in PROMPTS[::2]]
    assert [f.result().output_ids for f in again] == [o.output_ids for o in outs[::2]]


def test_score_matches_a_plain_forward_and_the_trainer(engine, model, tiny_path):
    ids = [5, 6, 7, 8, 9, 10, 30, 31, 7, 7, 2, 100]
    logprobs, top = engine.score(ids, top_k=3)
    lsm = forward_log_softmax(model, ids)
    assert len(logprobs) == len(top) == len(ids) - 1
    ref = lsm[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(logprobs), ref, atol=1e-5)
    for alts, row in zip(top, lsm[:-1]):
        check_alternatives(alts, row, 3)
    # the trainer's logprobs of the same tokens (its packed, chunked-head forward), as RL trains on them
    trainer = TrainEngine(load_model(tiny_path, dtype="float32"))
    sample = Sample(prompt_ids=ids[:1])
    sample.append_generated(ids[1:], [0.0] * (len(ids) - 1), [0] * (len(ids) - 1), "length")
    mb = Packer(10_000, pad_id=0).pack([sample]).micro_batches[0]
    assert torch.allclose(torch.tensor(logprobs), trainer.forward_logprobs(mb).float(), atol=1e-4)
    # a temperature scales the distribution as sampling does; no alternatives asked, none computed
    hot, none = engine.score(ids, temperature=2.0)
    ref_hot = forward_log_softmax(model, ids, 2.0)[:-1].gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    assert torch.allclose(torch.tensor(hot), ref_hot, atol=1e-5) and none == [[]] * (len(ids) - 1)
    assert engine.score([5]) == ([], [])  # one token: nothing before it to score it by
    assert engine.stats["scored_tokens"] == 2 * len(ids) + 1


def test_scores_run_between_steps_of_a_running_batch(engine, model):
    """Scores submitted while sequences decode are run by the worker between steps: the decoding sequences come
    out exactly as alone, the scores exactly as on an idle engine."""
    params = SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True)
    alone = engine.generate(PROMPTS, params)
    idle = [engine.score(p + [3, 4], top_k=2) for p in PROMPTS]
    running = [engine.submit(p, params) for p in PROMPTS]
    scores = [engine.submit_score(p + [3, 4], top_k=2) for p in PROMPTS]
    concurrent.futures.wait(running + scores)
    assert [f.result().output_ids for f in running] == [o.output_ids for o in alone]
    for f, ref in zip(scores, idle):
        assert f.result()[0] == pytest.approx(ref[0], abs=1e-6)
    cancelled = engine.submit_score(PROMPTS[0])
    cancelled.cancel()  # a caller that gave up: skipped, and the engine goes on
    assert engine.score(PROMPTS[1])[0] == pytest.approx(idle[1][0][: len(PROMPTS[1]) - 1], abs=1e-6)


def test_bad_score_and_top_logprobs_arguments_are_refused(engine):
    with pytest.raises(ValueError, match="empty"):
        engine.submit_score([])
    with pytest.raises(ValueError, match="max_seq_len"):
        engine.submit_score([1] * (engine.max_seq_len + 1))
    with pytest.raises(ValueError, match="top_k"):
        engine.submit_score([1, 2], top_k=-1)
    with pytest.raises(ValueError, match="top_logprobs"):
        SamplingParams(top_logprobs=-1)
    engine.close()
    with pytest.raises(RuntimeError, match="closed"):
        engine.submit_score([1, 2])
