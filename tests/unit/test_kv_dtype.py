"""engine.kv_dtype: an fp32 engine over a bf16 KV cache on a real tiny model. The C kernel reads the narrow cache
exactly as attention over bf16-rounded keys/values would; the kernel and SDPA paths agree token for token; the
cache takes half the bytes, so a byte budget holds twice the sequences; logprobs stay near the fp32 engine's."""

import shutil

import pytest
import torch
from device_checks import PROMPTS, full_forward_logprobs
from test_kv_budget import _watch  # the largest batch and cache seen at each admission and step

from relayrl.config import ConfigError
from relayrl.engine import attention
from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import load_model
from relayrl.run.build import make_engines
from relayrl.run.resolve import resolve

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler on this machine")
SAMPLED = SamplingParams(max_new_tokens=24, temperature=1.0, seed=3, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, dtype="float32")


@needs_cc
def test_the_kernel_attends_over_a_bf16_cache_as_over_rounded_keys_and_values():
    lib = attention.load_kernel()
    g = torch.Generator().manual_seed(7)
    n, heads, kvh, dim, length = 4, 9, 3, 64, 70
    k_cache = torch.randn(n, kvh, length, dim, generator=g).bfloat16()
    v_cache = torch.randn(n, kvh, length, dim, generator=g).bfloat16()
    query = torch.randn(n, 1, heads, dim, generator=g).transpose(1, 2)  # fp32, HF's transposed view
    key = torch.randn(n, kvh, 1, dim, generator=g)
    value = torch.randn(n, kvh, 1, dim, generator=g)
    positions = torch.tensor([0, 31, 32, 69])
    scale = dim ** -0.5
    got = attention.decode_attention(lib, query, key, value, k_cache, v_cache, positions, scale)
    rows = torch.arange(n)
    # the step's key/value were stored rounded to nearest, as torch rounds fp32 -> bf16
    assert torch.equal(k_cache[rows, :, positions], key[:, :, 0].bfloat16())
    assert torch.equal(v_cache[rows, :, positions], value[:, :, 0].bfloat16())
    want = torch.empty(n, 1, heads, dim)
    kf, vf = k_cache.float(), v_cache.float()  # now holding the rounded new rows too
    for i, p in enumerate(positions.tolist()):
        for h in range(heads):
            w = torch.softmax(query[i, h, 0] @ kf[i, h // 3, : p + 1].T * scale, dim=-1)
            want[i, 0, h] = w @ vf[i, h // 3, : p + 1]
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="no decode-attention kernel"):  # a bf16 model over an fp32 cache
        attention.decode_attention(lib, query.bfloat16(), key.bfloat16(), value.bfloat16(), kf, vf, positions, scale)


@needs_cc
def test_kernel_and_sdpa_agree_over_a_bf16_cache_and_stay_near_fp32(model):
    outs = {}
    for mode in ("auto", "sdpa"):
        eng = LocalEngine(model, eos_token_ids=[], max_batch_size=3, seed=5, attention=mode, kv_dtype="bfloat16")
        try:
            assert eng.cache.dtype == torch.bfloat16 and eng.attention == ("kernel" if mode == "auto" else "sdpa")
            outs[mode] = eng.generate(PROMPTS, SAMPLED)
            assert all(t.dtype == torch.bfloat16 for t in eng.cache.k + eng.cache.v)
            # a second turn prefills only its new tokens, attending over the parked (bf16) KV of the first
            first = eng.submit(PROMPTS[0], SAMPLED, rid="t").result()
            turn2 = PROMPTS[0] + first.output_ids + [9, 10, 11]
            outs[mode] += [first, eng.submit(turn2, SAMPLED, rid="t").result()]
            assert eng.stats["reused_tokens"] == len(PROMPTS[0]) + len(first.output_ids) - 1
        finally:
            eng.close()
    for a, b in zip(outs["auto"], outs["sdpa"]):  # both round on store and widen on read
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    worst = 0.0
    for prompt, out in zip(PROMPTS + [PROMPTS[0], turn2], outs["auto"]):
        ref = full_forward_logprobs(model, prompt, out.output_ids, 1.0)  # fp32 keys and values throughout
        worst = max(worst, (torch.tensor(out.logprobs) - ref).abs().max().item())
    assert 0 < worst < 0.05, worst  # rounded, so not exact; a wrong read would be far off


def test_a_bf16_cache_holds_twice_the_sequences_in_the_same_budget(model):
    fp32 = LocalEngine(model, eos_token_ids=[], max_batch_size=8)
    per_token = fp32.cache.bytes_per_token
    fp32.close()
    budget = 2 * 64 * per_token  # two fp32 sequences of one 64-position slot each
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8, kv_cache_bytes=budget, kv_dtype="bfloat16")
    seen = _watch(eng)
    try:
        assert eng.cache.bytes_per_token * 2 == per_token
        out = eng.generate([[5, 6, 7]] * 6, SamplingParams(max_new_tokens=20, temperature=0, ignore_eos=True))
        assert len(out) == 6 and seen["active"] == 4 and 0 < seen["bytes"] <= budget
    finally:
        eng.close()
    with pytest.raises(ValueError, match="kv_dtype"):
        LocalEngine(model, eos_token_ids=[], kv_dtype="int8")


def test_engine_kv_dtype_reaches_the_engine_and_is_checked(tiny_run):
    cfg = tiny_run(**{"engine.kv_dtype": "bfloat16"})
    (eng,) = make_engines(resolve(cfg, quiet=True), cfg.model.path, [], None, [])
    try:
        assert eng.cache.dtype == torch.bfloat16
        assert len(eng.generate([[5, 6, 7]] * 2, SamplingParams(max_new_tokens=4, ignore_eos=True))) == 2
    finally:
        eng.close()
    with pytest.raises(ConfigError, match="kv_dtype"):
        tiny_run(**{"engine.kv_dtype": "int8"})
