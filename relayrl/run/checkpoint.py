"""Checkpoints and exact resume (docs/checkpoints.md).

A checkpoint is RUN_DIR/checkpoints/step_N/:

    model/         the policy as a plain HF folder (safetensors + tokenizer): `from_pretrained` loads it
    trainer.pt     TrainController.state_dict(): policy optimizer, LR schedule, version, critic
    data.pt        the rollout source's state_dict() (relayrl.run.sources): DataManager.state_dict() (loader
                   position, epoch, drawn counter, prompts to generate again), the async scheduler's counters
                   and each local engine's generator; with scheduler.placement=separate the producer process's
                   (relayrl.run.producer), its own process's generators included
    rng.pt         python `random`, torch's generators
    logs.json      sizes of metrics.jsonl and trajectories/* at step N: a resume sets what follows aside
    config.yaml    the config that wrote it (a resume warns about training keys that changed, and refuses
                   another model.path)
    manifest.json  written last, with the size and sha256 of every file above

A sharded trainer (train.engine=fsdp) writes trainer_shards/ (every rank its shard of the policy and its
optimizer) and a trainer.pt without the policy optimizer instead; relayrl.run.checkpoint_dist has the details,
and the manifest records the world size.

It is built in a hidden temp folder and renamed into place, so a crash leaves either no step_N or a
complete one. A step_N without a manifest, or whose files do not match its sizes, is incomplete: it is never
resumed from. A resume also checks every file's sha256 (damage after the write: a bad disk, a partial copy);
a corrupt checkpoint is renamed to checkpoints/corrupt-step_N-* (kept, never deleted) and the resume falls
back to the previous one with a warning, which needs run.keep_checkpoints >= 2; so is one whose files match but
do not load (a tensor of another shape: written wrong, or edited with a fresh manifest). Older checkpoints are deleted
(renamed away first, so a half-deleted one never looks complete) only once the new one is in place.

Samples are not saved. A synchronous run has none between steps. An asynchronous run stops its producer
for the checkpoint: the groups in flight requeue their prompt as they are cancelled, and the groups
waiting in the replay buffer are requeued here, so data.pt counts every prompt ever drawn as either
trained or still to generate: nothing is lost, nothing is trained twice (the producer then restarts). A
producer process does the same on the trainer's request, and the groups it had already sent the trainer are
requeued there too.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from relayrl.common.files import atomic_write_text, check_writable
from relayrl.config import ConfigError, dump_yaml, flatten, to_dict
from relayrl.config.loader import read_yaml
from relayrl.config.schema import Config
from relayrl.models.moe import model_names
from relayrl.run.checkpoint_dist import read_trainer, write_trainer
from relayrl.run.checkpoint_logs import log_sizes, set_aside_after, set_aside_all
from relayrl.run.components import Components, write_failure
from relayrl.trainer.lora import is_lora

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: size and sha256 per file; format 1 (sizes only) is still read
MANIFEST = "manifest.json"
_STEP = re.compile(r"step_(\d+)")


def checkpoints_dir(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / "checkpoints"


# ---- finding checkpoints ----------------------------------------------------------------------------
def read_manifest(folder: Path) -> dict | None:
    """The manifest of a complete checkpoint folder, else None: missing or unreadable manifest, wrong
    step, or a listed file missing or of another size. Cheap (no file is read): `verify` checks contents."""
    m = _STEP.fullmatch(folder.name)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        ok = (m is not None and manifest.get("format") in (1, FORMAT) and manifest.get("step") == int(m.group(1))
              and all((folder / rel).is_file() and (folder / rel).stat().st_size == _size(entry)
                      for rel, entry in manifest["files"].items()))
    except (OSError, ValueError, KeyError, AttributeError, TypeError):
        return None
    return manifest if ok else None


def _size(entry: int | dict) -> int:
    return entry["size"] if isinstance(entry, dict) else entry  # format 2 | format 1


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify(folder: Path) -> str | None:
    """None if the checkpoint is complete and every file matches its sha256, else what is wrong. Reads every
    file (about a second per GB), so it runs once per resume, on the checkpoint about to be loaded."""
    manifest = read_manifest(folder)
    if manifest is None:
        return "incomplete (no manifest, or a file missing or of another size)"
    for rel, entry in manifest["files"].items():
        if isinstance(entry, dict) and sha256_of(folder / rel) != entry["sha256"]:
            return f"{rel} does not match the sha256 in its manifest"
    return None


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
        check_model(cfg, ckpt)
    return run_dir, ckpt


def resume_dir(cfg: Config) -> Path:
    """The run folder run.resume writes to, found without touching it (the run locks it first)."""
    if cfg.run.resume == "auto":
        return Path(cfg.run.output_dir) / cfg.run.name
    path = Path(cfg.run.resume).expanduser().resolve()
    return path.parent.parent if _STEP.fullmatch(path.name) else path


def _find_resume_target(cfg: Config) -> tuple[Path, Path | None]:
    spec = cfg.run.resume
    if spec == "auto":
        run_dir = resume_dir(cfg)
        return run_dir, latest_sound(run_dir)
    path = Path(spec).expanduser().resolve()
    if not _STEP.fullmatch(path.name):
        found = latest_sound(path)
        if found is None:
            raise ConfigError(f"no complete checkpoint in {checkpoints_dir(path)}", key="run.resume")
        return path, found
    if path.parent.name != "checkpoints":
        raise ConfigError(f"{path} is not inside a run's checkpoints/ folder", key="run.resume")
    problem = verify(path)
    if problem is not None:
        raise ConfigError(f"{path} cannot be resumed from: {problem}", key="run.resume")
    run_dir = path.parent.parent
    newer = [p.name for s, p in list_checkpoints(run_dir) if s > int(_STEP.fullmatch(path.name).group(1))]
    if newer:
        raise ConfigError(f"{run_dir} has newer checkpoints ({', '.join(newer)}): resuming from {path.name} would "
                          "mix two histories in one run folder; delete them first", key="run.resume")
    return run_dir, path


def latest_sound(run_dir: Path) -> Path | None:
    """The newest checkpoint whose files match their checksums. A corrupt newer one is renamed to
    checkpoints/corrupt-step_N-* (kept for inspection) with a warning, and the previous one is tried: with
    run.keep_checkpoints=1 there is none. If every checkpoint is corrupt, refuse: starting again at step 0
    would silently throw the run away."""
    found = list_checkpoints(run_dir)
    for _, folder in reversed(found):
        problem = verify(folder)
        if problem is None:
            return folder
        aside = folder.with_name(f"corrupt-{folder.name}-{time.time_ns()}")
        os.rename(folder, aside)
        logger.warning("checkpoint %s is corrupt (%s): moved to %s; falling back to the previous checkpoint "
                       "(run.keep_checkpoints >= 2 keeps one)", folder, problem, aside.name)
        print(f"warning: checkpoint {folder} is corrupt ({problem}); moved to {aside.name}")
    if found:
        raise ConfigError(f"every checkpoint in {checkpoints_dir(run_dir)} is corrupt (moved to corrupt-step_*); "
                          "with run.keep_checkpoints >= 2 an older one would have been used", key="run.resume")
    return None


def check_model(cfg: Config, ckpt: Path) -> None:
    """Refuse, before any model loads, to resume a checkpoint with another model.path than it was trained from:
    the tokenizer, architecture (and with LoRA the base weights) come from model.path, so another model would
    fail later or, worse, train on. A model folder moved elsewhere passes if its config.json is the same."""
    try:
        old = read_yaml(str(ckpt / "config.yaml"))["model"]["path"]  # bounded aliases, as any config
    except (ConfigError, KeyError, TypeError):
        return  # no record to compare with (written by hand, or by an older relayrl)
    new = cfg.model.path
    if _same_path(old, new) or (not Path(old).expanduser().exists() and _same_architecture(ckpt / "model", new)):
        return
    raise ConfigError(f"{ckpt} was trained from model {old!r}, not {new!r}: resume with model.path={old} (the "
                      "weights come from the checkpoint; model.path gives the tokenizer and architecture)",
                      key="model.path")


def _same_path(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    return a == b or (pa.exists() and pb.exists() and pa.resolve() == pb.resolve())


def _same_architecture(saved: Path, path: str) -> bool:
    def arch(folder: Path) -> dict | None:
        try:
            conf = json.loads((folder / "config.json").read_text())
        except (OSError, ValueError):
            return None
        return {k: v for k, v in conf.items() if k not in ("_name_or_path", "torch_dtype", "transformers_version")}

    mine = arch(Path(path).expanduser())
    return mine is not None and mine == arch(saved)


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
    """Make the run folder's logs look as they did at the checkpoint, deleting nothing: what they got after it
    (those steps are trained again; a line torn by a crash too) is moved to superseded/ (relayrl.run.checkpoint_logs).
    Without a checkpoint the run starts at step 0 there, and what an earlier attempt left is moved aside."""
    check_writable(run_dir, "run.resume")
    _remove_temps(checkpoints_dir(run_dir))
    if ckpt is not None:
        step = int(_STEP.fullmatch(ckpt.name).group(1))
        side = set_aside_after(run_dir, json.loads((ckpt / "logs.json").read_text()), step)
        print(f"resuming from {ckpt}" + (f"; logs written after step {step} moved to {side}" if side else ""))
        return
    side = set_aside_all(run_dir)
    print(f"no complete checkpoint in {run_dir}: starting at step 0 in that folder"
          + (f"; what the earlier attempt left there moved to {side}" if side else ""))


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
        with c.rollouts.paused():  # an async producer must not draw prompts while their state is taken
            data = c.rollouts.state_dict()
            rng = rng_state()
        extra = _write(c, tmp, data, rng)
        _write_manifest(tmp, step, c.train_ctl.version, extra)
        _replace(tmp, target)
    except OSError as e:
        msg = f"checkpoint of step {step}: cannot write {e.filename or tmp or root}: {e.strerror or e}"
        raise OSError(*((e.errno, msg) if e.errno else (msg,))) from e
    except Exception as e:  # torch.save / safetensors on a full disk: RuntimeError, SafetensorError
        failure = write_failure(e, root, f"checkpoint of step {step}: cannot write {target}")
        if failure is None:
            raise
        raise failure from e
    finally:
        if tmp is not None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _rotate(root, c.cfg.run.keep_checkpoints)
    return target


def _write(c: Components, folder: Path, data: dict, rng: dict) -> dict:
    """Write every file but the manifest; returns what the manifest adds (a sharded trainer's world size)."""
    extra = {}
    if c.train_ctl.engine.sharded:
        extra = write_trainer(c, folder)  # every rank writes its shard; back here once all have
    else:
        c.save_model(folder / "model")  # a plain HF folder (LoRA: adapters merged); adapters go in trainer.pt
        torch.save(c.train_ctl.state_dict(), folder / "trainer.pt")
    torch.save(data, folder / "data.pt")
    torch.save(rng, folder / "rng.pt")
    (folder / "logs.json").write_text(json.dumps(log_sizes(c.run_dir)))
    dump_yaml(c.cfg, str(folder / "config.yaml"))
    return extra


def _write_manifest(folder: Path, step: int, version: int, extra: dict | None = None) -> None:
    """Flush every file to disk and take its sha256, then write the manifest: only then is it complete."""
    files = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        with open(f, "rb+") as fh:
            os.fsync(fh.fileno())
        files[str(f.relative_to(folder))] = {"size": f.stat().st_size, "sha256": sha256_of(f)}
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
def rng_state() -> dict:
    """The process-wide generators (python, torch, CUDA): the trainer's here, a producer process's in its state;
    the engines' own are in the rollout source's state."""
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


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
    if "world_size" in manifest:  # sharded: every rank loads its slice (relayrl.run.checkpoint_dist)
        read_trainer(c, ckpt, manifest)
    else:
        if not is_lora(c.train_ctl.engine.model):  # LoRA: the base is model.path's; trainer.pt has the adapters
            load_weights(c.train_ctl.engine.model, ckpt / "model")
        # on the CPU first: load_state_dict copies into the trainer's own device (a GPU run's checkpoint loads anywhere)
        c.train_ctl.load_state_dict(torch.load(ckpt / "trainer.pt", weights_only=True, map_location="cpu"))
    c.rollouts.load_weights(c.train_ctl.weights())
    data = torch.load(ckpt / "data.pt", weights_only=True)
    rng = torch.load(ckpt / "rng.pt", weights_only=True)
    data.setdefault("engines", rng.get("engines", []))  # older checkpoints kept the engines' generators in rng.pt
    c.rollouts.load_state_dict(data)
    set_rng_state(rng)
    return int(manifest["step"])


def load_weights(model: torch.nn.Module, folder: Path) -> None:
    """Copy a saved HF folder's safetensors into `model` in place (tied weights are saved once)."""
    tensors = model_names({k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()})
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name not in tensors:
                raise ValueError(f"checkpoint {folder} has no weight {name!r}: was it written by another model?")
            p.copy_(tensors[name])


def config_changes(cfg: Config, ckpt: Path) -> list[str]:
    """Keys outside run.* and eval.* whose values differ from the checkpoint's config (exactness needs none).
    `resolved` is left out: its values are in the sections, and its reasons hold this machine's measurements."""
    old = flatten(read_yaml(str(ckpt / "config.yaml")))
    new = flatten(to_dict(cfg))
    return sorted(k for k in old.keys() | new.keys()
                  if not k.startswith(("run.", "eval.", "resolved.")) and old.get(k) != new.get(k))


# ---- disk space ------------------------------------------------------------------------------------------
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
    while ckpt is not None:
        try:
            c.step = restore(c, ckpt)
            return
        except (MemoryError, torch.cuda.OutOfMemoryError):
            raise  # the machine's problem, not the checkpoint's
        except Exception as e:  # noqa: PERF203 - content its checksums cannot catch: written wrong, or edited
            if "world_size" in (read_manifest(ckpt) or {}):
                raise  # sharded: every rank loads its slice; falling back on one rank alone would split them
            ckpt = _fall_back(c.run_dir, ckpt, f"{type(e).__name__}: {e}")


def _fall_back(run_dir: Path, ckpt: Path, problem: str) -> Path:
    """Set aside a checkpoint that matched its checksums but failed to load, as `latest_sound` sets aside a
    corrupt one, and return the previous sound checkpoint, its logs put back as they were then. The next
    `restore` overwrites everything the failed one loaded (weights, optimizer, data, RNGs)."""
    problem = " ".join(problem.split())[:300]
    aside = ckpt.with_name(f"corrupt-{ckpt.name}-{time.time_ns()}")
    os.rename(ckpt, aside)
    logger.warning("checkpoint %s failed to load (%s): moved to %s; falling back to the previous checkpoint",
                   ckpt, problem, aside.name)
    print(f"warning: checkpoint {ckpt} failed to load ({problem}); moved to {aside.name}")
    previous = latest_sound(run_dir)
    if previous is None:
        raise ConfigError(f"{ckpt} failed to load ({problem}; moved to {aside.name}) and no older checkpoint is left "
                          "(run.keep_checkpoints >= 2 keeps one)", key="run.resume")
    prepare_resume(run_dir, previous)
    return previous
