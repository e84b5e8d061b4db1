"""EnvAgent on the real tiny model and LocalEngine: token-exact episodes of reset/step environments, turn rewards,
an environment that raises or hangs costing one episode, start-up errors, and training through the loop."""

import asyncio
import json
import time

import pytest
from bounds import bound
from engines_for_tests import RecordingController
from envs_for_tests import ClosingEnv, EchoEnv, ParityEnv

from relayrl.agents.chat import continuation_ids
from relayrl.agents.env import EnvAgent
from relayrl.agents.reflection import ReflectionAgent
from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.envs import MathFeedbackEnv
from relayrl.judge import REJECTED_PREFIX, Judge
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run import build as build_module
from relayrl.run.loop import train
from relayrl.sample import NO_VERSION, Sample, Status
from relayrl.scheduler.common import rejection_counts, run_group

SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0)


@pytest.fixture(scope="module")
def parts(tiny_path):
    tok = load_tokenizer(tiny_path)
    engine = LocalEngine(load_model(tiny_path), eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=16,
                         seed=5)
    judge = Judge("rewards_for_tests:parity_reward", workers=1)
    yield tok, engine, judge
    engine.close()
    judge.close()


def samples(n, question="What is 2+2?"):
    return [Sample(prompt_ids=[1, 2, 3], data={"question": question, "answer": "4"}, group_id="g", index=i)
            for i in range(n)]


def play(agent, batch, timeout=None):
    """The episodes as the schedulers run them: each through run_agent (failures recorded, not raised)."""
    return asyncio.run(run_group(batch, agent, timeout))


def test_episodes_are_token_exact(parts):
    tok, engine, _ = parts
    ctl = RecordingController([engine])
    agent = EnvAgent(ctl, tok, SAMPLING, env="envs_for_tests:EchoEnv", env_kwargs={"greeting": "Count."},
                     max_turns=3)
    done = play(agent, samples(6))
    opening = EchoEnv("Count.").reset({"question": "What is 2+2?"})
    prompt = tok(tok.apply_chat_template(opening, tokenize=False, add_generation_prompt=True),
                 add_special_tokens=False)["input_ids"]
    closed_by_agent = 0
    for s in done:
        assert s.status == Status.COMPLETED, s.error
        calls = ctl.calls[s.uid]
        assert len(calls) == len(s.turns) == 3 and s.prompt_ids == prompt  # reset's messages are the prompt
        expected = list(prompt)  # prompt + generated ids + [eot if cut] + env messages' continuation, per turn
        for k, ((seen, out), turn) in enumerate(zip(calls, s.turns)):
            assert seen == expected  # the engine saw exactly the sequence so far, nothing re-encoded
            expected += out.output_ids
            assert s.logprobs[turn.start: turn.end] == out.logprobs
            assert s.versions[turn.start: turn.end] == out.versions
            assert (turn.version_start, turn.version_end, turn.finish_reason) == (
                out.versions[0], out.versions[-1], out.finish_reason)
            if k < 2:
                cut = out.output_ids[-1] != agent.eot
                closed_by_agent += cut
                between = [agent.eot] * cut + continuation_ids(tok, EchoEnv.reply(tok.decode(
                    out.output_ids, skip_special_tokens=True)))
                assert s.response_ids[turn.end: s.turns[k + 1].start] == between
                assert s.loss_mask[turn.end: s.turns[k + 1].start] == [0] * len(between)
                assert s.versions[turn.end: s.turns[k + 1].start] == [NO_VERSION] * len(between)
                expected += between
        assert s.input_ids == expected
        assert sum(s.loss_mask) == sum(t.end - t.start for t in s.turns)
        assert [t.step_reward for t in s.turns] == [1.0, 2.0, 3.0] and s.reward == 6.0  # sum of turn rewards
        assert s.metrics["turns"] == 3 and s.metrics["env_done"] == 0.0
        assert "You wrote" in tok.decode(s.response_ids)
    assert closed_by_agent > 0  # the eot-closing branch ran (turns cut at max_new_tokens)


@pytest.mark.parametrize("mode, discount, reward, turn_returns", [
    ("sum", 0.5, 1 + 0.5 * 2 + 0.25 * 3, None),
    ("last", 1.0, 3.0, None),
    ("per_turn", 0.5, 1 + 0.5 * (2 + 0.5 * 3), [1 + 0.5 * (2 + 0.5 * 3), 2 + 0.5 * 3, 3.0])])
