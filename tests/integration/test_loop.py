"""End to end on the real tiny model: the CLI and the colocated loop, with real judge processes."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bounds import bound
from conftest import TESTS, USER_OUTPUTS, tiny_run_args, write_sums
from sandbox_helpers import UNAVAILABLE

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.run.build import build
from relayrl.run.loop import train, train_steps
from relayrl.tracking.plot import plot_run


@pytest.fixture
def dataset(tmp_path):
    return write_sums(tmp_path / "sums.jsonl", 12)


def overrides(tiny_path, dataset, tmp_path, **extra):
    """A tiny run (conftest) with an eval set and every output on (as a user's run)."""
    return tiny_run_args(tiny_path, dataset, tmp_path, **{
        "data.eval.source": dataset, "data.group_size": 4, "sampling.max_new_tokens": 12, "eval.size": 3,
        "eval.n": 2, "eval.temperature": 1.0, **USER_OUTPUTS, **extra})



def test_two_training_steps_on_tiny_model(tiny_path, dataset, tmp_path):
    cfg = load_run_config(None, overrides(tiny_path, dataset, tmp_path))
    c = build(cfg)
    try:
        final = train_steps(c)
        assert c.train_ctl.version == 2 and c.rollout_ctl.version == 2
        trainer_w = dict(c.train_ctl.engine.model.named_parameters())
        for name, p in c.rollout_ctl.engines[0].model.named_parameters():
            assert p.data.equal(trainer_w[name].data), name  # relayed weights are the trained weights
    finally:
        c.close()
    rows = read_jsonl(c.run_dir / "metrics.jsonl")
    steps = [r for r in rows if "train/loss" in r]
    evals = [r for r in rows if "eval/pass@1" in r]
    assert [r["step"] for r in steps] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    for key in ["rollout/reward_mean", "rollout/pass_rate", "rollout/response_len_mean", "train/entropy",
                "train/clip_frac", "train/grad_norm", "time/rollout_s", "time/train_s", "perf/rollout_tokens_per_s",
                "train/logprob_diff_engine_max"]:
        assert key in steps[0], key
    assert steps[0]["rollout/samples"] == 8 and steps[0]["train/grad_norm"] > 0
    for r in steps:  # the engine's work in the step's rollout: each sample's first token comes from its prefill
        assert r["engine/decode_steps"] * r["engine/rows_per_step"] == r["rollout/generated_tokens"] - 8
        assert 1 <= r["engine/rows_per_step"] <= 8 and r["engine/busy_ms_per_step"] > 0
        assert r["engine/prefill_tokens"] > 0 and 0 < r["engine/busy_frac"] <= 1
    assert steps[0]["train/logprob_diff_engine_max"] < 1e-4  # fp32 engine and trainer agree
    assert "eval/pass@2" in evals[0] and final == {k: v for k, v in evals[-1].items() if k != "step"}
    assert list((c.run_dir / "tensorboard").glob("events.out.tfevents.*"))
    reloaded = load_run_config(str(c.run_dir / "config.yaml"))
    assert reloaded.algo.adv_std == "group" and reloaded.model.path == tiny_path
    png = plot_run([c.run_dir], tmp_path / "curve.png")
    assert png.stat().st_size > 5000


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_sampling_ignore_eos_generates_up_to_the_cap(ignore_eos, tiny_path, dataset, tmp_path):
    cfg = load_run_config(None, overrides(tiny_path, dataset, tmp_path, **{"sampling.ignore_eos": ignore_eos}))
    c = build(cfg)
    try:
        engine = c.rollout_ctl.engines[0]
        engine.eos_token_ids = frozenset(range(engine.model.config.vocab_size))  # any token would end a sample
        c.env.produce_batch(c.data, 2)
        lengths = {len(s.response_ids) for s in c.data.get_batch()}
    finally:
        c.close()
    assert lengths == ({12} if ignore_eos else {1})


def test_failing_and_hanging_agents_cost_one_sample_each(tiny_path, dataset, tmp_path, caplog):
    cfg = load_run_config(None, overrides(tiny_path, dataset, tmp_path, **{
        "agent.kind": "agents_for_tests:FlakyAgent", "agent.timeout": 1.0, "run.steps": 1, "eval.at_start": False,
        "eval.n": 3}))
    c = build(cfg)
    try:
        t0 = time.perf_counter()
        train_steps(c)
        assert time.perf_counter() - t0 < bound(30)
    finally:
        c.close()
    row, final = read_jsonl(c.run_dir / "metrics.jsonl")[0], read_jsonl(c.run_dir / "metrics.jsonl")[-1]
    assert row["rollout/failed"] == 4  # 2 groups x (one raising + one hanging sample)
    assert row["rollout/samples"] == 4 and row["train/samples"] == 4
    assert final["eval/failed"] == 6 and final["eval/samples"] == 3  # eval: 3 prompts x 3, two of each fail
    # and the user is told that the pass rates leave the failures out
    assert "eval: 6 samples failed or timed out (agent.timeout=1.0 s); the pass rates are over the 3" in caplog.text


def test_cli_train_runs_and_writes_a_run(tiny_path, dataset, tmp_path):
    env_path = f"{TESTS}"
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", *overrides(tiny_path, dataset, tmp_path,
                                                                                     **{"run.steps": 1})],
                          capture_output=True, text=True, timeout=bound(300), env={"PYTHONPATH": env_path,
                                                                           "PATH": "/usr/bin:/bin",
                                                                           "HF_HUB_OFFLINE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "final eval" in proc.stdout and "step" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "train/loss" in r)  # memory per step: now and the process's high-water mark
    assert 0.05 < step["mem/rss_gb"] <= step["mem/peak_rss_gb"] < 20
    # the last lines: held-out pass@1 at the first and the last eval, and where the curves are
    assert "held-out pass@1: " in proc.stdout and "at step 0 -> " in proc.stdout and "at step 1" in proc.stdout
    curves = tmp_path / "t" / "reward.png"
    assert f"curves: {curves}" in proc.stdout and curves.read_bytes()[:4] == b"\x89PNG"
    curves.unlink()  # `relayrl plot` draws the same picture again
    assert main(["plot", str(tmp_path / "t")]) == 0 and curves.is_file()


@pytest.mark.parametrize("bad, message", [
    (["algo.presett=grpo"], "did you mean algo.preset"),
    (["trian.lr=1e-5"], "did you mean train"),
    (["train.lr=abc"], "train.lr: expected float"),
    (["data.group_size=1"], "data.group_size: must be >= 2"),
    (["data.batch_size=0"], "data.batch_size: must be >= 1"),
    (["algo.preset=ppoo"], "algo.preset"),
    (["model.path=/nonexistent/model"], "model.path: model folder '/nonexistent/model' does not exist"),
])
def test_config_errors_name_the_key(bad, message, capsys):
    assert main(["train", "--config", "examples/arithmetic_grpo.yaml", *bad]) == 2
    assert message in capsys.readouterr().err


def test_bad_dataset_row_fails_before_any_model_loads(tiny_path, tmp_path):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?"}\n')
    cfg = load_run_config(None, overrides(tiny_path, str(data), tmp_path))
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match=r"bad.jsonl:2: row has no 'answer'"):
        build(cfg)
    assert time.perf_counter() - t0 < bound(5)


