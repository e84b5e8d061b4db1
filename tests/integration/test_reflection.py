"""ReflectionAgent on the real tiny model: token-exact trajectories, masks, versions, and rewards by hand."""

import asyncio
import copy

import pytest
import torch
from engines_for_tests import RecordingController

from relayrl.agents.chat import continuation_ids, continuation_text
from relayrl.agents.reflection import ReflectionAgent, shaped, turn_returns
from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.judge import Judge
from relayrl.judge.math import final_answer
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.evaluator import Evaluator, rollout_metrics
from relayrl.sample import NO_VERSION, Sample
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer


@pytest.fixture(scope="module")
def parts(tiny_path):
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=16, seed=3)
    judge = Judge("rewards_for_tests:parity_reward", workers=1)
    yield tok, model, engine, judge
    engine.close()
    judge.close()



def run(agent, samples):
    async def go():
        return await asyncio.gather(*(agent.generate_sample(s) for s in samples))

    return asyncio.run(go())


def test_feedback_tokens_are_the_template_continuation(tiny_path):
    tok = load_tokenizer(tiny_path)
    text = continuation_text(tok, [{"role": "user", "content": "Try again."}])
    assert text == "\n<|im_start|>user\nTry again.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(continuation_ids(tok, [{"role": "user", "content": "Try again."}])) == text


@pytest.mark.parametrize("mode", ["final", "per_turn"])
def test_multi_turn_trajectory_is_token_exact(parts, mode):
    tok, model, engine, judge = parts
    ctl = RecordingController([engine])
    agent = ReflectionAgent(ctl, tok, SamplingParams(max_new_tokens=10, temperature=1.0), judge, max_turns=3,
                            discount_mode=mode, feedback="Wrong, try again.")
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                         add_generation_prompt=True))["input_ids"]
    samples = run(agent, [Sample(prompt_ids=list(prompt), group_id="g", index=i) for i in range(12)])
    assert len({len(s.turns) for s in samples}) >= 2  # turns vary per sample
    for s in samples:
        calls = ctl.calls[s.uid]
        assert len(calls) == len(s.turns)
        for (seen, out), turn in zip(calls, s.turns):
            assert seen == s.input_ids[: len(seen)]  # what the engine saw is a prefix of the trained sequence
            p = len(s.prompt_ids)
            assert s.response_ids[turn.start: turn.end] == out.output_ids
            assert seen == s.input_ids[: p + turn.start]
            assert s.logprobs[turn.start: turn.end] == out.logprobs
            assert s.versions[turn.start: turn.end] == out.versions
            assert (turn.version_start, turn.version_end) == (out.versions[0], out.versions[-1])
            assert turn.finish_reason == out.finish_reason
        for prev, nxt in zip(s.turns, s.turns[1:]):  # between turns: [eot if cut] + feedback, never trained
            between = s.response_ids[prev.end: nxt.start]
            closed = [] if s.response_ids[prev.end - 1] == agent.eot else [agent.eot]
            assert between == closed + agent.feedback_ids
            assert s.loss_mask[prev.end: nxt.start] == [0] * len(between)
            assert s.versions[prev.end: nxt.start] == [NO_VERSION] * len(between)
        assert sum(s.loss_mask) == sum(t.end - t.start for t in s.turns)
        assert s.metrics["turns"] == len(s.turns)
        assert s.metrics["solved_turn"] in (0, len(s.turns))
        # the final decoded conversation shows the feedback turns
        if len(s.turns) > 1:
            assert "Wrong, try again." in tok.decode(s.response_ids)


def test_shaping_and_discount_by_hand():
    assert shaped(1, True, 1.0, 0.0) == 1.0 and shaped(0, True, 1.0, 0.0) == -1.0
    assert shaped(1, True, 2.0, 0.5) == pytest.approx(1.0)  # ((1 - .5) * 2 - .5) * 2
    assert shaped(0, True, 2.0, 0.5) == pytest.approx(-3.0)
    assert shaped(1, False, 2.0, 0.5) == 1.0
    # seed 001's backward sum: R_t = r_t + gamma * R_{t+1}
    assert turn_returns([-1.0, -1.0, 1.0], 0.9) == pytest.approx([-1 + 0.9 * (-1 + 0.9), -1 + 0.9, 1.0])


