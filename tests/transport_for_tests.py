"""A weight sender here and a receiver in a spawned process, for the dist transport's tests (CPU and GPU)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable

from relayrl.common.net import free_port
from relayrl.weights.transport import DistSender


def run_dist_pair(receive: Callable, send: Callable[[DistSender], None]):
    """`receive(address, out)` runs in a spawned process (a module-level function: spawn pickles it by name) and puts
    what it got on `out`; `send(sender)` runs here. Returns what the receiver put, once both ends closed cleanly."""
    address = f"127.0.0.1:{free_port()}"
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    proc = ctx.Process(target=receive, args=(address, out))
    proc.start()
    sender = DistSender(address)
    try:
        send(sender)
    finally:
        sender.close()
    got = out.get(timeout=60)
    proc.join(30)
    assert proc.exitcode == 0
    return got
