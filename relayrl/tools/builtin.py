"""Built-in tools for tool-using agents: a sandboxed Python interpreter and a calculator."""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from relayrl.tools.sandbox import run_python


@dataclass
class Tool:
    """A function the model may call: name, description and JSON-schema parameters, as chat templates
    expect them (`tokenizer.apply_chat_template(..., tools=[t.schema() for t in tools])`)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Awaitable[str]]
    options: dict[str, Any] = field(default_factory=dict)  # fixed keyword arguments (limits)

    def schema(self) -> dict[str, Any]:
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    async def __call__(self, arguments: dict[str, Any]) -> str:
        return await self.fn(**arguments, **self.options)


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
        ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
        ast.UAdd: operator.pos}
_FUNCS = {"sqrt": math.sqrt, "abs": abs, "round": round, "floor": math.floor, "ceil": math.ceil, "log": math.log,
          "exp": math.exp, "min": min, "max": max}


def _eval(node: ast.AST) -> float:
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 100:
            raise ValueError("exponent too large")
        return _OPS[type(node.op)](left, right)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*(_eval(a) for a in node.args))
    raise ValueError(f"unsupported expression: {ast.dump(node)[:60]}")


def evaluate(expression: str) -> str:
    """Arithmetic only (no names, attributes or calls besides a few math functions); never executes code."""
    try:
        value = _eval(ast.parse(expression.replace("^", "**").replace(",", ""), mode="eval").body)
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value)


async def _calculator(expression: str) -> str:
    return evaluate(str(expression))


async def _python(code: str, timeout: float = 5.0, memory_mb: int = 512, max_output: int = 2048) -> str:
    result = await run_python(str(code), timeout=timeout, memory_mb=memory_mb, max_output=max_output)
    return result.text()


def calculator_tool() -> Tool:
    return Tool("calculator", "Evaluate an arithmetic expression, e.g. (12 + 7) * 3 / 2.",
                {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
                _calculator)


def python_tool(timeout: float = 5.0, memory_mb: int = 512, max_output: int = 2048) -> Tool:
    return Tool("python", "Run a Python script and return what it prints (no network, no files outside a "
                          "scratch folder, limited time and memory).",
                {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                _python, {"timeout": timeout, "memory_mb": memory_mb, "max_output": max_output})


BUILTIN_TOOLS: dict[str, Callable[..., Tool]] = {"python": python_tool, "calculator": calculator_tool}
