"""`Slots` (relayrl/judge/slots.py), the LLM judge's concurrency limit across judge workers: holds exclude each
other within a process and across the processes one parent started, and a killed holder's slot comes free (the
kernel drops its lock), so a worker killed mid-request never leaks one."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import time

from relayrl.judge.slots import Slots


def _hold_forever(key: str, folder: str, held) -> None:
    async def main() -> None:
        async with Slots(key, 1, folder).hold():
            held.set()
            await asyncio.sleep(100)

    asyncio.run(main())


def test_holds_exclude_each_other_within_a_process(tmp_path):
    slots, inside, peak = Slots("k", 2, tmp_path), [0], [0]

    async def one() -> None:
        async with slots.hold():
            inside[0] += 1
            peak[0] = max(peak[0], inside[0])
            await asyncio.sleep(0.05)
            inside[0] -= 1

    async def main() -> None:
        await asyncio.gather(*(one() for _ in range(6)))

    asyncio.run(main())
    assert peak == [2]


def test_a_killed_holder_in_another_process_frees_its_slot(tmp_path):
    ctx = mp.get_context("spawn")
    held = ctx.Event()
    child = ctx.Process(target=_hold_forever, args=("k", str(tmp_path), held), daemon=True)
    child.start()
    try:
        assert held.wait(60)

        async def try_for(seconds: float) -> bool:
            try:
                async with asyncio.timeout(seconds):
                    async with Slots("k", 1, tmp_path).hold():
                        return True
            except TimeoutError:
                return False

        assert not asyncio.run(try_for(0.3))  # the child's hold counts here: one parent, one scope
        child.kill()
        child.join(10)
        start = time.monotonic()
        assert asyncio.run(try_for(5.0)) and time.monotonic() - start < 1.0
    finally:
        child.kill()
