"""MCP servers as tool providers (`agent.kwargs.mcp_servers`), through the official `mcp` SDK.

A server is `{command: ..., args: [...], env: {...}, cwd: ...}` (started as a subprocess, spoken to over stdio)
or `{url: "http://host:port/mcp", headers: {...}}` (streamable HTTP), plus an optional `timeout` (seconds per
call of its tools; the agent's `tool_timeout` otherwise) and `start_timeout` (seconds to start and list tools).
Its tools are listed when the agent is built; their input schemas go into the chat template's tool list as
they are, and each call goes through `ClientSession.call_tool`.

Lifetime: one session per server per process. The session lives in a task on its own event loop in a
daemon thread: agents are built in plain synchronous code (the tool list is needed for their prompts before
any rollout runs), the SDK's anyio cancel scopes tie a session to the task that opened it, and rollouts run
on another loop (the Env's) that calls across with `run_coroutine_threadsafe`. Agents of one process (train
and eval) share the session through a reference count; the last `release` closes it (a stdio server's
process ends with it), and an atexit hook closes what a crashed run left open.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import json
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from relayrl.common.errors import InputError, install_hint
from relayrl.tools.builtin import Tool, ToolError

if TYPE_CHECKING:  # the SDK is an optional extra (relayrl[agents]), imported where a server is used
    from mcp_types import CallToolResult

KEYS = ("command", "args", "env", "cwd", "url", "headers", "timeout", "start_timeout")
START_TIMEOUT = 30.0
_POOL: dict[str, tuple[McpServer, int]] = {}
_POOL_LOCK = threading.Lock()


def check_spec(spec: Any, key: str) -> dict[str, Any]:
    """The server entry, checked for shape only (no process started): exactly one of command / url."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise InputError(f"{key}: MCP servers need the mcp package: {install_hint('agents')}") from None
    if not isinstance(spec, dict):
        raise InputError(f"{key}: an MCP server is a mapping with `command` (stdio) or `url` (HTTP), got {spec!r}")
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        raise InputError(f"{key}: unknown keys {unknown}; known: {', '.join(KEYS)}")
    if ("command" in spec) == ("url" in spec):
        raise InputError(f"{key}: give exactly one of `command` (a stdio server) or `url` (streamable HTTP)")
    if "args" in spec and not (isinstance(spec["args"], list) and all(isinstance(a, str) for a in spec["args"])):
        raise InputError(f"{key}.args: a list of strings, got {spec['args']!r}")
    return spec


def address(spec: dict[str, Any]) -> str:
    """How errors name a server: its URL, or its command line."""
    return spec.get("url") or " ".join([spec["command"], *spec.get("args", [])])


def _root_cause(e: BaseException) -> BaseException:
    """The first leaf of anyio's nested ExceptionGroups: what actually went wrong."""
    while isinstance(e, BaseExceptionGroup) and e.exceptions:
        e = e.exceptions[0]
    return e


@contextlib.asynccontextmanager
async def _streams(spec: dict[str, Any]) -> AsyncIterator[tuple[Any, Any]]:
    """The SDK transport the spec names: a stdio subprocess or a streamable-HTTP connection."""
    if "url" in spec:
        import httpx2
        from mcp.client.streamable_http import streamable_http_client

        async with httpx2.AsyncClient(headers=spec.get("headers") or {}, timeout=httpx2.Timeout(30.0)) as http, \
                streamable_http_client(spec["url"], http_client=http) as (read, write):
            yield read, write
    else:
        from mcp.client.stdio import StdioServerParameters, stdio_client

        params = StdioServerParameters(command=spec["command"], args=list(spec.get("args", [])),
                                       env=spec.get("env"), cwd=spec.get("cwd"))
        async with stdio_client(params) as (read, write):
            yield read, write


