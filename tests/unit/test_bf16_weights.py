"""bf16 trainer weights (model.train_dtype=bfloat16) learn: each AdamW update is computed in fp32 and stored rounded
stochastically, so a weight moves by the fp32 update on average even where one update is far below half a bf16
step (rounded to nearest it would never move; the C kernel against the PyTorch step: test_optim.py); a tiny model
trained in bf16 improves its objective as much as in fp32; the floor is 8 bytes per parameter; FSDP refuses
bf16 weights; `auto` picks them only where fp32 would not fit and bf16 is native."""

import shutil

import pytest
import torch
from engines_for_tests import rollout

import relayrl.run.build as build
import relayrl.run.precision as precision
from relayrl.common import hardware
from relayrl.config.loader import ConfigError
from relayrl.config.schema import AlgoConfig, TrainConfig, load_run_config
from relayrl.models import load_model, stored_parameters
from relayrl.run.build import _memory_plan
from relayrl.run.resolve import resolve as resolve_run
from relayrl.trainer import optim
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.optim import Bf16StateAdamW, adamw
from relayrl.trainer.packer import Packer

HAVE_CC = shutil.which("cc") is not None
KERNEL = [pytest.param(True, id="kernel", marks=pytest.mark.skipif(not HAVE_CC, reason="no C compiler here")),
          pytest.param(False, id="pytorch")]


def ones_bf16(n: int = 100_000) -> torch.nn.Parameter:
    w = torch.nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
    w.grad = torch.ones_like(w)
    return w


@pytest.mark.parametrize("use_kernel", KERNEL)
def test_bf16_weights_move_by_the_fp32_update_on_average(use_kernel):
    """A constant gradient: Adam moves every weight by lr a step. From 1.0 that is 1/39 of a bf16 step (2^-8 below
    1.0): rounded to nearest nothing moves; rounded stochastically the mean follows fp32 AdamW."""
    lr, steps = 1e-4, 30
    w = ones_bf16()
    opt = Bf16StateAdamW([w], lr=lr, use_kernel=use_kernel)
    assert (opt.kernel is not None) == use_kernel
    ref = torch.nn.Parameter(torch.ones(1))
    ref_opt = torch.optim.AdamW([ref], lr=lr, weight_decay=0.0)
    for _ in range(steps):
        opt.step()
        ref.grad = torch.ones(1)
        ref_opt.step()
    moved = 1.0 - float(w.detach().float().mean())
    assert moved == pytest.approx(1.0 - float(ref.detach()), rel=0.03)  # ~3e-3, noise ~1e-5
    assert float(w.detach().max()) <= 1.0  # rounded between the neighbours of a smaller value: never up
    nearest = ones_bf16()
    torch.optim.AdamW([nearest], lr=lr, weight_decay=0.0).step()
    assert torch.equal(nearest.detach(), torch.ones_like(nearest))  # what torch's AdamW does with bf16 weights


def test_bf16_weights_always_take_the_rounding_optimizer():
    w = ones_bf16(1000)
    opt = adamw([w], state_dtype="float32", lr=1e-3)  # the moments' setting: torch's AdamW would round to nearest
    assert isinstance(opt, Bf16StateAdamW)
    opt.step()
    assert {opt.state[w][k].dtype for k in ("exp_avg", "exp_avg_sq")} == {torch.bfloat16}
    assert isinstance(adamw([torch.nn.Parameter(torch.zeros(3))], lr=1e-3), torch.optim.AdamW)


def objective(engine: TrainEngine, samples: list) -> float:
    """sum over samples of (reward - group mean) x mean token logprob: what a GRPO step increases."""
    batch = Packer(10_000, pad_id=0).pack(samples)
    for mb in batch.micro_batches:
        batch.scatter("logp", mb, engine.forward_logprobs(mb).float())
    total = 0.0
    for start in range(0, len(samples), 3):
        group = samples[start:start + 3]
        mean = sum(s.reward for s in group) / len(group)
        total += sum((s.reward - mean) * float(batch.per_token["logp"][start + j].mean()) for j, s in enumerate(group))
    return total


def test_a_bf16_trainer_learns_as_an_fp32_one(tiny_path):
    """Ten GRPO steps at lr 1e-5 on one batch: bf16 weights raise the objective by at least 0.6x what fp32 weights
    do (measured: 1.0x); rounded to nearest (torch's AdamW) they raised it by 0.2x."""
    samples = rollout(load_model(tiny_path), 1.0)
    for s in samples:
        s.reward = float(s.response_ids[0] % 2)
    assert len({s.reward for s in samples}) == 2
    gains = {}
    for dtype in ("float32", "bfloat16"):
        engine = TrainEngine(load_model(tiny_path, dtype=dtype), lr=1e-5)
        controller = TrainController(engine, AlgoConfig(), TrainConfig(lr=1e-5), pad_id=0, max_new_tokens=16)
        start = objective(engine, samples)
        for _ in range(10):
            controller.fit(samples)
        gains[dtype] = objective(engine, samples) - start
    assert gains["float32"] > 0
    assert gains["bfloat16"] > 0.6 * gains["float32"], gains


def test_the_floor_of_bf16_weights_is_8_bytes_a_parameter(tiny_path):
    cfg = resolve_run(load_run_config(None, [f"model.path={tiny_path}", "model.train_dtype=bfloat16"]), quiet=True)
    engine = TrainEngine(load_model(tiny_path, dtype="bfloat16"))
    n = sum(p.numel() for p in engine.model.parameters())
    assert (engine.floor_bytes, engine.floor_params) == (8 * n, n)
    assert isinstance(engine.optimizer, Bf16StateAdamW)
    assert _memory_plan(cfg, engine).startswith(f"memory: training floor {8 * n / 1e9:.2f} GB (8 bytes/trainable ")


