"""Weights by broadcast: one process group in which the trainer (rank 0) sends every tensor to the servers.

Both ends build the group here (`WeightGroup`): the trainer with rank 0, each inference server with
rank_offset + i. The group never touches torch.distributed's default group -- the trainer may already be
an FSDP rank, and a server is not part of any job -- so it is built from parts: a `TCPStore` that rank 0
hosts at master_address:master_port, and the backends constructed directly on prefixed views of it.

The store layout is the one torch's `init_process_group` machinery produces for SGLang's
`init_custom_process_group` (store -> PrefixStore(group_name) -> PrefixStore("group_name/") ->
PrefixStore("cpu/") for gloo, "cuda/" for nccl, one backend per group). Matching it is what lets a relayrl
trainer feed real SGLang servers, and an SGLang-style trainer feed `relayrl serve`. gloo moves CPU tensors,
nccl CUDA tensors: each end moves its tensors to that device.

`DistributedSync` is the trainer's side of the HTTP protocol (SGLang's /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group) for all the RemoteEngines of one run: one
group spans the trainer and every server, so one broadcast per tensor reaches them all.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from typing import Any, Protocol
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from relayrl.common.net import free_port


class Member(Protocol):
    """What the group needs of an inference server's client (relayrl.engine.remote.RemoteEngine)."""

    address: str

    def post_async(self, path: str, body: dict, *, timeout: float) -> concurrent.futures.Future: ...

BACKENDS = ("gloo", "nccl")
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
_PREFIX = {"gloo": "cpu", "nccl": "cuda"}  # torch builds one backend, under its first capable device's prefix
_DTYPES = {"float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int32",
           "int64", "bool"}
Named = Iterable[tuple[str, torch.Tensor]]


def resolve_backend(backend: str) -> str:
    """"auto" -> nccl where CUDA is available, else gloo; nccl needs CUDA here (it sends from a GPU)."""
    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in BACKENDS:
        raise ValueError(f"backend must be auto, gloo or nccl, got {backend!r}")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError("weight sync backend nccl needs a CUDA device in this process (use gloo)")
    return backend


def parse_dtype(name: Any) -> torch.dtype:
    """SGLang's dtype spelling ("bfloat16"; "torch.bfloat16" is accepted too) -> torch.dtype."""
    if not isinstance(name, str) or name.removeprefix("torch.") not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (expected one of {sorted(_DTYPES)})")
    return getattr(torch, name.removeprefix("torch."))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def local_address_toward(host: str) -> str:
    """This machine's address on the route to `host` (no packet is sent): the address peers can reach us at,
    which a hostname lookup gets wrong in containers and multi-homed hosts."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(host), 9))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class WeightGroup:
    """One member of a broadcast group (see the module docstring). Construction blocks until every rank has
    joined, or raises after `timeout` seconds; every later operation is bounded by the same timeout."""

    def __init__(self, master_address: str, master_port: int, *, rank: int, world_size: int,
                 backend: str = "gloo", group_name: str = DEFAULT_GROUP, timeout: float = 600.0):
        if backend not in BACKENDS:
            raise ValueError(f"backend must be gloo or nccl, got {backend!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group of {world_size}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise RuntimeError("backend nccl needs a CUDA device (use gloo)")
        self.rank, self.world_size, self.backend, self.group_name = rank, world_size, backend, group_name
        self.timeout = datetime.timedelta(seconds=timeout)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._store = dist.TCPStore(master_address, master_port, world_size, rank == 0, self.timeout)
        root = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, self._store))
        me = master_address if rank == 0 else local_address_toward(master_address)
        self._backend: Any = self._make_backend(dist.PrefixStore(f"{_PREFIX[backend]}/", root), me)

    def _make_backend(self, store: dist.Store, address: str) -> Any:
        if self.backend == "gloo":
            opts = dist.ProcessGroupGloo._Options()
            opts._timeout = self.timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
            backend = dist.ProcessGroupGloo(store, self.rank, self.world_size, opts)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            # the communicator comes with the first broadcast, as in SGLang (its peers may also connect at once)
            backend = dist.ProcessGroupNCCL(store, self.rank, self.world_size, opts)
        backend._set_sequence_number_for_group()  # as torch does for its own groups
        return backend

    def _broadcast_one(self, tensor: torch.Tensor) -> None:
        """One broadcast. A failure closes the group: it is out of step for good, and its peers are released."""
        backend = self._backend
        if backend is None:
            raise RuntimeError(f"weight group {self.group_name!r} is closed")
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.timeout = 0, self.timeout
        try:
            backend.broadcast([tensor], opts).wait()
        except BaseException:
            self.close()
            raise
        finally:
            del backend  # the traceback keeps this frame: it must not keep the connections open (see close)

    def broadcast(self, named_tensors: Named) -> int:
        """Rank 0: send each tensor (one broadcast each, in order) on this group's device; returns the count."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 broadcasts")
        n = 0
        with torch.no_grad():
            for _, tensor in named_tensors:
                self._broadcast_one(tensor.detach().to(self.device).contiguous())
                n += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return n

    def receive(self, specs: Iterable[tuple[str, torch.dtype, tuple[int, ...]]]) -> list[tuple[str, torch.Tensor]]:
        """Ranks > 0: receive one tensor per (name, dtype, shape), in order, into fresh buffers."""
        out = []
        for name, dtype, shape in specs:
            tensor = torch.empty(shape, dtype=dtype, device=self.device)
            self._broadcast_one(tensor)
            out.append((name, tensor))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return out

    def close(self) -> None:
        """Tear the connections down, so a peer blocked in a broadcast fails at once instead of timing out.
        For gloo that takes dropping the backend (its destructor closes the sockets; abort and shutdown leave
        them open); a broadcast still pending here keeps them until it ends. nccl is aborted first."""
        backend, self._backend, self._store = self._backend, None, None
        if backend is not None and self.backend == "nccl":
            with contextlib.suppress(Exception):
                backend.abort()


