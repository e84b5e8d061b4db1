"""The calculator example's own parts (examples/calculator_env.py): the user-written tool computes exactly and
refuses what it does not handle with a message, its schema comes from its hints and docstring, the rows are
deterministic and right, and the reward wants the number itself (not an expression math-verify would evaluate)."""

import importlib
from pathlib import Path

import pytest

from relayrl.tools.functions import function_tool

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def calc(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # the config names the example by import path from the repository root
    return importlib.import_module("examples.calculator_env")


@pytest.mark.parametrize("expression, result", [
    ("347 * 29", "10063"), ("1234 + 5678", "6912"), ("12 - 30", "-18"), ("(12 + 7) * 3", "57"),
    (" 1,234 + 5 = ", "1239"), ("7491 × 598", "4479618"), ("-5 * -5", "25"), ("999999 * 999999", "999998000001"),
])
def test_calculate_computes_exactly(calc, expression, result):
    assert calc.calculate(expression) == result


@pytest.mark.parametrize("expression, why", [
    ("7 / 2", "only integers"), ("2 ** 10", "only integers"), ("1.5 + 1", "only integers"),
    ("__import__('os').getcwd()", "only integers"), ("abs(-3)", "only integers"), ("True + 1", "only integers"),
    ("", "1 to 64 characters"), ("1 + " * 30 + "1", "1 to 64 characters"), ("12 +", "cannot parse"),
    ("999999 * 9999999", "limited to 12 digits"), ("9999999999999", "limited to 12 digits"),
    (12, "must be a string"),
])
def test_calculate_refuses_what_it_does_not_handle(calc, expression, why):
    """A refusal raises: ToolAgent hands the message to the model as the call's `error: ...` result."""
    with pytest.raises(ValueError, match=why):
        calc.calculate(expression)


def test_the_schema_comes_from_the_hints_and_docstring(calc):
    schema = function_tool(calc.calculate).schema()["function"]
    assert schema["name"] == "calculate" and schema["description"].startswith("Compute an integer arithmetic")
    described = 'Integers joined by +, - or *, with optional parentheses, e.g. "(12 + 7) * 3".'
    assert schema["parameters"] == {"type": "object", "required": ["expression"],
                                    "properties": {"expression": {"type": "string", "description": described}}}


def test_rows_are_deterministic_right_and_held_out(calc):
    train, again, held_out = calc.rows(50, seed=1), calc.rows(50, seed=1), calc.rows(50, seed=12345)
    assert train == again and train != held_out
    for row in train + held_out:
        a, op, b = row["prompt"][-1]["content"].removeprefix("What is ").removesuffix("?").split()
        assert 3 <= len(a) <= 4 and 3 <= len(b) <= (3 if op == "*" else 4)
        assert row["answer"] == str(int(a) + int(b) if op == "+" else int(a) * int(b))
    assert {row["prompt"][-1]["content"].split()[3] for row in train} == {"+", "*"}


def test_the_worked_examples_differ_only_in_the_tool(calc):
    tool, answer, none = (calc.rows(1, seed=3, shots=s)[0]["prompt"] for s in ("tool", "answer", "none"))
    assert [m["role"] for m in tool] == ["user", "assistant", "tool", "assistant"] * 2 + ["user"]
    assert tool[1]["content"] == '<tool_call>{"name": "calculate", "arguments": {"expression": "512 * 38"}}</tool_call>'
    assert tool[2]["content"] == "19456" and tool[3]["content"] == "\\boxed{19456}"
    assert answer == [m for m in tool if m["role"] == "user" or m["content"].startswith("\\boxed")]
    assert none == tool[-1:]
    with pytest.raises(ValueError, match="shots must be"):
        calc.rows(1, shots="some")


@pytest.mark.parametrize("response, correct, fmt", [
    ("\\boxed{4479618}", 1.0, 1.0), ("\\boxed{4,479,618}", 1.0, 1.0), ("so it is 4479618", 1.0, 0.0),
    ("\\boxed{7491*598}", 0.0, 1.0), ("\\boxed{7491 \\times 598}", 0.0, 1.0), ("\\boxed{4479618.0}", 0.0, 1.0),
    ("\\boxed{4479617}", 0.0, 1.0), ("", 0.0, 0.0),
])
def test_the_reward_wants_the_number_itself(calc, response, correct, fmt):
    assert calc.integer_reward(response, {"answer": "4479618"}) == {
        "reward": correct + 0.1 * fmt, "correct": correct, "format": fmt}
