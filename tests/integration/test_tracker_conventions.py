"""The trackers follow their ecosystems' conventions. wandb honours the mode it is given (run.wandb.mode, else
WANDB_MODE, else online only with an API key and a host that answers), labels the run with run.wandb's project,
name and tags, and keeps its files in RUN_DIR/wandb; nothing here reaches the network (hosts are 127.0.0.1
ports, open or closed). A resumed run continues the same wandb and mlflow runs. Bad settings are config errors
naming the key. The samples each step sends to the trackers are checked on test_trackers.py's real CLI run."""

import logging
import socket
from pathlib import Path

import pytest
import yaml
from conftest import tiny_run_args, write_sums
from test_trackers import needs, read_jsonl_rows, wandb_records

from relayrl.config import ConfigError
from relayrl.config.schema import Config, load_run_config
from relayrl.config.trackers import WandbConfig
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.tracking.metrics import MetricsLogger
from relayrl.tracking.trackers import wandb_mode

KEY = "k" * 40  # a key in the shape wandb accepts; never sent anywhere


def closed_port() -> int:
    """A 127.0.0.1 port nothing listens on (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """No wandb login anywhere (environment, ~/.netrc, wandb's settings), the server at a closed local port, and
    wandb's process-wide setup rebuilt from this environment (it reads the environment once per process)."""
    import wandb

    for var in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb-config"))
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{closed_port()}")
    wandb.teardown()
    yield monkeypatch
    wandb.teardown()


def log_one_step(run_dir: Path, cfg: WandbConfig = WandbConfig()) -> None:
    logger = MetricsLogger(run_dir, ["wandb"], config={"run": {"steps": 1}}, wandb=cfg)
    try:
        logger.log(1, {"train/loss": 0.5})
        logger.log_samples(1, [{"step": 1, "prompt": "What is 1 + 1?", "completion": "2", "reward": 1.0}])
    finally:
        logger.close()


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"))


def run_record(folder: Path) -> dict:
    (log,) = folder.glob("run-*.wandb")
    return next(r["run"] for r in wandb_records(log) if r["type"] == "run")


@needs("wandb")
def test_wandb_offline_from_the_environment_with_the_configured_labels(tmp_path, wandb_env):
    wandb_env.setenv("WANDB_MODE", "offline")
    log_one_step(tmp_path, WandbConfig(project="arith-rl", name="first try", tags=["grpo", "tiny"]))
    (folder,) = offline_runs(tmp_path)
    record = run_record(folder)
    assert (record["project"], record["display_name"], record["tags"]) == ("arith-rl", "first try", ["grpo", "tiny"])
    run_id = (tmp_path / "wandb" / "run_id").read_text()
    assert record["run_id"] == run_id and folder.name.endswith(f"-{run_id}")


@needs("wandb")
def test_wandb_disabled_writes_nothing(tmp_path, wandb_env):
    wandb_env.setenv("WANDB_MODE", "disabled")
    log_one_step(tmp_path)
    assert not (tmp_path / "wandb").exists()


@needs("wandb")
def test_wandb_auto_without_a_key_goes_offline_and_says_why(tmp_path, wandb_env, caplog):
    with caplog.at_level(logging.INFO, logger="relayrl.tracking.trackers"):
        log_one_step(tmp_path)
    (folder,) = offline_runs(tmp_path)
    assert run_record(folder)["project"] == "relayrl" and run_record(folder)["display_name"] == tmp_path.name
    (line,) = [r for r in caplog.records if r.name == "relayrl.tracking.trackers"]
    assert line.levelno == logging.WARNING and "offline run (no wandb API key" in line.getMessage()


@needs("wandb")
def test_wandb_auto_with_a_key_but_no_host_goes_offline(tmp_path, wandb_env, caplog):
    wandb_env.setenv("WANDB_API_KEY", KEY)
    with caplog.at_level(logging.INFO, logger="relayrl.tracking.trackers"):
        log_one_step(tmp_path)
    assert len(offline_runs(tmp_path)) == 1
    assert "does not answer" in caplog.text and "no wandb API key" not in caplog.text


@needs("wandb")
def test_wandb_mode_rule(tmp_path, wandb_env):
    """auto is online only with a key (WANDB_API_KEY, or ~/.netrc as `wandb login` writes it) and a host that
    accepts a connection; an explicit WANDB_MODE wins over auto, run.wandb.mode over both."""
    with socket.socket() as server:  # a host that answers: a listening 127.0.0.1 socket (wandb.init never runs)
        server.bind(("127.0.0.1", 0))
        server.listen()
        host = f"127.0.0.1:{server.getsockname()[1]}"
        wandb_env.setenv("WANDB_BASE_URL", f"http://{host}")
        assert wandb_mode("auto")[0] == "offline"  # no key
        (tmp_path / "home").mkdir()
        (tmp_path / "home" / ".netrc").write_text(f"machine {host} login user password {KEY}\n")
        (tmp_path / "home" / ".netrc").chmod(0o600)
        assert wandb_mode("auto") == ("online", f"an API key is set up and http://{host} answers")
        cfg = Config()
        cfg.run.offline, cfg.run.trackers = True, ["wandb"]
        logger = MetricsLogger.for_run(tmp_path / "promised", cfg)  # run.offline: no network, whatever auto finds
        logger.close()
        assert len(offline_runs(tmp_path / "promised")) == 1
        wandb_env.setenv("WANDB_MODE", "dryrun")  # wandb's old spelling of offline
        assert wandb_mode("auto") == ("offline", "WANDB_MODE=dryrun")
        assert wandb_mode("disabled") == ("disabled", "run.wandb.mode=disabled")


@needs("wandb")
@needs("mlflow")
def test_resume_continues_the_same_wandb_and_mlflow_runs(tiny_path, tmp_path, wandb_env):
    """2 steps with a checkpoint, then resumed to 4: one wandb run id across the offline run folders (wandb sync
    appends them), one mlflow run with steps 1..4, each step once."""
    from mlflow.tracking import MlflowClient

    wandb_env.setenv("WANDB_MODE", "offline")
    data = write_sums(tmp_path / "d.jsonl", 12)
    extra = {"run.trackers": "[jsonl, mlflow, wandb]", "run.checkpoint_every": 2, "run.samples_per_step": 2}
    for more in ({"run.steps": 2}, {"run.steps": 4, "run.resume": "auto"}):
        c = build(load_run_config(None, tiny_run_args(tiny_path, data, tmp_path, **extra, **more)))
        try:
            train_steps(c)
        finally:
            c.close()
    run_dir = tmp_path / "t"
    assert sorted(read_jsonl_rows(run_dir)) == [1, 2, 3, 4]
    folders = offline_runs(run_dir)
    run_id = (run_dir / "wandb" / "run_id").read_text()
    assert len(folders) == 2 and {run_record(f)["run_id"] for f in folders} == {run_id}
    wandb_steps = [r["history"]["step"]["num"] for f in folders for r in wandb_records(next(f.glob("run-*.wandb")))
                   if r["type"] == "history"]
    assert wandb_steps == [1, 2, 3, 4]
    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("relayrl").experiment_id])
    assert run.info.run_id == (run_dir / "mlruns" / "run_id").read_text() and run.info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [1, 2, 3, 4]
    assert run.data.params["run.steps"] == "2"  # params are write-once: the first attempt's; config.yaml is the last
    config = yaml.safe_load(Path(client.download_artifacts(run.info.run_id, "config.yaml", str(tmp_path))).read_text())
    assert config["run"]["steps"] == 4
    assert [a.path for a in client.list_artifacts(run.info.run_id, "samples")] == [
        f"samples/step_{s:06d}.json" for s in (1, 2, 3, 4)]


