"""Where a run's metrics go: one small backend per tracker behind one protocol, all fed the same rows.

`MetricsLogger` (relayrl/tracking/metrics.py) hands every step's metrics, the eval metrics and a few samples of
each step's batch to each tracker of `run.trackers` with the same keys and steps. metrics.jsonl is always
written: resume and plots read it. mlflow writes a local file store (RUN_DIR/mlruns) unless `run.mlflow_uri`
names another store. wandb follows its own conventions: the user's WANDB_MODE, API key and WANDB_BASE_URL, or
`run.wandb.mode`; with neither it goes online only where a key is found and the host answers (`wandb_mode`),
and its run folder is RUN_DIR/wandb either way.

A resumed run continues the same wandb and mlflow runs: their ids are kept in the run folder (RUN_DIR/wandb/run_id,
RUN_DIR/mlruns/run_id), so a resume that sets the folder aside (relayrl.run.checkpoint_logs) starts new ones.

The optional packages (wandb, mlflow) are imported only when their tracker is made, so a run without them
neither needs them nor pays their import time; `tracker_problem` tells the config check what is missing.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import yaml

from relayrl.common.files import append_jsonl, atomic_write_text
from relayrl.config import flatten
from relayrl.config.trackers import WANDB_ENV_MODES, WandbConfig

log = logging.getLogger(__name__)

MLFLOW_EXPERIMENT = "relayrl"
DEFAULT_WANDB_URL = "https://api.wandb.ai"
REACH_TIMEOUT_S = 2.0  # a reachable host answers a TCP connect in well under this; an unreachable one costs it once


class Tracker(Protocol):
    """A metrics destination. `log` gets finite floats only (MetricsLogger drops the rest); `log_samples` gets rows
    {step, prompt, completion, reward} of the step's batch; `location` says where it writes (the start block)."""

    location: str

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None: ...

    def close(self) -> None: ...


def active_trackers(names: Iterable[str], tensorboard: bool = True) -> list[str]:
    """run.trackers with jsonl always first (resume and plots read metrics.jsonl), duplicates dropped, and
    tensorboard dropped when the deprecated run.tensorboard is false."""
    out = ["jsonl"]
    for name in names:
        if name not in out and (tensorboard or name != "tensorboard"):
            out.append(name)
    return out


def make_trackers(names: Iterable[str], run_dir: Path, mlflow_uri: str = "",
                  wandb: WandbConfig | None = None) -> list[Tracker]:
    """One backend per name, opened in run_dir; the ones opened so far are closed again if one fails."""
    makers = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker,
              "wandb": lambda d: WandbTracker(d, wandb or WandbConfig()),
              "mlflow": lambda d: MlflowTracker(d, mlflow_uri)}
    made: list[Tracker] = []
    try:
        for name in names:
            made.append(makers[name](Path(run_dir)))
    except BaseException:
        for tracker in made:
            tracker.close()
        raise
    return made


