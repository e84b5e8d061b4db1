"""relayrl.train from a notebook: rows in memory, rewards and tools that no import path reaches (defined in an
interactive __main__, lambdas), a datasets.Dataset, and the result it hands back."""

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import datasets
import pytest
from bounds import bound
from conftest import TINY_RUN

import relayrl
from relayrl import TrainResult, api, train
from relayrl.common.errors import InputError
from relayrl.common.imports import import_from_path

ROWS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]


def _settings(tmp_path: Path, **extra) -> dict:
    """TINY_RUN without its reward (the tests pass their own) writing under tmp_path."""
    over = {k: v for k, v in TINY_RUN.items() if k != "judge.reward_fn"}
    return {**over, "run.output_dir": str(tmp_path), "run.trackers": ["jsonl"], **extra}


# What a notebook cell runs: `python -c` gives __main__ no file, so nothing in it can be imported by name in
# another process (the judge's workers, the tool agent's), exactly as in Jupyter.
NOTEBOOK = textwrap.dedent("""
    import json, sys
    import relayrl

    def quarter(response, row):
        return 0.25

    def add(a: int, b: int) -> int:
        '''Add two integers.

        Args:
            a: the first
            b: the second
        '''
        return a + b

    settings = json.loads(sys.argv[1])
    result = relayrl.train(model=settings.pop("model"), dataset=[{"question": f"What is {i} + {i}?",
                           "answer": str(2 * i)} for i in range(6)], reward=quarter, tools=[add],
                           overrides=settings)
    print("RESULT", json.dumps({"run_dir": str(result.run_dir), "metrics": result.metrics,
                                "model_path": str(result.model_path)}))
""")


def test_a_notebook_trains_with_its_own_reward_tool_and_rows(tiny_path, tmp_path):
    settings = _settings(tmp_path, model=tiny_path, **{"run.save_final": True})
    proc = subprocess.run([sys.executable, "-c", NOTEBOOK, json.dumps(settings)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=bound(300))
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    run_dir = Path(result["run_dir"])
    assert run_dir == (tmp_path / "t").resolve() and (run_dir / "metrics.jsonl").is_file()
    assert result["metrics"]["rollout/reward_mean"] == 0.25  # the notebook's reward ran in the judge's workers
    assert "train/loss" in result["metrics"] and result["metrics"]["step"] == 2
    assert Path(result["model_path"]) == run_dir / "model" and (run_dir / "model" / "config.json").is_file()
    cfg = (run_dir / "config.yaml").read_text()
    assert f"pickle:{run_dir}/inputs/reward_0_quarter.pkl" in cfg and f"source: {run_dir}/inputs/dataset.jsonl" in cfg
    assert f"pickle:{run_dir}/inputs/tool_0_add.pkl" in cfg and "kind: tool" in cfg
    assert import_from_path(f"pickle:{run_dir}/inputs/tool_0_add.pkl")(2, 3) == 5  # here too, by value


def test_lambda_rewards_and_a_datasets_dataset(tiny_path, tmp_path):
    rewards = [lambda response, row: 0.5, lambda prompts, completions, **kw: [1.0] * len(completions)]
    result = train(model=tiny_path, dataset=datasets.Dataset.from_list(ROWS), eval_dataset=ROWS[:2],
                   reward=rewards, reward_weights=[1.0, 0.25], overrides=_settings(tmp_path, **{"eval.at_end": True}))
    assert isinstance(result, TrainResult) and result.model_path is None  # TINY_RUN saves no model
    assert result.metrics["rollout/reward_mean"] == 0.75 and result.metrics["eval/reward_mean"] == 0.75
    assert sorted(p.name for p in (result.run_dir / "inputs").iterdir()) == [
        "dataset.jsonl", "eval_dataset.jsonl", "reward_0.pkl", "reward_1.pkl"]
    assert result.metrics["rollout/reward/reward_1_mean"] == 1.0  # each lambda is named for its metric
    metrics = relayrl.evaluate(model=tiny_path, eval_dataset=ROWS[:2], reward=lambda response, row: 0.5,
                               overrides=_settings(tmp_path))
    assert metrics["eval/reward_mean"] == 0.5


def test_a_config_object_still_trains_and_a_second_run_gets_its_own_folder(tiny_run, tmp_path):
    cfg = tiny_run(**{"run.steps": 1})
    first = relayrl.train(cfg, reward=lambda response, row: 0.5)
    second = relayrl.train(cfg, reward=lambda response, row: 0.5)
    assert (first.run_dir.name, second.run_dir.name) == ("t", "t-2")
    assert second.metrics["rollout/reward_mean"] == 0.5 and (second.run_dir / "inputs").is_dir()


def test_bad_input_fails_before_any_model_loads_and_leaves_no_folder(tiny_path, tmp_path):
    out = tmp_path / "runs"
    settings = _settings(out)
    t0 = time.perf_counter()
    with pytest.raises(InputError, match=r"^dataset\[1\]: row has no 'question', 'prompt' or 'messages'"):
        train(model=tiny_path, dataset=[ROWS[0], {"text": "no prompt here", "answer": "1"}],
              reward=lambda response, row: 0.0, overrides=settings)
    assert time.perf_counter() - t0 < bound(30)  # no model was loaded, no step run
    assert not out.exists()  # nor a folder left to mistake for a run
    with pytest.raises(TypeError, match=r"dataset\[1\] is a str"):
        train(model=tiny_path, dataset=[ROWS[0], "What is 1 + 1?"], overrides=settings)
    with pytest.raises(TypeError, match="DatasetDict"):
        train(model=tiny_path, dataset=datasets.DatasetDict(train=datasets.Dataset.from_list(ROWS)),
              overrides=settings)
    with pytest.raises(ValueError, match="model.path is given twice"):
        train(model=tiny_path, overrides={**settings, "model.path": tiny_path})
    assert not out.exists()


def test_the_docs_notebook_snippet_runs(tmp_path, monkeypatch):
    """docs/agents.md, "From Python or a notebook", as written, up to the training itself: its arguments are
    accepted, checked and written into a run folder (the training is the tests above)."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "agents.md").read_text()
    snippet = text.split("## From Python or a notebook", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    prepared = {}

    def prepare_only(config=None, *, overrides=(), **kw):
        cfg, run_dir, _ = api._prepare(config, overrides, api._Inputs(**kw), role="train")
        prepared.update(cfg=cfg)
        return TrainResult(run_dir, {"eval/pass@1": 0.0}, None)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(relayrl, "train", prepare_only, raising=False)
    exec(compile(snippet, "docs/agents.md", "exec"), {"__name__": "__main__"})  # noqa: S102 - the docs' own code
    cfg = prepared["cfg"]
    assert cfg.run.steps == 10 and cfg.agent.kind == "tool" and cfg.judge.reward_weights == [1.0, 0.5]
    lam = import_from_path(cfg.judge.reward_fn[1])
    assert lam.__name__ == "reward_1" and lam(["p"], ["short"]) == [0.1]
