#!/usr/bin/env python
"""Where a training step peaks: the resident high-water mark of each part of each micro-batch, at a model shape
of bench/scaling.py (random weights), with the trainer's real micro-step.

The high-water mark (VmHWM) is reset through /proc/self/clear_refs at each boundary, so each row says how high
resident memory went inside that part: the forward, the LM head's backward (until the gradient of its hidden
states exists), the layers' backward (until the input embedding's output gradient exists), the embedding's
backward (to the end of loss.backward), then the optimizer step. Run it with MALLOC_MMAP_THRESHOLD_=1048576
so that freed blocks leave RSS at once (otherwise glibc's retention blurs the parts). Found that a tied LM
head's weight gradient waited in autograd's buffer through the layers' backward (docs/benchmarks.md).

    MALLOC_MMAP_THRESHOLD_=1048576 .venv/bin/python bench/backward_peak.py --size smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import types

import _common
import _scaling_child
import scaling
from train_memory_trace import Trace  # the high-water mark between marks


def _instrument(train_ctl, marks: Trace) -> None:
    """Hooks at the part boundaries; the micro-step itself is the trainer's (called through, not copied)."""
    import relayrl.trainer.engine as te

    plain_head = te.head_logprobs

    def head(model, hidden, *args, **kwargs):
        if hidden.requires_grad:
            hidden.register_hook(lambda g: marks.mark("lm_head_backward"))
        return plain_head(model, hidden, *args, **kwargs)

    def embedding_out(module, inputs, out):
        if out.requires_grad:
            out.register_hook(lambda g: marks.mark("layers_backward"))

    te.head_logprobs = head
    train_ctl.engine.model.get_input_embeddings().register_forward_hook(embedding_out)
    plain_micro = train_ctl.engine._micro_step

    def micro(mb, loss_fn, *rest):
        marks.mark("before_micro_batch")

        def loss_marked(mb, logp, entropy):  # the forward ends where the loss is taken
            out = loss_fn(mb, logp, entropy)
            marks.mark("forward")
            return out

        stats = plain_micro(mb, loss_marked, *rest)
        marks.mark("embedding_backward")
        return stats

    train_ctl.engine._micro_step = micro


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="smollm2-135m", choices=sorted(scaling.SIZES | scaling.QUICK_SIZES))
    p.add_argument("--steps", type=int, default=2, help="the first step allocates the optimizer's state")
    p.add_argument("--out", default="bench/results/backward_peak.json")
    a = p.parse_args()
    hf_config = (scaling.SIZES | scaling.QUICK_SIZES)[a.size][0]  # tiny-a: a seconds-long smoke run
    shape = {"prompts": 8, "group": 8, "prompt_len": 64, "new_tokens": 128}  # bench/scaling.py's step
    spec = {"hf_config": hf_config, "shape": shape, "overrides": ["model.gradient_checkpointing=true"]}
    marks, rng, vocab, steps = Trace(), random.Random(0), hf_config["vocab_size"], []
    n_new, group = shape["new_tokens"], shape["group"]
    with tempfile.TemporaryDirectory(prefix="bench_backward_peak_") as tmp:
        _cfg, train_ctl, rollout_ctl, engine = _scaling_child._build(spec, tmp)
        rollout_ctl.release_memory(weights=True)  # as during training in the colocated loop
        _instrument(train_ctl, marks)
        for step in range(1, a.steps + 1):  # random answers of the full length: no rollout needed to train
            prompts = [[rng.randrange(3, vocab) for _ in range(shape["prompt_len"])] for _ in range(shape["prompts"])]
            outs = [types.SimpleNamespace(output_ids=[rng.randrange(3, vocab) for _ in range(n_new)],
                                          logprobs=[-1.0] * n_new, versions=[0] * n_new, finish_reason="length")
                    for _ in range(shape["prompts"] * group)]
            marks.rows.clear()
            marks.mark("start")
            train_ctl.fit(_scaling_child._samples(outs, prompts, group, step, rng))
            marks.mark("optimizer_and_rest")
            steps.append({"step": step, "parts": marks.rows[1:]})
            top = max(marks.rows[1:], key=lambda r: r["peak_since_last_gb"])
            print(f"step {step}: peak {top['peak_since_last_gb']:.3f} GB in {top['phase']}", file=sys.stderr)
        engine.close()
    result = {**_common.result_header("backward_peak"), "size": a.size, "shape": shape,
              "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"), "steps": steps}
    _common.write_json(a.out, result)
    print(f"wrote {a.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
