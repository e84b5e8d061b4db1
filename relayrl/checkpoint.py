"""Checkpoints and exact resume (docs/checkpoints.md).

A checkpoint is RUN_DIR/checkpoints/step_N/:

    model/         the policy as a plain HF folder (safetensors + tokenizer): `from_pretrained` loads it
    trainer.pt     TrainController.state_dict(): policy optimizer, LR schedule, version, critic
    data.pt        DataManager.state_dict() (loader position, epoch, drawn counter, prompts to generate
                   again) and the async scheduler's counters
    rng.pt         python `random`, torch's generators, each local engine's generator
    logs.json      sizes of metrics.jsonl and trajectories/* at step N: a resume cuts them back to these
    config.yaml    the config that wrote it (a resume warns about training keys that changed)
    manifest.json  written last, with the size of every file above

A sharded trainer (train.engine=fsdp) writes trainer_shards/ (every rank its shard of the policy and its
optimizer) and a trainer.pt without the policy optimizer instead; relayrl.checkpoint_dist has the details,
and the manifest records the world size.

It is built in a hidden temp folder and renamed into place, so a crash leaves either no step_N or a
complete one. A step_N without a manifest, or whose files do not match it, is incomplete: it is never
resumed from. Older checkpoints are deleted (renamed away first, so a half-deleted one never looks
complete) only once the new one is in place.

Samples are not saved. A synchronous run has none between steps. An asynchronous run stops its producer
for the checkpoint: the groups in flight requeue their prompt as they are cancelled, and the groups
waiting in the replay buffer are requeued here, so data.pt counts every prompt ever drawn as either
trained or still to generate: nothing is lost, nothing is trained twice (the producer then restarts).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import yaml

from relayrl.config import ConfigError, dump_yaml, to_dict
from relayrl.scheduler import AsyncScheduler
from relayrl.trainer.lora import is_lora
from relayrl.utils import atomic_write_text, check_writable

if TYPE_CHECKING:
    from relayrl.build import Components
    from relayrl.config.schema import Config

logger = logging.getLogger(__name__)

FORMAT = 1
MANIFEST = "manifest.json"
_STEP = re.compile(r"step_(\d+)")


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


# ---- finding checkpoints ----------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict | None:
    """The manifest of a complete checkpoint folder, else None: missing or unreadable manifest, wrong
    step, or a listed file missing or of another size (so a damaged checkpoint is never loaded)."""
    m = _STEP.fullmatch(folder.name)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        ok = (m is not None and manifest.get("format") == FORMAT and manifest.get("step") == int(m.group(1))
              and all((folder / rel).is_file() and (folder / rel).stat().st_size == size
                      for rel, size in manifest["files"].items()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return manifest if ok else None


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, folder), oldest first."""
    root = checkpoints_dir(run_dir)
    found = [(int(m.group(1)), p) for p in (root.iterdir() if root.is_dir() else [])
             if (m := _STEP.fullmatch(p.name)) and p.is_dir()]
    return sorted((step, p) for step, p in found if read_manifest(p) is not None)


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def resume_target(cfg: Config) -> tuple[Path, Path | None]:
    """(run folder, checkpoint) for run.resume, found before any model loads. "auto": the latest complete
    checkpoint of output_dir/name, or none (start at step 0 in that folder); a run folder: its latest; a
    step_N folder: that one, if no newer complete checkpoint would be left behind in its run."""
    run_dir, ckpt = _find_resume_target(cfg)
    if ckpt is not None:
        check_layout(cfg, ckpt)
    return run_dir, ckpt


