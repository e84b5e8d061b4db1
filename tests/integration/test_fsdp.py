"""FSDPEngine on real processes (gloo on CPU, NCCL when a GPU is present): one optimizer step on world
size 1 and 2 equals the single-process TrainEngine step; full-weight gathering; the balanced DP split.

The worlds are this file run as a script (`python tests/integration/test_fsdp.py RANK WORLD OUT`), one process per
rank, with torchrun's environment variables; both worlds start together and run every case in one go,
so the test pays for three interpreter starts, not one per case.
"""

from __future__ import annotations

import copy
import os
import random
import socket
import subprocess
import sys
import time

import pytest
import torch

from relayrl.config.schema import AlgoConfig, TrainConfig
from relayrl.sample import Sample
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import MicroBatch, Packer, balance_ranks

# name -> (optimizer, share_prompt, gradient checkpointing, bf16 mixed precision); "sgd" with lr 1 makes the
# weight change equal to minus the (clipped) gradient, so comparing weights compares gradients
CASES = {"sgd": ("sgd", True, False, False), "padded": ("sgd", False, False, False),
         "adamw": ("adamw", True, False, False), "ckpt": ("sgd", True, True, False),
         "bf16": ("sgd", True, False, True)}
LR = 1e-3
TIMEOUT_S = 240


def make_samples() -> list[Sample]:
    """Three GRPO groups of three with different prompt and response lengths (fixed seed)."""
    rng = random.Random(0)
    samples = []
    for g in range(3):
        prompt = [rng.randrange(3, 500) for _ in range(4 + 3 * g)]
        for i in range(3):
            s = Sample(prompt_ids=prompt, group_id=f"g{g}", index=i)
            resp = [rng.randrange(3, 500) for _ in range(3 + 2 * i + g)]
            s.append_generated(resp, [-1.0] * len(resp), [0] * len(resp), "length")
            s.reward = float((i + g) % 2)
            samples.append(s)
    return samples


def make_controller(engine: TrainEngine, case: str) -> TrainController:
    """A controller whose batch splits into several micro-batches, with an entropy term so the loss is not ~0."""
    optim, share, _, _ = CASES[case]
    ctl = TrainController(engine, AlgoConfig(entropy_coef=0.01),
                          TrainConfig(micro_batch_tokens=24, lr=LR, share_prompt=share, row_tokens=30),
                          pad_id=0, max_new_tokens=16)
    if optim == "sgd":
        engine.optimizer = torch.optim.SGD(engine.model.parameters(), lr=1.0)
    return ctl


def forward_batch():
    return Packer(24, pad_id=0, share_prompt=True, row_tokens=30).pack(make_samples())


# ---- the worker (one rank) ----------------------------------------------------------------------------
def worker(model_path: str, out: str) -> None:
    from relayrl.models import load_model
    from relayrl.trainer.fsdp import FSDPEngine, ReplicatedEngine, init_distributed, shutdown_distributed

    torch.set_num_threads(1)
    rank, _ = init_distributed()
    results = {}
    for case, (_, _, ckpt, mixed) in CASES.items():
        model = load_model(model_path)
        engine = FSDPEngine(model, lr=LR, gradient_checkpointing=ckpt, mixed_precision=mixed)
        before = _cpu_copy(engine.named_parameters())
        metrics = make_controller(engine, case).fit(make_samples())
        results[case] = {"metrics": metrics, "before": before, "after": _cpu_copy(engine.named_parameters())}
    results["all_ranks"] = _cpu_copy(engine.named_parameters(rank0_only=False))
    frozen = FSDPEngine(load_model(model_path).requires_grad_(False))  # as a KL reference engine is built
    results["forward"] = [frozen.forward_logprobs(mb) for mb in forward_batch().micro_batches]
    results["forward_all"] = {}
    replicated = ReplicatedEngine(load_model(model_path).requires_grad_(False))
    for kind, engine in (("fsdp", frozen), ("replicated", replicated)):
        calls, forward = [], engine.forward_logprobs
        engine.forward_logprobs = lambda mb, calls=calls, forward=forward: calls.append(1) or forward(mb)
        results["forward_all"][kind] = (engine.forward_logprobs_all(forward_batch().micro_batches), len(calls))
    results["floor"] = FSDPEngine(load_model(model_path), lr=LR).floor_bytes
    results["mismatch"] = None
    try:  # rank r drops its last r samples: a batch that differs between ranks must be refused
        make_controller(FSDPEngine(load_model(model_path), lr=LR), "sgd").fit(make_samples()[: 9 - rank])
    except RuntimeError as e:
        results["mismatch"] = str(e)
    torch.save(results, out)
    shutdown_distributed()


