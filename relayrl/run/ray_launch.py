"""`relayrl train ... launcher=ray`: the driver that runs a whole run as Ray actors (docs/ray.md).

The driver starts or joins a Ray cluster, reserves one bundle per trainer rank, per launched inference server
and (separate placement) for the producer (`placement.layout`), and starts a `TrainerWorker` per rank. The
workers run the same `relayrl.run.loop.train` as a local run; `relayrl.run.placement` is what changes for them.

Stopping: Ctrl-C in the driver puts a stop message on a queue each worker watches; the worker turns it into a
KeyboardInterrupt in its main thread, so the loop's own cleanup runs (servers, producer, judge stop) exactly as
on Ctrl-C in a local run. Actors still alive after `ray.stop_grace` seconds are killed; Ray kills the actors a
worker created when it dies, and launched servers and judge processes die with their parents.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time

from relayrl.common import logs
from relayrl.config import from_dict, to_dict
from relayrl.config.schema import Config, RayConfig
from relayrl.run.loop import train
from relayrl.run.placement import RayPlacement, _Actor, _get, _ray, _remote, layout

log = logging.getLogger(__name__)


class TrainerWorker(_Actor):
    def run(self, cfg_dict: dict, rank: int, world_size: int, master: tuple[str, int], stop) -> dict[str, float]:
        cfg = from_dict(Config, cfg_dict)
        if cfg.train.engine == "fsdp":  # what torchrun would set; each actor sees only its own GPU
            os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                              MASTER_ADDR=master[0], MASTER_PORT=str(master[1]))
        logs.from_env()  # after RANK: only rank 0 reports the choices
        with _interruptible(stop):
            return train(cfg)


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
    level = logs.third_party_level(logs.resolve(None)).upper()  # Ray's "ray" logger sets its own level
    if r.address is None:
        # a private single-machine cluster, dashboard off. address="local": without it ray.init joins whichever
        # cluster `ray start` left running on this machine (or RAY_ADDRESS), and fails on num_cpus there
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        ray.init(address="local", num_cpus=r.num_cpus, num_gpus=r.num_gpus, include_dashboard=False,
                 log_to_driver=True, logging_level=level)
        log.info("launcher=ray: started a private Ray cluster on this machine (ray.address is not set)")
        return True
    ray.init(address=r.address, log_to_driver=True, logging_level=level)
    log.info("launcher=ray: joined the Ray cluster at %s (ray.address)", r.address)
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