def test_fsdp_refuses_bf16_weights(tiny_path):
    with pytest.raises(ConfigError, match="model.train_dtype.*train.engine=local"):
        load_run_config(None, [f"model.path={tiny_path}", "model.train_dtype=bfloat16", "train.engine=fsdp",
                               "train.optimizer_state_dtype=float32"])


def test_the_kernel_is_what_steps_bf16_weights():  # where it can be built
    if optim.load_kernel() is None:
        pytest.skip("no C kernel here (no compiler or kernels off)")
    w = ones_bf16(10)
    opt = Bf16StateAdamW([w], lr=1e-3)
    assert opt._kernel_entry(w, torch.zeros(10, dtype=torch.bfloat16), torch.zeros(10, dtype=torch.bfloat16)) \
        is opt.kernel.relayrl_adamw_bf16_weights


def test_auto_takes_bf16_weights_only_where_fp32_would_not_fit_and_bf16_is_native(monkeypatch):
    resolve = hardware.resolve_train_dtype
    monkeypatch.setattr(hardware, "bf16_support", lambda device="cpu": hardware.Bf16Support(True, "simulated"))
    assert resolve("auto", "cpu", 10**9, 64 * 10**9)[0] == "float32"  # 16 GB floor, 25% of the memory
    dtype, why = resolve("auto", "cpu", 1_543_714_304, 25_300_000_000)  # Qwen2.5-1.5B on this 25.3 GB machine
    assert dtype == "bfloat16" and "the fp32 floor 24.7 GB is 98% of 25.3 GB" in why
    assert resolve("auto", "cpu", None, 10**9)[0] == "float32"  # parameters unknown
    assert resolve("float32", "cpu", 1_543_714_304, 25_300_000_000) == ("float32", "set in the config")
    monkeypatch.setattr(hardware, "bf16_support", lambda device="cpu": hardware.Bf16Support(False, "simulated"))
    dtype, why = resolve("auto", "cpu", 1_543_714_304, 25_300_000_000)
    assert dtype == "float32" and "bf16 is not native here" in why  # AVX2: bf16 weights would crawl
    assert "bf16 is not native here" in resolve("bfloat16", "cpu", 10**6, 10**12)[1]  # set anyway: said
    assert "beside bf16 trainer weights" in hardware.resolve_dtype("auto", "cpu", "auto", "bfloat16")[1]


def test_a_run_resolves_auto_from_the_parameters_its_folder_stores(tiny_path, monkeypatch, capsys):
    n = sum(p.numel() for p in load_model(tiny_path).parameters())
    assert stored_parameters(tiny_path) == n
    monkeypatch.setattr(hardware, "bf16_support", lambda device="cpu": hardware.Bf16Support(True, "simulated"))
    cfg = resolve_run(load_run_config(None, [f"model.path={tiny_path}"]))
    assert cfg.model.train_dtype == "float32"  # a tiny model on this machine
    monkeypatch.setattr(precision, "device_memory_bytes", lambda device: 16 * n)  # a device the fp32 floor fills
    cfg = resolve_run(load_run_config(None, [f"model.path={tiny_path}"]))
    assert cfg.model.train_dtype == "bfloat16" and cfg.engine.dtype == "bfloat16"
    assert "trainer bfloat16 weights" in capsys.readouterr().out
    assert build.shares_weights(cfg)  # one bf16 model for engine and trainer
    lora = resolve_run(load_run_config(None, [f"model.path={tiny_path}", "model.lora_rank=4"]))
    assert lora.model.train_dtype == "float32"


@pytest.mark.parametrize("share", [False, True], ids=["rows", "shared_prompt"])
def test_trainer_logprobs_of_bf16_weights_match_the_engine_on_the_same_model(tiny_path, share):
    """One bf16 model decoded by the engine and scored by the trainer (what a colocated run with bf16 weights
    does): the same tokens' logprobs agree to bf16 precision (measured: mean 0.0003-0.0006, max 0.003 nats)."""
    model = load_model(tiny_path, dtype="bfloat16")
    samples = rollout(model, 1.0)
    engine = TrainEngine(model)
    batch = Packer(10_000, pad_id=0, share_prompt=share, row_tokens=40).pack(samples)
    for mb in batch.micro_batches:
        batch.scatter("logp", mb, engine.forward_logprobs(mb))
    diff = torch.cat([(lp - torch.tensor(s.logprobs)).abs() for s, lp in zip(samples, batch.per_token["logp"])])
    assert float(diff.mean()) < 0.005 and float(diff.max()) < 0.02


def test_a_bf16_critic_rounds_its_updates_too(tiny_path):
    """PPO's critic copies the policy's dtype: in bf16 it needs the same optimizer, or its value head never learns."""
    ppo = AlgoConfig(adv_estimator="gae", adv_mean="batch", adv_std="batch", critic_lr=1e-3)
    controller = TrainController(TrainEngine(load_model(tiny_path, dtype="bfloat16")), ppo, TrainConfig(),
                                 pad_id=0, max_new_tokens=16)
    assert next(controller.critic.model.parameters()).dtype == torch.bfloat16
    assert isinstance(controller.critic.optimizer, Bf16StateAdamW)
