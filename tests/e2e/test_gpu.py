"""`pytest -m gpu`: the engine and the trainer on CUDA, on the tiny random model (scripts/gpu_check.sh runs these
and the GPU benches). The checks are tests/device_checks.py's, which tests/unit/test_device.py also runs on the CPU.
Without CUDA every test here is skipped, with the reason shown (`pytest -rs`)."""

import pytest
import torch
from device_checks import (
    PROMPTS,
    check_chunked_logprobs,
    check_colocated_run,
    check_engine_logprob_parity,
    check_staged_update,
    check_static_decode,
    check_train_step,
    check_weight_sync,
    engine_on,
)

from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.engine.rollout import RolloutController
from relayrl.weights.snapshot import Weights

GREEDY_SHORT = SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason=f"CUDA is not available: torch {torch.__version__} (CUDA build: {torch.version.cuda}) "
                              "sees no GPU; run scripts/gpu_check.sh on a machine with one"),
]


def test_engine_logprobs_equal_a_full_forward_on_cuda(tiny_path):
    check_engine_logprob_parity(tiny_path, "cuda")


def test_seeded_request_samples_the_same_tokens_on_cpu_and_cuda(tiny_path):
    """Uniforms come from CPU generators on every device (relayrl.engine.sampling), so a seeded request draws the
    same numbers on both; with logits equal up to float noise, it picks the same tokens."""
    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    outs = {}
    for device in ("cpu", "cuda"):
        eng = engine_on(tiny_path, device, max_batch_size=4)
        outs[device] = [o.output_ids for o in eng.generate(PROMPTS[:5], params)]
        eng.close()
    assert outs["cpu"] == outs["cuda"]


def test_one_train_step_on_cuda(tiny_path):
    check_train_step(tiny_path, "cuda")


def test_chunked_logprobs_equal_the_plain_log_softmax_on_cuda(tiny_path):
    check_chunked_logprobs(tiny_path, "cuda")


def test_weight_sync_to_the_engine_on_cuda(tiny_path, tmp_path):
    check_weight_sync(tiny_path, "cuda", tmp_path)


def test_a_busy_bf16_cuda_engine_stages_host_weights_on_the_gpu_before_pausing(tiny_path):
    check_staged_update(tiny_path, "cuda")


