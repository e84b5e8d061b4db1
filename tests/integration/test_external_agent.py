"""External agents: real subprocess programs using the openai SDK against relayrl's per-episode proxy, on the tiny
model. Tokens are checked against the model itself; hangs, crashes, floods and cross-episode calls cost one episode."""

import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from bounds import bound
from conftest import TESTS

from relayrl.agents import ExternalAgent
from relayrl.agents.openai_agent import Session
from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.build import check_user_code
from relayrl.run.loop import train
from relayrl.sample import Sample, Status
from relayrl.scheduler.common import run_agent

SCRIPTS = Path(TESTS) / "external_agents_for_tests"
ROW = {"question": "What is 2+2?", "answer": "4"}


@pytest.fixture(scope="module")
def setup(tiny_path):
    tok, model = load_tokenizer(tiny_path), load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=8)
    yield tok, RolloutController([engine]), model
    engine.close()


def agent_for(setup, script: str, *args: str, **kw) -> ExternalAgent:
    tok, ctl, _ = setup
    return ExternalAgent(ctl, tok, SamplingParams(max_new_tokens=6), command=[sys.executable, str(SCRIPTS / script),
                                                                             *args], **kw)


def run(agent: ExternalAgent, timeout: float | None = 120) -> list[Sample]:
    """One episode as the schedulers run it (failures recorded on the sample, not raised)."""
    try:
        return asyncio.run(run_agent(agent, Sample(prompt_ids=[1], data=dict(ROW), group_id="g"), timeout))
    finally:
        agent.close()


def model_logprobs(model, ids: list[int]) -> list[float]:
    """log p(ids[i] | ids[:i]) under the model, for i >= 1: what the engine should have recorded."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


@pytest.mark.parametrize("stream", [False, True])
def test_a_program_s_calls_are_recorded_token_exactly(setup, stream):
    tok, _, model = setup
    agent = agent_for(setup, "two_calls.py", *(["stream"] if stream else []))
    (s,) = run(agent)
    assert s.status == Status.COMPLETED, s.error
    assert s.reward == 0.25 and s.metrics["turns"] == 2.0 and s.group_id == "g"
    # one growing trajectory: two generated turns, the second call's prompt continues the first call's tokens
    assert len(s.turns) == 2
    first_prompt = tok(tok.apply_chat_template([{"role": "user", "content": ROW["question"]}], tokenize=False,
                                               add_generation_prompt=True), add_special_tokens=False)["input_ids"]
    assert s.prompt_ids == first_prompt
    # every generated token's recorded logprob is the model's own for that token in that context
    want = model_logprobs(model, s.input_ids)[len(s.prompt_ids) - 1:]
    got = [(lp, w) for lp, w, m in zip(s.logprobs, want, s.loss_mask) if m]
    assert len(got) == sum(s.loss_mask) > 0
    assert max(abs(a - b) for a, b in got) < 1e-4
    assert all(v == 0 for v, m in zip(s.versions, s.loss_mask) if m)


@pytest.mark.parametrize("stream", [False, True])
def test_the_tokens_the_program_received_are_the_trained_tokens(setup, tmp_path, stream):
    agent = agent_for(setup, "two_calls.py", *(["stream"] if stream else []))
    out = tmp_path / "out.txt"
    agent.command = ["sh", "-c", f'"$0" "$@" | tee {out}', *agent.command]
    (s,) = run(agent)
    assert s.status == Status.COMPLETED, s.error
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    calls, result = lines[:-1], lines[-1]
    assert result == {"reward": 0.25, "metrics": {"turns": 2}}
    assert [s.response_ids[t.start: t.end] for t in s.turns] == [c["token_ids"] for c in calls]
    assert [s.logprobs[t.start: t.end] for t in s.turns] == [c["logprobs"] for c in calls]
    assert [t.finish_reason for t in s.turns] == [{"length": "length"}.get(c["finish"], "stop") for c in calls]


def test_a_hanging_program_is_killed_with_its_children(setup, tmp_path):
    pids = tmp_path / "pids"
    agent = agent_for(setup, "misbehave.py", "hang", str(pids), timeout=3)
    t0 = time.perf_counter()
    (s,) = run(agent)
    assert time.perf_counter() - t0 < bound(20)
    assert s.status == Status.FAILED and "still running after 3 s: killed" in s.error
    for pid in map(int, pids.read_text().split()):  # the program and the child it started are gone
        _wait_gone(pid)


def _wait_gone(pid: int) -> None:
    deadline = time.monotonic() + bound(5)
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":  # exited, not yet reaped
            return
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still alive")


def test_a_crashing_program_fails_its_episode(setup):
    (s,) = run(agent_for(setup, "misbehave.py", "crash"))
    assert s.status == Status.FAILED
    assert "exited with code 3" in s.error and "about to crash" in s.error


def test_a_flooding_program_is_stopped_and_fails_its_episode(setup, tmp_path):
    agent = agent_for(setup, "misbehave.py", "flood", str(tmp_path / "status"), max_calls=3, timeout=60)
    t0 = time.perf_counter()
    (s,) = run(agent)
    assert time.perf_counter() - t0 < bound(30)  # stopped at the refusal, not at its timeout
    assert s.status == Status.FAILED and "more than max_calls=3" in s.error and "HTTP 429" in s.error


def test_the_token_cap_fails_a_flooding_program(setup, tmp_path):
    (s,) = run(agent_for(setup, "misbehave.py", "flood", str(tmp_path / "status"), max_tokens=10, timeout=60))
    assert s.status == Status.FAILED and "max_tokens=10" in s.error


@pytest.mark.parametrize("cap", ["calls", "tokens"])
def test_calls_past_a_cap_are_answered_429(setup, cap):
    """Over HTTP, as a program sees it: the call past the cap, and every later one, is refused with 429; the
    calls before it were capped at the episode's token budget."""
    agent = agent_for(setup, "two_calls.py")

    async def main():
        proxy = agent.proxy()
        ep = proxy.open(Session("s"), *((2, 100) if cap == "calls" else (100, 8)))
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
        async with httpx.AsyncClient() as http:
            codes = [(await http.post(proxy.base_url(ep) + "/chat/completions", json=body,
                                      headers={"authorization": f"Bearer {ep.key}"})) for _ in range(4)]
        return ep, codes

    try:
        ep, replies = asyncio.run(main())
    finally:
        agent.close()
    codes = [r.status_code for r in replies]
    if cap == "calls":
        assert codes == [200, 200, 429, 429] and "max_calls=2" in ep.failure
    else:  # at most 5 tokens a call, the last one capped at what is left of 8, then refused
        served = [r.json()["usage"]["completion_tokens"] for r in replies if r.status_code == 200]
        assert codes[:2] == [200, 200] and codes[-1] == 429 and "max_tokens=8" in ep.failure
        assert max(served) <= 5 and sum(served) <= 8
    assert replies[-1].json()["error"]["code"] == "episode_limit_exceeded"
    assert ep.failed.is_set()