@pytest.mark.parametrize("override, message", [
    ("run.wandb.mode=sometimes", "run.wandb.mode: expected one of 'auto', 'online', 'offline', 'disabled'"),
    ("run.wandb.projekt=x", "run.wandb.projekt: unknown key; did you mean run.wandb.project?"),
    ("run.wandb.project=a/b", "run.wandb.project: must be 1 to 128 characters, none of"),
    ("run.wandb.tags=grpo", "run.wandb.tags: expected list[str], got str 'grpo'"),
    ("run.wandb.tags=[ok, '']", "run.wandb.tags[1]: must be 1 to 64 characters"),
    ("run.wandb.entity=''", "run.wandb.entity: must not be empty"),
    ("run.samples_per_step=-1", "run.samples_per_step: must be >= 0"),
])
def test_tracker_settings_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match="^" + message.replace("[", r"\[").replace("?", r"\?")):
        load_run_config(None, ["data.train.source=rows.jsonl", override])


@needs("wandb")
def test_an_unknown_wandb_mode_in_the_environment_is_a_config_error(monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "onlin")
    with pytest.raises(ConfigError, match=r"^run.trackers: tracker 'wandb': the environment variable "
                                          r"WANDB_MODE='onlin' is not a wandb mode"):
        load_run_config(None, ["data.train.source=rows.jsonl", "run.trackers=[wandb]"])
    assert load_run_config(None, ["data.train.source=rows.jsonl"]).run.wandb == WandbConfig()  # wandb not used
