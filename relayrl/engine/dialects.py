"""Remote dialects: what a `RemoteEngine` says to one kind of inference server, and what it makes of the answers.

RemoteEngine (relayrl.engine.remote) owns the transport -- the HTTP client and its I/O loop, retries, errors,
health, weight folders on disk, the broadcast group -- and asks its `Dialect` for everything that differs between
servers: the generation request and its answer, pause / resume / abort, cache flushes, load, the server's weight
version, weight reloads from disk and LoRA adapters. What a server lacks is said once, here, by the base class.

Built-in dialects, registered in `REMOTE_BACKENDS` (engine.backend names one, or "package.module:Class" names a
Dialect subclass of your own):
- "sglang": SGLang's native API, spoken by `relayrl serve` and by real SGLang servers: POST /generate with token
  ids, weight reloads from disk, pause / continue / abort, per-token policy versions (relayrl's
  `meta_info.output_token_versions`; plain SGLang gets `weight_version` for every token). A vision-language
  prompt's images go beside its token ids as base64 `image_data`: `relayrl serve` takes the ids as the model's
  processor expanded them (what the trainer packs) and keys them with the images exactly as a LocalEngine does
  (relayrl.engine.vision), so the server samples what a LocalEngine would. Whether a real SGLang server keeps such
  ids as they are is not checked here (no SGLang on the test machines): its multimodal processors may expand the
  image placeholders themselves;
- "vllm": vLLM's OpenAI server, POST /v1/completions with the prompt as token ids. Output ids come from
  `choices[0].token_ids` (`return_token_ids`) or else from `"token_id:123"` tokens (`return_tokens_as_token_ids`).
  Weight reloads, pause (mode keep) and resume use vLLM's development routes (VLLM_SERVER_DEV_MODE=1); abort
  is not offered (vLLM's request ids are its own), and tokens are stamped with the client-side version.
"""

from __future__ import annotations

import base64
import contextlib
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from relayrl.common.errors import InputError
from relayrl.common.registry import Registry
from relayrl.engine.base import NotSupported, SamplingParams

CONTROL_TIMEOUT = 30.0  # pause / abort / load / health: short calls that must not hang a trainer step

# engine.weight_sync=distributed is SGLang's broadcast protocol: the one rule, read from `distributed_weight_sync`
DISTRIBUTED_RULE = ("engine.weight_sync=distributed needs backend=sglang, or a dialect that speaks SGLang's "
                    "broadcast routes (also served by relayrl serve): vLLM's weight-transfer routes "
                    "(/init_weight_transfer_engine, /update_weights, ...) use their own NCCL-only rendezvous, which "
                    "relayrl does not speak; use engine.weight_sync=disk with vLLM")


class EngineUnavailable(ConnectionError):
    """The server did not answer after every retry (dead, unreachable, or overloaded)."""


class RemoteRequestError(RuntimeError):
    """The server refused a request (HTTP 4xx or success=false): retrying would not help."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class Server(Protocol):
    """What a dialect needs of its engine: the address (for errors) and one request with the engine's retries."""

    address: str

    async def request(self, method: str, path: str, body: dict | None = None, *, timeout: float | None = None,
                      retries: int | None = None) -> Any: ...


@dataclass
class Reply:
    """One generation as the server answered it; the engine checks the logprobs and makes it a GenOutput."""

    output_ids: list[int]
    logprobs: list[Any]  # one per output id, as the server sent them (None where it sent none)
    versions: list[int]  # the policy version of each output id
    finish_reason: Any  # the server's word; "length" and "abort" are kept, anything else is a stop
    server_id: Any  # the server's id of the request, for GenOutput.meta
    stop_string: str | None = None