def test_staging_a_gpu_update_waits_for_the_kernels_that_write_it(tiny_path):
    """A colocated trainer's fp32 weights on the GPU, still being written by kernels queued on the caller's stream
    (behind a 50 ms GPU sleep here), are staged on a side stream: it must wait for them, or it rounds the old
    values. The staged engine ends bit for bit where an unstaged one ends."""
    from relayrl.models import load_model

    engines = [LocalEngine(load_model(tiny_path, dtype="bfloat16", device="cuda"), eos_token_ids=[],
                           max_batch_size=2, stage_weights=stage) for stage in (True, False)]
    target = {n: p.detach().float() + 1e-2 for n, p in engines[0].model.named_parameters()}
    try:
        engines[0].pause()
        fut = engines[0].submit(PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
        src = {n: torch.zeros_like(t) for n, t in target.items()}
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the caller's stream is busy ~50 ms before the writes below run
        for n, t in src.items():
            t.copy_(target[n])
        staged = engines[0].stage_weights(src.items(), 1)
        assert all(t.dtype == torch.bfloat16 for _, t in staged)
        RolloutController([engines[0]]).load_weights(Weights(lambda: staged, 1))
        RolloutController([engines[1]]).load_weights(Weights(lambda: target.items(), 1))
        for (name, a), (_, b) in zip(engines[0].model.named_parameters(), engines[1].model.named_parameters()):
            assert torch.equal(a, b), name
        assert fut.result(timeout=60).versions[-1] == 1
    finally:
        for e in engines:
            e.close()


def test_staging_is_skipped_on_a_gpu_without_the_memory_for_it(tiny_path):
    """A second copy of the weights must fit beside the KV cache: with under 256 MiB of the GPU free the update is
    passed on as host tensors (moved and rounded with the engine paused, as without staging), and still lands."""
    from relayrl.models import load_model

    eng = LocalEngine(load_model(tiny_path, dtype="bfloat16", device="cuda"), eos_token_ids=[], max_batch_size=2)
    host = {n: p.detach().float().cpu() for n, p in eng.model.named_parameters()}
    hog = None
    try:
        eng.pause()
        fut = eng.submit(PROMPTS[0], SamplingParams(max_new_tokens=4, ignore_eos=True))
        torch.cuda.empty_cache()
        free = torch.cuda.mem_get_info()[0]
        hog = torch.empty(free - (128 << 20), dtype=torch.uint8, device="cuda")
        assert all(t is host[n] for n, t in eng.stage_weights(host.items(), 1))
        del hog
        hog = None
        torch.cuda.empty_cache()
        assert all(t.is_cuda for _, t in eng.stage_weights(host.items(), 1))
        RolloutController([eng]).load_weights(Weights(lambda: host.items(), 1))
        assert fut.result(timeout=60).versions[-1] == 1
    finally:
        del hog
        eng.close()


def test_decode_steps_record_as_graphs_while_another_thread_copies_to_the_gpu(tiny_path):
    """A producer stages weight updates (host -> GPU copies on its own stream) while its engine records decode steps
    as CUDA graphs: both must go on. Recorded in torch's default capture mode, the copies failed with "operation
    not permitted when stream is capturing" (the first GPU run of staged updates)."""
    import threading

    errors, stop = [], threading.Event()

    def copy_loop() -> None:
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            while not stop.is_set():
                try:
                    torch.ones(1 << 16).to("cuda").sum().item()
                except Exception as e:  # noqa: BLE001 - what the test reports
                    errors.append(e)
                    return

    eng = engine_on(tiny_path, "cuda", max_batch_size=8)
    copier = threading.Thread(target=copy_loop)
    copier.start()
    try:
        for rows in (1, 2, 3, 5, 8):  # a new batch bucket each: several recordings
            eng.generate(PROMPTS[:rows] + PROMPTS[:max(0, rows - len(PROMPTS))], GREEDY_SHORT)
        assert eng._static.recorded >= 3 and eng._static.failed is None
    finally:
        stop.set()
        copier.join()
        eng.close()
    assert not errors, errors[0]


def test_colocated_run_on_cuda(tiny_path, tmp_path):
    check_colocated_run(tiny_path, "cuda", tmp_path)


def test_cuda_engine_and_trainer_turn_cudnn_attention_off(tiny_path):
    """cuDNN SDPA re-plans per shape (2 ms of host time per call on an H200; relayrl.common.device)."""
    from relayrl.trainer.engine import TrainEngine

    for make in (lambda: engine_on(tiny_path, "cuda", max_batch_size=2),
                 lambda: TrainEngine.from_pretrained(tiny_path, device="cuda")):
        torch.backends.cuda.enable_cudnn_sdp(True)
        obj = make()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        if hasattr(obj, "close"):
            obj.close()


def test_decode_steps_replayed_as_cuda_graphs_equal_the_engines_own(tiny_path):
    check_static_decode(tiny_path, "cuda")


def test_a_cuda_trainer_sends_shared_prompt_rows_through_sdpa(tiny_path):
    """On a GPU the dense mask through SDPA's fused kernels is faster than relayrl.models.segments (H100: 0.59 vs
    1.46 s per 8 x 8 step)."""
    from relayrl.trainer.engine import TrainEngine

    assert not TrainEngine.from_pretrained(tiny_path, device="cuda").segments


def _receive_two_versions(address, out):
    from relayrl.weights.transport import DistReceiver

    got = []
    r = DistReceiver(address, [("w", torch.zeros(1024, 1024))],
                     lambda ts, v: got.append((v, [float(t.sum()) for _, t in ts])))
    r.close(timeout=60)
    out.put(got)


def test_dist_transport_sends_cuda_weights_from_a_snapshot_taken_in_stream_order():
    """The trainer's tensors live on the GPU: send() copies them to pinned buffers on the current stream and
    returns; the next step's in-place update, queued after, must not reach the receiver."""
    from transport_for_tests import run_dist_pair

    def send(sender):
        w = torch.ones(1024, 1024, device="cuda")
        for v in (1, 2):
            sender.send([("w", w)], v)
            w.mul_(3.0)  # the next optimizer step, on the same stream

    assert run_dist_pair(_receive_two_versions, send) == [(1, [1024.0 * 1024]), (2, [3.0 * 1024 * 1024])]


def test_a_bf16_kv_cache_on_cuda_replays_as_graphs_and_stays_near_a_full_forward(tiny_path):
    """engine.kv_dtype=bfloat16 under an fp32 CUDA engine: the SDPA path stores rounded and reads widened copies,
    inside CUDA graphs too; graphs and eager steps give the same tokens, and logprobs stay near fp32."""
    from device_checks import full_forward_logprobs

    from relayrl.models import load_model

    params = SamplingParams(max_new_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    outs = {}
    for graphs in (True, False):
        eng = engine_on(tiny_path, "cuda", max_batch_size=4, kv_dtype="bfloat16", cuda_graphs=graphs)
        try:
            assert eng.cache.dtype == torch.bfloat16 and eng.cuda_graphs == graphs
            outs[graphs] = eng.generate(PROMPTS[:5], params)
        finally:
            eng.close()
    model = load_model(tiny_path, dtype="float32", device="cuda")
    for prompt, a, b in zip(PROMPTS[:5], outs[True], outs[False]):
        assert a.output_ids == b.output_ids
        ref = full_forward_logprobs(model, prompt, a.output_ids, 1.0)
        assert (torch.tensor(a.logprobs) - ref).abs().max().item() < 0.05


def test_host_weights_for_a_bf16_cuda_engine_are_rounded_on_the_gpu(tiny_path, monkeypatch):
    """The dist and disk transports hand a GPU engine fp32 host tensors. They must be rounded where the weights
    live: rounded on the producer's one host thread they kept SmolLM2's engine paused 1.4-3.1 s per update on an
    H200 machine (docs/benchmarks.md, "Sixth run"). Each weight lands on one of src's two bf16 neighbours."""
    import relayrl.trainer.optim as optim
    from relayrl.models import load_model

    devices = []
    plain = optim.stochastic_round_
    monkeypatch.setattr(optim, "stochastic_round_", lambda dst, src, g=None: (devices.append(src.device.type),
                                                                               plain(dst, src, g)))
    eng = LocalEngine(load_model(tiny_path, dtype="bfloat16", device="cuda"), eos_token_ids=[], max_batch_size=2)
    try:
        host = {n: p.detach().float().cpu() + 1e-3 * torch.randn(p.shape) for n, p in eng.model.named_parameters()}
        RolloutController([eng]).load_weights(Weights(lambda: host.items(), 1))
        assert devices and set(devices) == {"cuda"}
        for name, p in eng.model.named_parameters():
            src = host[name]
            bits = src.view(torch.int32).bitwise_and(-65536)  # bf16 is fp32's upper half: these two bracket src
            down, up = bits.view(torch.float32), (bits + 65536).view(torch.float32)
            got = p.detach().float().cpu()
            assert p.device.type == "cuda" and p.dtype == torch.bfloat16
            assert ((got == down) | (got == up)).all(), name
        assert eng.version == 1 and eng.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4))[0].output_ids
    finally:
        eng.close()


def test_a_run_on_a_launched_relayrl_serve_on_cuda(tiny_path, tmp_path):
    """engine.launch=relayrl with engine.server_args=[--device, cuda]: the run starts its own `relayrl serve` on the
    GPU (`--device`), trains two steps on the GPU beside it and sends it the new weights from disk."""
    from conftest import tiny_run_args, write_sums

    from relayrl.config.schema import load_run_config
    from relayrl.run.build import build
    from relayrl.run.loop import train_steps

    over = {"run.device": "cuda", "run.steps": 2, "sampling.max_new_tokens": 6, "engine.kind": "remote",
            "engine.launch": "relayrl", "engine.server_args": "[--device, cuda]"}
    data = write_sums(tmp_path / "d.jsonl", 8)
    c = build(load_run_config(None, tiny_run_args(tiny_path, data, tmp_path, **over)))
    try:
        assert "--device" in c.servers[0].cmd and " on cuda (" in c.servers[0].log_tail()  # its start line
        train_steps(c)
        assert c.train_ctl.version == 2 and c.rollout_ctl.engines[0].refresh_version() == 2
    finally:
        c.close()
