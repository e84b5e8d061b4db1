"""Weight sync by broadcast (engine.weight_sync=distributed, SGLang's /init_weights_update_group +
/update_weights_from_distributed) against real `relayrl serve` subprocesses on 127.0.0.1, over gloo: the
servers end up running exactly the trainer's tensors, one group feeds several servers, bad requests are
refused naming the field, a dead server or a silent trainer is an error in bounded time, and a 2-step
training run syncs this way. The group's store layout is checked against torch's own group machinery, which
is what real SGLang servers use to join."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
from bounds import bound
from conftest import relayrl_servers, write_sums

from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.common.net import free_port
from relayrl.config.loader import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.engine import LocalEngine, RemoteEngine, SamplingParams
from relayrl.engine.rollout import RolloutController
from relayrl.models import load_model
from relayrl.run.build import build
from relayrl.run.launcher import relayrl_server
from relayrl.run.loop import train_steps
from relayrl.weights.snapshot import Weights
from relayrl.weights.weight_group import WeightGroup, WeightSyncError

PROMPT = [5, 6, 7]


def greedy(n: int = 8) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def perturbed(tiny_path: str, seed: int) -> torch.nn.Module:
    """The tiny model with large random changes: any weight left unsent changes the greedy tokens."""
    model = load_model(tiny_path, dtype="float32")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    return model


def reference(model: torch.nn.Module, n: int = 8):
    local = LocalEngine(model, eos_token_ids=[])
    try:
        return local.generate([PROMPT], greedy(n))[0]
    finally:
        local.close()


def assert_serves(engine: RemoteEngine, model: torch.nn.Module, version: int) -> None:
    """Token for token (and logprob for logprob) what a LocalEngine holding `model` generates."""
    out, ref = asyncio.run(engine.agenerate(PROMPT, greedy())), reference(model)
    assert out.output_ids == ref.output_ids
    assert torch.allclose(torch.tensor(out.logprobs), torch.tensor(ref.logprobs), atol=1e-5)
    assert out.versions == [version] * 8 and engine.refresh_version() == version


def distributed(urls: list[str], timeout: float = 30.0) -> list[RemoteEngine]:
    return RemoteEngine.for_servers(urls, weight_sync="distributed", weight_sync_backend="gloo", timeout=timeout,
                                    retries=0)


def post(url: str, path: str, body: dict, timeout: float = 30.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


@pytest.fixture(scope="module")
def hidden(tiny_path) -> int:
    return load_model(tiny_path, dtype="float32").config.hidden_size


@pytest.fixture(scope="module")
def servers(tiny_path, tmp_path_factory):
    with relayrl_servers(tiny_path, tmp_path_factory.mktemp("broadcast")) as both:
        yield both


def test_broadcast_makes_the_server_run_the_trainers_weights(servers, tiny_path):
    (engine,) = distributed([servers[0].url])
    try:
        before = asyncio.run(engine.agenerate(PROMPT, greedy())).output_ids
        first, second = perturbed(tiny_path, 1), perturbed(tiny_path, 2)
        engine.load_weights(first.named_parameters(), 5)
        assert_serves(engine, first, 5)
        assert reference(first).output_ids != before  # the weights really changed
        engine.load_weights(second.named_parameters(), 6)  # the same group, reused
        assert_serves(engine, second, 6)
        assert engine.weight_group.group_name is not None and engine.weight_group.members == [engine]
    finally:
        engine.close()


def test_one_group_feeds_every_server_with_one_broadcast(servers, tiny_path, monkeypatch):
    engines = distributed([s.url for s in servers])
    sends = []
    broadcast = WeightGroup.broadcast
    monkeypatch.setattr(WeightGroup, "broadcast", lambda self, t: sends.append(self.world_size) or broadcast(self, t))
    ctl = RolloutController(engines)
    model = perturbed(tiny_path, 3)
    try:
        ctl.load_weights(Weights(model.named_parameters, 7))
        assert sends == [3]  # trainer + 2 servers, one broadcast for both engines
        for engine in engines:
            assert_serves(engine, model, 7)
        assert ctl.version == 7
        name = engines[0].weight_group.group_name
    finally:
        ctl.close()
    for s in servers:  # closing the engines destroyed the group on every server
        r = post(s.url, "/destroy_weights_update_group", {"group_name": name})
        assert r.status_code == 400 and "no weights update group" in r.json()["message"]


@pytest.mark.parametrize("path,body,field", [
    ("/init_weights_update_group", {"master_port": 1234, "rank_offset": 1, "world_size": 2}, "master_address"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 0,
                                    "world_size": 2, "backend": "gloo"}, "rank_offset"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 2,
                                    "world_size": 2, "backend": "gloo"}, "world_size"),
    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234, "rank_offset": 1,
                                    "world_size": 2, "backend": "mpi"}, "backend"),
    ("/update_weights_from_distributed", {"names": ["no.such.weight"], "dtypes": ["float32"], "shapes": [[2]]},
     "names[0]"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float33"], "shapes": [[64]]},
     "dtypes[0]"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight", "lm_head.weight"], "dtypes": ["float32"],
                                          "shapes": [[64], [1, 1]]}, "dtypes"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[3]]},
     "shapes[0]"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                          "load_format": "flattened_bucket"}, "load_format"),
    ("/update_weights_from_distributed", {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]],
                                          "group_name": "never-made"}, "group_name"),
    ("/destroy_weights_update_group", {"group_name": "never-made"}, "group_name"),
])
def test_bad_requests_are_refused_naming_the_field(servers, hidden, path, body, field):
    if "shapes" in body:  # 64 stands for the served hidden size: the length of model.norm.weight
        body = {**body, "shapes": [[hidden if d == 64 else d for d in shape] for shape in body["shapes"]]}
    r = post(servers[0].url, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["success"] is False and r.json()["message"].startswith(f"{field}:"), r.json()


def test_nccl_on_a_cpu_server_is_refused(servers):
    if torch.cuda.is_available():
        pytest.skip("this server has CUDA")
    r = post(servers[0].url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1234,
                                                            "rank_offset": 1, "world_size": 2, "backend": "nccl"})
    assert r.status_code == 400 and r.json()["message"].startswith("backend:")


def test_a_receive_that_times_out_is_an_error_and_health_stays_up(servers, hidden):
    """The test is the trainer here, with the same WeightGroup the server joins with; it never broadcasts."""
    url, port = servers[1].url, free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": "silent", "backend": "gloo", "timeout": 2}
    joined: list[httpx.Response] = []
    joining = threading.Thread(target=lambda: joined.append(post(url, "/init_weights_update_group", init)))
    joining.start()
    trainer = WeightGroup("127.0.0.1", port, rank=0, world_size=2, group_name="silent", timeout=2)
    joining.join(30)
    assert joined[0].status_code == 200 and joined[0].json()["success"] is True
    answers: list[httpx.Response] = []
    body = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[hidden]],
            "group_name": "silent", "weight_version": 99}
    waiting = threading.Thread(target=lambda: answers.append(post(url, "/update_weights_from_distributed", body)))
    t0 = time.monotonic()
    waiting.start()
    time.sleep(0.5)
    assert httpx.get(url + "/health", timeout=1.0).status_code == 200  # the event loop is free meanwhile
    waiting.join(30)
    trainer.close()
    assert time.monotonic() - t0 < bound(15)
    assert answers[0].status_code == 400 and "receiving the weights failed" in answers[0].json()["message"]
    assert httpx.get(url + "/get_weight_version").json()["weight_version"] != 99
    r = post(url, "/update_weights_from_distributed", body)  # the broken group was dropped
    assert r.status_code == 400 and r.json()["message"].startswith("group_name:")


def test_a_server_dying_mid_broadcast_is_a_clear_error_not_a_hang(servers, tiny_path, tmp_path, monkeypatch):
    doomed = relayrl_server(tiny_path, tmp_path / "doomed.log", dtype="float32").start().wait_ready(120)
    # the group's timeout below the trainer's 15 s settle (relayrl.weights.weight_group._SETTLE_S): where closing the
    # trainer's side does not release the survivor's receive at once (seen on an Intel Xeon), its receive times out
    # and answers within the settle; at 20 s it answered after it, as "no answer in time"
    survivor, dying = engines = distributed([servers[0].url, doomed.url], timeout=min(bound(10.0), 12.0))
    try:
        survivor.load_weights(perturbed(tiny_path, 4).named_parameters(), 1)  # forms the group: both get v1
        sent = []
        send = WeightGroup._broadcast_one

        def kill_after_first(self, tensor):
            sent.append(1)
            if len(sent) == 2:  # the server is mid-transfer: one tensor in, the rest still to come
                doomed.proc.kill()
                doomed.proc.wait()
            send(self, tensor)

        monkeypatch.setattr(WeightGroup, "_broadcast_one", kill_after_first)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=doomed.url.replace(".", r"\.")) as info:
            survivor.load_weights(perturbed(tiny_path, 5).named_parameters(), 2)
        # a hang would wait out timeout + 60 s; on a loaded 2-core CI run the dead server's retries took 15 s
        assert time.monotonic() - t0 < bound(30), info.value
        monkeypatch.undo()
        assert "receiving the weights failed" in str(info.value)  # the survivor was released, not left waiting
        assert survivor.refresh_version() == 1 and survivor.health()  # and it kept its old weights, whole
        t0 = time.monotonic()
        with pytest.raises(WeightSyncError, match=doomed.url.replace(".", r"\.")):
            survivor.load_weights(perturbed(tiny_path, 5).named_parameters(), 2)  # no new group without it
        assert time.monotonic() - t0 < bound(10)
    finally:
        for e in engines:
            e.close()
        doomed.stop()


def test_group_layout_matches_torch_process_groups(tmp_path):
    """Rank 1 joins with torch's init_process_group machinery the way SGLang's init_custom_process_group
    does (rendezvous store, PrefixStore(group_name), _new_process_group_helper): a relayrl trainer can feed
    real SGLang servers."""
    port, tensors = free_port(), [("a", torch.arange(6.0).reshape(2, 3)), ("b", torch.ones(4, dtype=torch.bfloat16))]
    script = f"""
