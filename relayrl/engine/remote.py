"""`RemoteEngine`: an inference server over HTTP, interchangeable with `LocalEngine` behind a RolloutController.

The engine owns the transport; its `Dialect` (relayrl.engine.dialects: "sglang", SGLang's native API, also spoken by
`relayrl serve`; "vllm", vLLM's OpenAI server; or one of your own by import path) says everything that differs
between servers: the generation request and its answer, pause / resume / abort, flushes, load, weight reloads and
LoRA adapters.

All HTTP runs on one private event loop thread per engine, over one `httpx.AsyncClient`. Callers' loops only
await a future (as with LocalEngine's worker thread), so an engine built on one loop works from any other, and
`close()` closes every connection on the loop that opened it. Cancelling an awaiting task cancels the HTTP
request, which makes `relayrl serve` drop the generation.

Weights reach the server from disk (`weight_sync="disk"`: a versioned safetensors folder, then the dialect's
reload from disk) or by broadcast (`"distributed"`, for dialects that speak SGLang's /init_weights_update_group +
/update_weights_from_distributed: a torch process group in which the trainer is rank 0;
`relayrl.weights.weight_group.DistributedSync`, shared by the engines of one run).

Failures: connection errors, timeouts and HTTP 5xx are retried with exponential backoff; 4xx raise at once with
the server's message (`RemoteRequestError`); when retries run out `EngineUnavailable` names the address and the
last error. A dead server therefore costs a few connect attempts, never a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import re
import shutil
import threading
import time
from collections.abc import Callable, Coroutine, Iterable
from pathlib import Path
from typing import Any

import httpx
import torch

from relayrl.common.net import check_address
from relayrl.config.engine import EngineConfig
from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams, TokenCallback
from relayrl.engine.dialects import EngineUnavailable, RemoteRequestError, Reply, dialect_class
from relayrl.trainer.lora import peek_adapters, save_peft_version
from relayrl.trainer.optim import rounded_to_bf16
from relayrl.weights.transport import save_weights_version
from relayrl.weights.weight_group import BACKENDS, DistributedSync

_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_VERSION_DIR = re.compile(r"^v(\d+)$")


class RemoteEngine(InferenceEngine):
    """One inference server at `address`, spoken to in the dialect `backend` names; see the module docstring."""

    _written: dict[tuple[str, int], Path] = {}  # (weights_dir, version) folders written by this process
    _written_lock = threading.Lock()

    def __init__(self, address: str, *, backend: str = "sglang", api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0, connect_timeout: float = 5.0, retries: int = 3,
                 backoff: float = 0.5, weights_dir: str | None = None, weight_sync: str = "disk",
                 weight_sync_backend: str = "auto", weight_group: DistributedSync | None = None,
                 send_bf16: bool = False):
        if retries < 0 or timeout <= 0 or connect_timeout <= 0:
            raise ValueError("retries must be >= 0 and timeouts > 0")
        if weight_sync not in ("disk", "distributed"):
            raise ValueError(f"weight_sync must be 'disk' or 'distributed', got {weight_sync!r}")
        if weight_sync_backend not in ("auto", *BACKENDS):
            raise ValueError(f"weight_sync_backend must be auto, gloo or nccl, got {weight_sync_backend!r}")
        self.address, self.backend = check_address(address), backend
        self.dialect = dialect_class(backend, weight_sync=weight_sync)(self, model)
        self.timeout, self.connect_timeout, self.retries, self.backoff = timeout, connect_timeout, retries, backoff
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.send_bf16 = send_bf16  # fp32 weights go out as bf16, rounded stochastically (the server runs bf16)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._version = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._client: httpx.AsyncClient | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.stats = {"requests": 0, "retries": 0, "generated_tokens": 0}
        self.weight_group: DistributedSync | None = None
        if weight_sync == "distributed":  # alone, the engine gets a group of its own (the trainer and its server)
            self.weight_group = weight_group or DistributedSync(weight_sync_backend, timeout=timeout)
            self.weight_group.attach(self)

    @classmethod
    def for_servers(cls, addresses: Iterable[str], **kwargs: Any) -> list[RemoteEngine]:
        """One engine per server address. With weight_sync="distributed" they share one DistributedSync, so
        one broadcast group spans the trainer and every server and each tensor is sent once for all of them."""
        shared = None
        if kwargs.get("weight_sync") == "distributed":  # (the engines check the other settings)
            shared = DistributedSync(kwargs.get("weight_sync_backend", "auto"), timeout=kwargs.get("timeout", 600.0))
        return [cls(a, weight_group=shared, **kwargs) for a in addresses]

    @classmethod
    def from_config(cls, e: EngineConfig, addresses: Iterable[str], weights_dir: str) -> list[RemoteEngine]:
        """One engine per server of a run's `engine` section (engine.backend checked against engine.launch and
        engine.weight_sync first, an InputError naming the key). fp32 weights go to bf16 servers rounded
        stochastically unless engine.weight_rounding says nearest."""
        dialect_class(e.backend, launch=e.launch, weight_sync=e.weight_sync)
        return cls.for_servers(addresses, backend=e.backend, api_key=e.api_key, timeout=e.request_timeout,
                               retries=e.retries, weights_dir=weights_dir, weight_sync=e.weight_sync,
                               weight_sync_backend=e.weight_sync_backend,
                               send_bf16=e.dtype == "bfloat16" and e.weight_rounding == "stochastic")

    def __repr__(self) -> str:
        return f"RemoteEngine({self.address!r}, backend={self.backend!r})"

    # ---- the private I/O loop -----------------------------------------------------------------
    def _io_loop(self) -> asyncio.AbstractEventLoop:
        """Start the I/O thread and its client on first use (a never-used engine holds no thread)."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"{self!r} is closed")
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                                name=f"relayrl-remote-{self.address}")
                self._thread.start()
            return self._loop

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:  # only touched on the I/O loop, so no lock is needed
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            self._client = httpx.AsyncClient(base_url=self.address, headers=self._headers, limits=limits,
                                             timeout=httpx.Timeout(self.timeout, connect=self.connect_timeout))
        return self._client

    def _submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        try:
            return asyncio.run_coroutine_threadsafe(self._guarded(coro), self._io_loop())
        except BaseException:
            coro.close()
            raise

    async def _guarded(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """A request cut short by close() fails with a clear error instead of a bare cancellation."""
        try:
            return await coro
        except asyncio.CancelledError:
            if self._closed:
                raise RuntimeError(f"{self!r} was closed during the request") from None
            raise

    def _call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        """Run on the I/O loop and wait (for the synchronous control methods); bounded by the HTTP timeouts."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("synchronous RemoteEngine methods cannot run on its own I/O loop")
        return self._submit(coro).result()

    async def request(self, method: str, path: str, body: dict | None = None, *,
                      timeout: float | None = None, retries: int | None = None) -> Any:
        """One call with retries, on the I/O loop (see the module docstring); returns the decoded JSON (None if
        empty, the text if not JSON). What the dialect speaks through."""
        client = self._http()
        t = httpx.Timeout(timeout or self.timeout, connect=self.connect_timeout)
        last, retries = "", self.retries if retries is None else retries
        for attempt in range(retries + 1):
            if attempt:
                self.stats["retries"] += 1
                await asyncio.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                r = await client.request(method, path, json=body, timeout=t)
            except _RETRYABLE as e:
                last = f"{type(e).__name__}: {e}"
                continue
            if r.status_code >= 500:
                last = f"HTTP {r.status_code}: {_message(r)}"
                continue
            if r.status_code >= 400:
                raise RemoteRequestError(f"{self.address}{path}: HTTP {r.status_code}: {_message(r)}", r.status_code)
            if not r.content:
                return None
            try:
                return r.json()
            except ValueError:  # vLLM answers its LoRA routes in plain text
                return r.text
        raise EngineUnavailable(f"engine server {self.address} unavailable ({method} {path}, "
                                f"{retries + 1} attempts): {last}")

    # ---- generation ---------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    async def agenerate(self, input_ids: list[int], params: SamplingParams, rid: str | None = None,
                        on_token: TokenCallback | None = None, images: tuple[bytes, ...] = ()) -> GenOutput:
        """Generate on the server; awaitable from any event loop (the HTTP call runs on the engine's own).
        `on_token` gets the tokens once the server answered (the server's answer is not streamed)."""
        if not input_ids:
            raise ValueError("input_ids is empty")
        if images and not self.dialect.takes_images:
            raise ValueError(self.dialect.no_images)
        input_ids = list(input_ids)
        run = self.dialect.generate(input_ids, params, rid, tuple(images), self._version)
        out = self._output(await asyncio.wrap_future(self._submit(run)), len(input_ids))
        for i, token in enumerate(out.output_ids if on_token is not None else []):
            on_token(token, out.logprobs[i], out.top_logprobs[i] if out.top_logprobs else None)
        return out

    def _output(self, reply: Reply, prompt_len: int) -> GenOutput:
        """The dialect's reply as a GenOutput, with one logprob per token or a RemoteRequestError."""
        ids, values = reply.output_ids, reply.logprobs
        if len(values) != len(ids) or any(v is None for v in values):
            raise RemoteRequestError(f"{self.address}: server returned {len(values)} logprobs for {len(ids)} tokens "
                                     "(training needs one per generated token)")
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(ids)
        finish = reply.finish_reason if reply.finish_reason in ("length", "abort") else "stop"
        out = GenOutput(ids, [float(v) for v in values], reply.versions, finish, prompt_len,
                        {"address": self.address, "id": reply.server_id})
        if finish == "stop":
            out.stop_string = reply.stop_string
        return out

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the weights to `weights_dir/v{version}` (atomically) and have the server load them from there.

        Called from the trainer thread. A version names one set of weights: engines of one run share a
        weights_dir, so the first engine to get a version writes it and the others load the same folder.
        The folder must be readable by the server (same machine, or a shared filesystem).
        With weight_sync="distributed" the weights are broadcast instead (see `DistributedSync`).
        With send_bf16, fp32 tensors are sent as bf16 rounded stochastically (relayrl.trainer.optim.rounded_to_bf16).

        LoRA (a trainer with model.lora_rank > 0 sends only adapters, relayrl.trainer.lora): a dialect that loads
        adapters by name (vLLM) gets them as a PEFT folder; the others get them as they are, never rounded to bf16
        (they are small, and the merge is in fp32): relayrl serve merges them into its base weights, a real SGLang
        server refuses them.
        """
        named_tensors, adapters = peek_adapters(named_tensors)
        if self.send_bf16 and not adapters:
            named_tensors = rounded_to_bf16(named_tensors, version)
        if adapters and self.dialect.adapters_by_name:
            self._load_adapter(named_tensors, version)
            return
        if self.weight_group is not None:
            self.weight_group.update(self, named_tensors, version)
            self._version = version
            return
        previous = self._version
        path = self._write_weights(named_tensors, version)
        self.load_weights_from_disk(str(path), version)
        self._remove_old_weights(previous)

    def _write_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                       save: Callable[[Path, Iterable[tuple[str, torch.Tensor]], int], Path] = save_weights_version
                       ) -> Path:
        if self.weights_dir is None:
            raise ValueError(f"{self!r}: load_weights needs weights_dir (a folder the server can read)")
        key = (str(self.weights_dir.resolve()), version)
        with RemoteEngine._written_lock:
            path = RemoteEngine._written.get(key)
            if path is None or not path.is_dir():
                path = RemoteEngine._written[key] = save(self.weights_dir, named_tensors, version)
            return path

    def _load_adapter(self, adapters: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write `weights_dir/v{version}` as a PEFT adapter and have the dialect load it by name
        (VLLMDialect.load_adapter); every later request names it."""
        path, previous = self._write_weights(adapters, version, save=save_peft_version), self._version
        self._call(self.dialect.load_adapter(str(path), version))
        self._version = version
        self._remove_old_weights(previous)

    def _remove_old_weights(self, previous: int) -> None:
        """Keep the loaded version and the one before it; older folders only fill the disk."""
        for folder in self.weights_dir.iterdir():
            m = _VERSION_DIR.match(folder.name)
            if m and int(m.group(1)) < previous and folder.is_dir():
                shutil.rmtree(folder, ignore_errors=True)
                with RemoteEngine._written_lock:
                    RemoteEngine._written.pop((str(self.weights_dir.resolve()), int(m.group(1))), None)

    def load_weights_from_disk(self, path: str, version: int) -> None:
        """Have the server load the *.safetensors of `path` (a folder on the server's filesystem) as `version`."""
        self._call(self.dialect.load_from_disk(str(path), version))
        self._version = version

    def refresh_version(self) -> int:
        """Read the server's weight version into the client-side `version` (kept when the server keeps none)."""
        server = self._call(self.dialect.weight_version())
        if server is not None:
            self._version = server
        return self._version

    def post_async(self, path: str, body: dict[str, Any], *, timeout: float) -> concurrent.futures.Future:
        """POST once (no retries: a repeated weight transfer would wait for a broadcast that never comes) on
        the I/O loop; the future fails with RemoteRequestError when the server answers success=false."""
        async def post() -> Any:
            answer = await self.request("POST", path, body, timeout=timeout, retries=0)
            if not (answer or {}).get("success", False):
                raise RemoteRequestError(f"{self.address}{path}: {(answer or {}).get('message')}")
            return answer

        return self._submit(post())

    # ---- control (the dialect's calls) --------------------------------------------------------
    def pause(self) -> None:
        """Stop generating at a token boundary; running requests keep their state (SGLang mode in_place,
        vLLM mode keep, a development route: a vLLM server without it is not paused)."""
        self._call(self.dialect.pause())

    def resume(self) -> None:
        self._call(self.dialect.resume())

    def abort(self, rid: str | None = None) -> int:
        """Abort the requests of trajectory `rid` (all if None); they come back with finish_reason "abort"."""
        return self._call(self.dialect.abort(rid))

    def flush_cache(self) -> None:
        self._call(self.dialect.flush_cache())

    def num_running(self) -> int:
        """Requests on the server, or -1 when it does not say."""
        return self._call(self.dialect.num_running())

    def health(self) -> bool:
        """One GET /health, no retries: True when it answers 200."""
        async def probe() -> bool:
            try:
                r = await self._http().get("/health", timeout=httpx.Timeout(5.0, connect=self.connect_timeout))
            except httpx.HTTPError:
                return False
            return r.status_code == 200

        return self._call(probe())

    def wait_ready(self, timeout: float = 60.0, interval: float = 0.25) -> None:
        """Poll /health until it answers 200; EngineUnavailable naming the address after `timeout` seconds."""

        deadline = time.monotonic() + timeout
        while not self.health():
            if time.monotonic() >= deadline:
                raise EngineUnavailable(f"engine server {self.address} not healthy after {timeout:.0f}s "
                                        "(GET /health)")
            time.sleep(interval)

    def close(self) -> None:
        """Close the connections (on the loop that opened them) and stop the I/O thread; idempotent. The first
        member of a weight group to close destroys the group (on every server, while their engines are open)."""
        if self.weight_group is not None:
            self.weight_group.close()
        with self._lock:
            loop, self._loop, self._closed = self._loop, None, True
        if loop is None:
            return

        async def shutdown() -> None:
            others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in others:  # requests still in flight fail now instead of waiting on a stopped loop
                t.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            if self._client is not None:
                await self._client.aclose()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(shutdown(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(timeout=10)
        loop.close()


def _message(r: httpx.Response) -> str:
    """The server's error message (SGLang / OpenAI {"error": {"message"}}, FastAPI {"detail"}) or the raw text."""
    try:
        body = r.json()
    except ValueError:
        return r.text[:500] or r.reason_phrase
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        for key in ("detail", "message", "error"):
            if body.get(key):
                return str(body[key])
    return str(body)[:500]
