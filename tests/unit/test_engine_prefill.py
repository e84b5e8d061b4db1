"""Batched prefill (relayrl.engine.prefill) on a real tiny model: the same KV and logits as one prompt at a time."""

import pytest
import torch

from relayrl.engine.base import SamplingParams
from relayrl.engine.kv_cache import SlotKVCache
from relayrl.engine.local import LocalEngine
from relayrl.engine.prefill import MIN_SHARED, SharedStart, common_prefix, prefill
from relayrl.models import load_model

SYSTEM = list(range(100, 112))  # a 12-token start shared by every prompt (a system prompt)
PROMPTS = [SYSTEM + [5, 6, 7], SYSTEM + [20], SYSTEM + [30] * 9, SYSTEM + [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def model(tiny_path):
    return load_model(tiny_path, dtype="float32")


def new_cache(model, slots=8, length=64):
    cfg = model.config
    return SlotKVCache(cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads,
                       torch.float32, slots=slots, length=length)


def one_by_one(model, rows, slots):
    cache, logits = new_cache(model), []
    with torch.inference_mode():
        for row, slot in zip(rows, slots):
            logits.append(prefill(model, cache, [row], [slot])[0][0])
    return cache, torch.stack(logits)


def hf_last_logits(model, row):
    with torch.no_grad():
        return model(torch.tensor([row])).logits[0, -1].float()


def test_common_prefix():
    assert common_prefix([[1, 2, 3], [1, 2, 4], [1, 2]]) == 2
    assert common_prefix([[1, 2, 3]]) == 3
    assert common_prefix([[1], [2]]) == 0


@pytest.mark.parametrize("budget", [2048, 8])  # 8: every row in its own forward
def test_batched_prefill_equals_one_prompt_at_a_time(model, budget):
    slots = [5, 0, 3, 1]  # not in order: rows land in the slots they are given
    ref_cache, ref_logits = one_by_one(model, PROMPTS, slots)
    cache = new_cache(model)
    with torch.inference_mode():
        logits, computed = prefill(model, cache, PROMPTS, slots, token_budget=budget)
    assert torch.allclose(logits, ref_logits, atol=1e-5)
    for row, got in zip(PROMPTS, logits):
        assert torch.allclose(got, hf_last_logits(model, row), atol=1e-4)
    for layer in range(len(cache.k)):
        for row, slot in zip(PROMPTS, slots):
            n = len(row)
            assert torch.allclose(cache.k[layer][slot, :, :n], ref_cache.k[layer][slot, :, :n], atol=1e-5)
            assert torch.allclose(cache.v[layer][slot, :, :n], ref_cache.v[layer][slot, :, :n], atol=1e-5)
    # the shared system prompt was computed once, every prompt's own tokens once
    assert computed == len(SYSTEM) + sum(len(p) - len(SYSTEM) for p in PROMPTS)


def test_short_shared_start_is_not_split_off(model):
    rows = [[1, 2, 3, 9], [1, 2, 3, 8, 8]]
    assert common_prefix(rows) < MIN_SHARED
    with torch.inference_mode():
        _, computed = prefill(model, new_cache(model), rows, [0, 1])
    assert computed == 9


def test_a_row_that_is_all_shared_start_keeps_its_last_token(model):
    rows = [SYSTEM, SYSTEM + [7, 7]]  # the first row is the other's start: its last position is still computed
    _, ref = one_by_one(model, rows, [0, 1])
    with torch.inference_mode():
        logits, computed = prefill(model, new_cache(model), rows, [0, 1])
    assert torch.allclose(logits, ref, atol=1e-5)
    assert computed == (len(SYSTEM) - 1) + 1 + 3  # the start less one token, then 1 and 3 tokens per row


def together(eng, prompts, params):
    """Generate with every request queued before the engine's worker admits any (it may wake at the first)."""
    eng.pause()
    futures = [eng.submit(p, params) for p in prompts]
    eng.resume()
    return [f.result() for f in futures]


def test_engine_admits_a_batch_with_one_prefill_forward_per_budget(model):
    """Through LocalEngine: 4 prompts x 2 samples; outputs equal HF greedy generation, the start computed once."""
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8, attention="sdpa", linear="default")
    try:
        outs = together(eng, [p for p in PROMPTS for _ in range(2)],
                        SamplingParams(max_new_tokens=6, temperature=0, ignore_eos=True))
        assert eng.stats["prefills"] == 4
        assert eng.stats["prefill_tokens"] == len(SYSTEM) + sum(len(p) - len(SYSTEM) for p in PROMPTS)
    finally:
        eng.close()
    for i, p in enumerate(PROMPTS):
        ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                             max_new_tokens=6, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert outs[2 * i].output_ids == ref and outs[2 * i + 1].output_ids == ref


def test_a_kept_start_serves_prompts_admitted_later(model):
    kept, cache = SharedStart(), new_cache(model)
    with torch.inference_mode():
        prefill(model, cache, PROMPTS[:2], [0, 1], kept=kept)
        assert kept.tokens == SYSTEM[:len(kept.tokens)] and len(kept.tokens) == len(SYSTEM)
        logits, computed = prefill(model, cache, [PROMPTS[3]], [4], kept=kept)  # one prompt, later
    assert computed == len(PROMPTS[3]) - len(SYSTEM)
    assert torch.allclose(logits[0], hf_last_logits(model, PROMPTS[3]), atol=1e-4)
    with torch.inference_mode():
        _, computed = prefill(model, cache, [[1] * 20], [5], kept=kept)  # another start: not used, not kept
    assert computed == 20 and kept.tokens == SYSTEM


def greedy(model, prompt, n=5):
    return model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()


def test_engine_reuses_the_kept_start_until_its_weights_change(tiny_path):
    model = load_model(tiny_path, dtype="float32")  # this test changes the weights: its own copy
    eng = LocalEngine(model, eos_token_ids=[], max_batch_size=8, attention="sdpa", linear="default")
    params = SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True)
    try:
        together(eng, PROMPTS[:2], params)
        before = eng.stats["prefill_tokens"]
        assert eng.generate([PROMPTS[2]], params)[0].output_ids == greedy(model, PROMPTS[2])
        assert eng.stats["prefill_tokens"] - before == len(PROMPTS[2]) - len(SYSTEM)  # the start came from the keep
        with torch.no_grad():
            new = {n: p + 0.05 * torch.randn_like(p) for n, p in model.named_parameters()}
        eng.load_weights(new.items(), version=1)
        before = eng.stats["prefill_tokens"]
        assert eng.generate([PROMPTS[2]], params)[0].output_ids == greedy(model, PROMPTS[2])  # the new weights' KV
        assert eng.stats["prefill_tokens"] - before == len(PROMPTS[2])  # the old weights' start was dropped
    finally:
        eng.close()