@pytest.mark.parametrize("mode", ["final", "per_turn"])
def test_rewards_of_each_mode(parts, mode):
    tok, _, engine, judge = parts
    agent = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=6), judge,
                            max_turns=3, discount=0.5, discount_mode=mode, reward_scaling=2.0, reward_bias=0.0)
    s = Sample(prompt_ids=[1, 5, 6])
    s.append_generated([7], [0.0], [0], "stop")
    s.append_context([8])
    s.append_generated([9], [0.0], [0], "stop")
    agent._set_rewards(s, [0.0, 1.0])  # wrong, then right
    if mode == "final":
        assert s.reward == pytest.approx(2.0 * 0.5)  # r_T * gamma^(T-1) with r_T = ((1-.5)*2)*2
        assert all(t.reward is None for t in s.turns)
    else:
        assert [t.reward for t in s.turns] == pytest.approx([-2.0 + 0.5 * 2.0, 2.0])
        assert s.reward == s.turns[0].reward
    assert s.metrics["solved_turn"] == 2 and s.metrics["correct"] == 1.0


def test_a_repeated_wrong_answer_costs_the_repeat_penalty(parts):
    tok, _, engine, judge = parts
    agent = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=6), judge, max_turns=3,
                            discount=0.5, discount_mode="per_turn", repeat_penalty=0.25)
    s = Sample(prompt_ids=[1, 5, 6])
    for k in range(3):
        if k:
            s.append_context([8])
        s.append_generated([9 + k], [0.0], [0], "stop")
    agent._set_rewards(s, [0.0, 0.0, 1.0], [False, True, False])  # wrong, the same wrong answer again, right
    r = [-1.0, -1.25, 1.0]
    assert [t.reward for t in s.turns] == pytest.approx([r[0] + 0.5 * (r[1] + 0.5 * r[2]), r[1] + 0.5 * r[2], r[2]])
    with pytest.raises(ValueError, match="agent.kwargs.repeat_penalty"):
        ReflectionAgent(RolloutController([engine]), tok, SamplingParams(), judge, repeat_penalty=-1.0)


def _turn_samples(returns: list[list[float]]) -> list[Sample]:
    samples = []
    for i, rets in enumerate(returns):
        s = Sample(prompt_ids=[1, 5, 6], group_id="g", index=i)
        for j, r in enumerate(rets):
            if j:
                s.append_context([8, 9])
            s.append_generated([10 + j, 11 + j], [0.0, 0.0], [0, 0], "stop")
            s.turns[-1].reward = r
        samples.append(s)
    return samples


@pytest.mark.parametrize("baseline", ["turn", "pooled"])
def test_per_turn_returns_give_per_turn_advantages(parts, baseline):
    tok, model, engine, _ = parts
    samples = _turn_samples([[0.0, 1.0], [1.0], [-1.0, -1.0]])
    ctl = TrainController(TrainEngine(copy.deepcopy(model)), AlgoConfig(adv_std="none", turn_baseline=baseline),
                          TrainConfig(), pad_id=0, max_new_tokens=8)
    batch = ctl.compute_advantages(Packer(4096, 0).pack(samples))
    adv = [a.tolist() for a in batch.per_token["advantages"]]
    if baseline == "pooled":  # one baseline: the mean of the group's five turn returns
        m1 = m2 = (0 + 1 + 1 - 1 - 1) / 5
    else:  # first turns against first turns (0, 1, -1), second turns against second turns (1, -1)
        m1, m2 = (0 + 1 - 1) / 3, (1 - 1) / 2
    assert adv[0] == pytest.approx([0 - m1] * 2 + [1 - m2] * 2)
    assert adv[1] == pytest.approx([1 - m1] * 2)
    assert adv[2] == pytest.approx([-1 - m1] * 2 + [-1 - m2] * 2)
    assert torch.cat(batch.per_token["behav_logp"]).numel() == 10


def test_a_failed_last_retry_is_not_reinforced(parts):
    """Reflection returns (gamma 0.9, shaped -1/+1): two samples solved at turn 2, six that failed all three turns.
    Pooled, the six failed third turns (-1) sit above the group mean and get a positive advantage; per turn they
    are compared with each other only (advantage 0), and the turn-2 recoveries beat the turn-2 failures."""
    _, model, _, _ = parts
    solved, failed = turn_returns([-1.0, 1.0], 0.9), turn_returns([-1.0, -1.0, -1.0], 0.9)
    samples = _turn_samples([solved] * 2 + [failed] * 6)

    def advantages(baseline):
        ctl = TrainController(TrainEngine(copy.deepcopy(model)), AlgoConfig(turn_baseline=baseline), TrainConfig(),
                              pad_id=0, max_new_tokens=8)
        return [a.tolist() for a in ctl.compute_advantages(Packer(4096, 0).pack(samples)).per_token["advantages"]]

    pooled, per_turn = advantages("pooled"), advantages("turn")
    assert pooled[2][-1] > 0  # the failure the pooled baseline rewards
    assert per_turn[2][-1] == pytest.approx(0.0)
    assert per_turn[0][-1] > 0 > per_turn[2][2]  # recovered turn 2 above failed turn 2


