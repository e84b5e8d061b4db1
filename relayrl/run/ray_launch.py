"""`launcher=ray`: every process of a run is a Ray actor, placed by one placement group (docs/ray.md).

The driver (`relayrl train ... launcher=ray`) starts or joins a Ray cluster, reserves one bundle per trainer
rank, per launched inference server and (separate placement) for the producer, and starts a `TrainerWorker`
per rank. The workers run the same `relayrl.run.loop.train` as a local run; only three things change under Ray,
and they ask this module through `ray_placement()`:
- launched servers (`build.launch_servers`) run in `ServerActor`s on their own bundles;
- the producer of separate placement (`producer.ProducerHandle`) is a `ProducerActor` fed by Ray queues;
- rendezvous addresses (torch.distributed, weight transports) use the node's IP instead of 127.0.0.1.

Stopping: Ctrl-C in the driver puts a stop message on a queue each worker watches; the worker turns it into a
KeyboardInterrupt in its main thread, so the loop's own cleanup runs (servers, producer, judge stop) exactly as
on Ctrl-C in a local run. Actors still alive after `ray.stop_grace` seconds are killed; Ray kills the actors a
worker created when it dies, and launched servers and judge processes die with their parents.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from relayrl.config import from_dict, to_dict
from relayrl.config.schema import Config, RayConfig
from relayrl.run.launcher import free_port, make_server

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
        raise ImportError("launcher=ray needs Ray: pip install 'ray>=2.40' (or relayrl[ray])") from None
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
               weights_root: str | None = None) -> RayServer:
        actor = _remote(ServerActor).options(**self.options(self.layout.servers[i])).remote(self)
        return RayServer(actor, (engine_cfg, model_path, str(log), seed, weights_root, self.server_host))

    def producer(self, args: tuple) -> tuple[RayProcess, Any, Any]:
        """The producer as an actor, with the two queues `producer_main` talks over (Ray's, not multiprocessing's)."""
        from ray.util.queue import Queue

        to_trainer, from_trainer = Queue(actor_options={"num_cpus": 0}), Queue(actor_options={"num_cpus": 0})
        actor = _remote(ProducerActor).options(**self.options(self.layout.producer)).remote(self)
        return RayProcess(actor, actor.run.remote(*args, to_trainer, from_trainer)), to_trainer, from_trainer


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


class TrainerWorker(_Actor):
    def run(self, cfg_dict: dict, rank: int, world_size: int, master: tuple[str, int], stop) -> dict[str, float]:
        from relayrl.run.loop import train

        cfg = from_dict(Config, cfg_dict)
        if cfg.train.engine == "fsdp":  # what torchrun would set; each actor sees only its own GPU
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        with _interruptible(stop):
            return train(cfg)


class ServerActor(_Actor):
    def start(self, engine_cfg, model_path: str, log: str, seed: int, weights_root: str | None,
              host: str) -> tuple[str, str]:
        ip = _node_ip()
        self.server = make_server(engine_cfg, model_path, Path(log), seed=seed, host=ip if host == "node" else host,
                                  weights_root=weights_root).start()
        return self.server.url, ip

    def wait_ready(self, timeout: float) -> None:
        self.server.wait_ready(timeout)

    def stop(self) -> None:
        self.server.stop()


class ProducerActor(_Actor):
    def run(self, *args) -> None:
        from relayrl.run.producer import producer_main

        producer_main(*args)


@contextlib.contextmanager
def _interruptible(stop):
    """Turn a message on `stop` into a KeyboardInterrupt in this (main) thread, so the run cleans up as on Ctrl-C."""
    def interrupt(*_):
        raise KeyboardInterrupt

    done = threading.Event()

    def watch() -> None:
        from ray.util.queue import Empty

        while not done.is_set():
            with contextlib.suppress(Empty):
                stop.get(timeout=1.0)
                if not done.is_set():
                    os.kill(os.getpid(), signal.SIGUSR1)
                return

    previous = signal.signal(signal.SIGUSR1, interrupt)
    threading.Thread(target=watch, name="relayrl-stop-watch", daemon=True).start()
    try:
        yield
    finally:
        done.set()
        signal.signal(signal.SIGUSR1, previous)


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


# ---- the driver -------------------------------------------------------------------------------------------
def train_on_ray(cfg: Config) -> dict[str, float]:
    """Run `relayrl.run.loop.train` for `cfg` in Ray actors; returns rank 0's final evaluation."""
    ray = _ray()
    started = _connect(cfg.ray)
    pg, workers = None, []
    try:
        lay = layout(cfg)
        pg = _reserve(lay.bundles, cfg.ray)
        placement = RayPlacement(pg, lay, os.getcwd(), list(sys.path), cfg.ray.server_host)
        workers = [_remote(TrainerWorker).options(**placement.options(b)).remote(placement) for b in lay.trainer]
        master = _get(workers[0].node.remote())
        from ray.util.queue import Queue

        stop = Queue(actor_options={"num_cpus": 0})
        refs = [w.run.remote(to_dict(cfg), rank, len(workers), master, stop) for rank, w in enumerate(workers)]
        return _wait(refs, stop, cfg.ray.stop_grace)
    finally:
        for w in workers:
            ray.kill(w)
        if pg is not None:
            ray.util.remove_placement_group(pg)
        if started:
            time.sleep(1.0)  # Ray's log monitor forwards workers' last lines about once a second
            ray.shutdown()


def _connect(r: RayConfig) -> bool:
    """Join the cluster at ray.address, or start a local one for this run (True: ours to shut down)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    if r.address is None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private single-machine cluster, dashboard off
        ray.init(num_cpus=r.num_cpus, num_gpus=r.num_gpus, include_dashboard=False, log_to_driver=True)
        return True
    ray.init(address=r.address, log_to_driver=True)
    return False


def _reserve(bundles: list[dict[str, float]], r: RayConfig):
    """The run's placement group, or a clear error if the cluster cannot hold it."""
    ray = _ray()
    have = ray.cluster_resources()
    for res in ("CPU", "GPU"):
        need = sum(b.get(res, 0) for b in bundles)
        if need > have.get(res, 0):
            raise RuntimeError(f"launcher=ray: the run needs {need:g} {res} (bundles {bundles}: ray.trainer_* per "
                               f"trainer rank, ray.rollout_* per launched server and producer) but the cluster has "
                               f"{have.get(res, 0):g}; lower them or add resources (ray.num_cpus / num_gpus)")
    pg = ray.util.placement_group(bundles, strategy=r.strategy)
    if not pg.wait(timeout_seconds=r.placement_timeout):
        ray.util.remove_placement_group(pg)
        raise TimeoutError(f"launcher=ray: no room for bundles {bundles} (strategy {r.strategy}) within "
                           f"ray.placement_timeout={r.placement_timeout:g}s; cluster: {have}")
    return pg


def _wait(refs: list, stop, grace: float) -> dict[str, float]:
    """Rank 0's result; the first failing rank's error; on Ctrl-C, a clean stop of every rank first."""
    ray = _ray()
    try:
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, timeout=1.0)
            for ref in done:
                _get(ref)
        return _get(refs[0])
    except KeyboardInterrupt:
        for _ in refs:
            stop.put(None)
        ray.wait(refs, num_returns=len(refs), timeout=grace)
        raise

