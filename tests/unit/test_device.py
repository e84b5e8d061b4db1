"""The device notion on the CPU: run.device, relayrl.common.device and the engine and trainer checks of
tests/device_checks.py (the ones tests/e2e/test_gpu.py runs on CUDA) with every device-aware path pointed at the CPU."""

import logging

import pytest
import torch
from device_checks import (
    check_chunked_logprobs,
    check_colocated_run,
    check_engine_logprob_parity,
    check_staged_update,
    check_static_decode,
    check_train_step,
    check_weight_sync,
)

from relayrl.common.device import resolve_device
from relayrl.config.loader import ConfigError
from relayrl.config.schema import load_run_config
from relayrl.engine import attention
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")


def test_run_device_setting_is_checked_when_the_config_loads():
    assert load_run_config(None, []).run.device == "auto"
    for ok in ("cpu", "cuda", "cuda:1", "auto"):
        assert load_run_config(None, [f"run.device={ok}"]).run.device == ok
    with pytest.raises(ConfigError, match="run.device"):
        load_run_config(None, ["run.device=gpu"])


def test_auto_is_cuda_only_where_cuda_is_available():
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == resolve_device(torch.device("cpu")) == torch.device("cpu")


@no_cuda
def test_asking_for_cuda_without_it_fails_before_any_model_loads():
    with pytest.raises(RuntimeError, match="CUDA is not available on this machine"):
        resolve_device("cuda:0")
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        load_model("/nonexistent-is-never-read", device="cuda")  # the path fails later than the device


def test_engine_logprobs_equal_a_full_forward_on_cpu(tiny_path):
    check_engine_logprob_parity(tiny_path, "cpu")


def test_one_train_step_on_cpu(tiny_path):
    check_train_step(tiny_path, "cpu")


def test_chunked_logprobs_equal_the_plain_log_softmax_on_cpu(tiny_path):
    check_chunked_logprobs(tiny_path, "cpu")


def test_weight_sync_to_the_engine_on_cpu(tiny_path, tmp_path):
    check_weight_sync(tiny_path, "cpu", tmp_path)


def test_a_busy_bf16_engine_stages_an_update_before_pausing_on_cpu(tiny_path):
    check_staged_update(tiny_path, "cpu")


def test_colocated_run_with_run_device_cpu(tiny_path, tmp_path):
    check_colocated_run(tiny_path, "cpu", tmp_path)


def test_the_c_kernel_is_never_given_tensors_off_the_cpu(tiny_path, caplog):
    """The kernel takes raw pointers: a GPU tensor would crash the process, so it is refused. No GPU here, so
    the meta device stands in for "not the CPU": the engine decides at construction, before any forward."""
    q = torch.empty(2, 4, 1, 16, device="meta")
    cache = torch.empty(2, 2, 8, 16, device="meta")
    with pytest.raises(RuntimeError, match="CPU tensors only"):
        attention.decode_attention(None, q, q[:, :2], q[:, :2], cache, cache, torch.zeros(2, dtype=torch.long), 1.0)
    off_cpu = load_model(tiny_path, dtype="float32").to("meta")
    with pytest.raises(RuntimeError, match="engine.attention=kernel: the C kernel reads CPU memory"):
        LocalEngine(off_cpu, eos_token_ids=[], attention="kernel")
    with caplog.at_level(logging.INFO, logger="relayrl.engine.local"):
        eng = LocalEngine(off_cpu, eos_token_ids=[])
    assert eng.attention == "sdpa" and eng.cache.k[0].device.type == "meta"
    assert "SDPA (the C kernel reads CPU memory and the model is on meta)" in caplog.text
    eng.close()


def test_a_micro_batch_moves_every_tensor_and_stays_itself_on_the_cpu():
    """TrainEngine and the critic call MicroBatch.to(their device) before each forward (meta stands in for a GPU)."""
    from relayrl.sample import Sample
    from relayrl.trainer.packer import Packer

    samples = []
    for i in range(3):
        s = Sample(prompt_ids=[5, 6, 7], group_id="g", index=i)
        s.append_generated([8 + i, 9], [-1.0, -1.0], [0, 0], "stop")
        samples.append(s)
    mb = Packer(10_000, pad_id=0, share_prompt=True).pack(samples).micro_batches[0]
    assert mb.position_ids is not None and mb.to("cpu") is mb and mb.to(torch.device("cpu")) is mb
    moved = mb.to("meta")
    tensors = ("input_ids", "attention_mask", "rows", "cols", "targets", "position_ids")
    assert all(getattr(moved, name).device.type == "meta" for name in tensors)
    assert all(getattr(mb, name).device.type == "cpu" for name in tensors)  # the packed batch is untouched
    layout = (moved.layout.out_index, *(t for b in moved.layout.buckets for t in (b.q_index, b.kv_index, b.mask)))
    assert all(t.device.type == "meta" for t in layout)  # the shared-prompt attention's indices go along
    assert (moved.sample_idx, moved.real_tokens, moved.num_tokens) == (mb.sample_idx, mb.real_tokens, mb.num_tokens)


def test_cudnn_attention_is_turned_off_for_cuda_models_only():
    """The flag is process-wide and exists in CPU builds too, so the rule is checked here; tests/e2e/test_gpu.py
    checks that a CUDA engine and trainer set it."""
    from relayrl.common.device import avoid_cudnn_attention

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        avoid_cudnn_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        avoid_cudnn_attention(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.mem_efficient_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_static_decode_steps_equal_the_engines_own_on_cpu(tiny_path):
    check_static_decode(tiny_path, "cpu")