def test_feedback_names_the_rejected_answer(parts):
    tok, _, engine, judge = parts
    agent = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=6), judge, max_turns=3,
                            feedback="Your answer {answer} is wrong.")
    assert tok.decode(agent.feedback_for("12")).count("Your answer 12 is wrong.") == 1
    assert "Your answer nothing is wrong." in tok.decode(agent.feedback_for(None))
    fixed = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=6), judge,
                            feedback="Wrong: put it in \\boxed{} {please}.")  # other braces stay literal
    assert fixed.feedback_for("12") is fixed.feedback_ids
    assert "Wrong: put it in \\boxed{} {please}." in tok.decode(fixed.feedback_ids)


def test_feedback_restates_the_rows_question_in_the_retrys_context(parts):
    """{question} becomes the row's question, token for token what the engine sees before the retry; an answer that
    reads "{question}" is not expanded (one pass over the template)."""
    tok, _, engine, judge = parts
    ctl = RecordingController([engine])
    agent = ReflectionAgent(ctl, tok, SamplingParams(max_new_tokens=10, temperature=1.0), judge, max_turns=2,
                            feedback="Not {answer}. Again: {question}")
    row = {"question": "What is 7*8?", "answer": "56"}
    samples = run(agent, [Sample(prompt_ids=_arith_prompt(tok, row["question"]), data=row, group_id="g", index=i)
                          for i in range(8)])
    retried = [s for s in samples if len(s.turns) == 2]
    assert retried, "the tiny model never got the parity wrong: nothing to check"
    for s in retried:
        first, second = s.turns
        said = final_answer(tok.decode(s.response_ids[first.start: first.end]))
        expected = continuation_ids(tok, [{"role": "user", "content": f"Not {said or 'nothing'}. Again: What is 7*8?"}])
        between = s.response_ids[first.end: second.start]
        assert between[-len(expected):] == expected
        assert ctl.calls[s.uid][1][0] == s.input_ids[: len(s.prompt_ids) + second.start]
    assert tok.decode(agent.feedback_for("{question}", "Q?")).count("Not {question}. Again: Q?") == 1


def test_retries_and_repeats_are_counted_turn_by_turn(parts):
    """The tiny model's answers (its last number) decide repeats; recount them from the decoded turns."""
    tok, _, engine, judge = parts
    agent = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=10, temperature=1.0),
                            judge, max_turns=3, feedback="Not {answer}. Again.")
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                         add_generation_prompt=True))["input_ids"]
    samples = run(agent, [Sample(prompt_ids=list(prompt), group_id="g", index=i) for i in range(12)])
    for s in samples:
        answers = [final_answer(tok.decode(s.response_ids[t.start: t.end], skip_special_tokens=True))
                   for t in s.turns]
        assert s.metrics["retries"] == len(s.turns) - 1
        assert s.metrics["repeats"] == sum(a is not None and a in answers[:k] for k, a in enumerate(answers) if k)
        for k, (prev, nxt) in enumerate(zip(s.turns, s.turns[1:])):  # the feedback names turn k's answer
            between = tok.decode(s.response_ids[prev.end: nxt.start])
            assert f"Not {answers[k] or 'nothing'}. Again." in between
    metrics = Evaluator().evaluate(samples)
    reached_2 = sum(len(s.turns) >= 2 for s in samples)
    assert metrics["eval/recovered_at_turn_2"] == pytest.approx(
        sum(s.metrics["solved_turn"] == 2 for s in samples) / reached_2)
    retries = sum(s.metrics["retries"] for s in samples)
    assert metrics["eval/retry_repeat_rate"] == pytest.approx(sum(s.metrics["repeats"] for s in samples) / retries)
    train_side = rollout_metrics(samples)  # the same per step of training, for the curves
    assert train_side["rollout/recovered_at_turn_2"] == metrics["eval/recovered_at_turn_2"]


