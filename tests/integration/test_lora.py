"""LoRA training (model.lora_rank > 0) on the real tiny model: only adapters train, only adapters travel, engines
merge them exactly, the KL reference is the base model, export is a plain merged HF folder, and the separate
placement relays adapters over disk."""

from __future__ import annotations

import contextlib
import time
import types

import pytest
import torch
from conftest import write_sums
from safetensors.torch import load_file
from test_async import cfg_for
from test_loop import overrides
from test_separate import run_separate
from transformers import AutoModelForCausalLM

from relayrl.cli import main
from relayrl.common.files import read_jsonl
from relayrl.config import ConfigError
from relayrl.config.schema import AlgoConfig, ModelConfig, TrainConfig
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.models import load_model, load_tokenizer
from relayrl.sample import Sample
from relayrl.trainer.controller import TrainController
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.lora import BaseReference, adapter_template, is_adapter_name, merged_state_dict, targeted
from relayrl.trainer.packer import Packer
from relayrl.weights.transport import DiskReceiver, DiskSender

PROMPTS = [[5, 6, 7, 8, 9], [20, 21], [30] * 11, [40, 41, 42]]
N_LAYERS, N_TARGETS = 2, 7  # the tiny model: 2 layers x q/k/v/o/gate/up/down


def lora_cfg(tiny_path, rank=8, **kw) -> ModelConfig:
    return ModelConfig(path=tiny_path, lora_rank=rank, **kw)


def controller(tiny_path, rank=8, **algo) -> TrainController:
    engine = TrainEngine.from_pretrained(tiny_path, lora=lora_cfg(tiny_path, rank), lr=1e-2)
    return TrainController(engine, AlgoConfig(**algo), TrainConfig(lr=1e-2), pad_id=0, max_new_tokens=16)


def engine_for(tiny_path, dtype="float32") -> LocalEngine:
    return LocalEngine(load_model(tiny_path, dtype=dtype), eos_token_ids=[], max_batch_size=8, seed=1)


def generate(engine: LocalEngine) -> list[Sample]:
    """GRPO groups sampled by `engine` (their logprobs are the engine's), with made-up rewards."""
    samples = []
    for g, prompt in enumerate(PROMPTS):
        for i, out in enumerate(engine.generate([prompt] * 3, SamplingParams(max_new_tokens=12, temperature=1.0))):
            s = Sample(prompt_ids=list(prompt), group_id=f"g{g}", index=i)
            s.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
            s.reward = float((i + g) % 2)
            samples.append(s)
    return samples


def recomputed(engine, samples: list[Sample]) -> torch.Tensor:
    """Every sample's response logprobs under a trainer-side engine (TrainEngine or BaseReference), flat."""
    batch = Packer(4096, pad_id=0).pack(samples)
    for mb in batch.micro_batches:
        batch.scatter("lp", mb, engine.forward_logprobs(mb))
    return torch.cat(batch.per_token["lp"])


def engine_logprobs(samples: list[Sample]) -> torch.Tensor:
    return torch.cat([torch.tensor(s.logprobs) for s in samples])