import datetime, os, torch, torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
timeout = datetime.timedelta(seconds=30)
store, rank, size = next(rendezvous("tcp://127.0.0.1:{port}", 1, 3, timeout=timeout))
pg, _ = _new_process_group_helper(3, 1, [], Backend("gloo"), PrefixStore("g", store), group_name="g",
                                  timeout=timeout)
_world.pg_group_ranks[pg] = {{0: 0, 1: 1, 2: 2}}
for want in (torch.arange(6.0).reshape(2, 3), torch.ones(4, dtype=torch.bfloat16)):
    got = torch.empty_like(want)
    dist.broadcast(got, src=0, group=pg)
    assert torch.equal(got, want), got
dist.destroy_process_group(pg)  # as SGLang's /destroy_weights_update_group does
print("received", flush=True)
os._exit(0)  # torch's gloo threads sometimes abort in interpreter teardown, after the work is done
"""
    sglang_style = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                    text=True)
    received = []

    def rank2() -> None:
        group = WeightGroup("127.0.0.1", port, rank=2, world_size=3, group_name="g", timeout=30)
        received.extend(group.receive([(n, t.dtype, tuple(t.shape)) for n, t in tensors]))
        group.close()

    other = threading.Thread(target=rank2)
    other.start()
    trainer = WeightGroup("127.0.0.1", port, rank=0, world_size=3, group_name="g", timeout=30)
    assert trainer.broadcast(tensors) == 2
    other.join(30)
    out, _ = sglang_style.communicate(timeout=60)
    trainer.close()
    assert sglang_style.returncode == 0 and "received" in out, out
    assert [n for n, _ in received] == ["a", "b"] and all(torch.equal(r, t) for (_, r), (_, t) in
                                                          zip(received, tensors))


def test_config_and_engine_refuse_what_cannot_work(tiny_path):
    with pytest.raises(ConfigError, match="engine.weight_sync.*kind=remote"):
        load_run_config(None, [f"model.path={tiny_path}", "engine.weight_sync=distributed"])
    cfg = load_run_config(None, [f"model.path={tiny_path}", "engine.kind=remote", "engine.launch=vllm",
                                 "engine.backend=vllm", "engine.weight_sync=distributed"])
    with pytest.raises(InputError, match="engine.weight_sync=distributed needs backend=sglang"):  # at start-up
        RemoteEngine.from_config(cfg.engine, ["http://127.0.0.1:1"], "unused")
    with pytest.raises(ValueError, match="engine.weight_sync=distributed needs backend=sglang"):
        RemoteEngine("http://127.0.0.1:1", backend="vllm", weight_sync="distributed")
    with pytest.raises(ValueError, match="weight_sync_backend"):
        RemoteEngine("http://127.0.0.1:1", weight_sync="distributed", weight_sync_backend="mpi")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="nccl needs a CUDA device"):
            RemoteEngine("http://127.0.0.1:1", weight_sync="distributed", weight_sync_backend="nccl")


def test_train_two_steps_syncing_by_broadcast(servers, tiny_path, tmp_path):
    data = write_sums(tmp_path / "sums.jsonl", 8)
    cfg = load_run_config(None, [
        f"model.path={tiny_path}", f"data.train.source={data}", "data.batch_size=2", "data.group_size=2",
        "sampling.max_new_tokens=8", "run.steps=2", f"run.output_dir={tmp_path}", "run.name=bcast",
        "judge.workers=1", "run.print_samples=0", "train.lr=1e-3", "engine.kind=remote", "engine.dtype=float32",
        f"engine.addresses=[{servers[0].url},{servers[1].url}]", "engine.weight_sync=distributed",
        "engine.weight_sync_backend=gloo"])
    c = build(cfg)
    try:
        train_steps(c)
        assert c.rollout_ctl.version == 2 and all(e.refresh_version() == 2 for e in c.rollout_ctl.engines)
        assert len({id(e.weight_group) for e in c.rollout_ctl.engines}) == 1  # one group for both servers
    finally:
        c.close()
    assert not (c.run_dir / "weights").exists()  # nothing went through the disk
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="NCCL needs CUDA and one GPU per rank (the trainer on GPU 0, the server on GPU 1)")
def test_nccl_broadcast(tiny_path, tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the server's GPU; this process keeps GPU 0
    server = relayrl_server(tiny_path, tmp_path / "nccl.log", dtype="float32").start()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    (engine,) = RemoteEngine.for_servers([server.wait_ready(120).url], weight_sync="distributed",
                                         weight_sync_backend="nccl", timeout=60.0, retries=0)
    try:
        model = perturbed(tiny_path, 6)
        engine.load_weights(model.named_parameters(), 3)
        assert_serves(engine, model, 3)
    finally:
        engine.close()
        server.stop()
