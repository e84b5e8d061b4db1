"""Fair admission of requests into the engine: no request's size holds up another's.

The engine admits whatever it is handed first-come first-served, so a request of 64 long samples handed to it
whole would take every slot and make a one-token request behind it wait for all 64. Here the server keeps the
queue instead and hands the engine only what it can run now:

- a request is a *ticket*: its samples wait in the ticket, and the tickets take turns, one sample per turn
  (round robin), whenever a slot and enough of the token budget are free;
- one ticket runs at most half of the slots and half of the budget at a time (at least one sample), so a
  newcomer finds room at once even while a large request runs -- it never waits for more than one sample of
  another request to finish;
- a sample's cost is prompt + max_new_tokens (clamped to the context by the caller), the same measure as
  LocalEngine's own `max_tokens_in_flight`, and is returned to the budget when the sample finishes, fails or
  is cancelled.

Everything here runs on the event loop's thread (engine results come back through asyncio.wrap_future), so
the bookkeeping needs no lock.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from relayrl.engine.base import GenOutput, SamplingParams, TokenCallback

Submit = Callable[..., concurrent.futures.Future]  # LocalEngine.submit(prompt, params, rid, on_token, images=)
Images = tuple[bytes, ...]  # a vision-language prompt's image files (relayrl.serve.images)


@dataclass(eq=False)
class _Sample:
    prompt: list[int]
    params: SamplingParams
    rid: str | None
    future: asyncio.Future  # what the request awaits
    on_token: TokenCallback | None = None  # a streamed sample's listener (relayrl.serve.streaming)
    images: Images = ()
    running: asyncio.Future | None = None  # the engine's, once handed over

    @property
    def cost(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


@dataclass(eq=False)
class _Ticket:
    waiting: deque[_Sample] = field(default_factory=deque)
    running: int = 0
    cost: int = 0


class Admission:
    """The server's queue in front of the engine; see the module docstring."""

    def __init__(self, submit: Submit, *, slots: int, budget: int):
        self._submit, self.slots, self.budget = submit, slots, budget
        self.share_slots, self.share_budget = max(1, slots // 2), max(1, budget // 2)
        self.running = self.used = 0
        self._turns: deque[_Ticket] = deque()  # tickets with waiting samples, in turn order

    def run(self, samples: list[tuple[list[int], SamplingParams, str | None]],
            on_tokens: list[TokenCallback | None] | None = None,
            images: list[Images] | None = None) -> list[asyncio.Future]:
        """Queue one request's samples as one ticket; a future per sample resolves to its GenOutput.
        Cancelling a future withdraws its sample (or stops it in the engine at the next step). `on_tokens`: a
        streamed request's listener per sample; `images`: each sample's prompt images."""
        loop = asyncio.get_running_loop()
        ticket = _Ticket()
        for (prompt, params, rid), on_token, imgs in zip(samples, on_tokens or [None] * len(samples),
                                                          images or [()] * len(samples), strict=True):
            s = _Sample(prompt, params, rid, loop.create_future(), on_token, imgs)
            s.future.add_done_callback(lambda f, s=s: self._withdrawn(s) if f.cancelled() else None)
            ticket.waiting.append(s)
        futures = [s.future for s in ticket.waiting]
        self._turns.append(ticket)
        self.pump()
        return futures

    def queued(self) -> int:
        """Samples waiting here (not yet handed to the engine)."""
        return sum(len(t.waiting) for t in self._turns)

    def abort(self, rid: str | None = None) -> int:
        """Finish the waiting samples of trajectory `rid` (all if None) as aborted, with no tokens; running
        ones are the engine's to abort. Returns how many."""
        hit = 0
        for ticket in self._turns:
            for s in [s for s in ticket.waiting if rid is None or s.rid == rid]:
                ticket.waiting.remove(s)
                if not s.future.done():
                    s.future.set_result(GenOutput([], [], [], "abort", len(s.prompt)))
                hit += 1
        self._turns = deque(t for t in self._turns if t.waiting)
        return hit

    # ---- the queue ----------------------------------------------------------------------------------
    def pump(self) -> None:
        """Hand the engine samples, one per ticket per turn, while a slot and the budget allow. A ticket at its
        share is passed over; when the ticket whose turn it is does not fit, everyone waits for a release (so
        a large sample is not starved by a stream of small ones)."""
        passed = 0
        while self._turns and passed < len(self._turns):
            ticket = self._turns[0]
            while ticket.waiting and ticket.waiting[0].future.done():  # cancelled while waiting
                ticket.waiting.popleft()
            if not ticket.waiting:
                self._turns.popleft()
                continue
            sample = ticket.waiting[0]
            if self.running >= self.slots or self.used + sample.cost > self.budget:
                return
            if ticket.running and (ticket.running >= self.share_slots or ticket.cost + sample.cost > self.share_budget):
                self._turns.rotate(-1)
                passed += 1
                continue
            ticket.waiting.popleft()
            self._start(ticket, sample)
            self._turns.rotate(-1)
            passed = 0

    def _start(self, ticket: _Ticket, s: _Sample) -> None:
        try:
            with_images = {"images": s.images} if s.images else {}
            s.running = asyncio.wrap_future(self._submit(s.prompt, s.params, s.rid, s.on_token, **with_images))
        except Exception as e:  # the engine refused it (closed): this sample fails, nothing else
            s.future.set_exception(e)
            return
        ticket.running, ticket.cost = ticket.running + 1, ticket.cost + s.cost
        self.running, self.used = self.running + 1, self.used + s.cost
        s.running.add_done_callback(lambda f: self._finished(ticket, s, f))

    def _finished(self, ticket: _Ticket, s: _Sample, done: asyncio.Future) -> None:
        ticket.running, ticket.cost = ticket.running - 1, ticket.cost - s.cost
        self.running, self.used = self.running - 1, self.used - s.cost
        if not s.future.done():
            if done.cancelled():
                s.future.cancel()
            elif done.exception() is not None:
                s.future.set_exception(done.exception())
            else:
                s.future.set_result(done.result())
        self.pump()

    def _withdrawn(self, s: _Sample) -> None:
        """The request gave up on this sample (client gone): stop it in the engine if it runs there; if it was
        waiting, the samples queued behind it may fit now."""
        if s.running is None:
            self.pump()
        elif not s.running.done():
            s.running.cancel()
