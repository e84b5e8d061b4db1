"""`RemoteEngine`: an inference server over HTTP, interchangeable with `LocalEngine` behind a RolloutController.

Two dialects:
- `backend="sglang"`: SGLang's native API, spoken by `relayrl serve` and by real SGLang servers: POST /generate
  with token ids, weight reloads from disk, pause / continue / abort, per-token policy versions (relayrl's
  `meta_info.output_token_versions`; plain SGLang gets `weight_version` for every token). A vision-language
  prompt's images go beside its token ids as base64 `image_data`: `relayrl serve` takes the ids as the model's
  processor expanded them (what the trainer packs) and keys them with the images exactly as a LocalEngine does
  (relayrl.engine.vision), so the server samples what a LocalEngine would. Whether a real SGLang server keeps such
  ids as they are is not checked here (no SGLang on the test machines): its multimodal processors may expand the
  image placeholders themselves;
- `backend="vllm"`: vLLM's OpenAI server, POST /v1/completions with the prompt as token ids. Output ids come from
  `choices[0].token_ids` (`return_token_ids`) or else from `"token_id:123"` tokens (`return_tokens_as_token_ids`).
  Weight reloads, pause (mode keep) and resume use vLLM's development routes (VLLM_SERVER_DEV_MODE=1); abort
  returns 0 (vLLM's request ids are its own), and tokens are stamped with the client-side version.

All HTTP runs on one private event loop thread per engine, over one `httpx.AsyncClient`. Callers' loops only
await a future (as with LocalEngine's worker thread), so an engine built on one loop works from any other, and
`close()` closes every connection on the loop that opened it. Cancelling an awaiting task cancels the HTTP
request, which makes `relayrl serve` drop the generation.

Weights reach the server from disk (`weight_sync="disk"`: a versioned safetensors folder, then
/update_weights_from_disk) or by broadcast (`"distributed"`, sglang dialect only: SGLang's
/init_weights_update_group + /update_weights_from_distributed over a torch process group in which the
trainer is rank 0; `relayrl.weights.weight_group.DistributedSync`, shared by the engines of one run).

Failures: connection errors, timeouts and HTTP 5xx are retried with exponential backoff; 4xx raise at once with
the server's message (`RemoteRequestError`); when retries run out `EngineUnavailable` names the address and the
last error. A dead server therefore costs a few connect attempts, never a hang.
"""

from __future__ import annotations

import asyncio
import base64
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
from relayrl.engine.base import GenOutput, InferenceEngine, SamplingParams, TokenCallback
from relayrl.trainer.lora import peek_adapters, save_peft_version
from relayrl.trainer.optim import rounded_to_bf16
from relayrl.weights.transport import save_weights_version
from relayrl.weights.weight_group import BACKENDS, DistributedSync

_RETRYABLE = (httpx.TimeoutException, httpx.NetworkError, httpx.RemoteProtocolError)
_CONTROL_TIMEOUT = 30.0  # pause / abort / health: short calls that must not hang a trainer step
_VERSION_DIR = re.compile(r"^v(\d+)$")


class EngineUnavailable(ConnectionError):
    """The server did not answer after every retry (dead, unreachable, or overloaded)."""


