"""`bench/engine.py weight_sync`: what one weight sync to a `relayrl serve` costs, LoRA adapters against full weights.

The trainer side is this process: the policy's full weights (a full-parameter run's sync) and a peft-wrapped copy's
adapters at each `--ranks` (a LoRA run's sync: relayrl.trainer.lora's wire format, B set non-zero so the server's
merge does real work). One `relayrl serve` (fp32, its own process) receives each through RemoteEngine, by disk
(safetensors folder written by the trainer, then /update_weights_from_disk) and by broadcast (gloo process group,
/update_weights_from_distributed). Timed: `RemoteEngine.load_weights`, from its call until the server answered that
the new weights are in place (for disk: the write, the server's read, checks and load or merge). Reported per
payload and way: the bytes sent, the median and min seconds over `--repeats` syncs (each a new version), and the
adapter sync's speed-up over the full one. After the last adapter sync, the server's greedy tokens are checked
against a local engine holding the merged weights, so a fast but wrong sync is not reported as a result.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import _common
import torch


def _timed_syncs(engine, named: list, first_version: int, repeats: int) -> list[float]:
    times = []
    for i in range(repeats):
        t0 = time.perf_counter()
        engine.load_weights(iter(named), first_version + i)
        times.append(time.perf_counter() - t0)
    return times


def _adapters(model_path: str, rank: int) -> list[tuple[str, torch.Tensor]]:
    from relayrl.config.schema import ModelConfig
    from relayrl.trainer.engine import TrainEngine

    engine = TrainEngine.from_pretrained(model_path, lora=ModelConfig(path=model_path, lora_rank=rank))
    with torch.no_grad():
        for i, (name, p) in enumerate(engine.model.named_parameters()):
            if "lora_B" in name:
                p.normal_(0, 1e-3, generator=torch.Generator().manual_seed(i))
    return [(n, t.clone()) for n, t in engine.named_parameters()]


def _check_merged(server_url: str, model_path: str, adapters: list) -> bool:
    """The server's greedy tokens equal a local engine's holding base + these adapters merged."""
    from relayrl.engine import LocalEngine, RemoteEngine, SamplingParams
    from relayrl.models import load_model
    from relayrl.trainer.lora import merge_into

    model = load_model(model_path, dtype="float32")
    merge_into(model.state_dict(keep_vars=True), dict(adapters), {})
    params = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    local, remote = LocalEngine(model, eos_token_ids=[], max_batch_size=4, seed=0), RemoteEngine(server_url)
    try:
        ours = local.generate([[1, 2, 3, 4, 5]], params)[0].output_ids
        theirs = asyncio.run(remote.agenerate([1, 2, 3, 4, 5], params)).output_ids
    finally:
        local.close()
        remote.close()
    return ours == theirs


def weight_sync(argv: list[str]) -> None:
    """One weight sync to a relayrl serve: LoRA adapters (by rank) against the full weights, by disk and broadcast.

    Bytes and seconds per sync (module docstring of bench/_weight_sync.py)."""
    p = _common.parser("weight_sync", weight_sync.__doc__)
    p.add_argument("--model", default="smollm2", help="alias, folder or hub id")
    p.add_argument("--ranks", default="8,64", help="LoRA ranks, comma-separated")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--ways", default="disk,distributed")
    p.add_argument("--out", default="bench/results/lora_weight_sync.json")
    a = p.parse_args(argv)
    from relayrl.engine import RemoteEngine
    from relayrl.models import load_model, resolve_model_path
    from relayrl.run.launcher import relayrl_server

    path = str(resolve_model_path(a.model))
    payloads = {"full": [(n, t.detach().clone()) for n, t in load_model(path).named_parameters()]}
    for r in (int(x) for x in a.ranks.split(",")):
        payloads[f"lora_r{r}"] = _adapters(path, r)
    result = {**_common.result_header("lora_weight_sync"), "model": path, "repeats": a.repeats, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        server = relayrl_server(path, Path(tmp) / "serve.log", dtype="float32", max_batch_size=4,
                                weights_root=Path(tmp)).start()
        try:
            server.wait_ready(300)
            version = 1
            for way in a.ways.split(","):
                engine = RemoteEngine(server.url, weights_dir=str(Path(tmp) / way), weight_sync=way,
                                      weight_sync_backend="gloo", timeout=600)
                try:
                    for name, named in payloads.items():
                        times = _timed_syncs(engine, named, version, a.repeats)
                        version += a.repeats
                        result["runs"][f"{way}/{name}"] = {
                            "tensors": len(named), "bytes": sum(t.numel() * t.element_size() for _, t in named),
                            "median_s": round(statistics.median(times), 4), "min_s": round(min(times), 4)}
                        print(f"{way}/{name}: {result['runs'][f'{way}/{name}']}", flush=True)
                finally:
                    engine.close()
            last = list(payloads)[-1]
            result["server_equals_merged"] = _check_merged(server.url, path, payloads[last]) if last != "full" else None
        finally:
            server.stop()
    runs = result["runs"]
    result["speedup_vs_full"] = {k: round(runs[k.split("/")[0] + "/full"]["median_s"] / v["median_s"], 1)
                                 for k, v in runs.items() if not k.endswith("/full")}
    result["bytes_fraction_of_full"] = {k: round(v["bytes"] / runs[k.split("/")[0] + "/full"]["bytes"], 5)
                                        for k, v in runs.items() if not k.endswith("/full")}
    _common.write_json(a.out, result)
    print(f"speed-up: {result['speedup_vs_full']}; server equals merged: {result['server_equals_merged']}")
    print(f"wrote {a.out}")
