"""`ReflectionAgent`: answer, hear whether it was right, reflect and retry.

Each turn the model answers; the judge scores that turn's text; a wrong answer is followed by a
feedback user turn (token ids appended, never re-encoded) and the model tries again, until it is right
or `max_turns` is reached. Turns per sample vary. With shaping on, a turn's success (0 or 1) is mapped to
-1/+1 so that a wrong turn is pushed down, not merely left unrewarded, then shifted and scaled:

    r_t = ((success_t - 0.5) * 2 - reward_bias) * reward_scaling     (shaping on; else r_t = success_t)

and the turn-level discount gamma is applied in one of two ways:
- "final": the sample's reward is r_T * gamma^(T - 1) for the last turn T (AReaL's reflection workflow);
- "per_turn": every turn gets its discounted reward-to-go R_t = r_t + gamma * R_(t+1) (summed backward
  from the last turn), stored in `Turn.reward`; the trainer then gives each turn's tokens that turn's advantage.

Feedback may name the answer it rejects: a `{answer}` in the feedback text becomes the answer the turn committed
to (its last \\boxed{}, else its last number; "nothing" when there is none), so the retry knows what to move
away from. A `{question}` becomes the row's question, restated after the rejected attempt: a small model answers
worse with its own wrong attempt in context than afresh (docs/benchmarks.md), and with the question restated the
retry ends in the same words as a first attempt, so what training teaches the first turn can carry to the retries.

Each sample records `retries` and `repeats` (retries whose answer equals an earlier turn's): a wrong retry that
repeats itself has learned nothing from the feedback, and `repeat_penalty` (subtracted from such a
turn's r_t) tells the policy that repeating is worse than trying something else. Training alone can raise the
share of retries that repeat (docs/benchmarks.md, "Making the feedback turns learnable"), so the penalty pushes back.

`train_turns="retries"` trains only the turns that follow feedback (the first answer stays in the sequence as
context, its tokens out of the loss), the first stage of SCoRe (Kumar et al., 2024). Trained on every turn, a
small model spends its updates on answering right the first time, and the retries it is left with are the
problems it still gets wrong, so recoveries cannot be read or learned apart from first answers. With the first
turn untrained, every update is about using the feedback, and turn 1 moves only as far as the shared weights
carry it. A sample solved at its first turn then has nothing to train and is left out of the step.

`plant_first_answer=p` starts a share p of the groups from a planted wrong first answer instead of a sampled one
(a curriculum of controlled mistakes): the assistant turn "The answer is \\boxed{N}." with N a wrong value near the
row's numeric `answer`, chosen from the question alone, so every sample of the group (and every evaluation of that
question, before and after training) retries from the same state. Why: recoveries from the model's own mistakes
are measured on the problems it still gets wrong, a set that gets harder as turn 1 improves, and each group's
retries start from different wrong answers; from one planted state per group, the group's retries are compared
with each other on equal footing and the held-out rate is comparable across checkpoints. The planted turn is
context (never trained) and counts as turn 1: a retry that succeeds is "solved at turn 2". Which groups are
planted is a function of the question (p = 1: all; evaluate with p = 1 to measure recovery from planted states).
What planting and restating the question (`{question}`) did for SmolLM2-135M: docs/benchmarks.md, "A curriculum of
planted wrong first answers" and "Restating the question in the feedback".
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from relayrl.agents.base import AGENTS, Agent
from relayrl.agents.chat import continuation_ids, end_of_turn_id
from relayrl.common.errors import InputError
from relayrl.judge import REJECTED_PREFIX
from relayrl.judge.math import final_answer
from relayrl.sample import Sample, Status

DEFAULT_FEEDBACK = "Your answer is either wrong or could not be parsed. Please reflect on it and try again."
ANSWER_FIELD = "{answer}"  # replaced in the feedback text; every other brace is literal (\\boxed{})
QUESTION_FIELD = "{question}"  # replaced by the row's question
_FIELDS = re.compile(re.escape(ANSWER_FIELD) + "|" + re.escape(QUESTION_FIELD))
PLANTED_OFFSETS = (-10, -2, -1, 1, 2, 10)  # wrong values near the right one: slips a small model makes


def shaped(success: float, shaping: bool, scaling: float, bias: float) -> float:
    return ((success - 0.5) * 2 - bias) * scaling if shaping else success


def turn_returns(rewards: list[float], gamma: float) -> list[float]:
    """Discounted reward-to-go per turn: R_t = r_t + gamma * R_(t+1)."""
    out = list(rewards)
    for t in range(len(out) - 2, -1, -1):
        out[t] = out[t] + gamma * out[t + 1]
    return out


@AGENTS.register("reflection")
class ReflectionAgent(Agent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *, max_turns: int = 2,
                 feedback: str = DEFAULT_FEEDBACK, discount: float = 0.9, discount_mode: str = "final",
                 shaping: bool = True, reward_scaling: float = 1.0, reward_bias: float = 0.0,
                 repeat_penalty: float = 0.0, train_turns: str = "all", max_total_tokens: int | None = None,
                 plant_first_answer: float = 0.0):
        super().__init__(rollout_ctl, tokenizer, sampling, judge)
        if judge is None:
            raise ValueError("ReflectionAgent needs a judge: feedback depends on whether an answer is right")
        self.check_kwargs(dict(max_turns=max_turns, discount_mode=discount_mode, repeat_penalty=repeat_penalty,
                               train_turns=train_turns, plant_first_answer=plant_first_answer))
        self.max_turns, self.discount, self.discount_mode = max_turns, discount, discount_mode
        self.shaping, self.reward_scaling, self.reward_bias = shaping, reward_scaling, reward_bias
        self.repeat_penalty, self.train_turns, self.plant_first_answer = repeat_penalty, train_turns, plant_first_answer
        self.max_total_tokens = max_total_tokens
        self.eot = end_of_turn_id(tokenizer)
        self.feedback = feedback
        self.feedback_varies = ANSWER_FIELD in feedback or QUESTION_FIELD in feedback
        self.feedback_ids = continuation_ids(tokenizer, [{"role": "user", "content": feedback}])

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Option values: checked by `build` before any model loads, and on construction."""
        max_turns, plant = kwargs.get("max_turns", 2), kwargs.get("plant_first_answer", 0.0)
        problems = [("max_turns", max_turns < 1, f"must be >= 1, got {max_turns}"),
                    ("discount_mode", kwargs.get("discount_mode", "final") not in ("final", "per_turn"),
                     f"must be 'final' or 'per_turn', got {kwargs.get('discount_mode')!r}"),
                    ("repeat_penalty", kwargs.get("repeat_penalty", 0.0) < 0,
                     f"must be >= 0, got {kwargs.get('repeat_penalty')}"),
                    ("train_turns", kwargs.get("train_turns", "all") not in ("all", "retries"),
                     f"must be 'all' or 'retries', got {kwargs.get('train_turns')!r}"),
                    ("plant_first_answer", not 0.0 <= plant <= 1.0, f"must be in [0, 1], got {plant}"),
                    ("plant_first_answer", bool(plant) and max_turns < 2,
                     "needs max_turns >= 2: the planted answer is turn 1")]
        for key, bad, why in problems:
            if bad:
                raise InputError(f"agent.kwargs.{key} {why}")

    async def generate_sample(self, sample: Sample) -> Sample:
        successes: list[float] = []
        answers: list[str | None] = []
        planted = self._planted(sample)
        if planted:
            answers.append(self.plant(sample))
            successes.append(0.0)
        for turn in range(len(answers), self.max_turns):
            if answers:  # after a wrong answer: feedback, then the retry
                feedback = self.feedback_for(answers[-1], sample.data.get("question", ""))
                if self._out_of_room(sample, len(feedback)):
                    break
                if sample.response_ids[-1] != self.eot:  # cut at the token limit: close the turn as the template would
                    sample.append_context([self.eot])
                sample.append_context(feedback)
            out = await self.rollout_ctl.generate(sample.input_ids, self.params_for(sample, turn), rid=sample.uid,
                                                  images=tuple(sample.images))  # every turn sees the prompt's images
            sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason, out.routed_experts)
            text = self.decode(out.output_ids)
            answers.append(final_answer(text))
            _, metrics, error = await self.judge.score(text, sample.data, sample.uid)
            sample.error = error or sample.error
            sample.metrics.update({k: v for k, v in metrics.items() if k.startswith(REJECTED_PREFIX)})
            successes.append(float(metrics.get("correct", metrics["reward"] > 0)))
            if successes[-1]:
                break
        repeated = [k > 0 and a is not None and a in answers[:k] for k, a in enumerate(answers)]
        self._set_rewards(sample, successes, repeated)
        if self.train_turns == "retries" and not planted:  # a planted first turn is context already
            sample.mask_turn(0)
        sample.metrics.update(retries=float(len(answers) - 1), repeats=float(sum(repeated)), planted=float(planted))
        sample.response_text = self.decode(sample.response_ids)
        sample.status = Status.COMPLETED
        return sample

    def _planted(self, sample: Sample) -> bool:
        """Whether the sample's question starts from a planted answer: a function of the question, so a group's
        samples agree and an evaluation plants the same questions at every checkpoint."""
        if self.plant_first_answer in (0.0, 1.0):
            return bool(self.plant_first_answer)
        return _unit_hash(f"plant?\0{_question_key(sample)}") < self.plant_first_answer

    def plant(self, sample: Sample) -> str:
        """Append the planted wrong first answer (context, not trained) and return it."""
        try:
            right = int(str(sample.data["answer"]).strip())
        except (KeyError, ValueError):
            raise ValueError(f"agent.kwargs.plant_first_answer needs an integer 'answer' field in each data row, "
                             f"got {sample.data.get('answer')!r}") from None
        wrong = str(right + PLANTED_OFFSETS[int(_unit_hash(_question_key(sample)) * len(PLANTED_OFFSETS))])
        text = f"The answer is \\boxed{{{wrong}}}."
        sample.append_context(self.tokenizer(text, add_special_tokens=False)["input_ids"] + [self.eot])
        return wrong

    def feedback_for(self, answer: str | None, question: str = "") -> list[int]:
        """Feedback token ids after a wrong turn (the fixed ids unless the text names the answer or question)."""
        if not self.feedback_varies:
            return self.feedback_ids
        values = {ANSWER_FIELD: answer if answer is not None else "nothing", QUESTION_FIELD: question}
        text = _FIELDS.sub(lambda m: values[m.group(0)], self.feedback)  # one pass: values are never re-read
        return continuation_ids(self.tokenizer, [{"role": "user", "content": text}])

    def _out_of_room(self, sample: Sample, feedback_len: int) -> bool:
        if self.max_total_tokens is None:
            return False
        room = feedback_len + 1 + self.sampling.max_new_tokens
        return len(sample.input_ids) + room > self.max_total_tokens

    def _set_rewards(self, sample: Sample, successes: list[float], repeated: list[bool] | None = None) -> None:
        repeated = repeated or [False] * len(successes)
        rewards = [shaped(s, self.shaping, self.reward_scaling, self.reward_bias) - self.repeat_penalty * r
                   for s, r in zip(successes, repeated)]
        if self.discount_mode == "per_turn":  # a planted first turn has a reward but no Turn: skip it
            skip = len(rewards) - len(sample.turns)
            for t, ret, r in zip(sample.turns, turn_returns(rewards, self.discount)[skip:], rewards[skip:]):
                t.reward, t.step_reward = ret, r
            sample.reward = sample.turns[0].reward if sample.turns else rewards[0]
        else:
            sample.reward = rewards[-1] * self.discount ** (len(rewards) - 1)
        solved = next((i + 1 for i, s in enumerate(successes) if s), 0)
        sample.metrics.update(correct=float(solved > 0), solved_turn=float(solved), turns=float(len(successes)),
                              reward=sample.reward)


def _question_key(sample: Sample) -> str:
    return repr(sample.data.get("question", sample.prompt_ids))


def _unit_hash(text: str) -> float:
    """A number in [0, 1) from `text`, the same in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") / 2**64
