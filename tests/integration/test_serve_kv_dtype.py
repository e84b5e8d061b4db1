"""`relayrl serve --kv-dtype bfloat16`: a real server subprocess (tiny random-init model, fp32, 127.0.0.1) keeps its
KV cache in bf16, says so in its first line, and generates what an in-process engine with that cache generates."""

import httpx
from serve_for_tests import Server

from relayrl.engine.base import SamplingParams
from relayrl.engine.local import LocalEngine
from relayrl.models import eos_token_ids, load_model, load_tokenizer


def test_a_served_bf16_kv_cache_generates_what_the_engine_does(tiny_path, tmp_path):
    prompt = [5, 6, 7, 8, 9]
    engine = LocalEngine(load_model(tiny_path, dtype="float32"), kv_dtype="bfloat16",
                         eos_token_ids=eos_token_ids(load_tokenizer(tiny_path), tiny_path))
    try:
        ref = engine.generate([prompt], SamplingParams(max_new_tokens=24, temperature=0, ignore_eos=True))[0]
    finally:
        engine.close()
    server = Server(tiny_path, tmp_path / "server.log", "--kv-dtype", "bfloat16")
    try:
        url = server.wait_ready()
        r = httpx.post(url + "/generate", timeout=60, json={
            "input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["output_ids"] == ref.output_ids
        served = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(a - b) for a, b in zip(served, ref.logprobs)) < 1e-5
    finally:
        assert server.stop() == 0
    assert any("float32, KV cache bfloat16" in line for line in server.lines), server.lines
