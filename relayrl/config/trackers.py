"""Which trackers `run.trackers` may name and what each needs installed: checked when the config loads, before
any model does (relayrl.tracking.trackers makes them)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable

TRACKERS = ("tensorboard", "jsonl", "wandb", "mlflow")
DEFAULT_TRACKERS = ("tensorboard", "jsonl")
# tracker -> the module it needs (mlflow-skinny provides mlflow)
PACKAGES = {"tensorboard": "tensorboard", "jsonl": None, "wandb": "wandb", "mlflow": "mlflow"}
EXTRA = "pip install relayrl[trackers]"


def tracker_problem(names: Iterable[str]) -> str | None:
    """Why these trackers cannot run here (an unknown name, a package not installed), or None."""
    for name in names:
        if name not in TRACKERS:
            return f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}"
        module = PACKAGES[name]
        if module is not None and importlib.util.find_spec(module) is None:
            return f"tracker {name!r} needs the {module} package, which is not installed: {EXTRA}"
    return None
