"""RemoteEngine and the launcher against real `relayrl serve` subprocesses on 127.0.0.1 (no mocks):
token/logprob parity with the in-process engine, sticky routing over two servers, weight sync from disk,
a server killed mid-rollout, launch failures with the server's log, and a 2-step training run on launched
servers."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import sys
import time

import pytest
import torch
from conftest import relayrl_servers, write_sums
from safetensors.torch import load_file

from relayrl.common.errors import InputError
from relayrl.common.files import read_jsonl
from relayrl.common.net import free_port
from relayrl.config.loader import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.engine import EngineUnavailable, LocalEngine, RemoteEngine, SamplingParams
from relayrl.engine.dialects import SGLangDialect
from relayrl.engine.rollout import RolloutController
from relayrl.models import eos_token_ids, load_model, load_tokenizer
from relayrl.run.build import build, check_user_code
from relayrl.run.launcher import ManagedServer, relayrl_server
from relayrl.run.loop import train_steps
from relayrl.weights.snapshot import Weights


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def servers(tiny_path, tmp_path_factory):
    # the engines write weights under their tests' tmp_path: all of them lie under pytest's base folder
    logs, root = tmp_path_factory.mktemp("remote"), tmp_path_factory.getbasetemp()
    with relayrl_servers(tiny_path, logs, weights_root=root) as both:
        yield both


@pytest.fixture()
def engines(servers, tmp_path):
    made = [RemoteEngine(s.url, weights_dir=str(tmp_path / "weights"), retries=1, backoff=0.1) for s in servers]
    yield made
    for e in made:
        e.close()


def test_generation_matches_local_engine_token_for_token(engines, tiny_path):
    model = load_model(tiny_path, dtype="float32")
    local = LocalEngine(model, eos_token_ids=eos_token_ids(load_tokenizer(tiny_path), tiny_path))
    try:
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
        ref = local.generate(prompts, greedy(12))
    finally:
        local.close()
    for engine in engines:
        outs = [asyncio.run(engine.agenerate(p, greedy(12))) for p in prompts]
        for o, r in zip(outs, ref):
            assert o.output_ids == r.output_ids and o.finish_reason == "length"
            assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-4)
            assert o.versions == [0] * 12 and o.meta["address"] == engine.address


def test_vllm_dialect_over_openai_completions(servers, tiny_path):
    """backend="vllm" speaks /v1/completions with token ids in and out; relayrl serve answers it too."""
    engine = RemoteEngine(servers[0].url, backend="vllm")
    sglang = RemoteEngine(servers[0].url)
    try:
        a = asyncio.run(engine.agenerate([5, 6, 7], greedy(10)))
        b = asyncio.run(sglang.agenerate([5, 6, 7], greedy(10)))
    finally:
        engine.close()
        sglang.close()
    assert a.output_ids == b.output_ids and len(a.logprobs) == 10
    assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4)


class CountingDialect(SGLangDialect):
    """A user's dialect (engine.backend="module:Class"): SGLang's API, counting every call the engine makes of it."""

    def __init__(self, server, model=None):
        super().__init__(server, model)
        self.calls: collections.Counter[str] = collections.Counter()

    async def generate(self, *args):
        self.calls["generate"] += 1
        return await super().generate(*args)

    async def load_from_disk(self, path: str, version: int) -> None:
        self.calls["load_from_disk"] += 1
        await super().load_from_disk(path, version)

    async def pause(self) -> None:
        self.calls["pause"] += 1
        await super().pause()

    async def resume(self) -> None:
        self.calls["resume"] += 1
        await super().resume()

    async def abort(self, rid: str | None) -> int:
        self.calls["abort"] += 1
        return await super().abort(rid)

    async def weight_version(self) -> int | None:
        self.calls["weight_version"] += 1
        return await super().weight_version()


def test_a_users_dialect_by_import_path_drives_relayrl_serve(servers, tiny_path, tmp_path):
    engine = RemoteEngine(servers[0].url, backend=f"{__name__}:CountingDialect", weights_dir=str(tmp_path / "w"))
    model = load_model(tiny_path, dtype="float32")  # the servers' own weights: the module's other tests see no change
    try:
        first = asyncio.run(engine.agenerate([5, 6, 7], greedy(4)))
        engine.pause()
        engine.resume()
        assert engine.abort("nobody") == 0
        engine.load_weights(model.named_parameters(), version=4)
        again = asyncio.run(engine.agenerate([5, 6, 7], greedy(4)))
        assert engine.refresh_version() == 4 and again.versions == [4] * 4 and again.output_ids == first.output_ids
    finally:
        engine.load_weights(model.named_parameters(), version=0)
        engine.close()
    assert engine.dialect.calls == {"generate": 2, "pause": 1, "resume": 1, "abort": 1, "load_from_disk": 2,
                                    "weight_version": 1}


def test_two_servers_sticky_per_trajectory(engines):
    ctl = RolloutController(engines)

    async def go():
        return await asyncio.gather(*(ctl.generate([5, 6, i], greedy(3), rid=f"traj-{i % 4}") for i in range(16)))

    outs = asyncio.run(go())
    by_rid: dict[str, set[str]] = {}
    for i, o in enumerate(outs):
        by_rid.setdefault(f"traj-{i % 4}", set()).add(o.meta["address"])
    assert all(len(a) == 1 for a in by_rid.values())  # each trajectory stays on one server
    assert len(set().union(*by_rid.values())) == 2  # and both servers are used


def test_weight_sync_from_disk_changes_outputs(engines, tiny_path, tmp_path):
    model = load_model(tiny_path, dtype="float32")
    ctl = RolloutController(engines)
    before = [asyncio.run(e.agenerate([5, 6, 7], greedy(8))) for e in engines]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    try:
        ctl.load_weights(Weights(model.named_parameters, 1))
        after = [asyncio.run(e.agenerate([5, 6, 7], greedy(8))) for e in engines]
        assert ctl.version == 1 and all(o.versions == [1] * 8 for o in after)
        assert after[0].output_ids != before[0].output_ids and after[0].output_ids == after[1].output_ids
        local = LocalEngine(model, eos_token_ids=[])
        ref = local.generate([[5, 6, 7]], greedy(8))[0]
        local.close()
        assert after[0].output_ids == ref.output_ids  # the servers now run exactly the trainer's weights
        ctl.load_weights(Weights(model.named_parameters, 2))
        ctl.load_weights(Weights(model.named_parameters, 3))
        kept = sorted(p.name for p in (tmp_path / "weights").iterdir())
        assert kept == ["v2", "v3"]  # older versions are deleted, no temp folders are left
    finally:
        zero = load_model(tiny_path, dtype="float32")  # the servers are shared by the module: restore them
        ctl.load_weights(Weights(zero.named_parameters, 0))


def test_bf16_servers_are_sent_stochastically_rounded_bf16(servers, tiny_path, tmp_path):
    """send_bf16 (a bf16 server beside an fp32 trainer): the folder the server loads holds bf16 tensors, each
    element one of the two bf16 neighbours of the trainer's value, and updates below half a bf16 step move
    about their share of the weights (rounded to nearest by the server, none would move)."""
    model = load_model(tiny_path, dtype="float32")  # the tiny model's weights are not on the bf16 grid
    start = {n: p.detach().to(torch.bfloat16).float() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n] + 0.25 * torch.where(start[n] == 0, 0.0, 2.0 ** (torch.frexp(start[n]).exponent - 8)))
    engine = RemoteEngine(servers[0].url, weights_dir=str(tmp_path / "weights"), retries=1, send_bf16=True)
    try:
        engine.load_weights(model.named_parameters(), version=1)
        out = asyncio.run(engine.agenerate([5, 6, 7], greedy(4)))
        assert out.versions == [1] * 4  # the server loaded them
        sent = load_file(str(tmp_path / "weights" / "v1" / "model.safetensors"))
        moved = total = 0
        for n, p in model.named_parameters():
            assert sent[n].dtype == torch.bfloat16, n
            d = sent[n].float() - start[n]
            assert ((d == 0) | (d.abs() <= (p.detach() - start[n]).abs() * 4 + 1e-30)).all(), n
            moved, total = moved + int((d != 0).sum()), total + d.numel()
        assert 0.2 < moved / total < 0.3
    finally:
        engine.close()
        zero = load_model(tiny_path, dtype="float32")  # the servers are shared by the module: restore them exactly
        with contextlib.closing(RemoteEngine(servers[0].url, weights_dir=str(tmp_path / "restore"))) as plain:
            plain.load_weights(zero.named_parameters(), version=0)


def test_killed_server_mid_rollout_retries_then_names_the_address(tiny_path, tmp_path):
    server = relayrl_server(tiny_path, tmp_path / "doomed.log", dtype="float32").start().wait_ready(120)
    engine = RemoteEngine(server.url, retries=2, backoff=0.2)

    async def go():
        engine.pause()  # the request stays in flight on the server until it dies
        task = asyncio.ensure_future(engine.agenerate([5, 6, 7], greedy(50)))
        while engine.num_running() < 1:
            await asyncio.sleep(0.05)
        server.proc.kill()
        return await task

    t0 = time.monotonic()
    try:
        with pytest.raises(EngineUnavailable, match=server.url.replace(".", r"\.")):
            asyncio.run(go())
    finally:
        engine.close()
        server.stop()
    assert engine.stats["retries"] == 2 and time.monotonic() - t0 < 30  # a few connect attempts, no hang


def test_unreachable_address_fails_fast_with_its_name():
    port = free_port()
    engine = RemoteEngine(f"http://127.0.0.1:{port}", retries=1, backoff=0.05)
    try:
        with pytest.raises(EngineUnavailable, match=f"127.0.0.1:{port}"):
            asyncio.run(engine.agenerate([1, 2], greedy(2)))
        with pytest.raises(EngineUnavailable, match=f"127.0.0.1:{port}.*not healthy"):
            engine.wait_ready(timeout=0.5)
    finally:
        engine.close()


def test_launch_failure_shows_the_server_log(tmp_path):
    bad = relayrl_server(str(tmp_path / "no-such-model"), tmp_path / "bad.log")
    with pytest.raises(RuntimeError, match="exited with code") as info:
        bad.start().wait_ready(60)
    assert "no-such-model" in str(info.value)  # the server's own error, quoted from its log
    hang = ManagedServer([sys.executable, "-c", "import time; time.sleep(600)"], free_port(), tmp_path / "h.log")
    with pytest.raises(TimeoutError, match="not healthy after"):
        hang.start().wait_ready(1.0)
    with pytest.raises(ProcessLookupError):  # the timed-out server was stopped, not orphaned
        os.kill(hang.proc.pid, 0)


def test_remote_config_errors(tiny_path):
    with pytest.raises(ConfigError, match="engine.addresses"):
        load_run_config(None, [f"model.path={tiny_path}", "engine.kind=remote"])
    with pytest.raises(ConfigError, match="engine.addresses.*bad engine address"):
        load_run_config(None, [f"model.path={tiny_path}", "engine.kind=remote", "engine.addresses=[localhost]"])
    cfg = load_run_config(None, [f"model.path={tiny_path}", "engine.kind=remote", "engine.launch=vllm"])
    with pytest.raises(InputError, match="engine.backend: 'sglang' does not speak"):  # checked at start-up
        RemoteEngine.from_config(cfg.engine, ["http://127.0.0.1:1"], "unused")
    with pytest.raises(InputError, match="engine.backend: 'sglang' does not speak"):  # before a server or model starts
        check_user_code(cfg)


def test_train_two_steps_on_launched_servers(tiny_path, tmp_path):
    data = write_sums(tmp_path / "sums.jsonl", 8)
    cfg = load_run_config(None, [
        f"model.path={tiny_path}", f"data.train.source={data}", "data.batch_size=2", "data.group_size=2",
        "sampling.max_new_tokens=8", "run.steps=2", f"run.output_dir={tmp_path}", "run.name=remote",
        "judge.workers=1", "run.print_samples=0", "train.lr=1e-3", "engine.kind=remote", "engine.launch=relayrl",
        "engine.num_engines=2", "engine.dtype=float32"])
    c = build(cfg)
    pids = [s.proc.pid for s in c.servers]
    try:
        train_steps(c)
        assert c.rollout_ctl.version == 2 and all(e.refresh_version() == 2 for e in c.rollout_ctl.engines)
    finally:
        c.close()
    rows = [r for r in read_jsonl(c.run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in rows] == [1, 2]
    for pid in pids:  # the run stopped the servers it launched
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
