"""LoRA with remote engines: a run whose trainer sends only adapters to a launched `relayrl serve`, which merges them
(by path and by broadcast) exactly as a local engine does; the server's checks of adapter updates; the PEFT folder
vLLM loads, and the request sequence RemoteEngine speaks to vLLM's adapter routes (against a small real HTTP server
answering as vLLM does: vLLM itself is not installed in the default suite)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from conftest import tiny_run_args, write_sums
from safetensors.torch import load_file, save_file

from relayrl.config.schema import load_run_config
from relayrl.engine import LocalEngine, RemoteEngine, SamplingParams
from relayrl.models import load_model
from relayrl.run.build import build
from relayrl.run.loop import train_steps
from relayrl.serve.errors import BadRequest
from relayrl.serve.weights_disk import check_tensors, load_checked
from relayrl.serve.weights_dist import parse_update
from relayrl.trainer.lora import is_adapter_name, merged_state_dict, save_peft_version

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13]]


def greedy(n: int = 10) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)


def remote_generate(engine: RemoteEngine) -> list:
    return [asyncio.run(engine.agenerate(p, greedy())) for p in PROMPTS]


def merged_engine(model_path: str, merged: dict[str, torch.Tensor]) -> LocalEngine:
    model = load_model(model_path, dtype="float32")
    model.load_state_dict(merged, strict=False)
    return LocalEngine(model, eos_token_ids=[], max_batch_size=8, seed=1)


def assert_same_outputs(outs: list, local: LocalEngine) -> None:
    ref = local.generate(PROMPTS, greedy())
    for o, r in zip(outs, ref):
        assert o.output_ids == r.output_ids
        assert torch.allclose(torch.tensor(o.logprobs), torch.tensor(r.logprobs), atol=1e-4)


@pytest.fixture(scope="module")
def lora_run(tiny_path, tmp_path_factory):
    """Two LoRA steps on one launched relayrl serve, weights by disk; the run kept open for the tests."""
    tmp = tmp_path_factory.mktemp("lora_remote")
    data = write_sums(tmp / "sums.jsonl", 8)
    cfg = load_run_config(None, tiny_run_args(tiny_path, data, tmp, **{  # the entropy bonus: a gradient at any reward
        "train.lr": 3e-2, "algo.entropy_coef": 0.01, "model.lora_rank": 4, "engine.kind": "remote",
        "engine.launch": "relayrl"}))
    c = build(cfg)
    try:
        train_steps(c)
        yield c
    finally:
        c.close()


def test_launched_server_generates_with_the_merged_adapters(lora_run, tiny_path):
    c = lora_run
    engine = c.rollout_ctl.engines[0]
    assert c.train_ctl.version == 2 and engine.refresh_version() == 2
    sent = load_file(str(c.run_dir / "weights" / "v2" / "model.safetensors"))
    assert sent and all(is_adapter_name(n) for n in sent)  # adapters only travelled
    merged = merged_state_dict(c.train_ctl.engine.model)
    base = dict(load_model(tiny_path).named_parameters())
    assert any(not torch.equal(merged[n], base[n]) for n in base)  # the run did move the policy
    with contextlib.closing(merged_engine(tiny_path, merged)) as local:
        assert_same_outputs(remote_generate(engine), local)


def test_adapters_by_broadcast_replace_the_previous_ones(lora_run, tiny_path):
    """The same server, adapters of another rank over /update_weights_from_distributed: the merge starts from the
    base weights again (not from the disk update's merged ones), so the server equals base + these adapters."""
    c, server = lora_run, lora_run.servers[0]
    trained = c.train_ctl.engine.model
    adapters = [(n, t * 0.5 if n.endswith("lora_B") else t) for n, t in c.train_ctl.engine.named_parameters()]
    engine = RemoteEngine(server.url, weight_sync="distributed", weight_sync_backend="gloo", timeout=60)
    try:
        engine.load_weights(adapters, 7)
        assert engine.refresh_version() == 7
        outs = remote_generate(engine)
    finally:
        engine.close()
    with torch.no_grad():
        for name, p in trained.named_parameters():
            if "lora_B" in name:
                p.mul_(0.5)
    with contextlib.closing(merged_engine(tiny_path, merged_state_dict(trained))) as local:
        assert_same_outputs(outs, local)


# ---- the server's checks of adapter updates -----------------------------------------------------------------
LAYER = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def served(tiny_path) -> dict[str, torch.Tensor]:
    return load_model(tiny_path).state_dict()


def adapter(served, rank=2, layer=LAYER) -> dict[str, torch.Tensor]:
    out, inp = served[f"{layer}.weight"].shape
    return {f"{layer}.lora_A": torch.randn(rank, inp), f"{layer}.lora_B": torch.randn(out, rank),
            f"{layer}.lora_scaling": torch.tensor([2.0])}


@pytest.mark.parametrize("change, message", [
    (lambda a: a.pop(f"{LAYER}.lora_scaling"), "has no lora_scaling"),
    (lambda a: a.update({f"{LAYER}.lora_B": torch.randn(a[f"{LAYER}.lora_B"].shape[0], 3)}),
     r"lora_A has rank \[2\], lora_B \[3\]"),
    (lambda a: a.update({f"{LAYER}.lora_B": torch.randn(5, 2)}), "expected"),
    (lambda a: a.update({f"{LAYER}.lora_A": torch.full_like(a[f"{LAYER}.lora_A"], float("nan"))}), "NaN"),
    (lambda a: a.update({"model.norm.lora_A": torch.ones(1, 1)}), "no linear layer 'model.norm'"),
])
def test_disk_route_refuses_bad_adapters_before_loading(served, tmp_path, change, message):
    tensors = adapter(served)
    change(tensors)
    folder = tmp_path / "v1"
    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(BadRequest, match=message):
        load_checked(served, tmp_path, folder, "v1")


def test_disk_route_accepts_whole_adapters_and_refuses_ranks_beyond_the_layer(served, tmp_path):
    folder = tmp_path / "v1"
    folder.mkdir()
    save_file(adapter(served), str(folder / "model.safetensors"))
    assert set(load_checked(served, tmp_path, folder, "v1")) == set(adapter(served))
    too_high = min(served[f"{LAYER}.weight"].shape) + 1
    with pytest.raises(BadRequest, match="rank .* is outside"):
        check_tensors(adapter(served, rank=too_high).items(), served, "names")


def test_broadcast_route_checks_adapter_specs_before_receiving(served):
    state = types.SimpleNamespace(engine=types.SimpleNamespace(model=types.SimpleNamespace(state_dict=lambda: served)))
    tensors = adapter(served)
    body = {"names": list(tensors), "dtypes": ["float32"] * 3, "shapes": [list(t.shape) for t in tensors.values()]}
    assert [name for name, _, _ in parse_update(body, state)] == list(tensors)
    body["shapes"][1] = [body["shapes"][1][0], 5]  # B of another rank than A
    with pytest.raises(BadRequest, match="names: .*lora_A has rank"):
        parse_update(body, state)


# ---- vLLM: a PEFT folder per version, loaded through its runtime adapter routes ---------------------------------
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")  # peft's, not ours
def test_peft_folder_loads_in_peft_as_the_merged_policy(lora_run, tiny_path, tmp_path):
    from peft import PeftModel

    c = lora_run
    folder = save_peft_version(tmp_path, c.train_ctl.engine.named_parameters(), 3)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == pytest.approx(16.0)  # model.lora_alpha's default
    peft_model = PeftModel.from_pretrained(load_model(tiny_path), str(folder)).eval()
    plain = load_model(tiny_path).eval()
    plain.load_state_dict(merged_state_dict(c.train_ctl.engine.model), strict=False)
    ids = torch.tensor([[5, 6, 7, 8, 9, 20, 21]])
    with torch.no_grad():
        assert torch.allclose(peft_model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5)


class VllmLike(BaseHTTPRequestHandler):
    """vLLM's answers to the routes RemoteEngine uses with adapters (plain-text success, 400 on a name loaded
    twice); every request is recorded as (path, body)."""

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
        self.server.seen.append((self.path, body))
        loaded = self.server.loaded
        if self.path == "/v1/load_lora_adapter" and self.server.lora_routes:
            if body["lora_name"] in loaded:
                return self._send(400, json.dumps({"error": {"message": "already loaded"}}))
            loaded[body["lora_name"]] = body["lora_path"]
            return self._send(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
        if self.path == "/v1/unload_lora_adapter":
            loaded.pop(body["lora_name"])
            return self._send(200, f"Success: LoRA adapter '{body['lora_name']}' removed successfully.")
        if self.path == "/v1/completions":
            n = body["max_tokens"]
            choice = {"token_ids": [1] * n, "logprobs": {"token_logprobs": [-0.5] * n}, "finish_reason": "length"}
            return self._send(200, json.dumps({"choices": [choice]}))
        return self._send(404, json.dumps({"detail": "Not Found"}))

    def _send(self, status: int, text: str) -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def vllm_like(lora_routes: bool = True):
    server = ThreadingHTTPServer(("127.0.0.1", 0), VllmLike)
    server.seen, server.loaded, server.lora_routes = [], {}, lora_routes
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_vllm_gets_one_adapter_per_version_and_requests_name_it(lora_run, tmp_path):
    adapters = list(lora_run.train_ctl.engine.named_parameters())
    with vllm_like() as server:
        engine = RemoteEngine(f"http://127.0.0.1:{server.server_port}", backend="vllm", model="base",
                              weights_dir=str(tmp_path / "w"), retries=0)
        try:
            asyncio.run(engine.agenerate([5, 6], greedy(2)))
            for version in (1, 2, 3):
                engine.load_weights(adapters, version)
                asyncio.run(engine.agenerate([5, 6], greedy(2)))
        finally:
            engine.close()
        calls = [(p, b.get("lora_name", b.get("model"))) for p, b in server.seen]
        assert calls == [("/v1/completions", "base"),
                         ("/v1/load_lora_adapter", "relayrl-v1"), ("/v1/completions", "relayrl-v1"),
                         ("/v1/load_lora_adapter", "relayrl-v2"), ("/v1/completions", "relayrl-v2"),
                         ("/v1/load_lora_adapter", "relayrl-v3"), ("/v1/unload_lora_adapter", "relayrl-v1"),
                         ("/v1/completions", "relayrl-v3")]
        assert set(server.loaded) == {"relayrl-v2", "relayrl-v3"}  # the previous stays for requests still running
    folder = tmp_path / "w" / "v3"
    assert server.loaded["relayrl-v3"] == str(folder)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in folder.iterdir()}
    assert not (tmp_path / "w" / "v1").exists()


def test_vllm_without_runtime_lora_says_how_to_start_it(lora_run, tmp_path):
    with vllm_like(lora_routes=False) as server:
        engine = RemoteEngine(f"http://127.0.0.1:{server.server_port}", backend="vllm", model="base",
                              weights_dir=str(tmp_path / "w"), retries=0)
        try:
            with pytest.raises(Exception, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=1"):
                engine.load_weights(lora_run.train_ctl.engine.named_parameters(), 1)
        finally:
            engine.close()
