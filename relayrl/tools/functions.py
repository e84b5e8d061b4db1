"""Tools from the user's code: any Python function with type hints and a docstring.

The JSON schema is what `transformers.utils.get_json_schema` makes of the function (what `apply_chat_template(
tools=[fn])` and TRL send to the model): the name, the docstring's first part as the description, the type
hints as parameter types, and the Google-style `Args:` section as parameter descriptions. A function without
them is refused when the agent is built or its options checked, naming the function, its file and line.

User functions are trusted code (the user's own, not the model's), so they run in this process: an `async def`
on the rollout loop, a plain function in a thread of its own. The agent bounds each call with a timeout; a
function that raises returns the error to the model as its result. Model-written code still runs only in the
sandboxed `python` tool.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Awaitable, Callable
from typing import Any

from transformers.utils import get_json_schema
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from relayrl.common.errors import InputError
from relayrl.common.imports import import_from_path
from relayrl.common.threads import in_thread
from relayrl.tools.builtin import BUILTIN_TOOLS, Tool, ToolError

MAX_RESULT_CHARS = 16_000  # a result longer than this is cut: it goes into the model's context
TOOL_OPTIONS = ("timeout",)  # what agent.kwargs.tool_options may set for a user tool


def where(fn: Callable[..., Any]) -> str:
    """`name (file:line)` of a function, for error messages."""
    name = getattr(fn, "__qualname__", None) or repr(fn)
    code = getattr(inspect.unwrap(fn), "__code__", None)
    return f"{name} ({code.co_filename}:{code.co_firstlineno})" if code else name


def function_tool(fn: Callable[..., Any], key: str = "agent.kwargs.tools") -> Tool:
    """A Tool calling `fn`, its schema from the type hints and docstring; InputError if they are missing."""
    try:
        schema = get_json_schema(fn)["function"]
    except (TypeHintParsingException, DocstringParsingException, TypeError, ValueError) as e:
        raise InputError(f"{key}: {where(fn)} cannot be a tool: {str(e).rstrip('!.')}; a tool needs a type hint on "
                         "every parameter and a docstring whose Args: section describes each one (docs/agents.md, "
                         "'Your tools')") from None
    return Tool(schema["name"], schema.get("description", ""), schema["parameters"], _runner(fn, schema["name"]),
                returns=schema.get("return"))


def _runner(fn: Callable[..., Any], name: str) -> Callable[..., Awaitable[str]]:
    """The coroutine the agent awaits: arguments checked against the signature (a TypeError there is the
    model's mistake: "bad arguments"), then the function run; what it raises becomes a ToolError (so a
    TypeError inside the function is not taken for the model's)."""
    signature = inspect.signature(fn)
    is_async = inspect.iscoroutinefunction(inspect.unwrap(fn))

    async def call(**arguments: Any) -> str:
        signature.bind(**arguments)
        try:
            result = await (fn(**arguments) if is_async else in_thread(fn, arguments))
        except Exception as e:  # the user's function failed: one failed call, the model is told why
            raise ToolError(f"tool {name} raised {type(e).__name__}: {e}") from e
        return as_text(result)

    return call


def as_text(value: Any) -> str:
    """A result for the model: strings as they are, other values as JSON where they can be, cut to
    MAX_RESULT_CHARS."""
    if not isinstance(value, str):
        try:
            value = json.dumps(value)
        except (TypeError, ValueError):
            value = str(value)
    return value if len(value) <= MAX_RESULT_CHARS else value[:MAX_RESULT_CHARS] + "\n[output truncated]"


def resolve_tools(entries: list[str | Callable[..., Any]], key: str = "agent.kwargs.tools",
                  builtins: bool = True) -> list[Tool | str]:
    """Each entry as a Tool: a function object, or an import path ('pkg.module:function'). Built-in names stay
    names (the agent builds them with their options); `builtins=False` drops them (a check without the sandbox
    probe)."""
    tools: list[Tool | str] = []
    for i, entry in enumerate(entries):
        if isinstance(entry, str) and entry in BUILTIN_TOOLS:
            tools += [entry] if builtins else []
            continue
        if isinstance(entry, str):
            if ":" not in entry and "." not in entry:
                raise InputError(f"{key}[{i}]: unknown tool {entry!r}; built-in: {', '.join(sorted(BUILTIN_TOOLS))}, "
                                 "or a function by import path ('package.module:function')")
            try:
                entry = import_from_path(entry)
            except (ImportError, ValueError) as e:
                raise InputError(f"{key}[{i}]: {e}") from None
        if not callable(entry):
            raise InputError(f"{key}[{i}]: a tool is a built-in name, an import path or a function, got {entry!r}")
        tools.append(function_tool(entry, f"{key}[{i}]"))
    return tools


def with_options(tool: Tool, options: dict[str, Any], key: str) -> Tool:
    """A copy of a user or MCP tool with its agent.kwargs.tool_options (only `timeout` so far) applied."""
    unknown = sorted(set(options) - set(TOOL_OPTIONS))
    if unknown:
        raise InputError(f"{key}: unknown options {unknown} for tool {tool.name}; known: {', '.join(TOOL_OPTIONS)}")
    return dataclasses.replace(tool, timeout=float(options["timeout"])) if "timeout" in options else tool


def check_unique(names: list[str]) -> None:
    """Tool names must differ: the model calls a tool by its name alone."""
    seen = {n for n in names if names.count(n) > 1}
    if seen:
        raise InputError(f"agent.kwargs.tools: more than one tool is named {', '.join(sorted(seen))}; a model calls "
                         "tools by name, so each needs its own (rename the function, or drop one)")
