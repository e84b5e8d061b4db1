"""examples/calculator_tools.yaml as a user runs it, on the tiny model: the user's own `calculate` function is
offered to the model (its schema-made description in the prompt), a step trains with the tool-call metrics logged,
the run without the tool (bench/learning.py tool_learning's overrides) offers none, and a call the model writes
reaches the user's function and its result comes back into the episode."""

import asyncio
from pathlib import Path

import pytest
from engines_for_tests import memorize

from relayrl.agents.tool import ToolAgent
from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config.schema import DatasetConfig, load_run_config
from relayrl.data.datasets import load_rows
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.sample import Sample

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "examples" / "calculator_tools.yaml")
OFFERED = "- calculate(expression): Compute an integer arithmetic expression exactly"
NO_TOOL = ["agent.kind=single_turn", "agent.kwargs={}", "data.train.kwargs.shots=answer",
           "data.eval.kwargs.shots=answer"]  # as bench/learning.py tool_learning runs the comparison


@pytest.fixture
def on_repo_path(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))  # the config names the tool, data and reward by import path


def tiny(tiny_path: str, out: Path) -> list[str]:
    return ["--config", CONFIG, f"model.path={tiny_path}", "engine.dtype=float32", "model.autocast_bf16=false",
            "data.batch_size=2", "data.group_size=2", "sampling.max_new_tokens=8", "run.steps=1", "eval.size=2",
            "judge.workers=1", "run.print_samples=0", "run.tensorboard=false", "run.save_final=false",
            f"run.output_dir={out}"]


def test_one_step_offers_the_users_tool_and_logs_its_calls(tiny_path, tmp_path, on_repo_path):
    assert main(["train", *tiny(tiny_path, tmp_path / "tool")]) == 0
    run = tmp_path / "tool" / "calculator_tools"
    rows = read_jsonl(run / "metrics.jsonl")
    step = next(r for r in rows if "train/loss" in r)
    assert {"rollout/tool_calls_mean", "rollout/tool_errors_mean", "rollout/turns_mean"} <= set(step)
    assert "eval/tool_calls_mean" in next(r for r in rows if "eval/pass@1" in r)
    prompts = (run / "trajectories" / "0" / "samples.txt").read_text()
    assert OFFERED in prompts and '"name": "calculate", "arguments": {"expression": "512 * 38"}' in prompts

    assert main(["train", *tiny(tiny_path, tmp_path / "none"), *NO_TOOL]) == 0
    run = tmp_path / "none" / "calculator_tools"
    step = next(r for r in read_jsonl(run / "metrics.jsonl") if "train/loss" in r)
    assert "rollout/tool_calls_mean" not in step
    prompts = (run / "trajectories" / "0" / "samples.txt").read_text()
    assert "calculate" not in prompts and "\\boxed{19456}" in prompts


def test_a_call_reaches_the_users_function(tiny_path, on_repo_path):
    """The tiny model taught to write the call for one question: the product only the user's function computes
    comes back as the tool's message, counted as one call without errors."""
    cfg = load_run_config(CONFIG, [f"model.path={tiny_path}"])
    kwargs = {k: v for k, v in cfg.agent.kwargs.items() if k != "tool_timeout"}
    tok = load_tokenizer(tiny_path)
    model = load_model(tiny_path)
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, tiny_path), max_batch_size=2)
    agent = ToolAgent(RolloutController([engine]), tok, SamplingParams(max_new_tokens=256, temperature=0), None,
                      **{**kwargs, "max_turns": 2})
    (row,) = load_rows(DatasetConfig(source="examples.calculator_env:rows", kwargs={"n": 1, "seed": 7, "ops": ["*"]}))
    a, _, b = row["question"].removeprefix("What is ").removesuffix("?").split()
    prompt = agent.prompt_ids(row)
    call = f'<tool_call>{{"name": "calculate", "arguments": {{"expression": "{a} * {b}"}}}}</tool_call>'
    emitted = tok(call, add_special_tokens=False)["input_ids"] + [agent.eot]
    memorize(model, prompt, emitted)
    try:
        s = asyncio.run(agent.generate_sample(Sample(prompt_ids=[0], data=row)))
    finally:
        engine.close()
    assert OFFERED in tok.decode(prompt)
    assert s.response_ids[: s.turns[0].end] == emitted
    tool_text = tok.decode(s.response_ids[s.turns[0].end: s.turns[1].start])
    assert tool_text == f"\n<|im_start|>tool\n{row['answer']}<|im_end|>\n<|im_start|>assistant\n"
    assert row["answer"] == str(int(a) * int(b)) and s.metrics["tool_calls"] == 1 and s.metrics["tool_errors"] == 0