def test_retries_only_keeps_the_first_answer_out_of_the_loss(parts):
    """train_turns="retries": the first turn stays in the sequence (what the engine saw next is unchanged) but
    only the retries' tokens are trained; a sample solved at turn 1 has nothing to train and the controller
    leaves it out of the step; the retries get the advantages of the turn-by-turn baseline."""
    tok, model, engine, judge = parts
    ctl = RecordingController([engine])
    kw = dict(max_turns=3, feedback="Wrong, try again.", discount_mode="per_turn")
    agent = ReflectionAgent(ctl, tok, SamplingParams(max_new_tokens=10, temperature=1.0), judge,
                            train_turns="retries", **kw)
    prompt = tok(tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                         add_generation_prompt=True))["input_ids"]
    samples = run(agent, [Sample(prompt_ids=list(prompt), group_id="g", index=i) for i in range(12)])
    assert any(len(s.turns) == 1 for s in samples) and any(len(s.turns) > 1 for s in samples)
    for s in samples:
        first = s.turns[0]
        assert s.loss_mask[first.start: first.end] == [0] * (first.end - first.start)
        assert s.num_trained_tokens == sum(t.end - t.start for t in s.turns[1:])
        for t in s.turns[1:]:
            assert s.loss_mask[t.start: t.end] == [1] * (t.end - t.start)
        for (seen, out), t in zip(ctl.calls[s.uid], s.turns):  # the trajectory itself is the usual one
            assert s.response_ids[t.start: t.end] == out.output_ids and seen == s.input_ids[: len(seen)]
    assert Evaluator().evaluate(samples)["eval/generated_tokens"] == sum(
        t.end - t.start for s in samples for t in s.turns)
    with pytest.raises(ValueError, match="agent.kwargs.train_turns"):
        ReflectionAgent(RolloutController([engine]), tok, SamplingParams(), judge, train_turns="last")

    # by hand: returns (turn 1 masked) -> only second-and-later turns are trained, each against its own turn index
    hand = _turn_samples([[0.0, 1.0], [1.0], [-1.0, -1.0], [0.5, 0.0, -1.0]])
    for s in hand:
        s.mask_turn(0)
    train = TrainController(TrainEngine(copy.deepcopy(model)), AlgoConfig(adv_std="none"), TrainConfig(), pad_id=0,
                            max_new_tokens=8)
    kept, _ = train.drop_small_groups([s for s in hand if s.num_trained_tokens > 0])
    assert [s.index for s in kept] == [0, 2, 3]  # solved at turn 1: nothing to train
    batch = train.compute_advantages(Packer(4096, 0).pack(kept))
    adv = [a.tolist() for a in batch.per_token["advantages"]]
    m2 = (1.0 - 1.0 + 0.0) / 3  # second turns of the kept samples
    assert adv == [pytest.approx([1 - m2] * 2), pytest.approx([-1 - m2] * 2),
                   pytest.approx([0 - m2] * 2 + [0.0] * 2)]  # the only third turn is its own baseline
    assert torch.cat(batch.per_token["behav_logp"]).numel() == 8


def _arith_prompt(tok, question):
    return tok(tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                       add_generation_prompt=True))["input_ids"]


