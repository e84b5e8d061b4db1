"""Blocking user code on an asyncio loop: a daemon thread per call, abandoned at its caller's timeout.

Callers: user tool functions (relayrl/tools/functions.py) and environments' plain `reset`/`step` methods
(relayrl/envs/base.py). Both are trusted code that may block or hang; one hung call must cost that call only.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any


async def in_thread(fn: Callable[..., Any], arguments: dict[str, Any], kind: str = "tool") -> Any:
    """Run a blocking function in a daemon thread of its own. Not `asyncio.to_thread`: its pool's threads are
    joined at interpreter exit and capped in number, so a function that never returns would hold the run's
    exit and, after a few hangs, every later call. A hung daemon thread is abandoned at the timeout (Python
    cannot kill a thread) and dies with the process. The thread is named relayrl-<kind>-<function name>, so a
    hung one is recognisable in a stack dump."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if future.done():  # cancelled at the timeout: nobody waits any more
            return
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)

    def target() -> None:
        try:
            result, error = fn(**arguments), None
        except Exception as e:
            result, error = None, e
        except BaseException as e:  # SystemExit and the like: a failed call, not a stop of the rollout loop
            result, error = None, RuntimeError(f"{type(e).__name__}: {e}")
        with contextlib.suppress(RuntimeError):  # the loop closed while the function ran
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=target, name=f"relayrl-{kind}-{getattr(fn, '__name__', 'fn')}", daemon=True).start()
    return await future
