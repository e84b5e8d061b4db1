"""The Python face of relayrl: train and evaluate from a script or a notebook, with your data, reward, tools,
environment and agent as plain Python objects.

    result = train(model="smollm2", dataset=[{"question": "2+2?", "answer": "4"}, ...], reward=my_reward,
                   overrides={"run.steps": 10})
    result.run_dir, result.metrics, result.model_path
    train(load_config("my.yaml"), agent=MyAgent, reward=my_reward)      # a Config works too

A run may be rebuilt in other processes (judge workers, a separate-placement producer, Ray), so everything it
is given must be reachable from its config. Rows in memory are written to RUN_DIR/inputs/*.jsonl and the
config's data sources point there. Objects are named by import path ("module:name") where one reaches them;
anything else (defined in `__main__`, a notebook cell, a lambda, a closure) is saved by value with cloudpickle
to RUN_DIR/inputs/*.pkl and named "pickle:/that/file.pkl", which `import_from_path` loads in any process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import cloudpickle

from relayrl.common.errors import InputError
from relayrl.common.files import atomic_write_bytes, atomic_write_text, read_jsonl
from relayrl.common.imports import PICKLE_SCHEME, import_from_path, module_level_path
from relayrl.config.loader import ConfigError
from relayrl.config.schema import Config, DatasetConfig, load_run_config
from relayrl.run.build import INPUTS, discard_new_run, new_run_dir
from relayrl.run.checkpoint import resume_target
from relayrl.run.loop import evaluate as _evaluate
from relayrl.run.loop import train as _train

Reward = Callable | Sequence[Callable]
Overrides = Mapping[str, Any] | Sequence[str]
# a dataset: a file, folder or source name as data.*.source takes it; rows in memory (dicts); a datasets.Dataset
DatasetLike = str | os.PathLike | Sequence[Mapping[str, Any]] | Any


@dataclasses.dataclass
class TrainResult:
    """What a training run leaves: its folder (config.yaml, metrics.jsonl, trajectories/), its final metrics
    (the last step's training metrics and the last evaluation's `eval/*`), and the trained model's folder
    (None with run.save_final=false), which `load_config(overrides={"model.path": ...})` evaluates."""

    run_dir: Path
    metrics: dict[str, float]
    model_path: Path | None


@dataclasses.dataclass
class _Inputs:
    """Everything a call passes besides the config, as Python objects."""

    model: str | os.PathLike | None = None
    dataset: DatasetLike | None = None
    eval_dataset: DatasetLike | None = None
    reward: Reward | None = None
    reward_weights: Sequence[float] | None = None
    agent: type | None = None
    tools: Sequence[str | Callable] | None = None
    env: type | str | None = None


def load_config(path: str | None = None, overrides: Overrides = ()) -> Config:
    """A checked Config from a YAML file (optional) plus overrides: {"train.lr": 1e-5} or ["train.lr=1e-5"].
    Errors name the key (relayrl.config.ConfigError), before anything is loaded."""
    return load_run_config(path, _override_list(overrides))


def train(config: Config | str | os.PathLike | None = None, *, model: str | os.PathLike | None = None,
          dataset: DatasetLike | None = None, eval_dataset: DatasetLike | None = None, reward: Reward | None = None,
          reward_weights: Sequence[float] | None = None, agent: type | None = None,
          tools: Sequence[str | Callable] | None = None, env: type | str | None = None,
          overrides: Overrides = ()) -> TrainResult:
    """Train as `relayrl train` does and say where the run went.

    config: a Config (load_config), a YAML path, or None (the defaults); overrides: {"train.lr": 1e-5, ...} on
    top of a path or the defaults (a Config already holds its own). model: model.path. dataset / eval_dataset:
    data.train / data.eval as a source (a file, folder, "gsm8k:train", ...), a list of dicts or a
    datasets.Dataset (columns and prompt_key of the config still apply). reward: a function (response, row,
    **kwargs) -> float | dict, or TRL's (prompts, completions, **columns) -> list[float | None], or a list of
    them (judge.reward_fn), weighted by reward_weights. tools: functions (or names, import paths) for the tool
    agent (agent.kind becomes "tool" unless agent is given); env: an environment class for the env agent
    (agent.kind "env"); agent: an Agent subclass. Any of them may be defined in a notebook or a lambda."""
    inputs = _Inputs(model, dataset, eval_dataset, reward, reward_weights, agent, tools, env)
    cfg, run_dir, created = _prepare(config, overrides, inputs, role="train")
    try:
        last_eval = _train(cfg)
    except InputError as e:
        discard_new_run(run_dir, created)  # a run that never started leaves no folder behind
        raise _rows_named(e, run_dir / INPUTS) from None
    except BaseException:
        discard_new_run(run_dir, created)
        raise
    model_path = run_dir / "model"
    return TrainResult(run_dir, _final_metrics(run_dir, last_eval), model_path if model_path.is_dir() else None)


def evaluate(config: Config | str | os.PathLike | None = None, *, model: str | os.PathLike | None = None,
             eval_dataset: DatasetLike | None = None, reward: Reward | None = None,
             reward_weights: Sequence[float] | None = None, agent: type | None = None,
             tools: Sequence[str | Callable] | None = None, env: type | str | None = None,
             overrides: Overrides = ()) -> dict[str, float]:
    """Evaluate config.model.path (or `model`) on data.eval (or `eval_dataset`) with the agent and reward, as
    `relayrl eval` does; the arguments are `train`'s. Returns the evaluation's metrics."""
    inputs = _Inputs(model, None, eval_dataset, reward, reward_weights, agent, tools, env)
    cfg, run_dir, created = _prepare(config, overrides, inputs, role="eval")
    try:
        return _evaluate(cfg)
    except InputError as e:
        discard_new_run(run_dir, created)
        raise _rows_named(e, run_dir / INPUTS) from None
    except BaseException:
        discard_new_run(run_dir, created)
        raise


def _prepare(config: Config | str | os.PathLike | None, overrides: Overrides, inputs: _Inputs,
             role: str) -> tuple[Config, Path, Path | bool]:
    """The checked Config of a call, its run folder (the one the build will pick) and what `discard_new_run` may
    undo there; the inputs written into RUN_DIR/inputs first."""
    cfg = _base_config(config, overrides, inputs)
    run_dir = _run_dir(cfg, role)
    resumed = role == "train" and bool(cfg.run.resume)  # a folder that was there: nothing of it is undone
    created = False if resumed else next((p for p in reversed([run_dir, *run_dir.parents]) if not p.exists()), True)
    try:
        cfg = _with_inputs(cfg, inputs, run_dir / INPUTS)
        cfg.validate()
    except BaseException:
        discard_new_run(run_dir, created)
        raise
    return cfg, run_dir, created


def _base_config(config: Config | str | os.PathLike | None, overrides: Overrides, inputs: _Inputs) -> Config:
    """The Config before the inputs: from a Config, a path or the defaults, with the overrides."""
    over = _override_list(overrides)
    for key, given in (("model.path", inputs.model), ("data.train.source", inputs.dataset),
                       ("data.eval.source", inputs.eval_dataset)):
        if given is not None and any(o.partition("=")[0].strip() == key for o in over):
            raise ValueError(f"{key} is given twice: as an argument and in overrides; keep one")
    if isinstance(config, Config):
        if over:
            raise TypeError("overrides apply to a YAML path or the defaults; a Config holds its own: "
                            "load_config(path, overrides)")
        return config
    if inputs.dataset is not None:  # a placeholder that passes the checks until the real source is known
        over.append("data.train.source=<in memory>")
    return load_run_config(None if config is None else str(config), over)


def _run_dir(cfg: Config, role: str) -> Path:
    """The folder the build will write to: the resumed run's, or the new one `new_run_dir` picks (a folder
    holding only inputs/ stays free for it)."""
    if role == "train" and cfg.run.resume:
        return resume_target(cfg)[0]
    return new_run_dir(cfg).resolve()


def _with_inputs(cfg: Config, inputs: _Inputs, folder: Path) -> Config:
    """`cfg` naming the inputs: data written to `folder`, objects by import path or pickled there."""
    data, judge, agent = cfg.data, cfg.judge, cfg.agent
    if inputs.model is not None:
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=os.fspath(inputs.model)))
    if inputs.dataset is not None:
        data = dataclasses.replace(data, train=dataclasses.replace(
            data.train, source=_dataset_source(inputs.dataset, folder / "dataset.jsonl", "dataset")))
    if inputs.eval_dataset is not None:
        data = dataclasses.replace(data, eval=dataclasses.replace(
            data.eval or DatasetConfig(), source=_dataset_source(inputs.eval_dataset, folder / "eval_dataset.jsonl",
                                                                 "eval_dataset")))
    if inputs.reward is not None:
        fns = [inputs.reward] if callable(inputs.reward) else list(inputs.reward)
        paths = [code_path(fn, folder, f"reward_{i}") for i, fn in enumerate(fns)]
        judge = dataclasses.replace(judge, reward_fn=paths[0] if callable(inputs.reward) else paths)
    if inputs.reward_weights is not None:
        judge = dataclasses.replace(judge, reward_weights=[float(w) for w in inputs.reward_weights])
    agent = _agent(agent, inputs, folder)
    return dataclasses.replace(cfg, data=data, judge=judge, agent=agent)


def _agent(agent: Any, inputs: _Inputs, folder: Path) -> Any:
    """cfg.agent with the agent class, tools and environment named; tools pick the tool agent and an
    environment the env agent unless an agent class is given."""
    kind, kwargs = agent.kind, dict(agent.kwargs)
    if inputs.tools is not None and inputs.env is not None:
        raise ValueError("tools and env pick different agents (tool, env): give one")
    if inputs.tools is not None:
        kwargs["tools"] = [t if isinstance(t, str) else code_path(t, folder, f"tool_{i}")
                           for i, t in enumerate(inputs.tools)]
        kind = "tool" if kind == "single_turn" else kind
    if inputs.env is not None:
        kwargs["env"] = inputs.env if isinstance(inputs.env, str) else code_path(inputs.env, folder, "env")
        kind = "env" if kind == "single_turn" else kind
    if inputs.agent is not None:
        kind = code_path(inputs.agent, folder, "agent")
    return dataclasses.replace(agent, kind=kind, kwargs=kwargs)


def _dataset_source(dataset: DatasetLike, path: Path, name: str) -> str:
    """data.*.source for `dataset`: a path or source name as it is, rows in memory written to `path` (JSONL,
    atomically: a crash never leaves half a dataset for a resume to read)."""
    if isinstance(dataset, str | os.PathLike):
        return os.fspath(dataset)
    rows = _rows(dataset, name)
    if not rows:
        raise ValueError(f"{name} has no rows")
    lines = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise TypeError(f"{name}[{i}] is a {type(row).__name__}; a row is a dict of columns, e.g. "
                            '{"question": "What is 2+2?", "answer": "4"}')
        try:
            lines.append(json.dumps(dict(row), ensure_ascii=False) + "\n")
        except (TypeError, ValueError) as e:
            raise TypeError(f"{name}[{i}]: a row must hold plain values (text, numbers, lists, dicts): {e}") from None
    atomic_write_text(path, "".join(lines))
    return str(path)


def _rows(dataset: Any, name: str) -> Sequence[Any]:
    """The rows of a list of dicts or a datasets.Dataset (loaded only when something else was given)."""
    if isinstance(dataset, Sequence):
        return dataset
    import datasets  # the HF library (slow to import): only for a Dataset object

    if isinstance(dataset, datasets.DatasetDict):
        raise TypeError(f"{name} is a DatasetDict with splits {list(dataset)}: pass one split, e.g. "
                        f"{name}=ds['train']")
    if isinstance(dataset, datasets.Dataset):
        return dataset.to_list()
    raise TypeError(f"{name} must be a path, a list of dicts or a datasets.Dataset, got {type(dataset).__name__}")


def code_path(obj: Any, folder: Path, stem: str) -> str:
    """How a config names `obj`: its import path where that reaches this very object from any process; else
    'pickle:<folder>/<stem>_<name>.pkl', the object saved there by value (cloudpickle)."""
    try:
        path = import_path(obj)
    except ValueError:
        path = None
    if path is not None and not path.startswith("__main__:"):  # __main__ is another module in a worker or Ray
        try:
            if import_from_path(path) is obj:
                return path
        except (ImportError, ValueError):
            pass
    try:
        data = cloudpickle.dumps(obj)
        name = getattr(obj, "__name__", type(obj).__name__)
        if name == "<lambda>":  # a name is a metric (reward/<name>) or what the model calls (a tool): give it one
            obj, name = cloudpickle.loads(data), stem
            obj.__name__ = obj.__qualname__ = name
            data = cloudpickle.dumps(obj)
    except Exception as e:
        raise TypeError(f"{obj!r} cannot be saved for the run's other processes (cloudpickle: {e}); define it "
                        "in a module and pass it from there") from e
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in name)
    file = folder / (f"{name}.pkl" if name == stem else f"{stem}_{name}.pkl")
    atomic_write_bytes(file, data)
    return f"{PICKLE_SCHEME}{file}"


def import_path(obj: Any) -> str:
    """'module:qualname' of a module-level class or function (what configs use to name user code)."""
    qualname = getattr(obj, "__qualname__", "")
    if not qualname and (found := module_level_path(obj)) is not None:
        return found  # a configured object, e.g. `helpful = llm_judge(...)` at the top level of its module
    if not qualname or "<locals>" in qualname or "<lambda>" in qualname:
        raise ValueError(f"{obj!r} must be defined at the top level of a module (worker processes import it by "
                         "name); lambdas and functions inside functions cannot be found there")
    return f"{obj.__module__}:{qualname}"


def _rows_named(e: InputError, folder: Path) -> InputError:
    """`e` with a row of a file the API wrote ("RUN_DIR/inputs/dataset.jsonl:2: ...", a file the user never
    saw and that is gone with the failed run) named as the argument's row ("dataset[1]: ...")."""
    for name in ("dataset", "eval_dataset"):
        found = re.match(rf"{re.escape(str(folder / name))}\.jsonl:(\d+): ", str(e))
        if found:
            return InputError(f"{name}[{int(found[1]) - 1}]: {str(e)[found.end():]}")
    return e


def _final_metrics(run_dir: Path, last_eval: dict[str, float]) -> dict[str, float]:
    """The records metrics.jsonl holds for the last step logged (training and evaluation), with the final
    evaluation on top."""
    file = run_dir / "metrics.jsonl"
    records = read_jsonl(file) if file.is_file() else []
    last = max((r.get("step", 0) for r in records), default=None)
    out: dict[str, float] = {}
    for r in records:
        if r.get("step") == last:
            out |= r
    return out | last_eval


def _override_list(overrides: Overrides) -> list[str]:
    """{"train.lr": 1e-5} or ["train.lr=1e-5"] as key=value strings."""
    if isinstance(overrides, str):
        raise TypeError("overrides must be a mapping or a list of 'key=value' strings, not one string")
    if isinstance(overrides, Mapping):
        return [f"{k}={_yaml(v)}" for k, v in overrides.items()]
    return list(overrides)


def _yaml(value: Any) -> str:
    """An override value as YAML text: JSON is YAML, so strings stay strings ("123" is not the number 123)."""
    return json.dumps(value)


__all__ = ["ConfigError", "TrainResult", "evaluate", "load_config", "train"]
