"""The LLM judge (relayrl/judge/llm.py) against a real `relayrl serve` with the tiny model on 127.0.0.1, behind a
counting proxy (tests/model_rewards_for_tests.py). The tiny model answers random text, so these test the plumbing:
the filled template reaches the server, the concurrency limit holds, the cache saves requests, a timeout costs
only its batch, and a reply that does not parse gives no reward from that judge."""

from __future__ import annotations

import asyncio

import model_rewards_for_tests as mrt
import pytest
from serve_for_tests import Server

from relayrl.judge import Judge
from relayrl.judge import llm as llm_module
from relayrl.judge.llm import LLMJudge

PROMPTS = [f"What is {i} + {i}?" for i in range(6)]
COMPLETIONS = [f"It is {2 * i}." for i in range(6)]
ANSWERS = [str(2 * i) for i in range(6)]


@pytest.fixture(scope="module")
def upstream(tiny_path, tmp_path_factory):
    server = Server(tiny_path, tmp_path_factory.mktemp("serve") / "serve.log", "--served-model-name", "tiny")
    try:
        yield server.wait_ready() + "/v1"
    finally:
        server.stop()


@pytest.fixture
def proxy(upstream):
    p = mrt.Proxy(upstream, suffix=" Score: 7")
    yield p
    p.close()


def _judge(proxy: mrt.Proxy, **settings) -> LLMJudge:
    return LLMJudge(name="j", model="tiny", template=mrt.TEMPLATE, base_url=proxy.url, max_tokens=4,
                    **{"cache": False, **settings})


def test_requests_fill_the_template_and_respect_the_concurrency_limit(proxy):
    proxy.hold = 0.3  # requests overlap: without the limit, all 6 would be in flight at once
    scores = asyncio.run(_judge(proxy, concurrency=2)(PROMPTS, COMPLETIONS, answer=ANSWERS))
    assert scores == [7.0] * 6  # the real reply + " Score: 7": the last number
    assert proxy.peak == 2
    sent = sorted(b["messages"][-1]["content"] for b in proxy.bodies)
    assert sent == sorted(mrt.TEMPLATE.format(prompt=p, completion=c, answer=a)
                          for p, c, a in zip(PROMPTS, COMPLETIONS, ANSWERS))
    assert {b["model"] for b in proxy.bodies} == {"tiny"} and {b["max_tokens"] for b in proxy.bodies} == {4}


def test_a_cached_request_is_not_made_again(proxy, tmp_path, monkeypatch):
    monkeypatch.setattr(llm_module, "_replies", {})
    judge = _judge(proxy, cache=True, cache_dir=str(tmp_path))
    first = asyncio.run(judge(PROMPTS[:3] * 2, COMPLETIONS[:3] * 2, answer=ANSWERS[:3] * 2))
    assert len(proxy.bodies) == 3  # a request repeated within the batch is made once
    again = asyncio.run(judge(PROMPTS[:3], COMPLETIONS[:3], answer=ANSWERS[:3]))
    assert len(proxy.bodies) == 3 and again == first[:3]
    monkeypatch.setattr(llm_module, "_replies", {})  # a new worker process: the disk cache answers
    assert asyncio.run(judge(PROMPTS[:3], COMPLETIONS[:3], answer=ANSWERS[:3])) == again
    assert len(proxy.bodies) == 3
    asyncio.run(judge(PROMPTS[3:4], COMPLETIONS[3:4], answer=ANSWERS[3:4]))  # a new sample is asked
    assert len(proxy.bodies) == 4


def test_an_unparsable_reply_is_none_and_counted(proxy, monkeypatch):
    monkeypatch.setattr(llm_module, "parse_failures", {})
    scores = asyncio.run(_judge(proxy, pattern=r"<score>(\d+)</score>")(PROMPTS[:3], COMPLETIONS[:3],
                                                                        answer=ANSWERS[:3]))
    assert scores == [None] * 3 and llm_module.parse_failures == {"j": [3, 3]}


def test_in_the_judge_a_timeout_costs_only_its_batch_and_none_only_its_term(proxy, monkeypatch):
    """Through relayrl.judge.Judge with the module-level objects (workers import them by path): batches of 2 on
    2 workers; the batch whose prompts the proxy holds past the judge's 4 s request timeout is rejected, the
    other is scored; `strict` never parses (no reward/strict), `helpful` and `length` add up."""
    proxy.delay = 10.0
    monkeypatch.setenv("RELAYRL_TEST_JUDGE_URL", proxy.url)
    monkeypatch.setenv("RELAYRL_TEST_JUDGE_TIMEOUT", "4")
    prompts = ["SLOW one", "SLOW two", "fast three", "fast four"]
    rows = [{"prompt": p, "answer": "x"} for p in prompts]
    with Judge(["model_rewards_for_tests:helpful", "model_rewards_for_tests:strict",
                "model_rewards_for_tests:length"], workers=2, batch_size=2, timeout=30) as judge:
        judge.start()
        judge.wait_ready()

        async def main():
            return await asyncio.gather(*(judge.score(f"answer {i}", row, str(i)) for i, row in enumerate(rows)))
        out = asyncio.run(main())
    assert judge.batches.batch_sizes == [2, 2]
    for reward, metrics, error in out[:2]:
        assert reward == 0.0 and metrics["judge_failed"] == 1.0 and "helpful" in error and "Timeout" in error
    for reward, metrics, error in out[2:]:
        assert error is None and metrics["reward/helpful"] == 7.0 and "reward/strict" not in metrics
        assert metrics["reward_none/strict"] == 1.0 and "reward_none/helpful" not in metrics
        assert reward == pytest.approx(7.0 + len("answer 2") / 10)
    asked = [str(body["messages"]) for body in proxy.bodies]
    for p in prompts[2:]:  # the fast batch: helpful and strict each asked once per sample
        assert sum(p in a for a in asked) == 2, asked
    for p in prompts[:2]:  # the slow batch: helpful asked; strict too unless the batch was over before its turn
        assert 1 <= sum(p in a for a in asked) <= 2, asked


def test_the_concurrency_limit_holds_across_the_judge_workers(proxy):
    """Three workers score three batches of 2 at once; `concurrency=2` bounds the requests in flight of all of
    them together (relayrl/judge/slots.py), not 2 per worker (6)."""
    proxy.hold = 0.3
    settings = {"name": "limited", "model": "tiny", "template": mrt.TEMPLATE, "base_url": proxy.url,
                "max_tokens": 4, "concurrency": 2, "cache": False}
    rows = [{"prompt": p, "answer": a} for p, a in zip(PROMPTS, ANSWERS)]
    with Judge("relayrl.judge.models:llm_reward", {"llm_judge": settings}, workers=3, batch_size=2,
               timeout=60) as judge:
        judge.start()
        judge.wait_ready()

        async def main():
            return await asyncio.gather(*(judge.score(c, row, str(i)) for i, (c, row) in
                                          enumerate(zip(COMPLETIONS, rows))))
        out = asyncio.run(main())
    assert judge.batches.batch_sizes == [2, 2, 2]
    assert [reward for reward, _, _ in out] == [7.0] * 6 and len(proxy.bodies) == 6
    assert proxy.peak == 2
