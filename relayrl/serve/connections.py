"""How many connections `relayrl serve` holds open, and for how long one may sit idle.

Each connection is a file descriptor. Past the process's open-files limit `accept()` fails, and asyncio then
logs a traceback for every waiting connection (megabytes a second) while good requests time out. So:
- at most `max_connections` are open (--max-connections; default half the open-files limit, at most 1024,
  leaving the rest to the model's files, threads and logs, and to a burst of accepted connections not yet
  closed: the listen backlog, which bounds such a burst, is sized to fit what is left). At the cap, the
  connection idle the longest (no request in flight) is closed to make room, so idle sockets can never lock
  out a good client; when every connection is busy, the newcomer gets 503 and is closed;
- a connection gets `idle_timeout` seconds (--idle-timeout) from its opening, and from the end of each answer,
  to send a request's complete headers; a client that sends nothing, or trickles its headers, is closed;
- resource errors are logged once per `LOG_EVERY` seconds with a count, never once per connection (also
  asyncio's own "socket.accept() out of system resource", should the process run out of descriptors anyway).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("relayrl.serve")
LOG_EVERY = 10.0  # seconds between two records of the same resource error
FD_RESERVE = 64  # descriptors the cap leaves free at least (model files, threads, logs, the listening socket)
MAX_DEFAULT = 1024
_BUSY_BODY = (b'{"error": {"message": "the server is at its connection limit (--max-connections)", '
              b'"type": "service_unavailable", "param": null, "code": null}}')
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"content-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY))


def open_files_limit() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft if soft != resource.RLIM_INFINITY else 2**20


def default_max_connections() -> int:
    return max(8, min(MAX_DEFAULT, open_files_limit() // 2))


def check_max_connections(n: int) -> int:
    """`n` if it leaves FD_RESERVE descriptors free; else a ValueError naming the flag and the limit."""
    limit = open_files_limit()
    if not 1 <= n <= limit - FD_RESERVE:
        raise ValueError(f"--max-connections must be in [1, {limit - FD_RESERVE}] (the open-files limit {limit} "
                         f"minus {FD_RESERVE}; raise it with ulimit -n), got {n}")
    return n


def listen_backlog(max_connections: int) -> int:
    """The listening socket's backlog, which is also how many connections asyncio accepts in one go before any
    of them can be closed: kept within the descriptors the cap leaves free, so a burst cannot exhaust them."""
    room = open_files_limit() - max_connections - FD_RESERVE
    return max(16, min(2048, room // 2))


class Throttled:
    """One log record per `every` seconds for a recurring condition, counting the occurrences in between."""

    def __init__(self, every: float = LOG_EVERY):
        self.every, self.last, self.count = every, -float("inf"), 0

    def __call__(self, message: str, *args: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.every:
            log.warning(message + " (%d times since the last such record; logged at most every %.0fs)", *args,
                        self.count, self.every)
            self.last, self.count = now, 0


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    idle_timeout: float


class Connections:
    """The open connections in the order they became idle; decides who is closed at the cap."""

    def __init__(self, limits: ConnectionLimits):
        self.limits = limits
        self.idle_since: dict[Any, float] = {}  # protocol -> when it became idle (absent: a request in flight)
        self.open: set[Any] = set()
        self.at_cap, self.refused = Throttled(), Throttled()

    def admit(self, conn: Any) -> bool:
        """Room for `conn`, closing the longest-idle connection at the cap; False when all are busy."""
        if len(self.open) >= self.limits.max_connections:
            oldest = next(iter(self.idle_since), None)
            if oldest is None:
                self.refused("connection limit %d reached with every connection busy: refusing new ones",
                             self.limits.max_connections)
                return False
            self.at_cap("connection limit %d reached: closing the longest-idle connections",
                        self.limits.max_connections)
            oldest.close_idle()
            self.drop(oldest)
        self.open.add(conn)
        return True

    def idle(self, conn: Any) -> None:
        self.idle_since.pop(conn, None)
        self.idle_since[conn] = time.monotonic()

    def busy(self, conn: Any) -> None:
        self.idle_since.pop(conn, None)

    def drop(self, conn: Any) -> None:
        self.open.discard(conn)
        self.idle_since.pop(conn, None)


def protocol_class(connections: Connections) -> type[H11Protocol]:
    """uvicorn's h11 protocol, bounded by `connections` (module doc); pass it as uvicorn.Config(http=...)."""
    timeout = connections.limits.idle_timeout

    class BoundedH11(H11Protocol):
        _idle_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if not connections.admit(self):
                transport.write(_BUSY)
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            connections.idle(self)
            self._idle_timer = self.loop.call_later(timeout, self._idle_expired)

        def _in_flight(self) -> bool:
            return self.cycle is not None and not self.cycle.response_complete

        def handle_events(self) -> None:
            super().handle_events()
            if self._in_flight():
                connections.busy(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()

        def _idle_expired(self) -> None:
            if not self._in_flight():
                self.close_idle()

        def close_idle(self) -> None:
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            connections.drop(self)
            if self._idle_timer is not None:
                self._idle_timer.cancel()
            super().connection_lost(exc)

    return BoundedH11


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Make asyncio's per-connection "out of system resource" tracebacks one record per LOG_EVERY seconds;
    everything else goes to the handler that was there."""
    previous: Callable[..., Any] | None = loop.get_exception_handler()
    throttled = Throttled()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if "out of system resource" in str(context.get("message", "")):
            throttled("%s: %s", context["message"], context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
