"""`agent.kind: verifiers`: a real verifiers 0.4 environment (tests/verifiers_envs, run by verifiers itself in
.venv-verifiers: its taskset, `null` chat harness, interception server and `@vf.reward` rubric) played by the tiny
model through relayrl's recording proxy. Skipped, saying so, where scripts/setup_verifiers.sh has not been run."""

import ast
import asyncio
from pathlib import Path

import pytest
from conftest import TESTS

from relayrl.agents import VerifiersAgent
from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.build import check_user_code
from relayrl.run.loop import train
from relayrl.sample import Sample, Status
from relayrl.scheduler.common import run_agent

PYTHON = Path(__file__).resolve().parents[2] / ".venv-verifiers" / "bin" / "python"
if not PYTHON.exists():
    pytest.skip(f"no {PYTHON}: run `bash scripts/setup_verifiers.sh`", allow_module_level=True)

NULL_HARNESS = {"agent": {"harness": {"id": "null"}}}  # a plain chat loop: the model's reply is the answer
KWARGS = {"env": "vf_arith", "env_config": NULL_HARNESS, "python": str(PYTHON), "timeout": 120,
          "env_vars": {"PYTHONPATH": str(Path(TESTS) / "verifiers_envs")}}


@pytest.fixture(scope="module")
def setup(tiny_path):
    tok, model = load_tokenizer(tiny_path), load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=8)
    yield tok, RolloutController([engine])
    engine.close()


def episode(setup, answer: str, **kw) -> Sample:
    """One seeded episode (the same reply every time: verifiers' sampling config sends the seed, the proxy
    honors it) of the row `What is 2+2?` with `answer`."""
    tok, ctl = setup
    seeded = {"agent": NULL_HARNESS["agent"] | {"sampling": {"seed": 1234}}}
    agent = VerifiersAgent(ctl, tok, SamplingParams(max_new_tokens=6), **(KWARGS | {"env_config": seeded} | kw))
    try:
        (s,) = asyncio.run(run_agent(agent, Sample(prompt_ids=[1], data={"question": "What is 2+2?",
                                                                         "answer": answer}, group_id="g"), 150))
    finally:
        agent.close()
    return s


def test_the_environment_s_own_reward_scores_the_reply_it_was_served(setup):
    """The rubric (`correct`: the reply equals the row's answer) and metric (`reply_chars`) of the environment
    score the recorded reply: wrong answer 0, the reply itself as the answer 1."""
    tok, _ = setup
    wrong = episode(setup, "no such answer")
    assert wrong.status == Status.COMPLETED, wrong.error
    reply = tok.decode(wrong.response_ids, skip_special_tokens=True)
    assert len(wrong.turns) == 1 and len(wrong.response_ids) > 0 and any(wrong.loss_mask)
    assert wrong.reward == 0.0 and wrong.metrics["correct"] == 0.0
    assert wrong.metrics["reply_chars"] == len(reply.strip())
    right = episode(setup, reply.strip())
    assert right.status == Status.COMPLETED, right.error
    assert right.response_ids == wrong.response_ids and reply.strip()  # seeded: the same reply, not blank
    assert right.reward == 1.0 and right.metrics["correct"] == 1.0


def test_a_broken_environment_costs_its_episode(setup):
    s = episode(setup, "4", env="vf_broken")
    assert s.status == Status.FAILED
    assert "verifiers episode failed" in s.error and "the answer key is missing" in s.error


def test_a_run_trains_one_step_on_a_verifiers_environment(tiny_run):
    cfg = tiny_run(**{"agent.kind": "verifiers", "run.steps": 1, "agent.kwargs": KWARGS})
    train(cfg)
    rows = read_jsonl(Path(cfg.run.output_dir) / cfg.run.name / "metrics.jsonl")
    step = next(r for r in rows if "train/loss" in r)
    assert step["rollout/samples"] == 4 and step["rollout/failed"] == 0 and step["train/samples"] == 4
    assert step["rollout/generated_tokens"] > 0


@pytest.mark.parametrize("kwargs, message", [
    ({"env": "no_such_taskset"}, "agent.kwargs.env: verifiers could not load 'no_such_taskset'"),
    ({"python": "/nonexistent/python"}, "agent.kwargs.python: /nonexistent/python does not exist"),
    ({"env": ""}, "agent.kwargs.env is required"),
    ({"env_config": {}}, "runs model-written code, and the runtime is a local subprocess")])  # bash by default
def test_bad_options_are_named_before_any_model_loads(tiny_run, kwargs, message):
    with pytest.raises(InputError, match=message):
        check_user_code(tiny_run(**{"agent.kind": "verifiers", "agent.kwargs": KWARGS | kwargs}))


def test_the_runner_imports_nothing_from_relayrl():
    """It runs under .venv-verifiers' python, where relayrl is not installed."""
    from relayrl.agents.verifiers import RUNNER

    tree = ast.parse(RUNNER.read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert imported and not any(m.split(".")[0] == "relayrl" for m in imported), imported
