"""`agent.kind: verifiers` with tools: a verifiers 0.4 taskset whose task serves an MCP toolset (`vf.Toolset`,
tests/verifiers_envs/vf_tools, launched per rollout by verifiers as a local process), played by verifiers' `null`
chat harness, which streams chat completions with `tools` from relayrl's per-episode proxy, runs the model's tool
call on the toolset and sends the result back. One training step on the tiny model.

A random tiny model never writes a tool call, so it is taught one (real optimizer steps) for the exact prompt the
proxy renders from verifiers' request: the task's prompt and the toolset's `add` schema as MCP lists it. Skipped,
saying so, where scripts/setup_verifiers.sh has not been run."""

import json
from pathlib import Path

import pytest
import torch
from conftest import TESTS, tiny_run_args

from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.loop import train
from relayrl.serve.chat_tools import ChatTools

PYTHON = Path(__file__).resolve().parents[2] / ".venv-verifiers" / "bin" / "python"
if not PYTHON.exists():
    pytest.skip(f"no {PYTHON}: run `bash scripts/setup_verifiers.sh`", allow_module_level=True)

QUESTION = "What is 2+2? Use the add tool."
# `add(a: int, b: int)` of tests/verifiers_envs/vf_tools/tool.py as the MCP SDK lists it (pydantic's schema)
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}},
    "required": ["a", "b"], "title": "addArguments", "type": "object"}}}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
KWARGS = {"env": "vf_tools", "env_config": {"agent": {"harness": {"id": "null"}}}, "python": str(PYTHON),
          "timeout": 240, "env_vars": {"PYTHONPATH": str(Path(TESTS) / "verifiers_envs")}}


def prompt_ids(tok) -> list[int]:
    """What the proxy renders for verifiers' first request: the user turn, the tools in the template's system
    prompt (the tiny model's ChatML has no tool support: relayrl describes the tools and the Hermes format)."""
    messages, kw = ChatTools(tok).template_inputs([{"role": "user", "content": QUESTION}], TOOLS)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return tok(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def taught(tiny_path, tmp_path_factory) -> str:
    """The tiny model taught to answer QUESTION with CALL greedily (the run samples at temperature 0)."""
    tok, model = load_tokenizer(tiny_path), load_model(tiny_path)
    prompt = prompt_ids(tok)
    ids = torch.tensor([prompt + tok(CALL, add_special_tokens=False)["input_ids"] + eos_token_ids(tok, tiny_path)[:1]])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    keep = ids.shape[1] - len(prompt) + 1  # the vocabulary is large: logits only where the call is predicted
    for _ in range(600):
        logits = model(ids, logits_to_keep=keep).logits[0, :-1]
        if bool((logits.argmax(-1) == ids[0, len(prompt):]).all()) and logits.softmax(-1).max(-1).values.min() > 0.9:
            break
        loss = torch.nn.functional.cross_entropy(logits, ids[0, len(prompt):])
        opt.zero_grad()
        loss.backward()
        opt.step()
    out = tmp_path_factory.mktemp("taught")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return str(out)


@pytest.mark.slow  # a verifiers episode with a tool server takes tens of seconds
def test_a_run_trains_one_step_on_a_verifiers_environment_with_tools(taught, tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"question": QUESTION, "answer": "4"}) + "\n")
    cfg = load_run_config(None, tiny_run_args(taught, str(data), tmp_path, **{
        "agent.kind": "verifiers", "agent.kwargs": json.dumps(KWARGS), "run.steps": 1, "data.batch_size": 1,
        "data.group_size": 2, "sampling.max_new_tokens": 80, "sampling.temperature": 0.0,
        "run.log_trajectories": True}))
    train(cfg)
    rows = read_jsonl(Path(cfg.run.output_dir) / cfg.run.name / "metrics.jsonl")
    step = next(r for r in rows if "train/loss" in r)
    assert step["rollout/samples"] == 2 and step["rollout/failed"] == 0 and step["train/samples"] == 2
    # the environment's own reward and metric: the model's call reached the toolset and its result came back
    assert step["rollout/used_tool_mean"] == 1.0 and step["rollout/tool_results_mean"] == 1.0
    assert step["rollout/reward_mean"] == 1.0
    episodes = read_jsonl(Path(cfg.run.output_dir) / cfg.run.name / "trajectories" / "0" / "monitor.jsonl")
    for e in episodes:  # one token-exact trajectory: the call, the tool's result as context, the second reply
        assert e["turns"] == 2 and [s["kind"] for s in e["segments"]] == ["gen", "ctx", "gen"], e["segments"]
        assert e["segments"][0]["text"].startswith(CALL) and "tool\n4<|im_end|>" in e["segments"][1]["text"]
