"""Multi-digit arithmetic with a user-written calculator tool: the data and the tool of
examples/calculator_tools.yaml.

Why this task: SmolLM2-135M-Instruct adds and multiplies 1-digit numbers in its head (examples/arithmetic_grpo.yaml
starts near 27%), but 3- and 4-digit products are out of its reach, so a tool that computes them exactly is what
separates success from failure, and the comparison with and without the tool (bench/learning.py tool_learning) measures
what learning to call it is worth.

- `calculate` is the tool: an ordinary typed function with a Google-style docstring, which relayrl turns into the
  JSON schema the model sees (relayrl/tools/functions.py). It is deliberately not the built-in `calculator`: this is
  the path a user's own tool takes. It computes integers exactly and refuses anything else with a short message the
  model can read (a raised exception becomes the call's `error: ...` result, never a crash).
- `rows` generates the questions: `data.train.source: "examples.calculator_env:rows"`, its arguments from
  `data.train.kwargs`; a different `seed` gives the held-out set.
- `integer_reward` is the judge: the final answer must be the number itself. relayrl's math reward accepts
  `\\boxed{7491*598}` for 4479618 (math-verify evaluates the product), which would hand the run without the tool a
  calculator of its own: SmolLM2 writes such answers untrained.

Run from the repository root (the config names these by import path).
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from collections.abc import Callable
from typing import Any

from relayrl.judge.math import final_answer, last_boxed

MAX_EXPRESSION_CHARS = 64  # a question's expression is ~12 characters; anything far longer is not one of ours
MAX_DIGITS = 12  # operands and results: big enough for every question here, small enough to stay instant

_OPS: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_AST_OF: dict[str, type[ast.operator]] = {"+": ast.Add, "-": ast.Sub, "*": ast.Mult}  # a row's operator symbol
DEMOS = ("512 * 38", "4071 + 926")  # the worked examples: one product, one sum


def _value(node: ast.AST) -> int:
    """The integer an expression node stands for; ValueError for anything but integers, + - * and parentheses."""
    if isinstance(node, ast.Constant) and type(node.value) is int:
        value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = -_value(node.operand)
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_value(node.left), _value(node.right))
    else:
        raise ValueError("only integers with +, - and * (and parentheses) are supported")
    if len(str(abs(value))) > MAX_DIGITS:  # checked at every node, so no intermediate result grows unbounded
        raise ValueError(f"numbers are limited to {MAX_DIGITS} digits")
    return value


def calculate(expression: str) -> str:
    """Compute an integer arithmetic expression exactly, e.g. "347 * 29" or "1234 + 5678".

    Args:
        expression: Integers joined by +, - or *, with optional parentheses, e.g. "(12 + 7) * 3".

    Returns:
        The exact integer result, as text.
    """
    if not isinstance(expression, str):  # the model may send a number or a list: say so instead of guessing
        raise ValueError(f"expression must be a string, got {type(expression).__name__}")
    text = expression.strip().replace("×", "*").replace("x", "*").replace(",", "").rstrip("=").strip()
    if not text or len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression must have 1 to {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r}") from None
    return str(_value(tree.body))


def integer_reward(response: str, data: dict[str, Any], *, format_bonus: float = 0.1) -> dict[str, float]:
    """1 when the final answer (the last \\boxed{}, else the last number; as relayrl's math reward reads it) is the
    integer `data["answer"]` written out, plus `format_bonus` for a \\boxed{} answer. An expression such as
    `7491*598` is not an answer here, however it evaluates."""
    answer = final_answer(response) if isinstance(response, str) else None
    correct = answer is not None and re.fullmatch(r"-?[0-9]+", answer) is not None \
        and int(answer) == int(data["answer"])
    boxed = 1.0 if isinstance(response, str) and last_boxed(response) is not None else 0.0
    return {"reward": float(correct) + format_bonus * boxed, "correct": float(correct), "format": boxed}


def question(a: str, op: str, b: str) -> str:
    """How a row asks: the expression in symbols, so the model can copy it into the tool call as it is."""
    return f"What is {a} {op} {b}?"


def demo(shots: str) -> list[dict[str, str]]:
    """Two worked examples before the question, as earlier turns of the chat: "tool" shows the call (in the hermes
    `<tool_call>` format SmolLM2's template gets), its result and the boxed answer; "answer" shows the same two
    questions answered directly, for the run without the tool; "none" shows nothing.

    Why: a 135M model told about a tool in words alone almost never writes a well-formed call (none of 16 samples
    did, even with an example call in the instruction), and GRPO learns nothing from groups that all fail. Shown
    the exchange twice, about a third of its episodes solve the question through the tool before any training,
    and RL makes that habit reliable. The run without the tool gets the same two questions and answers, so
    the two runs differ only in the tool."""
    if shots not in ("tool", "answer", "none"):
        raise ValueError(f"shots must be tool, answer or none, got {shots!r}")
    msgs: list[dict[str, str]] = []
    for expression in DEMOS if shots != "none" else ():
        answer = calculate(expression)
        msgs.append({"role": "user", "content": question(*expression.split())})
        if shots == "tool":
            call = json.dumps({"name": "calculate", "arguments": {"expression": expression}})
            msgs += [{"role": "assistant", "content": f"<tool_call>{call}</tool_call>"},
                     {"role": "tool", "content": answer}]
        msgs.append({"role": "assistant", "content": f"\\boxed{{{answer}}}"})
    return msgs


def rows(n: int = 1000, seed: int = 0, min_digits: int = 3, max_digits: int = 4,
         ops: tuple[str, ...] | list[str] = ("+", "*"), mul_max_digits: int = 3,
         shots: str = "tool") -> list[dict[str, Any]]:
    """`n` questions `a op b` with `min_digits`..`max_digits`-digit operands (products: the second operand at most
    `mul_max_digits` digits, so answers stay under 8 digits), deterministic in `seed`. Each row is {"prompt": the
    `demo(shots)` turns then the question, "answer"}.

    The answers come from Python's integers, never from `calculate`, so a bug in the tool cannot also bless its own
    wrong answers."""
    if not 1 <= min_digits <= max_digits or not ops or set(ops) - set(_AST_OF):
        raise ValueError(f"need 1 <= min_digits <= max_digits and ops from {sorted(_AST_OF)}; got "
                         f"{min_digits}, {max_digits}, {ops}")
    rng, opening = random.Random(seed), demo(shots)

    def number(digits: int) -> int:
        return rng.randint(10 ** (digits - 1), 10 ** digits - 1)

    out = []
    for _ in range(n):
        op = rng.choice(list(ops))
        a = number(rng.randint(min_digits, max_digits))
        b = number(rng.randint(min_digits, min(max_digits, mul_max_digits) if op == "*" else max_digits))
        prompt = [*opening, {"role": "user", "content": question(str(a), op, str(b))}]
        out.append({"prompt": prompt, "answer": str(_OPS[_AST_OF[op]](a, b))})
    return out

