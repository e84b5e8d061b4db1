"""`MathFeedbackEnv`: reflection (answer, hear it is wrong, retry) as an environment for `EnvAgent`.

Each step checks the assistant's answer with the math judge's own rule (`relayrl.judge.math.math_reward`: the
last \\boxed{}, else the last number, compared by math-verify) and either ends the episode (right, or out of
attempts) or replies with a feedback user turn. With the default rewards (1 right, 0 wrong) and EnvAgent's
`reward: sum` with `discount: g`, a sample solved at turn T scores g^(T-1), which is ReflectionAgent's
`discount_mode: final` without shaping; `reward: per_turn` gives every turn its reward-to-go, as
ReflectionAgent's `discount_mode: per_turn` (set `wrong_reward: -1` for its -1/+1 shaping).

Why this exists beside ReflectionAgent: it shows that the generic agent carries a multi-turn task whole, and
it is the template for feedback environments of one's own (code that runs tests, a checker, a game).
"""

from __future__ import annotations

import re
from typing import Any

from relayrl.envs.base import Message, Step
from relayrl.judge.math import final_answer, math_reward

DEFAULT_FEEDBACK = "Your answer is either wrong or could not be parsed. Please reflect on it and try again."
_FIELDS = re.compile(r"\{answer\}|\{question\}")  # the rest of the text is literal (\boxed{} stays)


class MathFeedbackEnv:
    """Checks math answers; wrong ones get `feedback` ({answer}: the rejected answer, {question}: the row's)."""

    def __init__(self, feedback: str = DEFAULT_FEEDBACK, right_reward: float = 1.0, wrong_reward: float = 0.0,
                 max_attempts: int | None = None, answer_key: str = "answer"):
        self.feedback, self.answer_key, self.max_attempts = feedback, answer_key, max_attempts
        self.right_reward, self.wrong_reward = right_reward, wrong_reward
        self.row: dict[str, Any] = {}
        self.attempts = 0

    def reset(self, row: dict[str, Any]) -> list[Message] | None:
        """Keep the row to check answers against; None: the model sees relayrl's prompt of the row, the same
        tokens a single-turn or reflection run starts from."""
        self.row, self.attempts = row, 0
        return None

    def step(self, assistant_text: str) -> Step:
        """Right: done with `right_reward`. Wrong: `wrong_reward` and the feedback, unless out of attempts.
        A plain method: math-verify may take a while, and EnvAgent runs plain methods off the event loop."""
        self.attempts += 1
        correct = math_reward(assistant_text, self.row, answer_key=self.answer_key)["correct"] > 0
        if correct or (self.max_attempts is not None and self.attempts >= self.max_attempts):
            return Step([], self.right_reward if correct else self.wrong_reward, True)
        answer = final_answer(assistant_text)
        values = {"{answer}": answer if answer is not None else "nothing",
                  "{question}": str(self.row.get("question", ""))}
        text = _FIELDS.sub(lambda m: values[m.group(0)], self.feedback)  # one pass: values are never re-read
        return Step([{"role": "user", "content": text}], self.wrong_reward, False)
