"""Where a run's metrics go: one small backend per tracker behind one protocol, all fed the same rows.

`MetricsLogger` (relayrl/tracking/metrics.py) hands every step's metrics, and the eval metrics, to each tracker
of `run.trackers` with the same keys and steps. Nothing here reaches the network: wandb runs offline (its run
folder under RUN_DIR/wandb, to sync later if wanted), mlflow writes a local file store (RUN_DIR/mlruns) unless
`run.mlflow_uri` names another store explicitly. metrics.jsonl is always written: resume and plots read it.

The optional packages (wandb, mlflow) are imported only when their tracker is made, so a run without them
neither needs them nor pays their import time; `tracker_problem` tells the config check what is missing.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol

import yaml

from relayrl.common.utils import append_jsonl
from relayrl.config import flatten

MLFLOW_EXPERIMENT = "relayrl"


class Tracker(Protocol):
    """A metrics destination. `log` gets finite floats only (MetricsLogger drops the rest)."""

    def log(self, step: int, metrics: dict[str, float]) -> None: ...

    def log_config(self, config: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


def active_trackers(names: Iterable[str], tensorboard: bool = True) -> list[str]:
    """run.trackers with jsonl always first (resume and plots read metrics.jsonl), duplicates dropped, and
    tensorboard dropped when the deprecated run.tensorboard is false."""
    out = ["jsonl"]
    for name in names:
        if name not in out and (tensorboard or name != "tensorboard"):
            out.append(name)
    return out


def make_trackers(names: Iterable[str], run_dir: Path, mlflow_uri: str = "") -> list[Tracker]:
    """One backend per name, opened in run_dir; the ones opened so far are closed again if one fails."""
    makers = {"jsonl": JsonlTracker, "tensorboard": TensorBoardTracker, "wandb": WandbTracker,
              "mlflow": lambda d: MlflowTracker(d, mlflow_uri)}
    made: list[Tracker] = []
    try:
        for name in names:
            made.append(makers[name](run_dir))
    except BaseException:
        for tracker in made:
            tracker.close()
        raise
    return made


class JsonlTracker:
    """RUN_DIR/metrics.jsonl, one line per log call (a whole-line append each: crash-safe, see append_jsonl).
    The config is not repeated here: the run folder's config.yaml is the record of it."""

    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / "metrics.jsonl"

    def log(self, step: int, metrics: dict[str, float]) -> None:
        append_jsonl(self.path, {"step": step, **metrics})

    def log_config(self, config: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker:
    """RUN_DIR/tensorboard: one scalar per metric, the config as a text summary named "config"."""

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

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    """An offline wandb run in RUN_DIR/wandb/offline-run-*/ (`wandb sync` uploads it later, if ever): the mode
    is forced offline, and system stats, git and code capture are off, so nothing leaves the machine."""

    def __init__(self, run_dir: Path):
        os.environ["WANDB_MODE"] = "offline"  # before the import: wandb reads it at setup; never online
        os.environ.setdefault("WANDB_DISABLE_WEAVE", "true")  # no LLM-tracing hook (it would go online)
        import wandb  # optional package (relayrl[trackers]): imported only for this tracker

        settings = wandb.Settings(mode="offline", silent=True, console="off", save_code=False, disable_git=True,
                                  x_disable_stats=True, x_disable_meta=True)
        self._run = wandb.init(dir=str(run_dir), project=MLFLOW_EXPERIMENT, name=Path(run_dir).name,
                               settings=settings, reinit="create_new")

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._run.log(metrics, step=step)

    def log_config(self, config: dict[str, Any]) -> None:
        self._run.config.update(config, allow_val_change=True)

    def close(self) -> None:
        self._run.finish()


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
    folder; the config goes in as flattened params (algo.clip_low = 0.2) plus a config.yaml artifact."""

    def __init__(self, run_dir: Path, uri: str = ""):
        self.uri = mlflow_uri_for(run_dir, uri)
        if self.uri.startswith("file:"):  # mlflow 3 refuses its file store unless asked; it is what we want here
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # no usage reports from a training run
        from mlflow.tracking import MlflowClient  # optional package (relayrl[trackers]): only for this tracker

        self._client = MlflowClient(tracking_uri=self.uri)
        exp = self._client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        exp_id = exp.experiment_id if exp else self._client.create_experiment(MLFLOW_EXPERIMENT)
        run = self._client.create_run(exp_id, run_name=Path(run_dir).name,
                                      tags={"relayrl.run_dir": str(Path(run_dir).resolve())})
        self.run_id = run.info.run_id

    def log(self, step: int, metrics: dict[str, float]) -> None:
        from mlflow.entities import Metric  # optional package, see __init__

        ms = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), v, ms, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # mlflow's limit per batch
            self._client.log_batch(self.run_id, metrics=batch[i:i + 1000])

    def log_config(self, config: dict[str, Any]) -> None:
        from mlflow.entities import Param  # optional package, see __init__

        params = [Param(mlflow_key(k), str(v)[:6000]) for k, v in flatten(config).items()]  # 6000: mlflow's cap
        for i in range(0, len(params), 100):  # mlflow's limit of params per batch
            self._client.log_batch(self.run_id, params=params[i:i + 100])
        self._client.log_dict(self.run_id, config, "config.yaml")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
