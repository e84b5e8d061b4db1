"""Rollout routing replay on the tiny Qwen3-MoE: the engine records every position's experts (through batched and
shared prefills, decode steps and slot moves), the trainer's forward replays them, and with them its logprobs are
the engine's even where the two routers choose differently; without them they are not."""

import numpy as np
import pytest
import torch

from relayrl.common.errors import InputError
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model
from relayrl.models.moe import Record, Replay, gate_weights, routers
from relayrl.sample import Sample
from relayrl.trainer import routing
from relayrl.trainer.engine import TrainEngine
from relayrl.trainer.packer import Packer

# 3 prompts sharing a 10-token start (a shared-start prefill), one of them twice (a running twin's copy), one short
PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 3, 4, 2],
           [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], [1, 2, 3]]


def second_choice(router, args, out):
    """An engine whose routers pick each token's 2nd..k+1-th best experts (gating weights as the model computes
    them for those): a router that disagrees with the trainer's everywhere, as a different kernel or dtype would
    near ties."""
    logits, _, own = out
    experts = logits.float().topk(own.shape[-1] + 1, dim=-1).indices[:, 1:]
    return logits, gate_weights(router, logits, experts), experts


@pytest.fixture(scope="module")
def trainer(tiny_moe_path):
    return TrainEngine(load_model(tiny_moe_path, dtype="float32"), lr=1e-3)


def generate(path, hook=None, max_new_tokens=8):
    model = load_model(path, dtype="float32")
    handles = [r.register_forward_hook(hook) for r in routers(model)] if hook else []
    engine = LocalEngine(model, eos_token_ids=[2])
    try:
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=max_new_tokens, seed=3, ignore_eos=True))
    finally:
        engine.close()
        for h in handles:
            h.remove()
    samples = []
    for i, (p, o) in enumerate(zip(PROMPTS, outs)):
        s = Sample(list(p), group_id=str(i))
        s.append_generated(o.output_ids, o.logprobs, o.versions, o.finish_reason, o.routed_experts)
        samples.append(s)
    return samples


@pytest.fixture(scope="module")
def agreeing(tiny_moe_path):
    """Samples of an fp32 engine with the trainer's weights: its routers choose as the trainer's."""
    return generate(tiny_moe_path)


@pytest.fixture(scope="module")
def disagreeing(tiny_moe_path):
    return generate(tiny_moe_path, hook=second_choice)


def own_routes(model, ids):
    got = []
    rec = Record(model, lambda layer, experts: got.append(experts.clone()), lambda: True)
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([ids]))
    finally:
        rec.remove()
    return torch.stack(got, 1).numpy()


def pack(samples, share_prompt):
    batch = Packer(4096, 0, share_prompt=share_prompt).pack(samples)
    batch.per_token["behav_logp"] = [torch.tensor(s.logprobs) for s in samples]
    return batch


def test_engine_records_every_position_it_ran(agreeing, trainer):
    for s in agreeing:
        routed = s.routed_experts
        # prompt + output - 1 positions (the last token never ran), 2 MoE layers, 2 experts; 1 byte each
        assert routed.shape == (len(s.input_ids) - 1, 2, 2) and routed.dtype == np.uint8
        own = own_routes(trainer.model, s.input_ids)[:-1]
        assert (np.sort(routed, -1) == np.sort(own, -1)).all()  # fp32 engine, same weights: the same experts


@pytest.mark.parametrize("share_prompt", [False, True])
def test_replay_gives_the_engines_logprobs_and_without_it_they_differ(disagreeing, trainer, share_prompt):
    batch = pack(disagreeing, share_prompt)
    mb = batch.micro_batches[0]
    engine_lp = batch.gather("behav_logp", mb)
    replayed = trainer.forward_logprobs(mb, replay=True)
    assert (replayed - engine_lp).abs().max() < 1e-4
    assert trainer.last_replay.agreed == 0 and trainer.last_replay.compared > 0  # it disagreed everywhere
    own = trainer.forward_logprobs(mb, replay=False)
    # a random-init model's logits are near uniform, so even the wrong experts move logprobs by only ~1e-2
    assert (own - engine_lp).abs().mean() > 1e-3
    m = routing.routing_metrics(trainer, batch)
    assert m["train/routing_agreement"] == 0.0
    assert m["train/logprob_diff_engine_noreplay"] > 1e-3 > 100 * m["train/logprob_diff_engine_replay"]


def test_agreement_is_one_where_the_routers_agree(agreeing, trainer):
    m = routing.routing_metrics(trainer, pack(agreeing, share_prompt=True))
    assert m["train/routing_agreement"] == 1.0
    assert m["train/logprob_diff_engine_replay"] < 1e-5 and m["train/logprob_diff_engine_noreplay"] < 1e-5


def test_replayed_training_step_moves_the_router(tiny_moe_path, disagreeing):
    """The gating weights come from the trainer's router at the replayed experts (R3): its weight gets gradients,
    in a training step (the replay open through the backward) as in a plain backward with the experts reordered."""
    engine = TrainEngine(load_model(tiny_moe_path, dtype="float32"), lr=1e-3)
    routing.enable(engine, True)
    before = [r.weight.detach().clone() for r in routers(engine.model)]
    mb = pack(disagreeing, share_prompt=False).micro_batches[0]
    stats = engine.train_step([mb], lambda mb, logp, ent: (-logp.mean(), {}), with_entropy=False)
    assert np.isfinite(stats["grad_norm"]) and engine.last_replay.compared > 0
    assert all(not torch.equal(b, r.weight) for b, r in zip(before, routers(engine.model)))
    ids = torch.tensor([[1, 5, 6, 7, 8, 9]])
    routes = torch.from_numpy(own_routes(engine.model, ids[0].tolist()).astype(np.int64))
    with Replay(engine.model, routes.roll(1, dims=-1)) as replay:  # the same sets in another order
        engine.model(input_ids=ids).logits.sum().backward()
    assert replay.agreed == replay.compared == 12
    assert all(r.weight.grad.abs().sum() > 0 for r in routers(engine.model))


def test_routing_replay_on_a_dense_model_names_the_key(tiny_path):
    engine = TrainEngine(load_model(tiny_path, dtype="float32"))
    with pytest.raises(InputError, match="algo.routing_replay"):
        routing.enable(engine, True)
    routing.enable(engine, False)
    assert Sample([1]).routed_experts is None


def test_cli_builds_the_tiny_moe(tmp_path, capsys):
    from relayrl.cli import main

    assert main(["models", "tiny-moe", str(tmp_path / "moe")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "moe")
    assert sum(f.stat().st_size for f in (tmp_path / "moe").iterdir()) < 2 * 2**20  # under ~50 MB by far
    model = load_model(str(tmp_path / "moe"), dtype="float32")
    assert model.config.model_type == "qwen3_moe" and len(routers(model)) == 2
