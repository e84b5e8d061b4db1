"""Agents written against the real `openai` package become token-exact, trainable trajectories."""

import asyncio

import pytest

from relayrl.agents import OpenAIAgent
from relayrl.agents.chat import continuation_ids
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.sample import Sample


@pytest.fixture(scope="module")
def setup(tiny_path):
    tok = load_tokenizer(tiny_path)
    engine = LocalEngine(load_model(tiny_path), eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=8)
    yield tok, RolloutController([engine])
    engine.close()


def episode(setup, name, row=None, **kw):
    tok, ctl = setup
    agent = OpenAIAgent(ctl, tok, SamplingParams(max_new_tokens=8), episode=f"agents_for_tests:{name}", **kw)
    prompt = [1]  # the episode builds its own prompts from the row
    sample = Sample(prompt_ids=prompt, data=row if row is not None else {"question": "What is 2+2?"}, group_id="g")
    return asyncio.run(agent.generate_sample(sample)), sample, agent


def test_multi_call_episode_is_one_token_exact_trajectory(setup):
    tok, _ = setup
    row = {"question": "What is 2+2?"}
    samples, _, agent = episode(setup, "two_call_episode", row)
    assert len(samples) == 1
    s = samples[0]
    first, second = row["_responses"]
    c1, c2 = first.choices[0], second.choices[0]
    # the API returned exactly the token ids and logprobs the sample trains on
    assert s.prompt_ids == c1.model_extra["prompt_token_ids"]
    assert [s.response_ids[t.start: t.end] for t in s.turns] == [c1.model_extra["token_ids"],
                                                                 c2.model_extra["token_ids"]]
    assert [lp.logprob for lp in c1.logprobs.content] == s.logprobs[: s.turns[0].end]
    # call 2's prompt is call 1's tokens + (end of turn) + the new user turn, tokenized alone
    assert c2.model_extra["prompt_token_ids"] == s.input_ids[: len(s.prompt_ids) + s.turns[1].start]
    between = s.response_ids[s.turns[0].end: s.turns[1].start]
    feedback = continuation_ids(tok, [{"role": "user", "content": "Are you sure? Answer again."}])
    assert between[-len(feedback):] == feedback and set(s.loss_mask[s.turns[0].end: s.turns[1].start]) == {0}
    assert s.reward in (0.0, 1.0) and s.group_id == "g"
    assert agent.backend.sessions == {}  # sessions are closed after the episode


def test_per_call_rewards_become_turn_returns(setup):
    samples, _, _ = episode(setup, "per_call_reward_episode", discount=0.5)
    (s,) = samples
    assert [t.reward for t in s.turns] == [-1.0 + 0.5 * 1.0, 1.0] and s.reward == -0.5


def test_separate_conversations_become_separate_samples(setup):
    samples, _, _ = episode(setup, "two_conversations_episode")
    assert len(samples) == 2 and all(s.reward == 0.5 and s.group_id == "g" for s in samples)
    assert samples[0].prompt_ids != samples[1].prompt_ids


def test_tool_messages_continue_the_conversation_token_exactly(setup):
    tok, _ = setup
    samples, _, _ = episode(setup, "tool_history_episode")
    (s,) = samples
    between = s.response_ids[s.turns[0].end: s.turns[1].start]
    tool_turn = continuation_ids(tok, [{"role": "tool", "tool_call_id": "call_0", "content": "4"}])
    assert between[-len(tool_turn):] == tool_turn
    assert "<|im_start|>tool\n4<|im_end|>" in tok.decode(s.response_ids)
    assert "calculator" in tok.decode(s.prompt_ids)  # tools described in the system prompt (no native support)


def test_an_episode_without_calls_fails_the_sample(setup, tmp_path):
    tok, ctl = setup
    (tmp_path / "empty_ep.py").write_text("async def run(client, row):\n    return 1.0\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    agent = OpenAIAgent(ctl, tok, SamplingParams(max_new_tokens=4), episode="empty_ep:run")
    with pytest.raises(RuntimeError, match="no chat completion calls"):
        asyncio.run(agent.generate_sample(Sample(prompt_ids=[1], data={})))
