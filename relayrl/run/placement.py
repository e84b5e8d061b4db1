"""`launcher=ray`: where a run's processes go when every process is a Ray actor (docs/ray.md).

The driver (`relayrl.run.ray_launch.train_on_ray`) reserves one placement group and starts a trainer actor per
rank; inside those actors three things change, and they ask this module through `ray_placement()` (None outside
Ray, where everything stays a local process):
- launched inference servers (`build.launch_servers`) run in `ServerActor`s on their own bundles;
- the producer of separate placement (`producer.ProducerHandle`) is a `ProducerActor` fed by Ray queues;
- rendezvous addresses (torch.distributed, weight transports) use the node's IP instead of 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.common.errors import install_hint
from relayrl.common.net import free_port
from relayrl.config.schema import Config
from relayrl.run.launcher import make_server

_PLACEMENT: RayPlacement | None = None  # set in every actor of a Ray run, None elsewhere


def ray_placement() -> RayPlacement | None:
    """Where this process may put the run's other processes, when it runs under `launcher=ray`."""
    return _PLACEMENT


def rendezvous_host() -> str:
    """The address other processes of this run reach this one at: the node's IP under Ray (they may be on
    other machines), loopback otherwise."""
    return _node_ip() if _PLACEMENT is not None else "127.0.0.1"


def _ray():
    try:
        import ray
    except ImportError:
        raise ImportError(f"launcher=ray needs Ray: {install_hint('ray')}") from None
    return ray


def _node_ip() -> str:
    return _ray().util.get_node_ip_address()


# ---- the placement group ----------------------------------------------------------------------------------
@dataclass
class Layout:
    """Which bundle of the placement group holds which process."""

    bundles: list[dict[str, float]]
    trainer: list[int]  # one per trainer rank
    servers: list[int]  # one per launched server
    producer: int | None  # separate placement


def layout(cfg: Config) -> Layout:
    r, e = cfg.ray, cfg.engine
    bundles: list[dict[str, float]] = []

    def add(cpus: float, gpus: float) -> int:
        bundles.append({k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v})
        return len(bundles) - 1

    trainer = [add(r.trainer_cpus, r.trainer_gpus) for _ in range(cfg.train.world_size)]
    servers = [add(r.rollout_cpus, r.rollout_gpus) for _ in range(e.launched_servers)]
    producer = add(r.rollout_cpus, r.rollout_gpus) if cfg.scheduler.placement == "separate" else None
    return Layout(bundles, trainer, servers, producer)


@dataclass
class RayPlacement:
    """What an actor of the run needs to place more actors, and to run like the driver (folder, imports)."""

    pg: Any  # ray.util.placement_group.PlacementGroup
    layout: Layout
    cwd: str
    sys_path: list[str]
    server_host: str  # ray.server_host

    def options(self, bundle: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = self.layout.bundles[bundle]
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle),
                "num_cpus": res.get("CPU", 0), "num_gpus": res.get("GPU", 0)}

    def server(self, i: int, engine_cfg, model_path: str, log: Path, seed: int,
               weights_root: str | None = None, lora_rank: int = 0) -> RayServer:
        actor = _remote(ServerActor).options(**self.options(self.layout.servers[i])).remote(self)
        return RayServer(actor, (engine_cfg, model_path, str(log), seed, weights_root, lora_rank, self.server_host))

    def producer(self, main, args: tuple) -> tuple[RayProcess, Any, Any]:
        """The producer as an actor running `main(*args, to_trainer, from_trainer)`, with the two queues it talks
        over (Ray's, not multiprocessing's)."""
        from ray.util.queue import Queue

        to_trainer, from_trainer = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
        actor = _remote(ProducerActor).options(**self.options(self.layout.producer)).remote(self)
        return RayProcess(actor, actor.run.remote(main, *args, to_trainer, from_trainer)), to_trainer, from_trainer


