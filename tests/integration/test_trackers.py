"""Trackers for real: each backend writes a few steps into tmp_path and its own reader (EventAccumulator, wandb's
`leet inspect` of the offline run, MlflowClient on the file store, the JSONL file) must give back the same keys,
values and steps. Then a real `relayrl train` subprocess on the tiny model with every tracker, its output piped
(not a terminal): the per-step progress lines, the start block, and the metrics in each tracker."""

import importlib.util
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TESTS, write_sums

from relayrl.cli import main
from relayrl.common.errors import install_hint
from relayrl.common.files import read_jsonl
from relayrl.config import flatten
from relayrl.config.schema import load_run_config
from relayrl.config.trackers import PACKAGES
from relayrl.tracking.metrics import MetricsLogger
from relayrl.tracking.progress import Progress
from relayrl.tracking.trackers import active_trackers, mlflow_key

# what a run logs: eval at step 0, two training steps, an eval merged into the last step
ROWS = [(0, {"eval/pass@1": 0.25, "eval/reward_mean": 0.5}),
        (1, {"train/loss": 0.5, "rollout/reward_mean": 0.125, "time/step_s": 3.0}),
        (2, {"train/loss": -0.25, "rollout/reward_mean": 0.375, "time/step_s": 2.5}),
        (2, {"eval/pass@1": 0.75, "eval/reward_mean": 1.0})]
CONFIG = {"run": {"steps": 2, "trackers": ["jsonl"]}, "algo": {"clip_low": 0.2, "preset": "grpo"}}


def expected() -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for step, metrics in ROWS:
        out.setdefault(step, {}).update(metrics)
    return out


def needs(tracker: str):
    """Skip (visibly) when the tracker's package is not installed (the trackers extra)."""
    module = PACKAGES[tracker]
    missing = module is not None and importlib.util.find_spec(module) is None
    return pytest.mark.skipif(missing, reason=f"{module} is not installed ({install_hint('trackers')})")


# ---- readers: each tracker's own way back to {step: {key: value}} and the config ------------------------------
def read_jsonl_rows(run_dir: Path) -> dict[int, dict[str, float]]:
    out: dict[int, dict[str, float]] = {}
    for row in read_jsonl(run_dir / "metrics.jsonl"):
        out.setdefault(int(row.pop("step")), {}).update(row)
    return out


def read_tensorboard(run_dir: Path) -> tuple[dict[int, dict[str, float]], str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    ea.Reload()
    out: dict[int, dict[str, float]] = {}
    for tag in ea.Tags()["scalars"]:
        for event in ea.Scalars(tag):
            out.setdefault(event.step, {})[tag] = event.value
    config = ea.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    return out, config


def wandb_records(log: Path) -> list[dict]:
    """An offline run's .wandb transaction log, decoded by wandb's own reader (`wandb leet inspect --json`)."""
    text = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)], check=True,
                          capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120).stdout
    return [json.loads(line) for line in text.splitlines()]


def read_wandb(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict]:
    """The metrics (not the samples tables) and config of the run folder's one offline wandb run."""
    (log,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    out: dict[int, dict[str, float]] = {}
    config: dict = {}
    for record in wandb_records(log):
        if record["type"] == "history":
            item = {k: v for k, v in record["history"]["item"].items() if not k.startswith(("_", "samples."))}
            out.setdefault(int(record["history"]["step"].get("num", 0)), {}).update(item)
        elif record["type"] == "config":
            config |= record["config"]["update"]
    return out, config


def read_mlflow(run_dir: Path) -> tuple[dict[int, dict[str, float]], dict[str, str], object]:
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # mlflow 3 opens a file store only when asked to
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("relayrl").experiment_id])
    out: dict[int, dict[str, float]] = {}
    for key in run.data.metrics:
        for m in client.get_metric_history(run.info.run_id, key):
            out.setdefault(m.step, {})[key] = m.value
    return out, run.data.params, run