def test_another_episode_s_url_is_refused(setup, tmp_path):
    """A program that calls another open episode's URL with its own key gets 401; the other episode records
    nothing; unknown and finished episodes are 404."""
    agent = agent_for(setup, "misbehave.py", "other", str(tmp_path / "url"), timeout=60)

    async def main():
        proxy = agent.proxy()
        other = proxy.open(Session("other"), 4, 100)
        (tmp_path / "url").write_text(proxy.base_url(other))
        samples = await run_agent(agent, Sample(prompt_ids=[1], data=dict(ROW), group_id="g"), 60)
        async with httpx.AsyncClient() as http:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
            auth = {"authorization": f"Bearer {other.key}"}
            ok = await http.post(proxy.base_url(other) + "/chat/completions", json=body, headers=auth)
            unknown = await http.post(proxy.base_url(other).replace(other.id, "0" * 16) + "/chat/completions",
                                      json=body, headers=auth)
            proxy.close(other)
            finished = await http.post(proxy.base_url(other) + "/chat/completions", json=body, headers=auth)
        return samples, other, ok, unknown, finished

    try:
        (s,), other, ok, unknown, finished = asyncio.run(main())
    finally:
        agent.close()
    assert s.status == Status.COMPLETED and s.metrics["status"] == 401.0 and s.reward == 0.0
    assert ok.status_code == 200 and len(other.session.calls) == 1  # only the other episode's own call
    assert unknown.status_code == 404 and finished.status_code == 404


def test_without_a_reward_line_the_judge_scores_and_a_run_trains(tiny_run):
    """One training step with agent.kind=external through the real loop: the program prints no reward, the
    judge (parity_reward) scores its last reply."""
    cfg = tiny_run(**{"agent.kind": "external", "run.steps": 1,
                      "agent.kwargs": {"command": [sys.executable, str(SCRIPTS / "misbehave.py"), "judge"],
                                       "timeout": 60}})
    train(cfg)
    rows = read_jsonl(Path(cfg.run.output_dir) / cfg.run.name / "metrics.jsonl")
    step = next(r for r in rows if "train/loss" in r)
    assert step["rollout/samples"] == 4 and step["rollout/failed"] == 0 and step["train/samples"] == 4
    assert step["rollout/generated_tokens"] > 0


@pytest.mark.parametrize("kwargs, message", [({}, "agent.kwargs.command is required"),
                                             ({"command": "python a.py", "timeout": 0}, "agent.kwargs.timeout")])
def test_bad_options_are_named_before_any_model_loads(tiny_run, kwargs, message):
    with pytest.raises(InputError, match=message):
        check_user_code(tiny_run(**{"agent.kind": "external", "agent.kwargs": kwargs}))


def test_streamed_chunks_arrive_while_the_call_generates(setup, tmp_path):
    """Token by token: the first content chunk comes long before the last (a call of 600 tokens), and the text the
    program joined is the recorded turn's."""
    tok, ctl, _ = setup
    agent = ExternalAgent(ctl, tok, SamplingParams(max_new_tokens=600, ignore_eos=True),
                          command=[sys.executable, str(SCRIPTS / "stream_timing.py"), "600"])
    out = tmp_path / "out.txt"
    agent.command = ["sh", "-c", f'"$0" "$@" | tee {out}', *agent.command]
    (s,) = run(agent)
    assert s.status == Status.COMPLETED, s.error
    got = json.loads(out.read_text().splitlines()[0])
    assert got["chunks"] > 50 and got["first"] < got["last"] / 4, got
    assert got["text"] == tok.decode(s.response_ids, skip_special_tokens=True)
