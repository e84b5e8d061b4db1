"""`ToolAgent`: multi-turn tool calling in the chat template's tool format.

The model calls tools in the format its chat template uses (`relayrl/tools/calls.py`): Hermes/Qwen
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, Llama 3 JSON `{"name": ..., "parameters": {...}}`,
or Mistral `[TOOL_CALLS] [...]`; `tool_format: auto` (the default) reads it off the template. Templates without
tool support get a system prompt that describes the chosen format. The agent runs each call -- the built-in
`python` tool in a bwrap sandbox, `calculator` and the user's own typed functions in-process
(`relayrl/tools/functions.py`), MCP servers' tools through the SDK (`relayrl/tools/mcp.py`) -- appends the
results as `tool` messages (token ids of the template text, nothing re-encoded), and lets the model go on until
it answers without a tool call or `max_turns` is reached. A malformed call, or a tool that raises or outlives
its timeout, gets an error message back as its tool result, never an exception.
The judge scores the final answer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from relayrl.agents.base import AGENTS, Agent
from relayrl.agents.chat import continuation_ids, end_of_turn_id
from relayrl.data.formats import prompt_messages
from relayrl.sample import Sample, Status
from relayrl.tools import BUILTIN_TOOLS, Tool, ToolError, mcp
from relayrl.tools.calls import call_id, resolve_format
from relayrl.tools.functions import check_unique, resolve_tools, with_options

DEFAULT_TOOLS = ("python", "calculator")
DEFAULT_INSTRUCTION = "\nUse a tool when it helps. Put your final answer within \\boxed{}."
log = logging.getLogger(__name__)
_logged: set[tuple[str, str]] = set()


@AGENTS.register("tool")
class ToolAgent(Agent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *,
                 tools: list[str | Callable[..., Any]] | None = None, max_turns: int = 4, tool_timeout: float = 10.0,
                 instruction: str = DEFAULT_INSTRUCTION, tool_options: dict[str, dict[str, Any]] | None = None,
                 tool_format: str = "auto", mcp_servers: list[dict[str, Any]] | None = None):
        super().__init__(rollout_ctl, tokenizer, sampling, judge)
        self._servers = mcp.open_servers(mcp_servers or [])
        try:
            self.tools = self._collect(tools, tool_options or {})
        except BaseException:
            self.close()
            raise
        self.max_turns, self.tool_timeout, self.instruction = max_turns, tool_timeout, instruction
        self.template = getattr(tokenizer, "chat_template", "") or ""
        self.format, why = resolve_format(tool_format, self.template)
        if (self.format.name, why) not in _logged:  # agents are built per worker: say it once per process
            _logged.add((self.format.name, why))
            log.info("tool-call format %s (%s)", self.format.name, why)
        self.eot = end_of_turn_id(tokenizer)
        vocab = tokenizer.get_vocab()
        self.turn_ends = {self.eot} | {vocab[t] for t in self.format.turn_end_tokens if t in vocab}
        self.native_tools = "tools" in self.template
        self._schemas = [t.schema() for t in self.tools.values()] if self.native_tools else None

    def _collect(self, entries: list[str | Callable[..., Any]] | None, options: dict[str, dict[str, Any]],
                 ) -> dict[str, Tool]:
        """The tools by name, in order: `entries` (built-in names, functions, import paths), then each MCP
        server's tools. With neither tools nor MCP servers given: python and calculator."""
        entries = entries or ([] if self._servers else list(DEFAULT_TOOLS))
        listed = [BUILTIN_TOOLS[t](**options.get(t, {})) if isinstance(t, str) else self._user(t, options)
                  for t in resolve_tools(entries)]
        listed += [self._user(t, options) for server in self._servers for t in server.tools]
        check_unique([t.name for t in listed])
        return {t.name: t for t in listed}

    @staticmethod
    def _user(tool: Tool, options: dict[str, dict[str, Any]]) -> Tool:
        return with_options(tool, options.get(tool.name, {}), f"agent.kwargs.tool_options.{tool.name}")

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Before any model loads: an unknown agent.kwargs.tool_format, a tool function without type hints or
        docstring, or an MCP server that does not start fails the run at start-up."""
        resolve_format(kwargs.get("tool_format", "auto"), None)
        tools = resolve_tools(kwargs.get("tools") or [], builtins=False)
        servers = mcp.open_servers(kwargs.get("mcp_servers") or [])  # started and listed, then closed again
        try:
            builtin = [n for n in kwargs.get("tools") or [] if isinstance(n, str) and n in BUILTIN_TOOLS]
            check_unique([*builtin, *(t.name for t in tools), *(t.name for s in servers for t in s.tools)])
        finally:
            for server in servers:
                mcp.release(server)

    def close(self) -> None:
        """Release this agent's MCP sessions (the last agent of the process using a server closes it)."""
        servers, self._servers = self._servers, []
        for server in servers:
            mcp.release(server)

    def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        tools = list(self.tools.values())
        system = None if self.native_tools else self.format.system_prompt(tools)
        msgs = prompt_messages(row, system, self.instruction)  # text or chat-message rows alike
        kw = {"tools": self._schemas} if self._schemas else {}
        text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, **kw)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def calls_text(self, ids: list[int]) -> str:
        """The text a turn's calls are parsed from: with special tokens where the format's marker is one."""
        if not self.format.keep_special:
            return self.decode(ids)
        end = len(ids) - 1 if ids and ids[-1] in self.turn_ends else len(ids)
        return self.tokenizer.decode(ids[:end], skip_special_tokens=False)

    def result_ids(self, results: list[str], ids: list[str]) -> list[int]:
        """Template token ids that hand a turn's tool results back and open the next assistant turn."""
        msgs = self.format.tool_messages(results, ids, self.template)
        return continuation_ids(self.tokenizer, msgs, self._schemas)

    async def run_call(self, call: dict[str, Any] | str) -> tuple[str, bool]:
        """(result text, ok) of one parsed call; every failure is a message for the model."""
        if isinstance(call, str):
            return call, False
        tool = self.tools.get(call["name"])
        if tool is None:
            return f"error: unknown tool {call['name']!r}; available: {', '.join(self.tools)}", False
        timeout = tool.timeout or self.tool_timeout
        try:
            return await asyncio.wait_for(tool(call["arguments"]), timeout), True
        except TimeoutError:
            return f"error: tool {tool.name} timed out after {timeout:g}s", False
        except TypeError as e:  # wrong or missing arguments
            return f"error: bad arguments for {tool.name}: {e}", False
        except ToolError as e:
            return f"error: {e}", False
        except Exception as e:  # a tool that fails costs this call, never the episode
            return f"error: tool {tool.name} failed: {type(e).__name__}: {e}", False

    async def generate_sample(self, sample: Sample) -> Sample:
        sample.prompt_ids = self.prompt_ids(sample.data)
        n_calls = n_errors = 0
        final_text, final_ids = "", []
        for turn in range(self.max_turns):
            out = await self.rollout_ctl.generate(sample.input_ids, self.params_for(sample, turn), rid=sample.uid,
                                                  images=tuple(sample.images))  # every turn sees the prompt's images
            sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason, out.routed_experts)
            final_text, final_ids = self.decode(out.output_ids), list(out.output_ids)
            calls = self.format.parse(self.calls_text(out.output_ids))
            if not calls or turn + 1 == self.max_turns:
                break
            results = [await self.run_call(c) for c in calls]
            n_calls += len(results)
            n_errors += sum(not ok for _, ok in results)
            if out.output_ids[-1] not in self.turn_ends:
                sample.append_context([self.eot])
            ids = [(c.get("id") if isinstance(c, dict) else None) or call_id(sample.uid, turn, i)
                   for i, c in enumerate(calls)]
            sample.append_context(self.result_ids([text for text, _ in results], ids))
        if self.judge is not None:
            reward, metrics, error = await self.judge.score(final_text, sample.data, sample.uid, final_ids)
            sample.reward, sample.error = reward, error
            sample.metrics.update(metrics)
        sample.metrics.update(tool_calls=float(n_calls), tool_errors=float(n_errors), turns=float(len(sample.turns)))
        sample.response_text = self.decode(sample.response_ids)
        sample.status = Status.COMPLETED
        return sample