class JsonlTracker:
    """RUN_DIR/metrics.jsonl, one line per log call (a whole-line append each: crash-safe, see append_jsonl).
    The config is not repeated here: the run folder's config.yaml is the record of it; nor are samples: every
    one is in RUN_DIR/trajectories when run.log_trajectories is on."""

    location = "metrics.jsonl"

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        append_jsonl(self.path, {"step": step, **metrics})

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """RUN_DIR/tensorboard: one scalar per metric, the config as a text summary named "config", each step's
    samples as a text summary named "samples" (TensorBoard's Text tab, a slider over the steps)."""

    location = "tensorboard/"

    def __init__(self, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package: only when asked for

        self._writer = SummaryWriter(str(Path(run_dir) / "tensorboard"))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)
        self._writer.flush()  # a crashed run keeps its curves up to the last step

    def log_config(self, config: dict[str, Any]) -> None:
        self._writer.add_text("config", "```yaml\n" + yaml.safe_dump(config, sort_keys=False) + "```")
        self._writer.flush()

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._writer.add_text("samples", "\n\n".join(map(_markdown_sample, rows)), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _markdown_sample(row: dict[str, Any]) -> str:
    """A sample as Markdown: texts as indented code blocks, which keep their line breaks and cannot be closed
    early by a ``` in a completion."""
    def block(text: str) -> str:
        return "\n".join("    " + line for line in str(text).splitlines() or [""])

    return (f"**reward {row['reward']}**\n\nprompt:\n\n{block(row['prompt'])}\n\n"
            f"completion:\n\n{block(row['completion'])}")


# ---- wandb ------------------------------------------------------------------------------------------------------
def wandb_base_url() -> str:
    """The wandb server wandb would talk to: WANDB_BASE_URL, else its settings (`wandb login --host` writes one)."""
    from wandb.sdk import wandb_setup  # optional package: only for the wandb tracker

    return os.environ.get("WANDB_BASE_URL") or wandb_setup.singleton().settings.base_url or DEFAULT_WANDB_URL


def wandb_key_problem(base_url: str) -> str | None:
    """Why wandb has no usable API key for `base_url`, or None. Found as wandb.login(prompt=False) finds it
    (WANDB_API_KEY, WANDB_IDENTITY_TOKEN_FILE, the .netrc entry `wandb login` writes, wandb's settings file),
    without its side effects: no prompt, no message, nothing saved."""
    from wandb.errors import AuthenticationError  # optional package: only for the wandb tracker

    try:  # wandb's own search (an internal module of wandb >= 0.31: where it moved, the environment decides)
        from wandb.sdk.lib import wbauth
    except ImportError:
        return None if os.environ.get("WANDB_API_KEY") else "no WANDB_API_KEY"
    try:
        auth = wbauth.authenticate_session(host=base_url, source="relayrl", prompt=False, update_session=False)
    except AuthenticationError as e:  # a key in a shape wandb refuses: it could not log in either
        return f"the wandb API key is unusable ({e})"
    return None if auth is not None else "no wandb API key (WANDB_API_KEY, or `wandb login` for ~/.netrc)"


def unreachable(url: str, timeout: float = REACH_TIMEOUT_S) -> str | None:
    """Why a TCP connection to the URL's host (its port, else 443 / 80 by scheme) fails, or None when it opens.
    A connect is what an online run needs first; nothing is sent."""
    parts = urlsplit(url)
    try:
        port = parts.port or (80 if parts.scheme == "http" else 443)
        socket.create_connection((parts.hostname or "", port), timeout=timeout).close()
    except (OSError, ValueError) as e:
        return f"{url} does not answer ({e or type(e).__name__})"
    return None


def wandb_mode(setting: str = "auto") -> tuple[str, str]:
    """(mode, why) for run.wandb.mode `setting`: an explicit mode as set; auto: WANDB_MODE when set, else online
    when wandb has an API key and its host answers, else offline."""
    if setting != "auto":
        return setting, f"run.wandb.mode={setting}"
    env = os.environ.get("WANDB_MODE", "")
    if env:
        return WANDB_ENV_MODES[env], f"WANDB_MODE={env}"  # the config check refused any other value
    url = wandb_base_url()
    problem = wandb_key_problem(url) or unreachable(url)
    if problem:
        return "offline", f"{problem}; set run.wandb.mode or WANDB_MODE to choose"
    return "online", f"an API key is set up and {url} answers"


class WandbTracker:
    """A wandb run in the mode `wandb_mode` picks, its files in RUN_DIR/wandb (offline: offline-run-*/, which
    `wandb sync` uploads later). Its id is kept in RUN_DIR/wandb/run_id so that a resumed run continues it. wandb's
    console capture, system stats, git and code capture stay off: relayrl prints its own progress, and a training
    job's environment is not what the run is about (WANDB_* settings cannot turn them back on here)."""

    def __init__(self, run_dir: Path, cfg: WandbConfig):
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # before the import: no LLM-tracing hook
        import wandb  # optional package (relayrl[trackers]): imported only for this tracker

        mode, why = wandb_mode(cfg.mode)
        run_dir = Path(run_dir)
        settings = wandb.Settings(mode=mode, base_url=wandb_base_url(), silent=True, console="off", save_code=False,
                                  disable_git=True, x_disable_stats=True, x_disable_meta=True)
        self._run = wandb.init(dir=str(run_dir), project=cfg.project, entity=cfg.entity,
                               name=cfg.name or run_dir.name, tags=cfg.tags or None, id=self._run_id(run_dir, mode),
                               resume="allow", settings=settings, reinit="create_new")
        local = mode in ("offline", "disabled")  # no URL (asking wandb for one warns)
        where = {"offline": str(run_dir / "wandb"), "disabled": "nothing written"}[mode] if local else self._run.url
        self.location = f"wandb/, {mode}" if local else f"{mode}: {where}"
        # falling back to offline is a warning: someone who meant to log online learns it at the start, not later
        fallback = cfg.mode == "auto" and mode == "offline" and not os.environ.get("WANDB_MODE")
        log.log(logging.WARNING if fallback else logging.INFO, "wandb tracker: %s run (%s): %s", mode, why, where)

    @staticmethod
    def _run_id(run_dir: Path, mode: str) -> str | None:
        """The run's wandb id: the one this run folder already has (a resume), else a new one kept there first, so
        that even a run that dies in wandb.init is continued under it. None when disabled (nothing written)."""
        if mode == "disabled":
            return None
        from wandb.sdk.lib import runid  # optional package, see __init__

        path = run_dir / "wandb" / "run_id"
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        run_id = runid.generate_id()
        atomic_write_text(path, run_id)
        return run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        import wandb  # optional package, imported by __init__ already

        table = wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


# ---- mlflow -----------------------------------------------------------------------------------------------------
# mlflow allows only these characters in metric and param names (mlflow.utils.validation)
_MLFLOW_BAD = re.compile(r"[^/\w.\- :]")


def mlflow_key(key: str) -> str:
    """A metric name mlflow accepts: "@" reads as "_at_" (eval/pass@1 -> eval/pass_at_1), anything else it
    refuses becomes "_"."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


def mlflow_uri_for(run_dir: Path, uri: str = "") -> str:
    """run.mlflow_uri as a tracking URI: empty -> the file store RUN_DIR/mlruns; a plain path -> a file: URI;
    anything else (sqlite:, http:) is used as the user wrote it."""
    if not uri:
        return (Path(run_dir) / "mlruns").resolve().as_uri()
    if "://" in uri or uri.startswith("file:"):
        return uri
    return Path(uri).expanduser().resolve().as_uri()


class MlflowTracker:
    """An mlflow run in experiment "relayrl" of a local store (see `mlflow_uri_for`), named after the run
    folder; the config goes in as flattened params (algo.clip_low = 0.2) plus a config.yaml artifact, each step's
    samples as artifacts samples/step_NNNNNN.json. Its id is kept in RUN_DIR/mlruns/run_id (whatever the store):
    a resumed run continues the same mlflow run."""

    def __init__(self, run_dir: Path, uri: str = ""):
        self.uri = mlflow_uri_for(run_dir, uri)
        if self.uri.startswith("file:"):  # mlflow 3 refuses its file store unless asked; it is what we want here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from a training run
        from mlflow.tracking import MlflowClient  # optional package (relayrl[trackers]): only for this tracker

        self._client = MlflowClient(tracking_uri=self.uri)
        self._id_file = Path(run_dir) / "mlruns" / "run_id"
        self.run_id = self._resume() or self._create(Path(run_dir))
        self.location = f"mlruns/, run {self.run_id}" if not uri else f"{self.uri}, run {self.run_id}"

    def _resume(self) -> str | None:
        """The run this folder already logged to, set running again; None for a new folder (or a store without it:
        run.mlflow_uri changed since, a warning says so)."""
        from mlflow.exceptions import MlflowException  # optional package, see __init__

        run_id = self._id_file.read_text().strip() if self._id_file.is_file() else ""
        if not run_id:
            return None
        try:
            self._client.update_run(run_id, status="RUNNING")
        except MlflowException as e:
            log.warning("mlflow: run %s (from %s) is not in %s (%s): starting a new run", run_id, self._id_file,
                        self.uri, e.message)
            return None
        return run_id

    def _create(self, run_dir: Path) -> str:
        exp = self._client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        exp_id = exp.experiment_id if exp else self._client.create_experiment(MLFLOW_EXPERIMENT)
        run = self._client.create_run(exp_id, run_name=run_dir.name, tags={"relayrl.run_dir": str(run_dir.resolve())})
        atomic_write_text(self._id_file, run.info.run_id)
        return run.info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional package, see __init__

        ms = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # mlflow's limit per batch
            self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_config(self, config: dict[str, Any]) -> None:
        """Params are write-once in mlflow (a changed value is an error): a resumed run adds only keys it did not
        have, so they keep the first attempt's values; config.yaml is replaced by the config now in force."""
        from mlflow.entities import Param  # optional package, see __init__

        known = self._client.get_run(self.run_id).data.params
        params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flatten(config).items()  # 6000: mlflow's cap
                  if mlflow_key(k) not in known]
        for i in range(0, len(params), 100):  # mlflow's limit of params per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])
        self._client.log_dict(self.run_id, config, "config.yaml")

    def log_samples(self, step: int, rows: list[dict[str, Any]]) -> None:
        self._client.log_dict(self.run_id, {"step": step, "rows": rows}, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