def test_reward_modes(parts, mode, discount, reward, turn_returns):
    tok, engine, _ = parts
    agent = EnvAgent(RolloutController([engine]), tok, SAMPLING, env=EchoEnv, max_turns=3, reward=mode,
                     discount=discount)
    (s,) = play(agent, samples(1))
    assert s.reward == pytest.approx(reward)
    assert [t.reward for t in s.turns] == (pytest.approx(turn_returns) if turn_returns else [None] * 3)
    assert [t.step_reward for t in s.turns] == [1.0, 2.0, 3.0]


def test_async_environment(parts):
    tok, engine, _ = parts
    agent = EnvAgent(RolloutController([engine]), tok, SAMPLING, env="envs_for_tests:AsyncEnv", max_turns=5)
    for s in play(agent, samples(3)):
        assert s.status == Status.COMPLETED, s.error
        assert len(s.turns) == 2 and s.metrics["env_done"] == 1.0  # the environment ended it, not max_turns
        assert [t.step_reward for t in s.turns] == [0.5, 0.5] and s.reward == 1.0
        assert "More." in tok.decode(s.response_ids)


def test_an_environment_that_raises_costs_its_episode_only(parts):
    tok, engine, _ = parts
    agent = EnvAgent(RolloutController([engine]), tok, SAMPLING, env=ParityEnv, max_turns=2)
    done = play(agent, samples(2, "What is BAD?") + samples(3))
    assert [s.status for s in done] == [Status.FAILED] * 2 + [Status.COMPLETED] * 3
    for s in done[:2]:
        assert "envs_for_tests:ParityEnv" in s.error and "envs_for_tests.py" in s.error
        assert "step raised RuntimeError: the environment broke" in s.error and s.metrics["env_failed"] == 1.0
    for s in done[2:]:
        assert s.reward in (0.0, 1.0) and len(s.turns) in (1, 2)


def test_close_runs_after_every_episode_and_its_failure_costs_nothing(parts):
    tok, engine, _ = parts
    ClosingEnv.closed.clear()
    agent = EnvAgent(RolloutController([engine]), tok, SAMPLING, env=ClosingEnv, max_turns=2)
    done = play(agent, samples(2, "What is BAD?") + samples(2))
    assert [s.status for s in done] == [Status.FAILED] * 2 + [Status.COMPLETED] * 2
    assert sorted(ClosingEnv.closed) == sorted(s.data["question"] for s in done)  # failed episodes are closed too
    failing = EnvAgent(RolloutController([engine]), tok, SAMPLING, env=ClosingEnv, env_kwargs={"fail_close": True},
                       max_turns=2)
    for s in play(failing, samples(2)):
        assert s.status == Status.COMPLETED and s.metrics["env_close_failed"] == 1.0


def test_a_hanging_environment_times_out(parts):
    tok, engine, _ = parts
    agent = EnvAgent(RolloutController([engine]), tok, SAMPLING, env="envs_for_tests:HangingEnv", env_timeout=0.5)
    t0 = time.perf_counter()
    done = play(agent, samples(2), timeout=60)
    assert time.perf_counter() - t0 < bound(20)
    for s in done:
        assert s.status == Status.FAILED
        assert "HangingEnv.step did not return within 0.5 s (agent.kwargs.env_timeout)" in s.error


def test_an_environment_without_rewards_leaves_the_episode_to_the_judge(parts):
    tok, engine, judge = parts
    agent = EnvAgent(RolloutController([engine]), tok, SAMPLING, judge, env="envs_for_tests:SilentEnv",
                     max_turns=2)
    for s in play(agent, samples(3)):
        last = tok.decode(s.response_ids[s.turns[-1].start: s.turns[-1].end], skip_special_tokens=True)
        assert s.status == Status.COMPLETED and s.reward == float(len(last) % 2 == 0)  # parity of the last turn
        assert [t.step_reward for t in s.turns] == [None, None]
    unjudged = EnvAgent(RolloutController([engine]), tok, SAMPLING, env="envs_for_tests:SilentEnv", max_turns=1)
    done = play(unjudged, samples(2))
    assert rejection_counts(done) == {"no_reward": 2}
    assert all(s.metrics[REJECTED_PREFIX + "no_reward"] == 1.0 for s in done)


@pytest.mark.parametrize("kwargs, message", [
    ({"env": "envs_for_tests:NoStepEnv"},
     r"agent.kwargs.env: envs_for_tests:NoStepEnv \(.*envs_for_tests.py\) does not implement the environment "
     r"protocol: it has no step\(assistant_text\) method"),
    ({"env": "envs_for_tests:NoArgStepEnv"},
     r"envs_for_tests:NoArgStepEnv \(.*envs_for_tests.py\)\.step must take one argument \(assistant_text\)"),
    ({"env": "envs_for_tests:Missing"}, r"agent.kwargs.env: module 'envs_for_tests' has no attribute 'Missing'"),
    ({"env": "envs_for_tests:EchoEnv", "env_kwargs": {"colour": 1}},
     r"agent.kwargs.env_kwargs do not fit envs_for_tests:EchoEnv .*colour"),
    ({}, r"agent.kwargs.env is required"),
    ({"env": "envs_for_tests:EchoEnv", "reward": "max"}, r"agent.kwargs.reward must be one of sum, last, per_turn")])