def _cpu_copy(named) -> dict[str, torch.Tensor]:
    return {n: t.to("cpu", copy=True) for n, t in named}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_world(world_size: int, model_path: str, out_dir, backend: str = "gloo") -> list[subprocess.Popen]:
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "RELAYRL_TEST_BACKEND": backend, "PYTHONWARNINGS": "ignore"}
        out = str(out_dir / f"ws{world_size}_r{rank}.pt")
        procs.append(subprocess.Popen([sys.executable, __file__, model_path, out], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    return procs


def wait_world(procs: list[subprocess.Popen], deadline: float) -> None:
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"FSDP worker did not finish in {TIMEOUT_S} s")
        if p.returncode:
            for q in procs:
                q.kill()
            pytest.fail(f"FSDP worker failed (exit {p.returncode}):\n{out.decode()[-4000:]}")


@pytest.fixture(scope="module")
def worlds(tiny_path, tmp_path_factory):
    """Run world size 1 and 2 side by side; returns {world size: {rank: results}}."""
    out_dir = tmp_path_factory.mktemp("fsdp")
    procs = {ws: start_world(ws, tiny_path, out_dir) for ws in (1, 2)}
    deadline = time.monotonic() + TIMEOUT_S
    for ps in procs.values():
        wait_world(ps, deadline)
    return {ws: {r: torch.load(out_dir / f"ws{ws}_r{r}.pt", weights_only=False) for r in range(ws)}
            for ws in (1, 2)}


@pytest.fixture(scope="module")
def reference(tiny_path):
    """The same steps on the single-process TrainEngine."""
    from relayrl.models import load_model

    base = load_model(tiny_path)
    out = {}
    for case in ("sgd", "padded", "adamw"):
        engine = TrainEngine(copy.deepcopy(base), lr=LR)
        metrics = make_controller(engine, case).fit(make_samples())
        out[case] = {"metrics": metrics, "after": dict(engine.named_parameters())}
    out["initial"] = {n: p.detach() for n, p in base.named_parameters()}
    frozen = TrainEngine(copy.deepcopy(base).requires_grad_(False))
    out["forward"] = [frozen.forward_logprobs(mb) for mb in forward_batch().micro_batches]
    return out


def assert_same_update(got: dict, want: dict, atol: float, adam: bool = False) -> None:
    """Same loss, gradient norm and weights after the step. After an Adam step a weight whose gradient is 0 up to
    rounding moves by up to +-lr depending on the rounding's sign (Adam divides by |grad|), and the ranks' sums
    round differently from one process's (in the full suite one such element of 300k failed at 1e-6), so with
    `adam` at most 1 in 10,000 elements may differ by up to 2 * lr; a wrong sharded step moves far more."""
    assert got["metrics"]["train/loss"] == pytest.approx(want["metrics"]["train/loss"], abs=1e-6)
    assert got["metrics"]["train/grad_norm"] == pytest.approx(want["metrics"]["train/grad_norm"], rel=1e-5)
    assert got["after"].keys() == want["after"].keys()
    for name, w in want["after"].items():
        diff = (got["after"][name] - w).abs()
        if adam:
            assert float(diff.max()) <= 2 * LR and int((diff > atol).sum()) <= max(1, diff.numel() // 10_000), name
        else:
            assert torch.allclose(got["after"][name], w, atol=atol, rtol=0), name


@pytest.mark.parametrize("case", ["sgd", "padded", "adamw"])
def test_fsdp_step_equals_single_process_step(worlds, reference, case):
    assert reference[case]["metrics"]["train/micro_batches"] >= 3  # data parallelism has work to split
    for ws in (1, 2):
        assert_same_update(worlds[ws][0][case], reference[case], atol=1e-6, adam=case == "adamw")
    assert worlds[2][0][case]["metrics"]["train/dp_empty_steps"] >= 0


def test_fsdp_packed_equals_padded_across_ranks(worlds):
    packed, padded = worlds[2][0]["sgd"], worlds[2][0]["padded"]
    assert packed["metrics"]["train/shared_prompt_saving"] > 0.1
    assert padded["metrics"]["train/shared_prompt_saving"] == 0
    assert_same_update(padded, packed, atol=1e-6)


def test_fsdp_gradient_checkpointing_gives_the_same_step(worlds):
    for ws in (1, 2):
        assert_same_update(worlds[ws][0]["ckpt"], worlds[ws][0]["sgd"], atol=1e-6)


def test_fsdp_memory_floor_is_the_whole_models_on_every_rank(worlds, tiny_path):
    """The start line's floor (relayrl.run.build._memory_plan) is the unsharded model's, whatever the world size
    (gradient checkpointing "auto" is decided before the model loads: tests/unit/test_resolve.py)."""
    from relayrl.models import load_model

    floor = 16 * sum(p.numel() for p in load_model(tiny_path).parameters())
    for ws in (1, 2):
        assert all(rank["floor"] == floor for rank in worlds[ws].values())


def test_fsdp_bf16_mixed_precision(worlds, reference):
    one, two = worlds[1][0]["bf16"], worlds[2][0]["bf16"]
    assert_same_update(two, one, atol=1e-6)  # bf16 compute per micro-batch is the same on both worlds
    ref = reference["sgd"]
    assert one["metrics"]["train/loss"] == pytest.approx(ref["metrics"]["train/loss"], abs=1e-3)
    assert one["metrics"]["train/grad_norm"] == pytest.approx(ref["metrics"]["train/grad_norm"], rel=2e-2)
    assert all(w.dtype == torch.float32 for w in one["after"].values())  # fp32 master weights

    def update(state: dict) -> torch.Tensor:
        return torch.cat([(state[n] - w).flatten() for n, w in reference["initial"].items()])

    fp32 = update(ref["after"])  # the bf16 update is the fp32 update up to bf16 rounding (~0.6% here)
    assert float((update(one["after"]) - fp32).norm() / fp32.norm()) < 0.05


def test_full_weight_gather_equals_model_state(worlds, reference):
    for ws in (1, 2):
        before = worlds[ws][0]["sgd"]["before"]
        assert before.keys() == reference["initial"].keys()
        for name, w in reference["initial"].items():
            assert torch.equal(before[name], w), name  # sharding and gathering back are exact
    assert worlds[2][1]["sgd"]["before"] == {}  # other ranks join the gathers but keep nothing
    for name, w in worlds[2][0]["all_ranks"].items():
        assert torch.equal(worlds[2][1]["all_ranks"][name], w), name


def test_fsdp_forward_logprobs_of_a_frozen_engine(worlds, reference):
    for ws in (1, 2):
        for r in range(ws):
            for got, want in zip(worlds[ws][r]["forward"], reference["forward"], strict=True):
                assert torch.allclose(got, want, atol=1e-6, rtol=0)


def test_forward_passes_are_split_across_ranks_and_shared(worlds, reference):
    """Old/reference logprobs: every micro-batch computed once on one rank, every rank gets all of them."""
    n = len(reference["forward"])
    for kind in ("fsdp", "replicated"):
        for ws in (1, 2):
            counts = [worlds[ws][r]["forward_all"][kind][1] for r in range(ws)]
            assert sum(counts) == n, (kind, ws, counts)  # each micro-batch forwarded exactly once
            assert ws == 1 or max(counts) < n, (kind, ws, counts)  # and not all of them on one rank
            for r in range(ws):
                got = worlds[ws][r]["forward_all"][kind][0]
                for g, w in zip(got, reference["forward"], strict=True):
                    assert torch.allclose(g, w, atol=1e-6, rtol=0), (kind, ws, r)


def test_fsdp_refuses_ranks_with_different_batches(worlds):
    assert worlds[1][0]["mismatch"] is None
    for r in (0, 1):
        assert "ranks hold different batches" in worlds[2][r]["mismatch"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")
def test_fsdp_nccl_step_equals_single_process_step(tiny_path, reference, tmp_path):
    ws = min(2, torch.cuda.device_count())
    wait_world(start_world(ws, tiny_path, tmp_path, backend="nccl"), time.monotonic() + TIMEOUT_S)
    got = torch.load(tmp_path / f"ws{ws}_r0.pt", weights_only=False)
    assert_same_update(got["sgd"], reference["sgd"], atol=1e-4)  # GPU kernels differ from CPU ones


def test_train_config_fsdp_keys():
    from relayrl.config.loader import ConfigError

    cfg = TrainConfig()
    assert (cfg.engine, cfg.fsdp_mixed_precision) == ("local", False)  # defaults keep the one-process engine
    TrainConfig(engine="fsdp", fsdp_mixed_precision=True).validate()
    with pytest.raises(ConfigError, match="engine=fsdp"):
        TrainConfig(fsdp_mixed_precision=True).validate()


# ---- the balanced split ----------------------------------------------------------------------------------
def _mb(width: int, pad: int = 0) -> MicroBatch:
    """A one-row micro-batch of `width` positions, `pad` of them padding."""
    one = torch.zeros(1, dtype=torch.long)
    return MicroBatch([], torch.zeros((1, width), dtype=torch.long), torch.ones((1, width), dtype=torch.long),
                      one, one, one, real_tokens=width - pad)


def test_balance_ranks_greedy_largest_first():
    split = balance_ranks([_mb(4), _mb(8), _mb(5), _mb(7, pad=2), _mb(6)], 2)
    # 8 -> r0, 7 -> r1, 6 -> r1 (7 < 8), 5 -> r0 (8 < 13), 4 -> r0 (loads tie at 13, micro-batches tie at 2)
    assert split.ranks == [[0, 1, 2], [3, 4]]
    assert split.steps == 3 and split.stats["dp_empty_steps"] == 1
    assert split.stats["pad_frac"] == pytest.approx(2 / 30)
    assert split.stats["dp_imbalance"] == pytest.approx(17 * 2 / 30)
    assert split.stats["dp_idle_frac"] == pytest.approx(1 - 30 / 34)


def test_balance_ranks_on_a_packed_batch():
    batch = Packer(24, pad_id=0, share_prompt=True, row_tokens=30).pack(make_samples())
    for ws in (1, 2, 3, len(batch.micro_batches) + 2):
        split = balance_ranks(batch.micro_batches, ws)
        assert sorted(i for r in split.ranks for i in r) == list(range(len(batch.micro_batches)))
        loads = [sum(batch.micro_batches[i].padded_tokens for i in r) for r in split.ranks]
        biggest = max(mb.padded_tokens for mb in batch.micro_batches)
        assert max(loads) - min(loads) <= biggest  # greedy largest-first bound
        assert split.steps == max(len(r) for r in split.ranks)
    assert balance_ranks(batch.micro_batches, 1).stats["dp_imbalance"] == 1.0
    with pytest.raises(ValueError):
        balance_ranks(batch.micro_batches, 0)


if __name__ == "__main__":
    if os.environ.get("RELAYRL_TEST_BACKEND") == "nccl":
        from relayrl.trainer.fsdp import init_distributed

        init_distributed("nccl")
    worker(sys.argv[1], sys.argv[2])
