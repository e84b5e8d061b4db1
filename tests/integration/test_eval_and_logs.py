"""Evaluator metrics by hand, trajectory logs on disk, `relayrl eval` on a trained run's saved model."""

import json
import os

import pytest

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.models import load_model
from relayrl.run.evaluator import Evaluator, majority_correct, pass_at_k
from relayrl.run.loop import train
from relayrl.sample import Sample
from relayrl.tracking.trajectories import load_trajectories, render, show

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(gid, text, correct, solved_turn=None):
    s = Sample(prompt_ids=[1], group_id=gid, response_text=text, reward=float(correct))
    s.metrics["correct"] = float(correct)
    if solved_turn is not None:
        s.metrics["solved_turn"] = float(solved_turn)
    return s


def test_pass_at_k_unbiased_estimator():
    assert pass_at_k(4, 1, 1) == 0.25
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - 3 / 6)  # 1 - C(3,2)/C(4,2)
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 3, 2) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_majority_vote_and_success_by_turn():
    group = [sample("a", "\\boxed{5}", 0), sample("a", "it is 7", 1), sample("a", "so 7", 1), sample("a", "5", 0)]
    assert majority_correct(group[:3], lambda t: t.split()[-1].strip("\\boxed{}")) == 1.0
    other = [sample("b", "x = 1,000", 0, 0), sample("b", "1000", 0, 0), sample("b", "42", 1, 2), sample("b", "?", 0, 0)]
    m = Evaluator().evaluate(group + other)
    # group a: first answer 5 (wrong); 2 samples: 5 vs 7 tie -> first seen (5) wins; 4 samples: 7 and 5 tie -> 5
    assert m["eval/maj@1"] == 0.0 and m["eval/maj@2"] == 0.0 and m["eval/maj@4"] == 0.0
    assert m["eval/pass@1"] == pytest.approx(3 / 8)
    assert m["eval/pass@4"] == 1.0
    assert m["eval/solved_at_turn_2"] == 0.25 and m["eval/solved_at_turn_1"] == 0.0
    # "1,000" and "1000" vote together
    assert majority_correct([sample("c", "x = 1,000", 1), sample("c", "1000", 1), sample("c", "3", 0)],
                            lambda t: t.split()[-1].replace(",", "")) == 1.0


@pytest.fixture
def trained_run(tiny_path, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(TESTS)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(6)))
    over = [f"model.path={tiny_path}", "engine.dtype=float32", f"data.train.source={data}",
            f"data.eval.source={data}", "data.batch_size=2", "data.group_size=2", "sampling.max_new_tokens=8",
            "eval.size=3", "eval.n=2", "eval.temperature=1.0", "run.steps=2", f"run.output_dir={tmp_path}",
            "run.name=r", "judge.reward_fn=rewards_for_tests:parity_reward", "judge.workers=1", "run.print_samples=0",
            "run.tensorboard=false", "train.lr=1e-3", "agent.kind=reflection", "agent.kwargs={max_turns: 2}"]
    train(load_run_config(None, over))
    return tmp_path / "r", over


def test_trajectory_logs_are_complete_lines_per_version(trained_run):
    run_dir, _ = trained_run
    recs = load_trajectories(run_dir)
    assert len(recs) == 8 and {r["version_start"] for r in recs} == {0, 1}
    assert {"uid", "version_start", "version_end", "success", "prompt_len", "answer_len", "turns", "reward",
            "segments"} <= set(recs[0])
    multi = [r for r in recs if r["turns"] == 2]
    for r in multi:
        assert [s["kind"] for s in r["segments"]] == ["gen", "ctx", "gen"]
        assert "reflect" in r["segments"][1]["text"]
    monitor = run_dir / "trajectories" / "0" / "monitor.jsonl"
    with open(monitor, "a") as f:  # a crash mid-write leaves an unterminated line: readers skip it
        f.write('{"uid": "torn')
    assert len(read_jsonl(monitor)) == 4
    text = (run_dir / "trajectories" / "1" / "samples.txt").read_text()
    assert text.count("versions 1..1") == 4
    coloured = show(run_dir, version=1, limit=2)
    assert "\033[" in coloured and coloured.count("versions 1..1") == 2
    assert "\033[" not in render(recs[0], colour=False)
    assert main(["show-trajectories", str(run_dir), "--only", "fail", "--no-color"]) == 0


def test_eval_a_saved_model(trained_run, tmp_path, capsys):
    run_dir, over = trained_run
    load_model(run_dir / "model")  # a plain HF folder
    out = tmp_path / "eval.json"
    code = main(["eval", "--config", str(run_dir / "config.yaml"), "--model", str(run_dir / "model"),
                 "--out", str(out), "eval.n=4", "run.log_trajectories=false"])
    assert code == 0
    metrics = json.loads(out.read_text())
    assert metrics["model"] == str(run_dir / "model")
    for key in ["eval/pass@1", "eval/pass@4", "eval/maj@4", "eval/reward_mean", "eval/solved_at_turn_1"]:
        assert key in metrics, key
    assert "eval/pass@1" in capsys.readouterr().out
