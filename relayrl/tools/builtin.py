"""Built-in tools for tool-using agents: a sandboxed Python interpreter and a bounded calculator."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from relayrl.common.errors import InputError
from relayrl.tools.sandbox import SandboxMode, check_sandbox, run_python, set_max_concurrent


class ToolError(Exception):
    """A tool call that failed (the tool raised, or its server answered with an error): the message goes to the
    model as the call's result, and the call counts in the sample's `tool_errors`."""


@dataclass
class Tool:
    """A function the model may call: name, description and JSON-schema parameters, as chat templates
    expect them (`tokenizer.apply_chat_template(..., tools=[t.schema() for t in tools])`)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Awaitable[str]]
    options: dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments (limits)
    timeout: float | None = None  # seconds per call; None: the agent's tool_timeout
    returns: dict[str, Any] | None = None  # the "return" entry of a typed function's schema, as transformers has it

    def schema(self) -> dict[str, Any]:
        function = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": function | ({"return": self.returns} if self.returns else {})}

    async def __call__(self, arguments: dict[str, Any]) -> str:
        return await self.fn(**arguments, **self.options)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "log": math.log,
          "exp": math.exp, "min": min, "max": max}
# Bounds that keep every step cheap, checked BEFORE computing: Python's big integers make `9**9**9` or
# `2**10**10` run for minutes (holding the GIL, so a thread or wait_for could not interrupt it). With integers
# capped at MAX_BITS and expressions at MAX_CHARS, an evaluation is at most a few thousand small operations.
MAX_BITS = 10_000  # about 3,000 decimal digits
MAX_CHARS = 10_000


def _ints(*xs: object) -> bool:
    return all(isinstance(x, int) for x in xs)


def _check_pow(base: float, exp: float) -> None:
    """Refuse an integer power whose result would exceed MAX_BITS (float powers overflow cheaply by themselves)."""
    if _ints(base, exp) and exp > 0 and abs(base) > 1 and (exp.bit_length() > 32
                                                            or exp * math.log2(abs(base)) > MAX_BITS):
        raise ValueError("exponent too large")


def _binop(op: ast.operator, left: float, right: float) -> float:
    if isinstance(op, ast.Pow):
        _check_pow(left, right)
    elif isinstance(op, ast.Mult) and _ints(left, right) and left.bit_length() + right.bit_length() > MAX_BITS:
        raise ValueError("result too large")
    return _OPS[type(op)](left, right)


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        value = node.value
    elif isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        value = _binop(node.op, _eval(node.left), _eval(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        value = _OPS[type(node.op)](_eval(node.operand))
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS \
            and not node.keywords:
        value = _FUNCS[node.func.id](*(_eval(a) for a in node.args))
    else:
        raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")
    if isinstance(value, int) and value.bit_length() > MAX_BITS:
        raise ValueError("result too large")
    return value


def evaluate(expression: str) -> str:
    """Arithmetic only (no names, attributes or calls besides a few math functions); never executes code, never
    raises, and returns quickly for any input: sizes are checked before each step (see MAX_BITS)."""
    if len(expression) > MAX_CHARS:
        return f"error: expression longer than {MAX_CHARS} characters"
    try:
        value = _eval(ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except RecursionError:
        return "error: expression nested too deeply"
    except MemoryError:  # the parser's own limit on nesting
        return "error: expression too large"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


async def _calculator(expression: str) -> str:
    return evaluate(str(expression))


async def _python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 2048,
                  sandbox: SandboxMode = "auto") -> str:
    result = await run_python(str(code), timeout=timeout, memory_mb=memory_mb, max_output=max_output,
                              sandbox=sandbox)
    return result.text()


def calculator_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression, e.g. (12 + 7) * 3 / 2.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                _calculator)


def python_tool(timeout: float = 5.0, memory_mb: int = 512, max_output: int = 2048,
                sandbox: SandboxMode = "auto", max_concurrent: int | None = None) -> Tool:
    """The python tool. `sandbox` (auto | bwrap | none) is checked here, at agent construction: `auto`/`bwrap`
    raise SandboxUnavailable where no sandbox can start, `none` (unsandboxed) warns loudly. `max_concurrent`
    (agent.kwargs.tool_options.python.max_concurrent) sets the process-wide cap on sandboxes running at once;
    unset keeps relayrl.tools.sandbox.DEFAULT_MAX_CONCURRENT."""
    if max_concurrent is not None:
        try:
            set_max_concurrent(max_concurrent)
        except ValueError as e:
            raise InputError(f"agent.kwargs.tool_options.python.max_concurrent: {e}") from None
    check_sandbox(sandbox)
    return Tool("python", "Run a Python script and return what it prints (no network, no files outside a "
                          "scratch folder, limited time and memory).",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                _python, {"timeout": timeout, "memory_mb": memory_mb, "max_output": max_output, "sandbox": sandbox})


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool, "calculator": calculator_tool}