def _remote(cls: type):
    """The Ray actor class of `cls`, made on first use (Ray stays an optional import)."""
    if not hasattr(cls, "_ray_actor"):
        cls._ray_actor = _ray().remote(cls)
    return cls._ray_actor


# ---- actors -----------------------------------------------------------------------------------------------
class _Actor:
    """Every actor of a run works in the driver's folder with the driver's import path, so relative paths in
    the config (data, runs/) and user code named by import path resolve the same (a shared filesystem on a
    multi-node cluster)."""

    def __init__(self, placement: RayPlacement):
        global _PLACEMENT
        with contextlib.suppress(OSError):
            os.chdir(placement.cwd)
        sys.path[:0] = [p for p in placement.sys_path if p not in sys.path]
        _PLACEMENT = placement
        for stream in (sys.stdout, sys.stderr):  # Ray forwards what reaches its log files: write lines at once
            with contextlib.suppress(AttributeError, ValueError):
                stream.reconfigure(line_buffering=True)

    def node(self) -> tuple[str, int]:
        """This actor's node IP and a port free on it (the rank-0 rendezvous of torch.distributed)."""
        ip = _node_ip()
        return ip, free_port(ip)


class ServerActor(_Actor):
    def start(self, engine_cfg, model_path: str, log: str, seed: int, weights_root: str | None, lora_rank: int,
              host: str) -> tuple[str, str]:
        ip = _node_ip()
        self.server = make_server(engine_cfg, model_path, Path(log), seed=seed, host=ip if host == "node" else host,
                                  weights_root=weights_root, lora_rank=lora_rank).start()
        return self.server.url, ip

    def wait_ready(self, timeout: float) -> None:
        self.server.wait_ready(timeout)

    def stop(self) -> None:
        self.server.stop()


class ProducerActor(_Actor):
    def run(self, main, *args) -> None:
        """Run the producer's entry point (passed in, pickled by reference: this module stays below it)."""
        main(*args)


# ---- handles the trainer holds ----------------------------------------------------------------------------
class RayServer:
    """A launched server in its own actor, with ManagedServer's interface (start, wait_ready, url, stop)."""

    def __init__(self, actor, args: tuple):
        self.actor, self.args, self.url = actor, args, ""

    def start(self) -> RayServer:
        self.url, node = _get(self.actor.start.remote(*self.args))
        here = _node_ip()
        if self.args[-1] == "127.0.0.1" and node != here:
            self.stop()
            raise RuntimeError(f"a launched server runs on node {node} but binds 127.0.0.1, which this process "
                               f"(node {here}) cannot reach: set ray.server_host=node on a multi-node cluster")
        return self

    def wait_ready(self, timeout: float) -> RayServer:
        _get(self.actor.wait_ready.remote(timeout))
        return self

    def stop(self) -> None:
        ray = _ray()
        with contextlib.suppress(Exception):
            ray.get(self.actor.stop.remote(), timeout=30)
        ray.kill(self.actor)


class RayProcess:
    """The producer actor with the multiprocessing.Process calls ProducerHandle makes."""

    def __init__(self, actor, ref):
        self.actor, self.ref = actor, ref

    def is_alive(self) -> bool:
        return not _ray().wait([self.ref], timeout=0)[0]

    @property
    def exitcode(self) -> int | None:
        if self.is_alive():
            return None
        try:
            _ray().get(self.ref)
            return 0
        except Exception:  # noqa: BLE001 - the failure itself reaches the trainer as an "error" message
            return 1

    def join(self, timeout: float | None = None) -> None:
        """Wait for the producer to finish, then free its bundle (the actor has nothing left to do)."""
        if _ray().wait([self.ref], timeout=timeout)[0]:
            self.kill()

    def kill(self) -> None:
        _ray().kill(self.actor)


def _get(ref):
    """ray.get that raises the actor's own exception (with its message), not a RayTaskError wrapper."""
    ray = _ray()
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None