def _find_resume_target(cfg: Config) -> tuple[Path, Path | None]:
    spec = cfg.run.resume
    if spec == "auto":
        run_dir = Path(cfg.run.output_dir) / cfg.run.name
        return run_dir, latest_checkpoint(run_dir)
    path = Path(spec).expanduser().resolve()
    if not _STEP.fullmatch(path.name):
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"no complete checkpoint in {checkpoints_dir(path)}", key="run.resume")
        return path, found
    if path.parent.name != "checkpoints":
        raise ConfigError(f"{path} is not inside a run's checkpoints/ folder", key="run.resume")
    if read_manifest(path) is None:
        raise ConfigError(f"{path} is an incomplete checkpoint (no manifest, or files missing)", key="run.resume")
    run_dir = path.parent.parent
    newer = [p.name for s, p in list_checkpoints(run_dir) if s > int(_STEP.fullmatch(path.name).group(1))]
    if newer:
        raise ConfigError(f"{run_dir} has newer checkpoints ({', '.join(newer)}): resuming from {path.name} would "
                          "mix two histories in one run folder; delete them first", key="run.resume")
    return run_dir, path


def check_layout(cfg: Config, ckpt: Path) -> None:
    """Refuse, before any model loads, a checkpoint whose trainer layout the configured engine cannot read:
    sharded checkpoints need train.engine=fsdp (any train.world_size: they reshard), one-process ones the
    local engine."""
    world = read_manifest(ckpt).get("world_size")
    if world is not None and cfg.train.engine != "fsdp":
        raise ConfigError(f"{ckpt} was written by a sharded trainer (train.engine=fsdp, world size {world}): "
                          "resume it with train.engine=fsdp (any train.world_size)", key="train.engine")
    if world is None and cfg.train.engine == "fsdp":
        raise ConfigError(f"{ckpt} was written by one process (train.engine=local): resume it with "
                          "train.engine=local", key="train.engine")


def prepare_resume(run_dir: Path, ckpt: Path | None) -> None:
    """Make the run folder look as it did at the checkpoint (at step 0 without one): logs written after it
    (including a line torn by a crash) are cut off, since those steps are trained again."""
    check_writable(run_dir, "run.resume")
    _remove_temps(checkpoints_dir(run_dir))
    sizes = json.loads((ckpt / "logs.json").read_text()) if ckpt is not None else {}
    truncate_logs(run_dir, sizes)
    print(f"resuming from {ckpt}" if ckpt is not None else f"no complete checkpoint in {run_dir}: starting at "
          "step 0 in that folder")


# ---- saving -------------------------------------------------------------------------------------------
def is_due(cfg: Config, step: int) -> bool:
    every = cfg.run.checkpoint_every
    return every > 0 and (step % every == 0 or step == cfg.run.steps)


def save_if_due(c: Components, step: int) -> Path | None:
    """The training loops' one call: a checkpoint every run.checkpoint_every steps and at the last step."""
    return save(c, step) if is_due(c.cfg, step) else None


def save(c: Components, step: int) -> Path:
    """Write RUN_DIR/checkpoints/step_N atomically, then delete all but the newest run.keep_checkpoints.
    A write that fails (full disk, unwritable folder) raises an OSError naming the path."""
    root = checkpoints_dir(c.run_dir)
    target, tmp = root / f"step_{step}", None
    try:
        root.mkdir(parents=True, exist_ok=True)
        _remove_temps(root)
        tmp = Path(tempfile.mkdtemp(prefix=f".step_{step}.tmp-", dir=root))
        with _producer_stopped(c):  # an async producer must not draw prompts while their state is taken
            data = _data_state(c)
            rng = _rng_state(c)
        extra = _write(c, tmp, data, rng)
        _write_manifest(tmp, step, c.train_ctl.version, extra)
        _replace(tmp, target)
    except OSError as e:
        msg = f"checkpoint of step {step}: cannot write {e.filename or tmp or root}: {e.strerror or e}"
        raise OSError(*((e.errno, msg) if e.errno else (msg,))) from e
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _rotate(root, c.cfg.run.keep_checkpoints)
    return target