class Dialect(ABC):
    """One server API, bound to one engine (`server`). Every method runs on the engine's I/O loop. The defaults
    below are what relayrl does with a server that lacks the capability; a subclass overrides what its server has."""

    launchers: ClassVar[tuple[str, ...]] = ()  # the engine.launch values whose servers speak it
    distributed_weight_sync: ClassVar[bool] = False  # speaks SGLang's broadcast routes (DISTRIBUTED_RULE)
    takes_images: ClassVar[bool] = False  # a vision-language prompt's images go with its token ids
    # LoRA: True = adapters are loaded as PEFT folders, by name (`load_adapter`); False = they go to the server as
    # weights (relayrl serve merges them into its base weights; a real SGLang server refuses them)
    adapters_by_name: ClassVar[bool] = False

    def __init__(self, server: Server, model: str | None = None):
        self.server, self.model = server, model

    @property
    def no_images(self) -> str:
        """Why a prompt with images cannot go to this server (the engine raises it before any request)."""
        return (f"a vision-language policy's images cannot go to a {type(self).__name__} server; use "
                "engine.backend=sglang with relayrl serve (input_ids with image_data), or engine.kind=local")

    @abstractmethod
    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None,
                       images: tuple[bytes, ...], version: int) -> Reply:
        """Generate on the server; `version` is the engine's, for servers that do not stamp tokens themselves."""

    @abstractmethod
    async def load_from_disk(self, path: str, version: int) -> None:
        """Have the server load the *.safetensors of `path` (on its filesystem) as `version`."""

    @abstractmethod
    async def pause(self) -> None:
        """Stop generating at a token boundary; running requests keep their state."""

    @abstractmethod
    async def resume(self) -> None:
        """Generate again after `pause`."""

    @abstractmethod
    async def flush_cache(self) -> None:
        """Forget cached KV (computed by older weights)."""

    async def abort(self, rid: str | None) -> int:
        """Abort the requests of trajectory `rid` (all if None); how many. Default 0: the server's request ids are
        its own, so relayrl cannot name them."""
        return 0

    async def num_running(self) -> int:
        """Requests on the server; default -1: the server does not say."""
        return -1

    async def weight_version(self) -> int | None:
        """The server's weight version; default None: the server keeps none, the engine's own count stands."""
        return None

    async def load_adapter(self, path: str, version: int) -> None:
        """Load the PEFT folder `path` as the adapter of `version` (only with adapters_by_name)."""
        raise NotSupported(f"{type(self).__name__} does not load LoRA adapters by name")


REMOTE_BACKENDS: Registry[type[Dialect]] = Registry("remote backend")


def dialect_class(backend: str, *, launch: str = "none", weight_sync: str = "disk") -> type[Dialect]:
    """The Dialect that engine.backend names (a registered name or "package.module:Class"), checked against
    engine.launch and engine.weight_sync; an InputError naming the key otherwise. Cheap (no server is asked), so a
    run can check it before any model loads."""
    cls = REMOTE_BACKENDS.get(backend, "engine.backend")
    if not (isinstance(cls, type) and issubclass(cls, Dialect)):
        raise InputError(f"engine.backend: {backend!r} is not a relayrl.engine.dialects.Dialect subclass")
    if launch != "none" and launch not in cls.launchers:
        speaks = [n for n in REMOTE_BACKENDS.names() if launch in REMOTE_BACKENDS.get(n, "engine.backend").launchers]
        raise InputError(f"engine.backend: {backend!r} does not speak the API of the servers engine.launch={launch} "
                         f"starts; set engine.backend={' or '.join(speaks) or 'a dialect that does'}")
    if weight_sync == "distributed" and not cls.distributed_weight_sync:
        raise InputError(DISTRIBUTED_RULE)
    return cls


