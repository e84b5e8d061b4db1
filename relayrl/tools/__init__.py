"""Tools for agents: a sandboxed Python runner and a calculator, described in chat-template tool format."""

from relayrl.tools.builtin import BUILTIN_TOOLS, Tool, ToolError, calculator_tool, evaluate, python_tool
from relayrl.tools.sandbox import SandboxResult, SandboxUnavailable, check_sandbox, run_python

__all__ = ["BUILTIN_TOOLS", "SandboxResult", "SandboxUnavailable", "Tool", "ToolError", "calculator_tool",
           "check_sandbox", "evaluate", "python_tool", "run_python"]