def test_a_planted_first_answer_is_context_and_every_retry_starts_from_it(parts):
    """plant_first_answer=1: turn 1 is a planted wrong answer near the row's answer, the same for every sample of a
    question; the engine first sees prompt + planted turn + feedback naming it; only the retries are trained."""
    tok, _, engine, judge = parts
    ctl = RecordingController([engine])
    agent = ReflectionAgent(ctl, tok, SamplingParams(max_new_tokens=10, temperature=1.0), judge, max_turns=3,
                            feedback="Not {answer}. Again.", discount_mode="per_turn", plant_first_answer=1.0)
    rows = [{"question": "What is 7*8?", "answer": "56"}, {"question": "What is 3+4?", "answer": "7"}]
    samples = run(agent, [Sample(prompt_ids=_arith_prompt(tok, r["question"]), data=r, group_id=r["question"],
                                 index=i) for r in rows for i in range(6)])
    for s in samples:
        first = s.turns[0]
        planted_text = tok.decode(s.response_ids[: first.start])
        wrong = final_answer(planted_text.split("Not")[0])
        assert int(wrong) - int(s.data["answer"]) in (-10, -2, -1, 1, 2, 10)
        assert planted_text.startswith(f"The answer is \\boxed{{{wrong}}}.") and f"Not {wrong}. Again." in planted_text
        assert s.loss_mask[: first.start] == [0] * first.start  # the planted turn and the feedback: never trained
        assert ctl.calls[s.uid][0][0] == s.input_ids[: len(s.prompt_ids) + first.start]
        assert s.num_trained_tokens == sum(t.end - t.start for t in s.turns)
        assert s.metrics["planted"] == 1.0 and s.metrics["turns"] == len(s.turns) + 1
        assert s.metrics["solved_turn"] in (0, len(s.turns) + 1)  # a retry that succeeds is solved at turn 2+
        assert s.turns[0].reward == s.reward  # rewards start at the first generated turn
    by_question = {}
    for s in samples:  # one state per question: every sample of it retries from the same planted answer
        by_question.setdefault(s.data["question"], set()).add(tuple(s.response_ids[: s.turns[0].start]))
    assert all(len(v) == 1 for v in by_question.values())
    metrics = Evaluator().evaluate(samples)
    reached_2 = len(samples)
    assert metrics["eval/planted/recovered_at_turn_2"] == pytest.approx(
        sum(s.metrics["solved_turn"] == 2 for s in samples) / reached_2)
    assert "eval/solved_at_turn_1" not in metrics  # no natural samples: nothing could be solved at turn 1


def test_planted_groups_are_a_share_and_their_returns_skip_the_planted_turn(parts):
    tok, _, engine, judge = parts
    agent = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=6), judge, max_turns=3,
                            discount=0.5, discount_mode="per_turn", plant_first_answer=0.5)
    chosen = [agent._planted(Sample(prompt_ids=[1], data={"question": f"q{i}"}, group_id="g")) for i in range(400)]
    assert 0.4 < sum(chosen) / 400 < 0.6
    again = [agent._planted(Sample(prompt_ids=[1], data={"question": f"q{i}"}, group_id=f"g{i}")) for i in range(400)]
    assert chosen == again  # by question, whatever the group id
    s = Sample(prompt_ids=[1, 5, 6], data={"question": "q", "answer": "3"})
    agent.plant(s)
    s.append_context([8])
    s.append_generated([9], [0.0], [0], "stop")
    s.append_context([8])
    s.append_generated([10], [0.0], [0], "stop")
    agent._set_rewards(s, [0.0, 0.0, 1.0])  # planted wrong, retry wrong, retry right
    assert [t.reward for t in s.turns] == pytest.approx([-1.0 + 0.5 * 1.0, 1.0])
    assert s.metrics["solved_turn"] == 3
    for bad, match in [(dict(plant_first_answer=1.5), "plant_first_answer must be in"),
                       (dict(plant_first_answer=1.0, max_turns=1), "needs max_turns >= 2")]:
        with pytest.raises(ValueError, match=match):
            ReflectionAgent(RolloutController([engine]), tok, SamplingParams(), judge, **bad)
    with pytest.raises(ValueError, match="integer 'answer' field"):
        agent.plant(Sample(prompt_ids=[1], data={"question": "q", "answer": "x/2"}))


def test_rollout_metrics_keep_planted_samples_apart(parts):
    """Mixed batches: success by turn for the sampled first answers, and separately for the planted ones."""
    tok, _, engine, judge = parts
    agent = ReflectionAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=10, temperature=1.0),
                            judge, max_turns=2, plant_first_answer=0.5)
    rows = [{"question": f"What is {i}+1?", "answer": str(i + 1)} for i in range(8)]
    samples = run(agent, [Sample(prompt_ids=_arith_prompt(tok, r["question"]), data=r, group_id=f"g{k}", index=i)
                          for k, r in enumerate(rows) for i in range(2)])
    assert all(a.metrics["planted"] == b.metrics["planted"] for a, b in zip(samples[::2], samples[1::2]))
    planted = [s for s in samples if s.metrics["planted"]]
    natural = [s for s in samples if not s.metrics["planted"]]
    assert planted and natural
    m = rollout_metrics(samples)
    assert m["rollout/planted_mean"] == len(planted) / len(samples)
    assert m["rollout/planted/recovered_at_turn_2"] == sum(s.metrics["solved_turn"] == 2 for s in planted) / len(
        planted)
    assert m.get("rollout/solved_at_turn_1", 0.0) == sum(s.metrics["solved_turn"] == 1 for s in natural) / len(natural)