@REMOTE_BACKENDS.register("sglang")
class SGLangDialect(Dialect):
    """SGLang's native API (module docstring)."""

    launchers = ("relayrl", "sglang")
    distributed_weight_sync = True
    takes_images = True

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None,
                       images: tuple[bytes, ...], version: int) -> Reply:
        """`images`: the prompt's image files, sent as base64 `image_data` beside the processor-expanded ids,
        which relayrl serve takes as they are (module docstring)."""
        body: dict[str, Any] = {"input_ids": input_ids, "sampling_params": sglang_sampling(params),
                                "return_logprob": True}
        if images:
            body["image_data"] = [base64.b64encode(b).decode("ascii") for b in images]
        if rid is not None:
            body["rid"] = rid
        answer = await self.server.request("POST", "/generate", body)
        meta = answer.get("meta_info") or {}
        ids = [int(t) for t in answer.get("output_ids") or []]
        versions = meta.get("output_token_versions")
        if not isinstance(versions, list) or len(versions) != len(ids):
            versions = [as_int(meta.get("weight_version"), version)] * len(ids)
        finish = meta.get("finish_reason")
        reason = (finish or {}).get("type") if isinstance(finish, dict) else finish
        matched = finish.get("matched") if isinstance(finish, dict) else None
        stop = matched if isinstance(matched, str) and matched in params.stop_strings else None
        return Reply(ids, [e[0] for e in meta.get("output_token_logprobs") or []], [int(v) for v in versions],
                     reason, meta.get("id"), stop)

    async def load_from_disk(self, path: str, version: int) -> None:
        answer = await self.server.request("POST", "/update_weights_from_disk",
                                           {"model_path": path, "weight_version": str(version)})
        if not (answer or {}).get("success", False):
            raise RemoteRequestError(f"{self.server.address} could not load {path}: {(answer or {}).get('message')}")

    async def pause(self) -> None:
        await self._control("/pause_generation", {"mode": "in_place"})

    async def resume(self) -> None:
        await self._control("/continue_generation")

    async def flush_cache(self) -> None:
        await self._control("/flush_cache")

    async def abort(self, rid: str | None) -> int:
        answer = await self._control("/abort_request", {"rid": rid} if rid is not None else {"abort_all": True})
        return as_int((answer or {}).get("aborted"), 0)

    async def num_running(self) -> int:
        try:
            load = await self.server.request("GET", "/get_load", timeout=CONTROL_TIMEOUT)
            return sum(int(r.get("num_reqs", 0)) for r in (load if isinstance(load, list) else [load]))
        except (RemoteRequestError, EngineUnavailable, AttributeError, TypeError, ValueError):
            return -1

    async def weight_version(self) -> int | None:
        answer = await self.server.request("GET", "/get_weight_version", timeout=CONTROL_TIMEOUT) or {}
        return as_int(answer.get("weight_version"), None)

    async def _control(self, path: str, body: dict | None = None) -> Any:
        return await self.server.request("POST", path, body or {}, timeout=CONTROL_TIMEOUT)