def _write(c: Components, folder: Path, data: dict, rng: dict) -> dict:
    """Write every file but the manifest; returns what the manifest adds (a sharded trainer's world size)."""
    extra = {}
    if getattr(c.train_ctl.engine, "sharded", False):
        from relayrl.checkpoint_dist import write_trainer

        extra = write_trainer(c, folder)  # every rank writes its shard; back here once all have
    else:
        c.save_model(folder / "model")  # a plain HF folder (LoRA: adapters merged); adapters go in trainer.pt
        torch.save(c.train_ctl.state_dict(), folder / "trainer.pt")
    torch.save(data, folder / "data.pt")
    torch.save(rng, folder / "rng.pt")
    (folder / "logs.json").write_text(json.dumps(_log_sizes(c.run_dir)))
    dump_yaml(c.cfg, str(folder / "config.yaml"))
    return extra


def _write_manifest(folder: Path, step: int, version: int, extra: dict | None = None) -> None:
    """Flush every file to disk, then write the manifest: only then is the checkpoint complete."""
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[str(f.relative_to(folder))] = f.stat().st_size
    manifest = {"format": FORMAT, "step": step, "version": version, "time": time.time(), **(extra or {}),
                "files": files}
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=1) + "\n")


def _replace(tmp: Path, target: Path) -> None:
    """Rename the finished folder into place (moving an incomplete leftover of the same name away first)."""
    if target.exists():
        old = target.with_name(f".{target.name}.old-{time.time_ns()}")
        os.rename(target, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(tmp, target)
    fd = os.open(target.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # make the rename itself durable
    finally:
        os.close(fd)


def _rotate(root: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`; each is renamed away before it is removed."""
    for _, folder in list_checkpoints(root.parent)[:-keep]:
        doomed = folder.with_name(f".{folder.name}.del-{time.time_ns()}")
        os.rename(folder, doomed)
        shutil.rmtree(doomed, ignore_errors=True)


def _remove_temps(root: Path) -> None:
    """Hidden folders are checkpoints being built, replaced or deleted by a process that was killed (one
    process writes a run's checkpoints at a time)."""
    for p in root.glob(".step_*") if root.is_dir() else []:
        shutil.rmtree(p, ignore_errors=True)


# ---- what a checkpoint holds beyond the weights ----------------------------------------------------------
@contextlib.contextmanager
def _producer_stopped(c: Components):
    """Async, one process: stop the producer and requeue what it generated but nobody trained (see the
    module docstring), then start it again. A no-op for the synchronous scheduler."""
    sched = c.env.scheduler if c.env is not None else None
    if not isinstance(sched, AsyncScheduler) or not c.env.producing:
        yield
        return
    c.stop_producer()
    try:
        for group in c.data.replay_buffer.take():
            c.data.requeue(group[0].data)
            sched.manager.on_expire()
        yield
    finally:
        c.start_producer()


def _data_state(c: Components) -> dict:
    state = {"data": c.data.state_dict()}
    sched = c.env.scheduler
    if isinstance(sched, AsyncScheduler):  # groups trained so far: the base of the staleness admission rule
        state["async"] = {"accepted": sched.manager.accepted, "stats": dict(sched.stats)}
    return state


def _engines(c: Components) -> list:
    return [e for e in (c.rollout_ctl.engines if c.rollout_ctl is not None else []) if hasattr(e, "rng_state")]


def _rng_state(c: Components) -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "engines": [e.rng_state() for e in _engines(c)]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(c: Components, state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    for engine, s in zip(_engines(c), state["engines"]):
        engine.set_rng_state(s)


# ---- resuming -------------------------------------------------------------------------------------------
def restore(c: Components, ckpt: Path) -> int:
    """Load a checkpoint into a freshly built run: the weights into the trainer and, stamped with the
    trainer's version, into the engines; then optimizer, LR schedule, critic, data position, RNGs.
    Returns the step it was taken at (the run continues with the next one)."""
    manifest = read_manifest(ckpt)
    if manifest is None:
        raise ValueError(f"run.resume: {ckpt} is not a complete checkpoint")
    changed = config_changes(c.cfg, ckpt)
    if changed:
        logger.warning("resuming with training settings changed since the checkpoint: %s", ", ".join(changed))
    if "world_size" in manifest:  # sharded: every rank loads its slice (relayrl.checkpoint_dist)
        from relayrl.checkpoint_dist import read_trainer

        read_trainer(c, ckpt, manifest)
    else:
        if not is_lora(c.train_ctl.engine.model):  # LoRA: the base is model.path's; trainer.pt has the adapters
            load_weights(c.train_ctl.engine.model, ckpt / "model")
        # on the CPU first: load_state_dict copies into the trainer's own device (a GPU run's checkpoint loads anywhere)
        c.train_ctl.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=True, map_location="cpu"))
    c.relay_weights()
    data = torch.load(ckpt / "data.pt", weights_only=True)
    c.data.load_state_dict(data["data"])
    sched = c.env.scheduler
    if isinstance(sched, AsyncScheduler) and "async" in data:
        sched.manager.accepted = data["async"]["accepted"]
        sched.stats.update(data["async"]["stats"])
    _set_rng_state(c, torch.load(ckpt / "rng.pt", weights_only=True))
    return int(manifest["step"])


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy a saved HF folder's safetensors into `model` in place (tied weights are saved once)."""
    from safetensors.torch import load_file

    tensors = {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in tensors:
                raise ValueError(f"checkpoint {folder} has no weight {name!r}: was it written by another model?")
            p.copy_(tensors[name])


def config_changes(cfg: Config, ckpt: Path) -> list[str]:
    """Keys outside run.* and eval.* whose values differ from the checkpoint's config (exactness needs none)."""
    old = _flat(yaml.safe_load((ckpt / "config.yaml").read_text()))
    new = _flat(to_dict(cfg))
    return sorted(k for k in old.keys() | new.keys()
                  if not k.startswith(("run.", "eval.")) and old.get(k) != new.get(k))


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out |= _flat(v, f"{prefix}{k}.") if isinstance(v, dict) and v else {f"{prefix}{k}": v}
    return out


# ---- logs and disk space ----------------------------------------------------------------------------------
def _log_files(run_dir: Path) -> list[Path]:
    traj = run_dir / "trajectories"
    files = [run_dir / "metrics.jsonl", *(sorted(traj.rglob("*")) if traj.is_dir() else [])]
    return [f for f in files if f.is_file()]


def _log_sizes(run_dir: Path) -> dict[str, int]:
    """Appends are whole lines (one write each), so these sizes always end on a line boundary."""
    return {str(f.relative_to(run_dir)): f.stat().st_size for f in _log_files(run_dir)}


def truncate_logs(run_dir: Path, sizes: dict[str, int]) -> None:
    """Cut metrics.jsonl and the trajectory logs back to `sizes`; delete log files that did not exist then."""
    for f in _log_files(run_dir):
        size = sizes.get(str(f.relative_to(run_dir)))
        if size is None:
            f.unlink()
        elif f.stat().st_size > size:
            os.truncate(f, size)
    traj = run_dir / "trajectories"
    for d in sorted(traj.iterdir()) if traj.is_dir() else []:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()


def checkpoint_bytes(c: Components) -> int:
    """About what one checkpoint takes: the trained weights plus Adam's two moments (critic included)."""
    models = [c.train_ctl.engine.model] + ([c.train_ctl.critic.model] if c.train_ctl.critic is not None else [])
    return 3 * sum(p.numel() * p.element_size() for m in models for p in m.parameters())


def check_space(folder: Path, need: int) -> None:
    """Fail before training when `folder` cannot hold one more checkpoint (older ones go only after)."""
    folder.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise OSError(errno.ENOSPC, f"run.checkpoint_every: {folder} has {free / 2**20:.0f} MiB free; a checkpoint "
                                    f"needs about {need / 2**20:.0f} MiB")


def prepare(c: Components, ckpt: Path | None) -> None:
    """At build time: check the checkpoint folder (writable, room for one), then resume from `ckpt` if given."""
    if c.cfg.run.checkpoint_every:
        check_writable(checkpoints_dir(c.run_dir), "run.checkpoint_every")
        check_space(checkpoints_dir(c.run_dir), checkpoint_bytes(c))
    if ckpt is not None:
        c.step = restore(c, ckpt)
