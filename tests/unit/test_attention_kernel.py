"""The C decode-attention kernel (relayrl/engine/kernels/decode_attention.c): exact against a hand-written
softmax attention, used by LocalEngine by default, and replaced by SDPA when it cannot be built."""

import logging
import shutil

import pytest
import torch

from relayrl.engine import attention
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")


def reference(query, key, value, k_cache, v_cache, positions, scale):
    """fp32 attention of each row over its slot's positions 0..p after writing the new key/value there."""
    k_cache, v_cache = k_cache.float().clone(), v_cache.float().clone()
    n, heads, _, dim = query.shape
    kvh = key.shape[1]
    out = torch.empty(n, 1, heads, dim)
    for i, p in enumerate(positions.tolist()):
        k_cache[i, :, p], v_cache[i, :, p] = key[i, :, 0].float(), value[i, :, 0].float()
        for h in range(heads):
            kv = h // (heads // kvh)  # grouped-query attention: query head h reads KV head h // G
            w = torch.softmax(query[i, h, 0].float() @ k_cache[i, kv, : p + 1].T * scale, dim=-1)
            out[i, 0, h] = w @ v_cache[i, kv, : p + 1]
    return out


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# the vector paths: 4 keys x up to 3 heads per pass, 3 heads x 32 dims per tile (G=7: 3+3+1 heads, D=40: 32+8);
# D=12 is not a multiple of 8: the scalar path
@pytest.mark.parametrize("heads,kv_heads,dim",
                         [(4, 2, 16), (9, 3, 64), (4, 4, 32), (7, 1, 40), (6, 2, 12), (8, 2, 128)])
def test_kernel_matches_softmax_attention_and_writes_the_new_key_value(dtype, heads, kv_heads, dim):
    lib = attention.load_kernel()
    assert lib is not None, "a C compiler is present, so the kernel must build"
    g = torch.Generator().manual_seed(heads * dim)
    n, slots, length = 5, 7, 80  # positions past one 32-key block, and a 0 (attend to the new token only)
    k_cache = torch.randn(slots, kv_heads, length, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots, kv_heads, length, dim, generator=g).to(dtype)
    # HF hands over transposed views: [n, 1, heads, dim] memory seen as [n, heads, 1, dim]
    query = torch.randn(n, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)
    key = torch.randn(n, 1, kv_heads, dim, generator=g).to(dtype).transpose(1, 2)
    value = torch.randn(n, kv_heads, 1, dim, generator=g).to(dtype)
    positions = torch.tensor([0, 31, 32, 79, 45])
    before_k, before_v = k_cache.clone(), v_cache.clone()
    want = reference(query, key, value, k_cache, v_cache, positions, dim ** -0.5)
    got = attention.decode_attention(lib, query, key, value, k_cache, v_cache, positions, dim ** -0.5)
    assert got.shape == (n, 1, heads, dim) and got.dtype == dtype
    # fp32: softmax-weighted sums over <= 80 keys of unit-variance values, reordered by vector width (~sqrt(80) u
    # = 5e-7 typical, 80 u = 5e-6 worst) and exp within 1 ulp of PyTorch's: 1e-5 on every target. bf16: the
    # output's own rounding (2^-8 = 4e-3) dominates
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
    rows = torch.arange(n)
    assert torch.equal(k_cache[rows, :, positions], key[:, :, 0]) and torch.equal(v_cache[rows, :, positions],
                                                                                   value[:, :, 0])
    written = torch.zeros_like(k_cache, dtype=torch.bool)
    written[rows, :, positions] = True
    assert torch.equal(k_cache[~written], before_k[~written]) and torch.equal(v_cache[~written], before_v[~written])


@needs_cc
def test_engine_decodes_through_the_kernel_and_matches_sdpa_token_for_token(tiny_path):
    prompts = [[5, 6, 7, 8, 9], [20, 21], [30] * 17, [40, 41, 42], [7]]
    results = {}
    for mode in ("auto", "sdpa"):  # auto: the kernel, since a compiler is present
        eng = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], max_batch_size=3, seed=5,
                          attention=mode)
        assert eng.attention == ("kernel" if mode == "auto" else "sdpa")
        greedy = eng.generate(prompts, SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True))
        sampled = eng.generate(prompts, SamplingParams(max_new_tokens=40, seed=11, ignore_eos=True))
        results[mode] = greedy + sampled
        eng.close()
    for a, b in zip(results["auto"], results["sdpa"]):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


def test_without_the_kernel_the_engine_uses_sdpa_and_kernel_mode_says_why(tiny_path, monkeypatch):
    monkeypatch.setattr(attention, "load_kernel", lambda: None)
    eng = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[])
    assert eng.attention == "sdpa"
    out = eng.generate([[5, 6, 7]], SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].output_ids) == 4
    eng.close()
    with pytest.raises(RuntimeError, match="engine.attention=kernel: the kernel did not build"):
        LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], attention="kernel")
    fp16 = LocalEngine(load_model(tiny_path, dtype="float16"), eos_token_ids=[])
    assert fp16.attention == "sdpa"  # no fp16 kernel: auto falls back
    fp16.close()


@needs_cc
def test_a_model_whose_layers_bypass_the_kernel_is_caught_at_construction(tiny_path, monkeypatch):
    """If the model's attention never reaches relayrl's attention entry point (here: it stays plain SDPA), a fused
    step would attend over the new token alone; the construction-time decode fails (here SDPA's mask no longer
    fits; else the count of kernel layers) and the engine falls back instead of failing."""
    monkeypatch.setattr(attention, "install", lambda model: True)  # claims success, routes nothing
    eng = LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[])
    assert eng.attention == "sdpa"
    eng.close()
    with pytest.raises(RuntimeError, match="engine.attention=kernel: "):
        LocalEngine(load_model(tiny_path, dtype="float32"), eos_token_ids=[], attention="kernel")


def test_a_compiler_failure_is_a_warning_not_an_error(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.WARNING, logger="relayrl.common.cbuild"):
        assert attention.load_kernel.__wrapped__() is None
    assert "false failed on decode_attention.c" in caplog.text
    assert not list((tmp_path / "kernels").iterdir())  # no half-written library left behind
    monkeypatch.setenv("RELAYRL_KERNELS", "0")
    assert attention.load_kernel.__wrapped__() is None


RELEASE_SCRIPT = r"""
import os, threading, time
import torch
from relayrl.common.threads import release_openmp_threads

def threads():
    return len(os.listdir("/proc/self/task"))

torch.set_num_threads(3)
base = threads()
torch.randn(1_000_000).mul_(2)  # a parallel op: this thread's OpenMP team starts 2 workers
with_team = threads()
release_openmp_threads()
deadline = time.time() + 5
while threads() > base and time.time() < deadline:
    time.sleep(0.01)
print(base, with_team, threads())
"""


def test_a_waiting_thread_gives_its_openmp_workers_back():
    """Two threads each owning an OpenMP team on few cores make libgomp stop spinning (7-8x slower small
    ops in the engine's decode step); release_openmp_threads ends the caller's team."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", RELEASE_SCRIPT], capture_output=True, text=True, timeout=120,
                         check=True).stdout.split()
    base, with_team, after = map(int, out)
    assert with_team == base + 2 and after == base