def test_only_adapters_train_and_only_they_are_in_the_optimizer(tiny_path):
    ctl = controller(tiny_path)
    model = ctl.engine.model
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert len(trainable) == N_LAYERS * N_TARGETS * 2 and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    in_optimizer = [p for group in ctl.engine.optimizer.param_groups for p in group["params"]]
    assert {id(p) for p in in_optimizer} == {id(p) for p in trainable.values()} and len(in_optimizer) == len(trainable)
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    with contextlib.closing(engine_for(tiny_path)) as eng:
        ctl.fit(generate(eng))
    assert all(torch.equal(p, frozen[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(p.abs().max() > 0 for n, p in trainable.items() if ".lora_B." in n)  # B starts at 0: it moved


def test_ppo_critic_stays_full_parameter(tiny_path):
    ctl = controller(tiny_path, adv_estimator="gae")
    critic = [p for p in ctl.critic.model.parameters()]
    assert all(p.requires_grad for p in critic)
    assert sum(len(g["params"]) for g in ctl.critic.optimizer.param_groups) == len(critic)


@pytest.mark.parametrize("dtype, atol", [("float32", 1e-5), ("bfloat16", 1e-2)])  # bf16: as a full-weight relay
def test_engine_logprobs_equal_trainer_logprobs_after_each_sync(tiny_path, dtype, atol):
    """Two steps: the second merge must start from the base weights again, not stack on the first."""
    ctl, base = controller(tiny_path), TrainEngine(load_model(tiny_path))
    eng = engine_for(tiny_path, dtype)
    try:
        for step in (1, 2):
            ctl.fit(generate(eng))
            RolloutController([eng]).load_weights(ctl.weights())
            samples = generate(eng)
            assert eng.version == step and all(v == step for s in samples for v in s.versions)
            trainer = recomputed(ctl.engine, samples)
            assert (engine_logprobs(samples) - trainer).abs().max() < atol
            assert (recomputed(base, samples) - trainer).abs().max() > 0.05  # the adapters do matter
    finally:
        eng.close()


def test_the_payload_is_adapter_only_small_and_travels_by_disk(tiny_path, tmp_path):
    ctl = controller(tiny_path, rank=2)
    with contextlib.closing(engine_for(tiny_path)) as eng:
        ctl.fit(generate(eng))
    payload = list(ctl.engine.named_parameters())
    plain = load_model(tiny_path)
    layers = targeted(plain, lora_cfg(tiny_path).lora_target_modules)
    assert len(layers) == N_LAYERS * N_TARGETS and all(is_adapter_name(n) for n, _ in payload)
    assert [n for n, _ in payload] == [f"{m}.{p}" for m in layers for p in ("lora_A", "lora_B", "lora_scaling")]
    template = adapter_template(plain, lora_cfg(tiny_path, rank=2))  # what a dist receiver allocates
    assert [(n, t.shape) for n, t in template] == [(n, t.shape) for n, t in payload]
    full = sum(p.numel() * p.element_size() for p in plain.parameters())
    adapters = sum(t.numel() * t.element_size() for _, t in payload)
    assert adapters * 10 < full
    sent = DiskSender(tmp_path / "w").send(payload, 1) / "model.safetensors"
    assert set(load_file(str(sent))) == {n for n, _ in payload} and sent.stat().st_size * 10 < full

    receiving = engine_for(tiny_path)
    receiver = DiskReceiver(tmp_path / "w", receiving.load_weights, poll_s=0.01)  # the producer's receiver
    deadline = time.monotonic() + 20
    while receiver.version < 1 and receiver.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    receiver.close()
    assert receiver.error is None and receiving.version == 1
    merged, got = merged_state_dict(ctl.engine.model), dict(receiving.model.named_parameters())
    assert all(torch.equal(got[n], merged[n]) for n in got)
    receiving.load_weights(plain.named_parameters(), 2)  # full weights become the engine's new base
    assert all(torch.equal(got[n], p) for n, p in plain.named_parameters())
    receiving.load_weights(payload, 3)
    assert all(torch.equal(got[n], merged[n]) for n in got)
    receiving.close()


def test_kl_reference_is_exactly_the_base_model(tiny_path):
    ctl = controller(tiny_path, kl_coef=0.1)
    with contextlib.closing(engine_for(tiny_path)) as eng:
        samples = generate(eng)
    ctl.fit(samples)  # adapters are now non-zero
    policy = recomputed(ctl.engine, samples)
    ref = recomputed(BaseReference(ctl.engine), samples)
    assert torch.equal(ref, recomputed(TrainEngine(load_model(tiny_path)), samples))
    assert (policy - ref).abs().max() > 0.05
    assert torch.equal(recomputed(ctl.engine, samples), policy)  # the adapters are back on afterwards


def test_save_model_writes_the_merged_policy_as_a_plain_folder(tiny_path, tmp_path):
    from relayrl.run.build import Components

    ctl = controller(tiny_path)
    with contextlib.closing(engine_for(tiny_path)) as eng:
        ctl.fit(generate(eng))
    c = types.SimpleNamespace(train_ctl=ctl, tokenizer=load_tokenizer(tiny_path))
    folder = Components.save_model(c, tmp_path / "model")
    assert not (folder / "adapter_config.json").exists()
    saved, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = torch.tensor([[5, 6, 7, 8, 9, 20, 21]])
    ctl.engine.model.eval()
    with torch.no_grad():
        assert torch.allclose(saved(input_ids=ids).logits, ctl.engine.model(input_ids=ids).logits, atol=1e-5)


def test_cli_train_with_lora_and_kl_saves_a_merged_model(tiny_path, tmp_path, capsys):
    data = write_sums(tmp_path / "sums.jsonl", 12)
    args = overrides(tiny_path, data, tmp_path, **{"model.lora_rank": 8, "algo.kl_coef": 0.01, "train.lr": 1e-2,
                                                   "eval.at_start": False, "run.tensorboard": False})
    assert main(["train", *args]) == 0, capsys.readouterr().err[-2000:]
    steps = [r for r in read_jsonl(tmp_path / "t" / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2] and "train/kl_ref" in steps[1]
    assert steps[1]["train/logprob_diff_engine_max"] < 1e-4  # step 2 sampled by the engine's merged version 1
    saved, info = AutoModelForCausalLM.from_pretrained(tmp_path / "t" / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    base, trained = dict(load_model(tiny_path).named_parameters()), dict(saved.named_parameters())
    changed = {n for n in base if not torch.equal(base[n], trained[n])}
    assert changed and all(n.endswith("_proj.weight") for n in changed)  # adapted layers only


@pytest.mark.parametrize("transport", ["disk", "dist"])  # dist: the producer sizes its buffers from the config
def test_separate_placement_relays_adapters(tiny_path, tmp_path, transport):
    data = write_sums(tmp_path / "d.jsonl", 40)
    c = run_separate(cfg_for(tiny_path, data, tmp_path, "sep-lora", **{
        "model.lora_rank": 8, "train.lr": 1e-2, "run.steps": 2, "scheduler.mode": "async",
        "scheduler.placement": "separate", "scheduler.transport": transport, "scheduler.max_staleness": 0}))
    assert c.rollouts.proc.exitcode == 0
    if transport == "disk":
        sent = load_file(str(c.run_dir / "weights" / "v2" / "model.safetensors"))
        assert sent and all(is_adapter_name(n) for n in sent)
    steps = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert steps[1]["staleness/max"] == 0  # step 2 trained on samples of the producer's merged version 1
    assert steps[1]["train/logprob_diff_engine_max"] < 1e-4


@pytest.mark.parametrize("bad, message", [
    (["model.lora_rank=-1"], "model.lora_rank: must be >= 0"),
    (["model.lora_dropout=1.0"], "model.lora_dropout: must be in [0, 1)"),
    (["model.lora_rank=8", "model.lora_target_modules=[]"], "model.lora_target_modules: must name"),
    (["model.lora_rank=8", "engine.kind=remote", "engine.launch=sglang", "engine.backend=sglang"],
     "engine.launch: LoRA (model.lora_rank > 0) with launch=sglang is not supported"),
    (["model.lora_rank=600", "engine.kind=remote", "engine.launch=vllm", "engine.backend=vllm"],
     "model.lora_rank: vLLM serves LoRA adapters up to rank 512, got 600"),
])
def test_config_errors_name_their_keys(bad, message, capsys):
    assert main(["train", "--config", "examples/arithmetic_grpo.yaml", *bad]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("targets, message", [(["q_proj", "qq_proj"], "'qq_proj' matches no linear layer"),
                                              (["lm_head"], "the LM head is never adapted")])
def test_unknown_target_modules_fail_at_load_naming_the_key(tiny_path, targets, message):
    with pytest.raises(ConfigError, match="model.lora_target_modules") as info:
        TrainEngine.from_pretrained(tiny_path, lora=lora_cfg(tiny_path, lora_target_modules=targets))
    assert message in str(info.value) and "down_proj, gate_proj, k_proj" in str(info.value)