class RemoteRequestError(RuntimeError):
    """The server refused a request (HTTP 4xx or success=false): retrying would not help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class RemoteEngine(InferenceEngine):
    """One inference server at `address`; see the module docstring."""

    _written: dict[tuple[str, int], Path] = {}  # (weights_dir, version) folders written by this process
    _written_lock = threading.Lock()

    def __init__(self, address: str, *, backend: str = "sglang", api_key: str | None = None,
                 model: str | None = None, timeout: float = 600.0, connect_timeout: float = 5.0, retries: int = 3,
                 backoff: float = 0.5, weights_dir: str | None = None, weight_sync: str = "disk",
                 weight_sync_backend: str = "auto", weight_group: DistributedSync | None = None,
                 send_bf16: bool = False):
        if backend not in ("sglang", "vllm"):
            raise ValueError(f"backend must be 'sglang' or 'vllm', got {backend!r}")
        if retries < 0 or timeout <= 0 or connect_timeout <= 0:
            raise ValueError("retries must be >= 0 and timeouts > 0")
        _check_weight_sync(backend, weight_sync, weight_sync_backend)
        self.address, self.backend, self.model = check_address(address), backend, model
        self.timeout, self.connect_timeout, self.retries, self.backoff = timeout, connect_timeout, retries, backoff
        self.weights_dir = Path(weights_dir) if weights_dir else None
        self.send_bf16 = send_bf16  # fp32 weights go out as bf16, rounded stochastically (the server runs bf16)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._version = 0
        self._adapters: list[str] = []  # vLLM LoRA adapters loaded by this engine, newest last (requests name it)
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

    async def _request(self, method: str, path: str, body: dict | None = None, *,
                       timeout: float | None = None, retries: int | None = None) -> Any:
        """One call with retries (see the module docstring); returns the decoded JSON (None if empty)."""
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
        if images and self.backend != "sglang":
            raise ValueError(VLLM_IMAGES)
        if self.backend == "sglang":
            run = self._generate_sglang(list(input_ids), params, rid, images)
        else:
            run = self._generate_vllm(list(input_ids), params, rid)
        out = await asyncio.wrap_future(self._submit(run))
        for i, token in enumerate(out.output_ids if on_token is not None else []):
            on_token(token, out.logprobs[i], out.top_logprobs[i] if out.top_logprobs else None)
        return out

    async def _generate_sglang(self, input_ids: list[int], params: SamplingParams, rid: str | None,
                               images: tuple[bytes, ...] = ()) -> GenOutput:
        """`images`: the prompt's image files, sent as base64 `image_data` beside the processor-expanded ids,
        which relayrl serve takes as they are (module docstring)."""
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": _sglang_sampling(params),
                                "return_logprob": True}
        if images:
            body["image_data"] = [base64.b64encode(b).decode("ascii") for b in images]
        if rid is not None:
            body["rid"] = rid
        client_version = self._version
        answer = await self._request("POST", "/generate", body)
        meta = answer.get("meta_info") or {}
        ids = [int(t) for t in answer.get("output_ids") or []]
        logprobs = self._logprobs([e[0] for e in meta.get("output_token_logprobs") or []], ids)
        versions = meta.get("output_token_versions")
        if not isinstance(versions, list) or len(versions) != len(ids):
            versions = [_as_int(meta.get("weight_version"), client_version)] * len(ids)
        finish = meta.get("finish_reason")
        reason = (finish or {}).get("type") if isinstance(finish, dict) else finish
        matched = finish.get("matched") if isinstance(finish, dict) else None
        out = self._output(ids, logprobs, [int(v) for v in versions], reason, input_ids, meta.get("id"))
        if out.finish_reason == "stop" and isinstance(matched, str) and matched in params.stop_strings:
            out.stop_string = matched
        return out

    async def _generate_vllm(self, input_ids: list[int], params: SamplingParams, rid: str | None) -> GenOutput:
        model = self._adapters[-1] if self._adapters else await self._vllm_model()
        body = {"model": model, "prompt": input_ids, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
                "seed": params.seed, "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
                "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
        if params.stop_strings:  # vLLM's token_ids keep every sampled token; only `text` loses the stop string
            body["stop"] = list(params.stop_strings)
        if rid is not None:
            body["user"] = rid  # vLLM has no sticky id; this only labels the request in its logs
        client_version = self._version
        choice = (await self._request("POST", "/v1/completions", body))["choices"][0]
        lp = choice.get("logprobs") or {}
        if choice.get("token_ids") is not None:
            ids = [int(t) for t in choice["token_ids"]]
        else:
            ids = [_token_id(t) for t in lp.get("tokens") or []]
        logprobs = self._logprobs(lp.get("token_logprobs") or [], ids)
        out = self._output(ids, logprobs, [client_version] * len(ids), choice.get("finish_reason"), input_ids, rid)
        if out.finish_reason == "stop" and choice.get("stop_reason") in params.stop_strings:  # vLLM's stop_reason
            out.stop_string = choice["stop_reason"]
        return out

    async def _vllm_model(self) -> str:
        """The served model's name (vLLM checks it): the `model` argument, else the first of /v1/models."""
        if self.model is None:
            models = (await self._request("GET", "/v1/models", timeout=_CONTROL_TIMEOUT)).get("data") or []
            if not models:
                raise RemoteRequestError(f"{self.address}/v1/models lists no model")
            self.model = models[0]["id"]
        return self.model

    def _logprobs(self, values: list[Any], ids: list[int]) -> list[float]:
        if len(values) != len(ids) or any(v is None for v in values):
            raise RemoteRequestError(f"{self.address}: server returned {len(values)} logprobs for {len(ids)} tokens "
                                     "(training needs one per generated token)")
        return [float(v) for v in values]

    def _output(self, ids: list[int], logprobs: list[float], versions: list[int], reason: Any,
                input_ids: list[int], rid: Any) -> GenOutput:
        self.stats["requests"] += 1
        self.stats["generated_tokens"] += len(ids)
        finish = reason if reason in ("length", "abort") else "stop"
        return GenOutput(ids, logprobs, versions, finish, len(input_ids), {"address": self.address, "id": rid})

    # ---- weights ------------------------------------------------------------------------------
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Write the weights to `weights_dir/v{version}` (atomically) and have the server load them from there.

        Called from the trainer thread. A version names one set of weights: engines of one run share a
        weights_dir, so the first engine to get a version writes it and the others load the same folder.
        The folder must be readable by the server (same machine, or a shared filesystem).
        With weight_sync="distributed" the weights are broadcast instead (see `DistributedSync`).
        With send_bf16, fp32 tensors are sent as bf16 rounded stochastically (relayrl.trainer.optim.rounded_to_bf16).

        LoRA (a trainer with model.lora_rank > 0 sends only adapters, relayrl.trainer.lora): the sglang dialect sends
        them as they are, never rounded to bf16 (they are small, and the merge is in fp32); relayrl serve merges them
        into its base weights, a real SGLang server refuses them. vLLM loads them as a PEFT adapter
        (`_load_vllm_adapter`).
        """
        named_tensors, adapters = peek_adapters(named_tensors)
        if self.send_bf16 and not adapters:
            named_tensors = rounded_to_bf16(named_tensors, version)
        if adapters and self.backend == "vllm":
            self._load_vllm_adapter(named_tensors, version)
            return
        if self.weight_group is not None:
            self.weight_group.update(self, named_tensors, version)
            self._version = version
            return
        if self.weights_dir is None:
            raise ValueError(f"{self!r}: update_weights needs weights_dir (a folder the server can read)")
        previous = self._version
        path = self._write_weights(named_tensors, version)
        self.load_weights_from_disk(str(path), version)
        self._remove_old_weights(previous)

    def _write_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, *,
                       save: Callable[[Path, Iterable[tuple[str, torch.Tensor]], int], Path] = save_weights_version
                       ) -> Path:
        key = (str(self.weights_dir.resolve()), version)
        with RemoteEngine._written_lock:
            path = RemoteEngine._written.get(key)
            if path is None or not path.is_dir():
                path = RemoteEngine._written[key] = save(self.weights_dir, named_tensors, version)
            return path

    def _load_vllm_adapter(self, adapters: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """vLLM: write `weights_dir/v{version}` as a PEFT adapter, load it as adapter `relayrl-v{version}`
        (/v1/load_lora_adapter: the server needs --enable-lora, --max-lora-rank >= model.lora_rank, and
        VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), and name it as the model of every later request. Each version is
        a new adapter, since vLLM refuses to load a name twice; the one before stays loaded for the requests still
        running on it, older ones are unloaded (and their folders removed)."""
        if self.weights_dir is None:
            raise ValueError(f"{self!r}: update_weights needs weights_dir (a folder the server can read)")
        path, name = self._write_weights(adapters, version, save=save_peft_version), f"relayrl-v{version}"
        try:
            self._call(self._request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)},
                                     retries=0))
        except RemoteRequestError as e:
            if e.status in (400, 404, 405):
                raise RemoteRequestError(f"{e} (relayrl trains LoRA against vLLM through its runtime adapter "
                                         "loading: start vLLM with --enable-lora, --max-lora-rank >= model.lora_rank "
                                         "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)", e.status) from e
            raise
        previous, stale = self._version, self._adapters[:-1]
        self._adapters = [*self._adapters[-1:], name]
        self._version = version
        for old in stale:
            with contextlib.suppress(RemoteRequestError):  # already gone (a restarted server) is no error
                self._call(self._request("POST", "/v1/unload_lora_adapter", {"lora_name": old},
                                         timeout=_CONTROL_TIMEOUT, retries=0))
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
        """Have the server load the *.safetensors of `path` (a folder on the server's filesystem) as `version`.

        vLLM: its development routes (VLLM_SERVER_DEV_MODE=1, which relayrl's launcher sets) reload in place
        (`/collective_rpc` reload_weights), then the prefix cache -- KV of the old weights -- is reset."""
        if self.backend == "vllm":
            self._call(self._vllm_reload(str(path), version))
            self._version = version
            return
        answer = self._call(self._request("POST", "/update_weights_from_disk",
                                          {"model_path": str(path), "weight_version": str(version)}))
        if not (answer or {}).get("success", False):
            raise RemoteRequestError(f"{self.address} could not load {path}: {(answer or {}).get('message')}")
        self._version = version

    async def _vllm_reload(self, path: str, version: int) -> None:
        try:
            await self._request("POST", "/collective_rpc",
                                {"method": "reload_weights", "kwargs": {"weights_path": path}})
        except RemoteRequestError as e:
            if e.status == 404:
                raise RemoteRequestError(f"{self.address} has no /collective_rpc: start the vLLM server with "
                                         "VLLM_SERVER_DEV_MODE=1 to let relayrl reload its weights", 404) from e
            raise
        await self._request("POST", "/reset_prefix_cache", timeout=_CONTROL_TIMEOUT)
        with contextlib.suppress(RemoteRequestError):  # newer servers keep a version label; older have none
            await self._request("POST", "/update_weight_version", {"new_version": str(version)},
                                timeout=_CONTROL_TIMEOUT)

    def refresh_version(self) -> int:
        """Read the server's weight version (GET /get_weight_version) into the client-side `version`."""
        if self.backend == "sglang":
            answer = self._call(self._request("GET", "/get_weight_version", timeout=_CONTROL_TIMEOUT)) or {}
            self._version = _as_int(answer.get("weight_version"), self._version)
        return self._version

    def post_async(self, path: str, body: dict[str, Any], *, timeout: float) -> concurrent.futures.Future:
        """POST once (no retries: a repeated weight transfer would wait for a broadcast that never comes) on
        the I/O loop; the future fails with RemoteRequestError when the server answers success=false."""
        async def post() -> Any:
            answer = await self._request("POST", path, body, timeout=timeout, retries=0)
            if not (answer or {}).get("success", False):
                raise RemoteRequestError(f"{self.address}{path}: {(answer or {}).get('message')}")
            return answer

        return self._submit(post())

    # ---- control ------------------------------------------------------------------------------
    def _control(self, path: str, body: dict | None = None) -> Any:
        return self._call(self._request("POST", path, body or {}, timeout=_CONTROL_TIMEOUT))

    def pause(self) -> None:
        """Stop generating at a token boundary; running requests keep their state (SGLang mode in_place,
        vLLM mode keep, a development route: a vLLM server without it is not paused)."""
        if self.backend == "sglang":
            self._control("/pause_generation", {"mode": "in_place"})
        else:
            self._vllm_control("/pause?mode=keep")

    def resume(self) -> None:
        if self.backend == "sglang":
            self._control("/continue_generation")
        else:
            self._vllm_control("/resume")

    def _vllm_control(self, path: str) -> None:
        try:
            self._control(path)
        except RemoteRequestError as e:
            if e.status != 404:
                raise

    def abort(self, rid: str | None = None) -> int:
        """Abort the requests of trajectory `rid` (all if None); they come back with finish_reason "abort"."""
        if self.backend != "sglang":
            return 0
        answer = self._control("/abort_request", {"rid": rid} if rid is not None else {"abort_all": True})
        return _as_int((answer or {}).get("aborted"), 0)

    def flush_cache(self) -> None:
        self._control("/flush_cache" if self.backend == "sglang" else "/reset_prefix_cache")

    def num_running(self) -> int:
        """Requests on the server (GET /get_load), or -1 when it does not say."""
        if self.backend != "sglang":
            return -1
        try:
            load = self._call(self._request("GET", "/get_load", timeout=_CONTROL_TIMEOUT))
            return sum(int(r.get("num_reqs", 0)) for r in (load if isinstance(load, list) else [load]))
        except (RemoteRequestError, EngineUnavailable, AttributeError, TypeError, ValueError):
            return -1

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


def _check_weight_sync(backend: str, weight_sync: str, weight_sync_backend: str) -> None:
    if weight_sync not in ("disk", "distributed"):
        raise ValueError(f"weight_sync must be 'disk' or 'distributed', got {weight_sync!r}")
    if weight_sync_backend not in ("auto", *BACKENDS):
        raise ValueError(f"weight_sync_backend must be auto, gloo or nccl, got {weight_sync_backend!r}")
    if weight_sync == "distributed" and backend != "sglang":
        raise ValueError(VLLM_DISTRIBUTED)


VLLM_IMAGES = ("a vision-language policy's images cannot go to a vLLM server token-in/token-out: its /v1/completions "
               "takes prompt token ids without images, and its chat API renders and tokenizes the prompt itself; use "
               "engine.backend=sglang with relayrl serve (input_ids with image_data), or engine.kind=local")
VLLM_DISTRIBUTED = ("engine.weight_sync=distributed needs backend=sglang: vLLM's weight-transfer routes "
                    "(/init_weight_transfer_engine, /update_weights, ...) use their own NCCL-only rendezvous, "
                    "which relayrl does not speak; use engine.weight_sync=disk with vLLM")


def _sglang_sampling(p: SamplingParams) -> dict[str, Any]:
    """SamplingParams in SGLang's spelling (top_k -1 = off, sampling_seed); defaults left out for old servers."""
    out: dict[str, Any] = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p,
                           "top_k": p.top_k or -1}
    if p.stop_token_ids:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.stop_strings:  # SGLang returns every token it sampled in output_ids; only `text` loses the stop string
        out["stop"] = list(p.stop_strings)
    if p.ignore_eos:
        out["ignore_eos"] = True
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


def _token_id(token: str) -> int:
    if not isinstance(token, str) or not token.startswith("token_id:"):
        raise RemoteRequestError(f"vLLM token {token!r} is not 'token_id:N': start the server with "
                                 "--return-tokens-as-token-ids or use a vLLM that supports return_token_ids")
    return int(token.removeprefix("token_id:"))


def _as_int(value: Any, default: int) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


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