def in_mlflow_names(rows: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
    return {step: {mlflow_key(k): v for k, v in m.items()} for step, m in rows.items()}


def log_rows(run_dir: Path, trackers: list[str]) -> None:
    logger = MetricsLogger(run_dir, trackers, config=CONFIG)
    try:
        for step, metrics in ROWS:
            logger.log(step, metrics | {"nan": float("nan"), "text": "dropped"})  # not finite numbers: dropped
    finally:
        logger.close()


# ---- each tracker alone ------------------------------------------------------------------------------------------
def test_jsonl_is_always_written_and_first(tmp_path):
    assert active_trackers(["mlflow", "tensorboard", "mlflow"]) == ["jsonl", "mlflow", "tensorboard"]
    assert active_trackers(["tensorboard", "jsonl"], tensorboard=False) == ["jsonl"]  # the deprecated alias
    log_rows(tmp_path, [])
    assert read_jsonl_rows(tmp_path) == expected()
    assert not (tmp_path / "tensorboard").exists()


@needs("tensorboard")
def test_tensorboard_gets_the_same_rows(tmp_path):
    log_rows(tmp_path, ["tensorboard"])
    rows, config = read_tensorboard(tmp_path)
    assert rows.keys() == expected().keys()
    for step, metrics in expected().items():
        assert rows[step] == pytest.approx(metrics, rel=1e-6), step  # event files hold float32
    assert "clip_low: 0.2" in config and read_jsonl_rows(tmp_path) == expected()


@needs("wandb")
def test_wandb_offline_run_gets_the_same_rows(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # the user's mode is honoured (test_tracker_conventions.py)
    log_rows(tmp_path, ["wandb"])
    rows, config = read_wandb(tmp_path)
    assert rows == expected()
    assert config["algo"] == {"clip_low": 0.2, "preset": "grpo"} and config["run"]["steps"] == 2


@needs("mlflow")
def test_mlflow_file_store_gets_the_same_rows(tmp_path):
    log_rows(tmp_path, ["mlflow"])
    rows, params, run = read_mlflow(tmp_path)
    assert rows == in_mlflow_names(expected())
    assert "eval/pass_at_1" in rows[0]  # mlflow refuses "@" in names
    assert params == {k: str(v) for k, v in flatten(CONFIG).items()}
    assert run.info.run_name == tmp_path.name and run.info.status == "FINISHED"


def test_unknown_or_uninstalled_trackers_fail_at_config_load(tmp_path, monkeypatch, capsys):
    data = write_sums(tmp_path / "d.jsonl", 4)
    base = ["train", f"data.train.source={data}", f"run.output_dir={tmp_path / 'runs'}"]
    assert main([*base, "run.trackers=[tensorboard, mlfow]"]) == 2
    err = capsys.readouterr().err
    assert "config error: run.trackers: unknown tracker 'mlfow'; choose from tensorboard, jsonl, wandb, mlflow" in err
    monkeypatch.setitem(sys.modules, "wandb", None)  # what an uninstalled package looks like to find_spec
    assert main([*base, "run.trackers=[wandb]"]) == 2
    err = capsys.readouterr().err
    assert ("config error: run.trackers: tracker 'wandb' needs the wandb package, which is not installed: "
            "pip install -e '.[trackers]' in the relayrl checkout") in err and "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # before any model loaded or folder was made
    assert load_run_config(None, ["run.trackers=[jsonl]"]).run.trackers == ["jsonl"]


# ---- progress ----------------------------------------------------------------------------------------------------
def test_progress_line_when_not_a_terminal():
    out = io.StringIO()
    p = Progress(0, 30, stream=out)
    assert not p.live
    line = p.line(3, {"rollout/reward_mean": 0.41, "rollout/pass_rate": 0.38, "train/kl_ref": 0.00123}, 72.0)
    assert line == "step 3/30 | 0:01:12 elapsed | ETA 0:10:48 | reward 0.41 | pass 38.0% | kl 0.0012 | 24.0 s/step"
    resumed = Progress(10, 30, stream=out)  # ETA from the steps this process ran: 2 in 10 s
    assert "ETA 0:01:30" in resumed.line(12, {}, 10.0)
    assert list(resumed) == list(range(11, 31))
    resumed.show(12, {"rollout/reward_mean": 1.0})
    assert out.getvalue().startswith("step 12/30 | ") and out.getvalue().count("\n") == 1


def test_progress_is_a_bar_on_a_terminal():
    primary, secondary = os.openpty()
    with os.fdopen(secondary, "w") as tty:
        p = Progress(0, 2, stream=tty)
        assert p.live and list(p) == [1, 2]
    os.close(primary)


# ---- a real run -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cli_run(tiny_path, tmp_path_factory):
    """`relayrl train` on the tiny model, 3 steps, every installed tracker, stdout and stderr piped."""
    tmp = tmp_path_factory.mktemp("cli")
    data = write_sums(tmp / "sums.jsonl", 12)
    trackers = ["jsonl", "tensorboard"] + [t for t in ("mlflow", "wandb") if importlib.util.find_spec(t)]
    args = {"model.path": tiny_path, "engine.dtype": "float32", "data.train.source": data, "data.eval.source": data,
            "data.batch_size": 2, "data.group_size": 2, "sampling.max_new_tokens": 8, "eval.size": 2, "eval.n": 1,
            "eval.at_start": True, "run.steps": 3, "run.output_dir": str(tmp), "run.name": "r",
            "judge.reward_fn": "rewards_for_tests:parity_reward", "judge.workers": 1, "run.print_samples": 0,
            "run.save_final": False, "run.log_trajectories": False, "run.trackers": f"[{', '.join(trackers)}]"}
    env = {"PYTHONPATH": f"{Path(TESTS).parent}:{TESTS}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": "1", "HOME": str(tmp)}
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", *[f"{k}={v}" for k, v in args.items()]],
                          capture_output=True, text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc, tmp / "r", trackers


LINE = re.compile(r"^step (\d)/3 \| \d+:\d\d:\d\d elapsed \| ETA \d+:\d\d:\d\d \| reward [-\d.e]+ \| "
                  r"pass \d+\.\d% \| len [\d.]+ \| .*\d+\.\d s/step$", re.M)


def test_cli_prints_one_progress_line_per_step_when_piped(cli_run):
    proc, run_dir, trackers = cli_run
    assert [int(m) for m in LINE.findall(proc.stderr)] == [1, 2, 3], proc.stderr[-3000:]
    assert "\r" not in proc.stderr and "wandb:" not in proc.stderr + proc.stdout  # no bar redraws, no wandb chatter
    assert proc.stdout.count("precision: engine float32, trainer float32") == 1  # the start block's first line
    assert f"model: {load_run_config(str(run_dir / 'config.yaml')).model.path}" in proc.stdout
    assert "data: train 12 prompts, 2 x 2 samples per step; eval 2 prompts x 1; 3 steps" in proc.stdout
    assert f"outputs: {run_dir} | trackers: jsonl (metrics.jsonl), tensorboard (tensorboard/)" in proc.stdout


def test_cli_run_reaches_every_tracker(cli_run):
    _, run_dir, trackers = cli_run
    rows = read_jsonl_rows(run_dir)
    assert sorted(rows) == [0, 1, 2, 3] and "train/loss" in rows[3] and "eval/pass@1" in rows[0]
    tb, config = read_tensorboard(run_dir)
    assert sorted(tb) == [0, 1, 2, 3] and tb[2]["train/loss"] == pytest.approx(rows[2]["train/loss"], rel=1e-6)
    assert "trackers:" in config
    if "mlflow" in trackers:
        ml, params, _ = read_mlflow(run_dir)
        assert ml == in_mlflow_names(rows) and params["run.steps"] == "3" and params["engine.dtype"] == "float32"
    if "wandb" in trackers:
        wb, wconfig = read_wandb(run_dir)
        assert wb == rows and wconfig["run"]["steps"] == 3


def test_cli_run_sends_samples_to_every_tracker(cli_run):
    """run.samples_per_step (default 4) rows of each step's batch: TensorBoard text, mlflow artifacts
    samples/step_N.json and a wandb table per step, the same rows in each."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, trackers = cli_run
    ea = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"tensors": 0})
    ea.Reload()
    texts = {e.step: e.tensor_proto.string_val[0].decode() for e in ea.Tensors("samples/text_summary")}
    assert sorted(texts) == [1, 2, 3] and texts[1].count("completion:") == 4 and "What is" in texts[1]
    if "mlflow" in trackers:
        from mlflow.tracking import MlflowClient

        _, _, run = read_mlflow(run_dir)
        client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
        names = [a.path for a in client.list_artifacts(run.info.run_id, "samples")]
        assert names == [f"samples/step_{s:06d}.json" for s in (1, 2, 3)]
        saved = json.loads(Path(client.download_artifacts(run.info.run_id, names[0], str(run_dir.parent))).read_text())
        rows = saved["rows"]
        assert saved["step"] == 1 and len(rows) == 4 and {r["step"] for r in rows} == {1}
        assert all("What is" in r["prompt"] and isinstance(r["reward"], float) for r in rows)
        questions = [re.search(r"What is \d+ \+ \d+\?", r["prompt"]).group() for r in rows]
        assert [q for q in questions if q in texts[1]] == questions  # the same rows as TensorBoard's
    if "wandb" in trackers:
        (folder,) = (run_dir / "wandb").glob("offline-run-*")
        tables = {int(p.name.split("_")[1]): json.loads(p.read_text())
                  for p in (folder / "files" / "media" / "table").glob("samples_*.table.json")}
        assert sorted(tables) == [1, 2, 3] and tables[1]["columns"] == ["step", "prompt", "completion", "reward"]
        if "mlflow" in trackers:
            assert tables[1]["data"] == [list(r.values()) for r in rows]
