#!/usr/bin/env python
"""How far a bf16 KV cache (engine.kv_dtype=bfloat16) moves an fp32 engine's logprobs from the trainer's, on the real
model: both engines sample from the same chat prompts, the trainer scores the same tokens, and the per-token gaps
and importance ratios (exp(engine - trainer)) are summarised.

Why: the engine's logprobs are the old-policy logprobs of relayrl's losses (and the behaviour logprobs of a
decoupled one), so a cache that rounds keys and values shows up in every importance ratio; this says by how much.

    HF_HUB_OFFLINE=1 .venv/bin/python bench/kv_dtype_parity.py --out bench/results/kv_dtype_parity.json
"""

from __future__ import annotations

import argparse
import json
import sys

import _common

QUESTIONS = ["What is 7 * 8?", "What is 9 - 4? Put your final answer within \\boxed{}.",
             "Explain why the sky is blue in two sentences.", "What is 12 + 30?"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--samples", type=int, default=4, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--out", default=None)
    a = p.parse_args()
    import torch

    from relayrl.engine.base import SamplingParams
    from relayrl.engine.local import LocalEngine
    from relayrl.models import eos_token_ids, load_model, load_tokenizer, resolve_model_path
    from relayrl.sample import Sample
    from relayrl.trainer.engine import TrainEngine
    from relayrl.trainer.packer import Packer

    path = resolve_model_path(a.model)
    tok = load_tokenizer(path)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True))["input_ids"] for q in QUESTIONS]
    model = load_model(path, dtype="float32")
    trainer = TrainEngine(model, temperature=1.0)
    res = {**_common.result_header("kv_dtype_parity"), "workload": {
        "model": path, "prompts": len(prompts), "samples": a.samples, "max_new_tokens": a.max_new_tokens}, "sides": {}}
    for kv in ("auto", "bfloat16"):
        engine = LocalEngine(model, eos_token_ids=eos_token_ids(tok, path), max_batch_size=16, kv_dtype=kv)
        samples = []
        for g, prompt in enumerate(prompts):
            params = SamplingParams(max_new_tokens=a.max_new_tokens, temperature=1.0, seed=g)
            for out in engine.generate([prompt] * a.samples, params):
                s = Sample(prompt_ids=prompt, group_id=str(g))
                s.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason)
                samples.append(s)
        engine.close()
        batch = Packer(4096, pad_id=tok.pad_token_id, share_prompt=True).pack(samples)
        for mb in batch.micro_batches:
            batch.scatter("logp", mb, trainer.forward_logprobs(mb))
        gap = torch.cat([torch.tensor(s.logprobs) - lp for s, lp in zip(samples, batch.per_token["logp"])])
        res["sides"][kv] = {"tokens": gap.numel(), "max_abs": gap.abs().max().item(),
                            "mean_abs": gap.abs().mean().item(), "p99_abs": gap.abs().quantile(0.99).item(),
                            "ratio_min": gap.exp().min().item(), "ratio_max": gap.exp().max().item()}
    print(json.dumps(res, indent=2))
    if a.out:
        _common.write_json(a.out, res)


if __name__ == "__main__":
    sys.exit(main())
