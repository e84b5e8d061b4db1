"""`ServerState`: what the routes of `relayrl serve` share (engine, tokenizer, limits, lifecycle flags)."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import HTTPException

from relayrl.engine.base import SamplingParams, TokenCallback
from relayrl.engine.local import LocalEngine
from relayrl.serve.admission import Admission
from relayrl.serve.images import ServeImages
from relayrl.serve.limits import ServerLimits


@dataclass
class ServerState:
    """What the routes share: the engine, its tokenizer, the limits, and the server's lifecycle flags."""

    engine: LocalEngine
    tokenizer: Any
    model_path: str
    limits: ServerLimits
    api_key: str | None = None
    weights_root: Path | None = None  # /update_weights_from_disk reads only under it; None: the route is off
    closing: bool = False  # set at shutdown: new generations get 503, running ones are aborted
    paused: bool = False
    images: ServeImages | None = None  # a vision-language model's image side; None: image inputs are refused
    admission: Admission = field(init=False)
    _tokenizing: concurrent.futures.ThreadPoolExecutor = field(init=False)

    def __post_init__(self) -> None:
        self.admission = Admission(self.engine.submit, slots=self.engine.max_batch_size, budget=self.limits.budget)
        # one thread: tokenizing never blocks the event loop, and the tokenizer is never used by two at once
        self._tokenizing = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="relayrl-serve-tokenize")

    def submit(self, jobs: list[tuple[list[int], SamplingParams, str | None]],
               on_tokens: list[TokenCallback | None] | None = None,
               images: list[tuple[bytes, ...]] | None = None) -> list[asyncio.Future]:
        """Queue one request's samples (see `relayrl.serve.admission`; `on_tokens` streams them; `images`: each
        sample's prompt images, checked by relayrl.serve.images). Submitted now,
        not when an awaiting task first runs: once `closing` is set no request can slip in after the shutdown's
        abort."""
        self.check_open()
        return self.admission.run(jobs, on_tokens, images)

    def generate(self, prompt: list[int], params: SamplingParams, rid: str | None = None) -> asyncio.Future:
        return self.submit([(prompt, params, rid)])[0]

    async def in_tokenizer_thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        return await self.in_tokenizer_thread(lambda: [self.tokenizer(t)["input_ids"] for t in texts])

    async def abort(self, rid: str | None = None) -> int:
        """Abort the trajectory `rid` (all if None): what waits in the server's queue, then what runs."""
        return self.admission.abort(rid) + await asyncio.to_thread(self.engine.abort, rid)

    def num_requests(self) -> int:
        return self.engine.num_running() + self.admission.queued()

    def check_open(self) -> None:
        if self.closing:
            raise HTTPException(status_code=503, detail="server is shutting down")

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
