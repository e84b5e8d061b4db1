"""Urgent requests: an evaluation beside an asynchronous producer is served before the producer's waiting work.

`URGENT` is a context variable. Requests an engine receives from code running inside `urgent()` -- and an asyncio
task inherits the context it is created in, so every task an evaluation's scheduler starts there -- wait ahead of
the plain requests in the engine's queue (behind earlier urgent ones). Running sequences are not interrupted: an
urgent request takes the next free slot. LocalEngine honours it; remote servers order their queues themselves.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator
from contextvars import ContextVar

from relayrl.engine.sequence import Seq

URGENT: ContextVar[bool] = ContextVar("relayrl_urgent", default=False)


@contextlib.contextmanager
def urgent() -> Iterator[None]:
    """Requests submitted inside (and from tasks created inside) go before the waiting plain ones."""
    token = URGENT.set(True)
    try:
        yield
    finally:
        URGENT.reset(token)


class UrgentSeq(Seq):
    """A request submitted under `URGENT`: it waits ahead of the plain ones."""


def enqueue(waiting: deque[Seq], seq: Seq) -> None:
    """Queue `seq`: a plain request at the end, an urgent one behind the urgent requests already waiting."""
    if not isinstance(seq, UrgentSeq):
        waiting.append(seq)
        return
    ahead = 0
    while ahead < len(waiting) and isinstance(waiting[ahead], UrgentSeq):
        ahead += 1
    waiting.insert(ahead, seq)
