"""Which trackers `run.trackers` may name and what each needs installed, and the `run.wandb` section: checked when
the config loads, before any model does (relayrl.tracking.trackers makes them)."""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from relayrl.common.errors import install_hint
from relayrl.config.loader import check

TRACKERS = ("tensorboard", "jsonl", "wandb", "mlflow")
DEFAULT_TRACKERS = ("tensorboard", "jsonl")
# tracker -> the module it needs (mlflow-skinny provides mlflow)
PACKAGES = {"tensorboard": "tensorboard", "jsonl": None, "wandb": "wandb", "mlflow": "mlflow"}
EXTRA = install_hint("trackers")
# WANDB_MODE values wandb itself accepts -> the mode they mean (dryrun and run are its old spellings)
WANDB_ENV_MODES = {"online": "online", "offline": "offline", "disabled": "disabled", "shared": "shared",
                   "dryrun": "offline", "run": "online"}
# characters wandb refuses in a project name (its server's rule), and its longest project name and tag
_WANDB_PROJECT_BAD = re.compile(r"[/\\#?%:]")
_WANDB_MAX_PROJECT, _WANDB_MAX_TAG = 128, 64


@dataclass
class WandbConfig:
    """wandb's run for this run (when run.trackers names wandb): where it goes and how it is labelled."""

    project: str = "relayrl"  # the wandb project the run is logged to
    entity: str | None = None  # the team or user that owns the project; None: the API key's default entity
    name: str | None = None  # the run's display name; None: the run folder's name
    tags: list[str] = field(default_factory=list)  # labels to filter runs by in the wandb UI
    # online | offline (RUN_DIR/wandb/offline-run-*, `wandb sync` uploads it later) | disabled (nothing written);
    # auto: offline under run.offline, else the WANDB_MODE environment variable when set, else online when an API
    # key is found (WANDB_API_KEY or ~/.netrc, as wandb finds it) and the wandb host answers, else offline (a
    # warning says why)
    mode: Literal["auto", "online", "offline", "disabled"] = "auto"

    def validate(self) -> None:
        check(bool(self.project) and not _WANDB_PROJECT_BAD.search(self.project)
              and len(self.project) <= _WANDB_MAX_PROJECT, "project",
              f"must be 1 to {_WANDB_MAX_PROJECT} characters, none of / \\ # ? % :, got {self.project!r}")
        check(self.entity is None or bool(self.entity.strip()), "entity", "must not be empty (null: the default)")
        check(self.name is None or bool(self.name.strip()), "name", "must not be empty (null: the run folder's)")
        for i, tag in enumerate(self.tags):
            check(bool(tag.strip()) and len(tag) <= _WANDB_MAX_TAG, f"tags[{i}]",
                  f"must be 1 to {_WANDB_MAX_TAG} characters, got {tag!r}")


def tracker_problem(names: Iterable[str]) -> str | None:
    """Why these trackers cannot run here (an unknown name, a package not installed, a WANDB_MODE wandb would
    refuse once the models are loaded), or None."""
    for name in names:
        if name not in TRACKERS:
            return f"unknown tracker {name!r}; choose from {', '.join(TRACKERS)}"
        module = PACKAGES[name]
        if module is not None and importlib.util.find_spec(module) is None:
            return f"tracker {name!r} needs the {module} package, which is not installed: {EXTRA}"
        env_mode = os.environ.get("WANDB_MODE", "")
        if name == "wandb" and env_mode and env_mode not in WANDB_ENV_MODES:
            return (f"tracker 'wandb': the environment variable WANDB_MODE={env_mode!r} is not a wandb mode; "
                    f"use one of {', '.join(WANDB_ENV_MODES)} or unset it")
    return None