class WeightSyncError(RuntimeError):
    """A weight broadcast (or the group's setup) failed; the message names the servers that failed and why."""


_SETTLE_S = 15.0  # after a failure, how long the other transfers get to fail in turn (the group is closed)


class DistributedSync:
    """The trainer's side of one broadcast group spanning every server of a run (see the module docstring).

    The RemoteEngines of a RolloutController share one instance: the first update builds the group (world
    size 1 + servers, server i at rank_offset 1 + i); each update then posts /update_weights_from_distributed
    to every server at once while this process broadcasts. RolloutController calls load_weights once per
    engine: the first call of a round transfers to all servers, the others only catch up. Any failure closes
    the group (so no server stays blocked on it) and raises WeightSyncError; the next update builds a new one.
    """

    def __init__(self, backend: str = "auto", *, timeout: float = 600.0):
        resolve_backend(backend)  # fail on a bad name now, not at the first update
        self.backend, self.timeout = backend, timeout
        self.members: list[Member] = []
        self.group_name: str | None = None
        self._group: WeightGroup | None = None
        self._round: tuple[int, set[int]] | None = None  # (version, members not yet called for it)
        self._joins: list[tuple[str, concurrent.futures.Future]] = []  # nccl: init answers still to come
        self._lock = threading.Lock()
        self._closed = False

    def attach(self, engine: Member) -> None:
        with self._lock:
            if self._group is not None:
                raise RuntimeError("the weight group is already formed: attach every engine before the first update")
            self.members.append(engine)

    def update(self, engine: Member, named_tensors: Named, version: int) -> None:
        """Called by each member's load_weights; see the class docstring."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the weight group is closed")
            me = next(i for i, m in enumerate(self.members) if m is engine)
            if self._round is not None and self._round[0] == version and me in self._round[1]:
                self._round[1].discard(me)
                for _ in named_tensors:  # consumed anyway: a collective source (FSDP gathers) must stay in step
                    pass
                return
            self._round = None
            if self._group is None:
                self._form_group()
            self._broadcast(list(named_tensors), version)
            self._round = (version, set(range(len(self.members))) - {me})

    def _form_group(self) -> None:
        backend = resolve_backend(self.backend)
        host = urlsplit(self.members[0].address).hostname or "127.0.0.1"
        address, port, world = local_address_toward(host), free_port(""), 1 + len(self.members)
        self.group_name = f"relayrl-{uuid.uuid4().hex[:12]}"  # fresh per attempt: a failed one may linger
        body = {"master_address": address, "master_port": port, "world_size": world,
                "group_name": self.group_name, "backend": backend}
        calls = [(m.address, m.post_async("/init_weights_update_group", {**body, "rank_offset": 1 + i},
                                          timeout=self.timeout)) for i, m in enumerate(self.members)]
        mine = on_daemon_thread(lambda: WeightGroup(address, port, rank=0, world_size=world, backend=backend,
                                                     group_name=self.group_name, timeout=self.timeout))
        if backend == "nccl":  # a server may answer only once NCCL connects, which our first broadcast does
            self._joins, calls = calls, []
        self._settle(calls, mine, f"forming weight group {self.group_name!r} ({backend}, {address}:{port})",
                     settle=1.0)  # once one member failed, the others' joins can only time out: no waiting for them
        self._group = mine.result()

    def _broadcast(self, tensors: list[tuple[str, torch.Tensor]], version: int) -> None:
        body = {"names": [n for n, _ in tensors], "dtypes": [dtype_name(t.dtype) for _, t in tensors],
                "shapes": [list(t.shape) for _, t in tensors], "group_name": self.group_name,
                "flush_cache": True, "weight_version": str(version)}
        calls = [(m.address, m.post_async("/update_weights_from_distributed", body, timeout=self.timeout))
                 for m in self.members]
        joins, self._joins, group = self._joins, [], self._group
        self._settle(joins + calls, on_daemon_thread(lambda: group.broadcast(tensors)),
                     f"broadcasting weights version {version} over group {self.group_name!r}")

    def _settle(self, calls: list[tuple[str, concurrent.futures.Future]], mine: concurrent.futures.Future, what: str,
                settle: float = _SETTLE_S) -> None:
        """Wait for the servers' answers and this side's part; on the first failure close the group, give the
        rest `settle` seconds to fail too (closing released them), and raise one error naming every failure."""
        futures = [*(f for _, f in calls), mine]
        _, pending = concurrent.futures.wait(futures, timeout=self.timeout + 60,
                                             return_when=concurrent.futures.FIRST_EXCEPTION)
        if not pending and all(f.exception() is None for f in futures):
            return
        self._reset()
        mine.add_done_callback(_close_group)  # a group formed late (or just now) must not linger either
        concurrent.futures.wait(futures, timeout=settle)
        errors = [f"{address}: {_outcome(f)}" for address, f in calls if _outcome(f) != "ok"]
        if _outcome(mine) != "ok":
            errors.append(f"trainer (rank 0): {_outcome(mine)}")
        raise WeightSyncError(f"{what} failed: " + "; ".join(errors or ["no answer in time"]))

    def _reset(self) -> None:
        """Drop the group here and (best effort) on the servers, so the next update starts afresh."""
        group, self._group = self._group, None
        if group is not None:
            group.close()
        for m in self.members:
            with contextlib.suppress(Exception):  # a dead server has nothing left to destroy
                m.post_async("/destroy_weights_update_group", {"group_name": self.group_name}, timeout=10.0)

    def close(self) -> None:
        """Destroy the group on every server and here; idempotent (each member's close calls it)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._group is None:
                return
            calls = []
            for m in self.members:
                with contextlib.suppress(Exception):  # a member already closed cannot post
                    calls.append(m.post_async("/destroy_weights_update_group", {"group_name": self.group_name},
                                              timeout=10.0))
            concurrent.futures.wait(calls, timeout=15.0)
            self._group.close()
            self._group = None


def on_daemon_thread(fn: Callable[[], Any]) -> concurrent.futures.Future:
    """Run fn on a daemon thread: a broadcast stuck on a dead peer must not keep the process from exiting
    (a thread pool's workers are joined at exit). Also used by relayrl serve's side of the routes."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the waiting caller
                future.set_exception(e)

    threading.Thread(target=run, daemon=True, name="relayrl-weight-sync").start()
    return future


def _close_group(future: concurrent.futures.Future) -> None:
    if future.exception() is None and isinstance(future.result(), WeightGroup):
        future.result().close()


def _outcome(future: concurrent.futures.Future) -> str:
    """"ok", or what went wrong with one transfer (its error, or no answer yet)."""
    if not future.done():
        return "no answer in time"
    e = future.exception()
    return "ok" if e is None else f"{type(e).__name__}: {e}"