@REMOTE_BACKENDS.register("vllm")
class VLLMDialect(Dialect):
    """vLLM's OpenAI server (module docstring). LoRA adapters are loaded by name, one per version; the newest names
    the model of every request, the one before it stays for the requests still running on it."""

    launchers = ("vllm",)
    adapters_by_name = True

    def __init__(self, server: Server, model: str | None = None):
        super().__init__(server, model)
        self.adapters: list[str] = []  # adapters this engine loaded, newest last

    @property
    def no_images(self) -> str:
        return ("a vision-language policy's images cannot go to a vLLM server token-in/token-out: its "
                "/v1/completions takes prompt token ids without images, and its chat API renders and tokenizes the "
                "prompt itself; use engine.backend=sglang with relayrl serve (input_ids with image_data), or "
                "engine.kind=local")

    async def generate(self, input_ids: list[int], params: SamplingParams, rid: str | None,
                       images: tuple[bytes, ...], version: int) -> Reply:
        model = self.adapters[-1] if self.adapters else await self._model()
        body = {"model": model, "prompt": input_ids, "max_tokens": params.max_new_tokens,
                "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
                "seed": params.seed, "stop_token_ids": list(params.stop_token_ids), "ignore_eos": params.ignore_eos,
                "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
        if params.stop_strings:  # vLLM's token_ids keep every sampled token; only `text` loses the stop string
            body["stop"] = list(params.stop_strings)
        if rid is not None:
            body["user"] = rid  # vLLM has no sticky id; this only labels the request in its logs
        choice = (await self.server.request("POST", "/v1/completions", body))["choices"][0]
        lp = choice.get("logprobs") or {}
        if choice.get("token_ids") is not None:
            ids = [int(t) for t in choice["token_ids"]]
        else:
            ids = [_token_id(t) for t in lp.get("tokens") or []]
        stop = choice.get("stop_reason")  # vLLM's stop_reason: the stop string, when one ended it
        return Reply(ids, lp.get("token_logprobs") or [], [version] * len(ids), choice.get("finish_reason"), rid,
                     stop if isinstance(stop, str) and stop in params.stop_strings else None)

    async def _model(self) -> str:
        """The served model's name (vLLM checks it): the `model` argument, else the first of /v1/models."""
        if self.model is None:
            models = (await self.server.request("GET", "/v1/models", timeout=CONTROL_TIMEOUT)).get("data") or []
            if not models:
                raise RemoteRequestError(f"{self.server.address}/v1/models lists no model")
            self.model = models[0]["id"]
        return self.model

    async def load_from_disk(self, path: str, version: int) -> None:
        """Its development routes (VLLM_SERVER_DEV_MODE=1, which relayrl's launcher sets) reload in place
        (`/collective_rpc` reload_weights), then the prefix cache -- KV of the old weights -- is reset."""
        try:
            await self.server.request("POST", "/collective_rpc",
                                      {"method": "reload_weights", "kwargs": {"weights_path": path}})
        except RemoteRequestError as e:
            if e.status == 404:
                raise RemoteRequestError(f"{self.server.address} has no /collective_rpc: start the vLLM server with "
                                         "VLLM_SERVER_DEV_MODE=1 to let relayrl reload its weights", 404) from e
            raise
        await self.flush_cache()
        with contextlib.suppress(RemoteRequestError):  # newer servers keep a version label; older have none
            await self.server.request("POST", "/update_weight_version", {"new_version": str(version)},
                                      timeout=CONTROL_TIMEOUT)

    async def load_adapter(self, path: str, version: int) -> None:
        """Load `path` as adapter `relayrl-v{version}` (/v1/load_lora_adapter: the server needs --enable-lora,
        --max-lora-rank >= model.lora_rank, and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1). Each version is a new adapter,
        since vLLM refuses to load a name twice; older ones than the one before are unloaded."""
        name = f"relayrl-v{version}"
        try:
            await self.server.request("POST", "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path},
                                      retries=0)
        except RemoteRequestError as e:
            if e.status in (400, 404, 405):
                raise RemoteRequestError(f"{e} (relayrl trains LoRA against vLLM through its runtime adapter "
                                         "loading: start vLLM with --enable-lora, --max-lora-rank >= model.lora_rank "
                                         "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1)", e.status) from e
            raise
        stale, self.adapters = self.adapters[:-1], [*self.adapters[-1:], name]
        for old in stale:
            with contextlib.suppress(RemoteRequestError):  # already gone (a restarted server) is no error
                await self.server.request("POST", "/v1/unload_lora_adapter", {"lora_name": old},
                                          timeout=CONTROL_TIMEOUT, retries=0)

    async def pause(self) -> None:
        await self._dev_route("/pause?mode=keep")

    async def resume(self) -> None:
        await self._dev_route("/resume")

    async def flush_cache(self) -> None:
        await self.server.request("POST", "/reset_prefix_cache", {}, timeout=CONTROL_TIMEOUT)

    async def _dev_route(self, path: str) -> None:
        """A development route (VLLM_SERVER_DEV_MODE=1); a server without it is left as it is."""
        try:
            await self.server.request("POST", path, {}, timeout=CONTROL_TIMEOUT)
        except RemoteRequestError as e:
            if e.status != 404:
                raise


def sglang_sampling(p: SamplingParams) -> dict[str, Any]:
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


def as_int(value: Any, default: Any) -> Any:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default