class McpServer:
    """One connected server: `tools` (relayrl Tools calling it) and `close()`."""

    def __init__(self, spec: dict[str, Any], key: str):
        self.spec, self.key, self.name = spec, key, address(spec)
        self.tools: list[Tool] = []
        self._session: Any = None
        self._serve_task: asyncio.Task | None = None
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relayrl-mcp", daemon=True)
        self._thread.start()
        self._task = asyncio.run_coroutine_threadsafe(self._serve(), self._loop)
        self._start()

    def _start(self) -> None:
        """Wait until the server has listed its tools; a server that fails or stays silent is an InputError."""
        wait = float(self.spec.get("start_timeout", START_TIMEOUT))
        done, _ = concurrent.futures.wait([self._ready, self._task], wait, concurrent.futures.FIRST_COMPLETED)
        if self._ready in done:
            return
        if self._task in done:
            error = self._task.exception()
            why = _describe(_root_cause(error)) if error else "it closed the connection"
        else:
            why = f"no answer within {wait:g}s"
        self.close()
        raise InputError(f"{self.key}: MCP server {self.name} did not start: {why}")

    async def _serve(self) -> None:
        """The session's whole life in one task: open, list tools, wait for close, exit the SDK contexts."""
        from mcp import ClientSession

        self._serve_task = asyncio.current_task()
        async with _streams(self.spec) as (read, write), ClientSession(read, write) as session:
            await session.initialize()
            self.tools = await self._list_tools(session)
            self._session = session
            self._ready.set_result(None)
            await self._stop.wait()

    async def _list_tools(self, session: Any) -> list[Tool]:
        from mcp_types import PaginatedRequestParams

        listed, cursor = [], None
        while True:
            page = await session.list_tools(params=PaginatedRequestParams(cursor=cursor) if cursor else None)
            listed += page.tools
            cursor = page.next_cursor
            if not cursor:
                break
        timeout = self.spec.get("timeout")
        return [Tool(t.name, t.description or "", t.input_schema, self._caller(t.name),
                     timeout=float(timeout) if timeout is not None else None) for t in listed]

    def _caller(self, name: str):
        async def call(**arguments: Any) -> str:
            future = asyncio.run_coroutine_threadsafe(self._call(name, arguments), self._loop)
            return await asyncio.wrap_future(future)  # cancelling this (a timeout) cancels the call there
        return call

    async def _call(self, name: str, arguments: dict[str, Any]) -> str:
        """The call's text for the model; an error reply or a broken connection is a ToolError."""
        if self._session is None:
            raise ToolError(f"MCP server {self.name} is closed")
        try:
            result = await self._session.call_tool(name, arguments)
        except Exception as e:  # protocol errors, a dead server: one failed call, not the run
            raise ToolError(f"MCP server {self.name}: {_describe(_root_cause(e))}") from None
        from mcp_types import CallToolResult

        if not isinstance(result, CallToolResult):
            raise ToolError(f"tool {name} asked for input, which a relayrl agent does not give")
        text = _result_text(result)
        if result.is_error:
            raise ToolError(text)
        return text

    def close(self) -> None:
        """End the session (and a stdio server's process), then the loop thread."""
        if self._loop.is_closed():
            return
        self._session = None
        # a started session leaves the SDK's contexts cleanly; one still starting is cancelled (it may never answer)
        self._loop.call_soon_threadsafe(self._stop.set if self._ready.done() else self._cancel_start)
        with contextlib.suppress(BaseException):
            self._task.result(timeout=10)
        self._task.cancel()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self._loop.close()


    def _cancel_start(self) -> None:
        if self._serve_task is not None:
            self._serve_task.cancel()
        else:
            self._task.cancel()


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def _result_text(result: CallToolResult) -> str:
    """Text contents joined; other content kinds are named; structured-only results become JSON."""
    from mcp_types import TextContent

    parts = [c.text if isinstance(c, TextContent) else f"[{c.type} content]" for c in result.content]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def open_servers(specs: list[Any], key: str = "agent.kwargs.mcp_servers") -> list[McpServer]:
    """A session with each server (`acquire`), or none: when one fails, those already open are released."""
    servers: list[McpServer] = []
    try:
        for i, spec in enumerate(specs):
            servers.append(acquire(check_spec(spec, f"{key}[{i}]"), f"{key}[{i}]"))
    except BaseException:
        for server in servers:
            release(server)
        raise
    return servers


def acquire(spec: dict[str, Any], key: str) -> McpServer:
    """This process's session with the server `spec` names, started on first use (see the module docstring)."""
    ident = json.dumps(spec, sort_keys=True, default=str)
    with _POOL_LOCK:
        server, refs = _POOL.get(ident, (None, 0))
        if server is None:
            server = McpServer(spec, key)
        _POOL[ident] = (server, refs + 1)
        return server


def release(server: McpServer) -> None:
    """Drop one reference; the last one closes the session."""
    with _POOL_LOCK:
        for ident, (s, refs) in list(_POOL.items()):
            if s is server:
                if refs > 1:
                    _POOL[ident] = (s, refs - 1)
                    return
                del _POOL[ident]
    server.close()


@atexit.register
def close_all() -> None:
    """Close every session still open: a run that failed before closing its agents leaves no server behind."""
    with _POOL_LOCK:
        servers = [s for s, _ in _POOL.values()]
        _POOL.clear()
    for server in servers:
        server.close()
