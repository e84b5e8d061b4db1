"""The Python face of relayrl: load a config, train, evaluate, with your agent and reward as plain objects.

    cfg = load_config(overrides={"data.train.source": "prompts.jsonl", "run.steps": 10})
    train(cfg, agent=MyAgent, reward=my_reward)        # a whole script: examples/python_api.py

Configs name user code by import path ("module:name") because reward functions run in worker processes and
a run may be rebuilt in another process (separate placement, Ray). `train` turns objects into those paths; an
object defined in the script you run is found again by the workers as `__main__:name`, which is how Python's
spawned processes see a script (run it as a file, not from a notebook, for the reward's sake).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from relayrl.agents import AGENTS
from relayrl.common.utils import module_level_path
from relayrl.config.schema import Config, load_run_config
from relayrl.run.loop import evaluate as _evaluate
from relayrl.run.loop import train as _train


def load_config(path: str | None = None, overrides: Mapping[str, Any] | Sequence[str] = ()) -> Config:
    """A checked Config from a YAML file (optional) plus overrides: {"train.lr": 1e-5} or ["train.lr=1e-5"].
    Errors name the key (relayrl.config.ConfigError), before anything is loaded."""
    if isinstance(overrides, Mapping):
        overrides = [f"{k}={_yaml(v)}" for k, v in overrides.items()]
    return load_run_config(path, list(overrides))


Reward = Callable | Sequence[Callable]


def train(config: Config, *, agent: type | None = None, reward: Reward | None = None,
          reward_weights: Sequence[float] | None = None) -> dict[str, float]:
    """Train as `relayrl train` does; returns the last evaluation's metrics (empty without eval data).

    agent: an Agent subclass (instead of agent.kind); reward: a function (response, row, **kwargs) -> float or
    {"reward": float, ...}, or TRL's (prompts, completions, **columns) -> list[float | None], or a list of such
    functions (instead of judge.reward_fn); reward_weights: one per function (instead of judge.reward_weights)."""
    return _train(_with_objects(config, agent, reward, reward_weights))


def evaluate(config: Config, *, agent: type | None = None, reward: Reward | None = None,
             reward_weights: Sequence[float] | None = None) -> dict[str, float]:
    """Evaluate config.model.path on config.data.eval with the agent and reward, as `relayrl eval` does."""
    return _evaluate(_with_objects(config, agent, reward, reward_weights))


def _with_objects(cfg: Config, agent: type | None, reward: Reward | None = None,
                  reward_weights: Sequence[float] | None = None) -> Config:
    if agent is not None:
        kind = import_path(agent)
        if agent.__module__ == "__main__":  # this process finds it by name even where __main__ is a notebook
            AGENTS[kind] = agent
        cfg = dataclasses.replace(cfg, agent=dataclasses.replace(cfg.agent, kind=kind))
    if reward is not None:
        paths = import_path(reward) if callable(reward) else [import_path(fn) for fn in reward]
        cfg = dataclasses.replace(cfg, judge=dataclasses.replace(cfg.judge, reward_fn=paths))
    if reward_weights is not None:
        cfg = dataclasses.replace(cfg, judge=dataclasses.replace(cfg.judge, reward_weights=list(reward_weights)))
    cfg.validate()
    return cfg


def import_path(obj: Any) -> str:
    """'module:qualname' of a module-level class or function (what configs use to name user code)."""
    qualname = getattr(obj, "__qualname__", "")
    if not qualname and (found := module_level_path(obj)) is not None:
        return found  # a configured object, e.g. `helpful = llm_judge(...)` at the top level of its module
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{obj!r} must be defined at the top level of a module (worker processes import it by "
                         "name); lambdas and functions inside functions cannot be found there")
    return f"{obj.__module__}:{qualname}"


def _yaml(value: Any) -> str:
    """An override value as YAML text: JSON is YAML, so strings stay strings ("123" is not the number 123)."""
    return json.dumps(value)