def test_startup_errors_name_the_class_and_file_before_any_model_loads(tiny_run, monkeypatch, kwargs, message):
    def no_model(*a, **k):
        raise AssertionError("the run went on to load its models before the environment was checked")

    monkeypatch.setattr(build_module, "_build_with_judge", no_model)  # what builds engines and trainer
    cfg = tiny_run(**{"agent.kind": "env", "agent.kwargs": json.dumps(kwargs)})
    with pytest.raises(InputError, match=message):
        build_module.build(cfg)


def write_rows(path, questions):
    path.write_text("".join(json.dumps({"question": q, "answer": "4"}) + "\n" for q in questions))
    return str(path)


@pytest.mark.parametrize("env", ["envs_for_tests:ParityEnv", "relayrl.envs.reflection:MathFeedbackEnv"])
def test_training_steps_through_the_loop(tiny_run, tmp_path, env):
    data = write_rows(tmp_path / "rows.jsonl", ["What is 2+2? BAD", "What is 2+2?"])  # both rows in every step
    cfg = tiny_run(**{"agent.kind": "env", "agent.kwargs": json.dumps({"env": env, "max_turns": 2}),
                      "data.train.source": data, "data.shuffle": False})
    train(cfg)
    steps = [r for r in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:  # ParityEnv: the BAD row's group (2 samples) fails each time it is drawn; the run goes on
        assert r["rollout/failed"] >= 2 and r["rollout/failed"] % 2 == 0 if env.endswith("ParityEnv") else (
            r["rollout/failed"] == 0)
    logged = [rec for f in (tmp_path / "t" / "trajectories").glob("*/monitor.jsonl") for rec in read_jsonl(f)]
    completed = [rec for rec in logged if rec["status"] == "archived"]  # trained on
    assert completed and {rec["turns"] for rec in completed} <= {1, 2}
    for rec in completed:  # each generated turn logs the reward step gave it
        assert [seg["reward"] for seg in rec["segments"] if seg["kind"] == "gen"] in ([0.0], [1.0], [0.0, 0.0],
                                                                                     [0.0, 1.0])
    if env.endswith("MathFeedbackEnv"):  # a random tiny model is never right: every episode gets its retry
        assert {rec["turns"] for rec in completed} == {2}
        assert any("reflect on it and try again" in seg["text"] for rec in completed for seg in rec["segments"])


def test_math_feedback_env_by_hand():
    env = MathFeedbackEnv(feedback="Not {answer}. {question}", max_attempts=2)
    assert env.reset({"question": "What is 2+2?", "answer": "4"}) is None
    assert env.step("It is \\boxed{5}.") == ([{"role": "user", "content": "Not 5. What is 2+2?"}], 0.0, False)
    assert env.step("Still 5") == ([], 0.0, True)  # out of attempts
    env.reset({"question": "What is 2+2?", "answer": "4"})
    assert env.step("The answer is \\boxed{4}.") == ([], 1.0, True)


def test_math_feedback_env_plays_as_the_reflection_agent(parts):
    """Same seeds, same engine: EnvAgent + MathFeedbackEnv produce the reflection agent's tokens and rewards."""
    tok, engine, _ = parts
    math_judge = Judge("relayrl.judge.math:math_reward", workers=1)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                         add_generation_prompt=True), add_special_tokens=False)["input_ids"]

    def seeded():
        return [Sample(prompt_ids=list(prompt), data={"question": "What is 2+2?", "answer": "4"}, seed=i)
                for i in range(4)]

    try:
        reflect = ReflectionAgent(RolloutController([engine]), tok, SAMPLING, math_judge, max_turns=3, discount=0.5,
                                  shaping=False)
        env = EnvAgent(RolloutController([engine]), tok, SAMPLING, env=MathFeedbackEnv, max_turns=3, discount=0.5)
        for a, b in zip(play(reflect, seeded()), play(env, seeded()), strict=True):
            assert b.status == Status.COMPLETED and a.input_ids == b.input_ids and a.loss_mask == b.loss_mask
            assert [(t.start, t.end) for t in a.turns] == [(t.start, t.end) for t in b.turns]
            assert a.reward == b.reward and len(b.turns) == 3  # the random tiny model is wrong: feedback twice
    finally:
        math_judge.close()
