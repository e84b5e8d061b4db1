"""A tiny MCP server for the tests, on the official SDK: `python mcp_server_for_tests.py stdio` serves over
stdin/stdout, `python mcp_server_for_tests.py http PORT` over streamable HTTP on 127.0.0.1:PORT/mcp."""

import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("relayrl-tests", log_level="WARNING")
CAPITALS = {"France": "Paris", "Japan": "Tokyo", "Kenya": "Nairobi"}


@server.tool()
def capital(country: str) -> str:
    """The capital city of a country."""
    return CAPITALS.get(country, "unknown")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def broken(reason: str) -> str:
    """Always fails, with the reason as its message (a ToolError: the failure a tool author reports)."""
    raise ToolError(reason)


@server.tool()
def stall(seconds: float) -> str:
    """Sleep, to exercise the caller's timeout."""
    time.sleep(seconds)
    return "woke up"


if __name__ == "__main__":
    if sys.argv[1] == "http":
        server.run(transport="streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
