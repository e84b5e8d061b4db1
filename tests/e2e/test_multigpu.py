"""`pytest -m multigpu`: what only a machine with two or more GPUs can show (scripts/gpu_check.sh's multi-GPU stage):
FSDP2 over NCCL trains like one process, an NCCL broadcast between two GPUs puts the trainer's exact tensors into
an engine on the other GPU, and Ray places one trainer rank on each GPU. Everything runs on the tiny random model.
With fewer than two GPUs every test here is skipped, with the reason shown (`pytest -rs`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from bounds import bound
from conftest import TESTS, write_sums

from relayrl.common.files import read_jsonl
from relayrl.common.net import free_port
from relayrl.engine import LocalEngine, SamplingParams
from relayrl.models import load_model
from relayrl.weights.weight_group import WeightGroup

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
ENV = {**os.environ, "PYTHONPATH": TESTS, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "disabled", "OMP_NUM_THREADS": "1"}
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.multigpu,
    pytest.mark.skipif(GPUS < 2, reason=f"needs two or more CUDA devices; this machine has {GPUS} "
                                        f"(torch {torch.__version__}, CUDA build {torch.version.cuda})"),
]
PROMPT = [5, 6, 7]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


def train(tiny_path: str, data: str, out: Path, name: str, *extra: str) -> list[dict]:
    args = [f"model.path={tiny_path}", "run.device=cuda", "engine.dtype=float32", f"data.train.source={data}",
            "data.batch_size=2", "data.group_size=2", "sampling.max_new_tokens=10", "run.steps=2",
            f"run.output_dir={out}", f"run.name={name}", "train.lr=1e-3", "judge.workers=1",
            "judge.reward_fn=rewards_for_tests:parity_reward", "run.tensorboard=false", "eval.at_start=false",
            "eval.at_end=false", "train.micro_batch_tokens=16", *extra]
    proc = subprocess.run([sys.executable, "-m", "relayrl.cli", "train", *args], env=ENV, capture_output=True,
                          text=True, timeout=bound(600))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return [r for r in read_jsonl(out / name / "metrics.jsonl") if "train/loss" in r]


def assert_same_steps(one: list[dict], other: list[dict]) -> None:
    assert [r["step"] for r in other] == [r["step"] for r in one] == [1, 2]
    for a, b in zip(one, other):  # same batches; NCCL's sum order may differ from one process's in the last bits
        assert a["rollout/reward_mean"] == b["rollout/reward_mean"]
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=1e-4)


def test_fsdp2_over_nccl_on_two_gpus_trains_like_one_process(tiny_path, tmp_path):
    data = write_sums(tmp_path / "d.jsonl", 8)
    one = train(tiny_path, data, tmp_path, "one")
    two = train(tiny_path, data, tmp_path, "two", "train.engine=fsdp", "train.world_size=2")
    assert_same_steps(one, two)
    assert "train/dp_imbalance" in two[0]


RECEIVER = textwrap.dedent("""
    import json, sys, torch
    from relayrl.engine import LocalEngine, SamplingParams
    from relayrl.models import load_model
    from relayrl.weights.weight_group import WeightGroup
    path, port = sys.argv[1], int(sys.argv[2])
    torch.cuda.set_device(1)
    model = load_model(path, dtype="float32").to("cuda:1")
    specs = [(n, p.dtype, tuple(p.shape)) for n, p in model.named_parameters()]
    group = WeightGroup("127.0.0.1", port, rank=1, world_size=2, backend="nccl", timeout=120)
    received = group.receive(specs)
    group.close()
    engine = LocalEngine(model, eos_token_ids=[])
    engine.load_weights(received, version=1)
    out = engine.generate([[5, 6, 7]], SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))[0]
    engine.close()
    print(json.dumps({"ids": out.output_ids, "logprobs": out.logprobs, "device": str(received[0][1].device)}))
""")


def test_nccl_broadcast_puts_the_trainers_tensors_into_an_engine_on_another_gpu(tiny_path):
    torch.cuda.set_device(0)
    model = load_model(tiny_path, dtype="float32")
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():  # large changes: any tensor left unsent changes the greedy tokens
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    model = model.to("cuda:0")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", RECEIVER, tiny_path, str(port)], env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    group = WeightGroup("127.0.0.1", port, rank=0, world_size=2, backend="nccl", timeout=120)
    assert group.broadcast(list(model.named_parameters())) == len(list(model.parameters()))
    group.close()
    out, err = proc.communicate(timeout=bound(300))
    assert proc.returncode == 0, err[-4000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert got["device"] == "cuda:1"
    local = LocalEngine(model, eos_token_ids=[])
    try:
        ref = local.generate([PROMPT], GREEDY)[0]
    finally:
        local.close()
    assert got["ids"] == ref.output_ids
    assert torch.allclose(torch.tensor(got["logprobs"]), torch.tensor(ref.logprobs), atol=1e-4)


def test_ray_places_one_fsdp_rank_on_each_gpu(tiny_path, tmp_path):
    pytest.importorskip("ray")
    data = write_sums(tmp_path / "d.jsonl", 8)
    one = train(tiny_path, data, tmp_path, "local")
    ranks = min(GPUS, 4)
    on_ray = train(tiny_path, data, tmp_path, "ray", "launcher=ray", "train.engine=fsdp",
                   f"train.world_size={ranks}", "ray.trainer_gpus=1", f"ray.num_cpus={ranks + 2}")
    assert_same_steps(one, on_ray)
