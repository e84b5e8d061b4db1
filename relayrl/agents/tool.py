"""`ToolAgent`: multi-turn tool calling in the chat template's tool format.

The model calls a tool by writing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes /
Qwen format, which templates with tool support also describe in their system prompt). The agent runs
each call -- the built-in `python` tool in a bwrap sandbox, `calculator` in-process -- appends the
results as `tool` messages (token ids of the template text, nothing re-encoded), and lets the model go on
until it answers without a tool call or `max_turns` is reached. A malformed call gets an error message
back as its tool result, never an exception. The judge scores the final answer.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from relayrl.agents.base import Agent
from relayrl.agents.chat import continuation_ids, end_of_turn_id
from relayrl.sample import Sample, Status
from relayrl.tools import BUILTIN_TOOLS, Tool

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
DEFAULT_INSTRUCTION = "\nUse a tool when it helps. Put your final answer within \\boxed{}."


def parse_tool_calls(text: str) -> list[dict[str, Any] | str]:
    """Tool calls in a turn: {"name", "arguments"} dicts, or an error string for a malformed one."""
    calls: list[dict[str, Any] | str] = []
    for body in _CALL.findall(text):
        try:
            call = json.loads(body)
        except json.JSONDecodeError as e:
            calls.append(f"error: tool call is not valid JSON ({e.msg} at char {e.pos})")
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            calls.append('error: a tool call must be {"name": ..., "arguments": {...}}')
            continue
        args = call.get("arguments", {})
        if isinstance(args, str):  # some models send arguments as a JSON string
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                args = {}
        calls.append({"name": call["name"], "arguments": args if isinstance(args, dict) else {}})
    return calls


def tools_system_prompt(tools: list[Tool]) -> str:
    """A system prompt describing the tools, for chat templates that have no tool support of their own."""
    lines = ["You can call tools. To call one, write on its own line:",
             '<tool_call>{"name": "TOOL_NAME", "arguments": {"ARG": "VALUE"}}</tool_call>',
             "The result comes back in a tool message. Available tools:"]
    for t in tools:
        args = ", ".join(t.parameters.get("properties", {}))
        lines.append(f"- {t.name}({args}): {t.description}")
    lines.append("When you know the answer, reply without a tool call.")
    return "\n".join(lines)


class ToolAgent(Agent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *, tools: list[str] | None = None,
                 max_turns: int = 4, tool_timeout: float = 10.0, instruction: str = DEFAULT_INSTRUCTION,
                 tool_options: dict[str, dict[str, Any]] | None = None):
        super().__init__(rollout_ctl, tokenizer, sampling, judge)
        names = tools or ["python", "calculator"]
        unknown = [n for n in names if n not in BUILTIN_TOOLS]
        if unknown:
            raise ValueError(f"agent.kwargs.tools: unknown tools {unknown}; built-in: {sorted(BUILTIN_TOOLS)}")
        self.tools = {n: BUILTIN_TOOLS[n](**(tool_options or {}).get(n, {})) for n in names}
        self.max_turns, self.tool_timeout, self.instruction = max_turns, tool_timeout, instruction
        self.eot = end_of_turn_id(tokenizer)
        self.native_tools = "tools" in (getattr(tokenizer, "chat_template", "") or "")
        self._schemas = [t.schema() for t in self.tools.values()] if self.native_tools else None

    def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        tools = list(self.tools.values())
        msgs = [] if self.native_tools else [{"role": "system", "content": tools_system_prompt(tools)}]
        msgs.append({"role": "user", "content": row["question"] + self.instruction})
        kw = {"tools": self._schemas} if self._schemas else {}
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    async def run_call(self, call: dict[str, Any] | str) -> tuple[str, bool]:
        """(result text, ok) of one parsed call; every failure is a message for the model."""
        if isinstance(call, str):
            return call, False
        tool = self.tools.get(call["name"])
        if tool is None:
            return f"error: unknown tool {call['name']!r}; available: {', '.join(self.tools)}", False
        try:
            return await asyncio.wait_for(tool(call["arguments"]), self.tool_timeout), True
        except TimeoutError:
            return f"error: tool {tool.name} timed out after {self.tool_timeout:g}s", False
        except TypeError as e:  # wrong or missing arguments
            return f"error: bad arguments for {tool.name}: {e}", False

    async def generate_sample(self, sample: Sample) -> Sample:
        sample.prompt_ids = self.prompt_ids(sample.data)
        n_calls = n_errors = 0
        final_text = ""
        for turn in range(self.max_turns):
            out = await self.rollout_ctl.generate(sample.input_ids, self.params_for(sample, turn), rid=sample.uid)
            sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
            final_text = self.decode(out.output_ids)
            calls = parse_tool_calls(final_text)
            if not calls or turn + 1 == self.max_turns:
                break
            results = [await self.run_call(c) for c in calls]
            n_calls += len(results)
            n_errors += sum(not ok for _, ok in results)
            if out.output_ids[-1] != self.eot:
                sample.append_context([self.eot])
            msgs = [{"role": "tool", "content": text} for text, _ in results]
            sample.append_context(continuation_ids(self.tokenizer, msgs, self._schemas))
        if self.judge is not None:
            reward, metrics, error = await self.judge.score(final_text, sample.data, sample.uid)
            sample.reward, sample.error = reward, error
            sample.metrics.update(metrics)
        sample.metrics.update(tool_calls=float(n_calls), tool_errors=float(n_errors), turns=float(len(sample.turns)))
        sample.response_text = self.decode(sample.response_ids)
        sample.status = Status.COMPLETED
        return sample
