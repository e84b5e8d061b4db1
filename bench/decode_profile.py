#!/usr/bin/env python
"""One bare decode forward of a model (transformers' own dynamic KV cache, no relayrl code in the forward) at
--batch rows (32) and a --context-token context (278), timed 10 times and profiled once: which ops cost CPU
time and which cost device time.

Why it exists: on a GPU, a small model's decode step is bound by the host, not the device, and this shows which op
holds the host. On the H200 it found SDPA's cuDNN backend spending 2 ms of CPU per call (a new execution plan for
each context length) against 5.5 ms of GPU time for the whole step (docs/benchmarks.md, "On a GPU");
relayrl.common.device.avoid_cudnn_attention is the fix. --cudnn keeps the cuDNN backend, to compare.

    python3 bench/decode_profile.py MODEL_DIR cuda      # e.g. a bench/random_model.py folder
    .venv/bin/python bench/decode_profile.py MODEL_DIR cpu --batch 8 --context 64
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats

import _common
import torch
from engine_step_parts import bare_decode, times_ms
from torch.profiler import ProfilerActivity, profile

from relayrl.common.device import avoid_cudnn_attention
from relayrl.models import load_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("device")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=278)
    p.add_argument("--cudnn", action="store_true", help="leave SDPA's cuDNN backend on (torch's own choice)")
    a = p.parse_args()
    dev = a.device
    m = load_model(a.model, dtype="bfloat16", device=dev)
    if not a.cudnn:
        avoid_cudnn_attention(torch.device(dev))
    print("param devices", {str(p.device) for p in m.parameters()}, "buffers", {str(b.device) for b in m.buffers()},
          "attn", m.config._attn_implementation, "threads", torch.get_num_threads(),
          "cudnn sdpa", torch.backends.cuda.cudnn_sdp_enabled())
    step = bare_decode(m, a.batch, a.context, min(1000, m.config.vocab_size))
    print("decode ms", [round(x, 1) for x in times_ms(step, dev, 10)])  # the context grows by one per call
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev != "cpu" else [])
    with profile(activities=acts) as prof:
        step()
        _common.synchronize(dev)
    ev = prof.key_averages()
    print("total self cpu ms", round(sum(e.self_cpu_time_total for e in ev) / 1e3, 2),
          "self device ms", round(sum(getattr(e, "self_device_time_total", 0) for e in ev) / 1e3, 2))
    for key in ("self_cpu_time_total", "self_device_time_total"):
        print("--", key)
        for e in sorted(ev, key=lambda e: getattr(e, key, 0), reverse=True)[:10]:
            print(f"   {e.key[:60]:60s} calls {e.count:5d} cpu {e.self_cpu_time_total / 1e3:8.2f} "
                  f"dev {getattr(e, 'self_device_time_total', 0) / 1e3:8.2f}")
    pr = cProfile.Profile()
    pr.enable()
    step()
    _common.synchronize(dev)
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(12)
    print(s.getvalue()[-2500:])


if __name__ == "__main__":
    main()