def test_presets_expand_and_explicit_keys_win():
    cfg = load_run_config("examples/arithmetic_grpo.yaml", ["algo.preset=rloo"])
    assert (cfg.algo.adv_leave_one_out, cfg.algo.adv_std) == (True, "none")
    cfg = load_run_config("examples/arithmetic_grpo.yaml", ["algo.preset=dr_grpo", "algo.adv_std=batch"])
    assert (cfg.algo.loss_agg, cfg.algo.adv_std) == ("seq_mean_token_sum_norm", "batch")


EXAMPLES = sorted(Path("examples").glob("*.yaml"))
# examples for another kind of policy run on the tiny model of that kind
TINY_OF_KIND = {"moe_replay": "tiny_moe_path", "vlm_squares": "tiny_vlm_path"}


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_every_example_config_runs_a_step_on_the_tiny_model(example, request, tmp_path, monkeypatch):
    """The shipped examples load, and one training step of each works (tiny model, tiny sizes), on the data that
    ships with relayrl (GSM8K included: nothing from outside the repository)."""
    tiny_path = request.getfixturevalue(TINY_OF_KIND.get(example.stem, "tiny_path"))
    monkeypatch.delenv("RELAYRL_GSM8K_DIR", raising=False)
    monkeypatch.syspath_prepend(str(Path.cwd()))  # examples.* episodes are named by import path
    generated = []  # an example whose data a script of its own writes (README-style steps): written here
    if example.stem == "vlm_squares":
        from examples.vlm_squares import make_squares
        generated = [f"data.train.source={make_squares(tmp_path / 'squares', n=4)}"]
    cfg = load_run_config(str(example), [*generated,
        f"model.path={tiny_path}", "model.autocast_bf16=false", "engine.dtype=float32", "data.batch_size=1",
        "data.group_size=2", "data.train.size=4", "sampling.max_new_tokens=8", "run.steps=1", "eval.size=1",
        "eval.n=1", "eval.every=0", f"run.output_dir={tmp_path}", "run.tensorboard=false", "run.print_samples=0",
        "run.save_final=false", "judge.workers=1"])
    if cfg.agent.kind == "tool" and "python" in cfg.agent.kwargs.get("tools", ["python"]) and UNAVAILABLE:
        pytest.skip(f"the python tool needs an OS sandbox, and none can start here: {UNAVAILABLE}")
    final = train(cfg)
    assert "eval/pass@1" in final or not (cfg.eval.at_start or cfg.eval.at_end)  # examples that evaluate
    rows = read_jsonl(tmp_path / cfg.run.name / "metrics.jsonl")
    assert any("train/loss" in r for r in rows)
