"""Model-based rewards (relayrl/judge/models.py, relayrl/judge/llm.py): the judge-reply parser, template filling,
how configured objects are named by path, and a tiny random reward model scored against its own forward."""

from __future__ import annotations

import asyncio
import os

import model_rewards_for_tests as mrt
import pytest
import torch

from relayrl.api import import_path
from relayrl.judge import BATCHED, Judge, reward_fn_path
from relayrl.judge.functions import describe
from relayrl.judge.llm import NUMBER, YES_NO, LLMJudge, parse_score
from relayrl.judge.models import RewardModel, load, reward_model, rm_reward

PROMPTS = ["What is 2+2?", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}],
           "Count to three.", "Why?", "Say hi."]
COMPLETIONS = ["4", [{"role": "assistant", "content": "The quick brown fox."}], "one two three", "because", "hi"]


@pytest.mark.parametrize("reply, pattern, labels, score", [
    ("Reasoning: 3 points off. Score: 7", NUMBER, None, 7.0),  # the last number, after the reasoning
    ("score -2.5", NUMBER, None, -2.5),
    ("I cannot rate this.", NUMBER, None, None),
    ("", NUMBER, None, None),
    (None, NUMBER, None, None),
    ("Yes, no doubt... final: NO", YES_NO, {"yes": 1.0, "no": 0.0}, 0.0),
    ("YES", YES_NO, {"yes": 1.0, "no": 0.0}, 1.0),
    ("nobody knows", YES_NO, {"yes": 1.0, "no": 0.0}, None),  # \b: "no" inside a word is not an answer
    ("<score>8</score> and 3", r"<score>(\d+)</score>", None, 8.0),
    ("Grade: B", r"grade: ([abc])", {"A": 1.0, "B": 0.5, "C": 0.0}, 0.5),
    ("Grade: Z", r"grade: (\w)", {"a": 1.0}, None),
])
def test_parse_score(reply, pattern, labels, score):
    labels = {k.lower(): v for k, v in labels.items()} if labels else labels
    assert parse_score(reply, pattern, labels) == score


def test_template_fills_prompt_completion_and_columns():
    j = LLMJudge(name="j", model="m", template="Q: {prompt}\nA: {completion}\nRef: {answer} ({level})",
                 system="You grade answers.")
    m = j.messages(PROMPTS[1], COMPLETIONS[1], {"answer": "fox", "level": 3})
    assert m == [{"role": "system", "content": "You grade answers."},
                 {"role": "user", "content": "Q: system: Be brief.\nuser: Name a fox.\nA: The quick brown fox.\n"
                                             "Ref: fox (3)"}]
    with pytest.raises(KeyError, match="level"):
        j.messages("q", "a", {"answer": "x"})
    with pytest.raises(ValueError, match="parser"):
        LLMJudge(name="j", model="m", template="{completion}", parser="stars")


def test_configured_objects_are_named_by_path():
    """A module-level judge is found by path (configs and train(reward=...)), named by its `name` metric, and
    read as a batched function; a local one is refused with the existing message."""
    assert import_path(mrt.helpful) == reward_fn_path(mrt.helpful) == "model_rewards_for_tests:helpful"
    f = describe(mrt.helpful, "model_rewards_for_tests:helpful")
    assert (f.name, f.style) == ("helpful", BATCHED) and describe(mrt.rm, "x:rm").name == "rm"
    local = reward_model("somewhere", name="local")
    with pytest.raises(ValueError, match="not importable by path"):
        reward_fn_path(local)


@pytest.fixture(scope="module")
def rm_path(tiny_path, tmp_path_factory):
    return str(mrt.build_rm(tmp_path_factory.mktemp("rm"), tiny_path))


def _forward(path: str, texts: list[str] | list[tuple[str, str]], index: int = 0) -> list[float]:
    """The reward model's score for each text, computed by hand: one unpadded forward per text."""
    model, tok = load(path, "cpu")
    out = []
    for t in texts:
        ids = tok(*t, return_tensors="pt") if isinstance(t, tuple) else tok(t, add_special_tokens=False,
                                                                            return_tensors="pt")
        with torch.inference_mode():
            out.append(model(**ids).logits[0, index].item())
    return out


def test_reward_model_scores_equal_its_own_forward(rm_path):
    _, tok = load(rm_path, "cpu")
    texts = [tok.apply_chat_template(_chat(p, c), tokenize=False) for p, c in zip(PROMPTS, COMPLETIONS)]
    assert "<|im_start|>assistant\nThe quick brown fox." in texts[1]  # the chat template, both turns
    want = _forward(rm_path, texts)
    batched = RewardModel(rm_path, batch_size=4)(PROMPTS, COMPLETIONS)  # a batch of 4 (padded) and one of 1
    one_by_one = [RewardModel(rm_path, batch_size=1)([p], [c])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert batched == pytest.approx(want, abs=1e-5) and one_by_one == pytest.approx(want, abs=1e-5)
    assert len(set(round(s, 4) for s in want)) == len(want)  # distinct texts, distinct scores: not a constant
    assert rm_reward(PROMPTS, COMPLETIONS, reward_model={"path": rm_path, "batch_size": 2}) == pytest.approx(want,
                                                                                                       abs=1e-5)


def _chat(prompt, completion):
    turns = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    text = completion[-1]["content"] if isinstance(completion, list) else completion
    return [*turns, {"role": "assistant", "content": text}]


def test_reward_model_without_chat_template_scores_pairs_and_picks_a_label(tiny_path, tmp_path):
    path = str(mrt.build_rm(tmp_path, tiny_path, num_labels=3, chat=False))
    prompts, completions = ["What is 2+2?", "Say hi."], ["4", "hi there"]
    want = _forward(path, list(zip(prompts, completions)), index=2)
    assert RewardModel(path, label=2, batch_size=2)(prompts, completions) == pytest.approx(want, abs=1e-5)
    with pytest.raises(ValueError, match="3 labels"):
        RewardModel(path)(prompts, completions)


def test_reward_model_in_a_judge_worker(rm_path, monkeypatch):
    """One real judge call: the module-level `rm` in a worker process under the default 4096 MiB cap, batched
    with another function; each sample's reward/rm is the model's own score."""
    monkeypatch.setenv("RELAYRL_TEST_RM", rm_path)  # the workers build `rm` from it when they import the module
    want = RewardModel(rm_path)(PROMPTS[:4], ["4", "fox", "one two three", "because"])
    with Judge(["model_rewards_for_tests:rm", "model_rewards_for_tests:length"], workers=1, timeout=120,
               memory_mb=4096) as judge:
        async def main():
            return await asyncio.gather(*(judge.score(c, {"prompt": p}, str(i)) for i, (p, c) in enumerate(
                zip(PROMPTS[:4], ["4", "fox", "one two three", "because"]))))
        out = asyncio.run(main())
    assert os.environ["RELAYRL_TEST_RM"] == rm_path
    for (reward, metrics, error), w, c in zip(out, want, ["4", "fox", "one two three", "because"]):
        assert error is None
        assert metrics["reward/rm"] == pytest.approx(w, abs=1e-5) and reward == pytest.approx(w + len(c) / 10,
                                                                                           abs=1e-5)
