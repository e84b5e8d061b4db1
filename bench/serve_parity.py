#!/usr/bin/env python
"""lm-eval against `relayrl serve` and against lm-eval's own `hf` backend, on the same model and examples.

Two local tasks, written to a temporary folder (nothing is downloaded): a GSM8K generation task over the first
`--limit` questions of the GSM8K test split shipped with relayrl (zero-shot, greedy, stopped by lm-eval's
`until` strings), and a multiple-choice task of `--limit` two-term sums with four choices each. The server runs
the model in float32 (`relayrl serve --dtype float32`). Reported: how many greedy answers through
`local-completions` are identical to `hf`'s, and the largest per-choice log-likelihood difference from `hf`'s
through `local-completions` (echo) and `sglang-generate` (prompt logprobs). `local-chat-completions` is not
compared: its prompts are chat-rendered, so `hf` is not its reference.

    .venv/bin/python bench/serve_parity.py                    # SmolLM2, 20 examples per task
    .venv/bin/python bench/serve_parity.py --limit 5 --out /tmp/p.json
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import _common

READY = re.compile(r"relayrl serve: ready on (http://\S+)")
GEN_TASK = """task: parity_gsm8k
dataset_path: json
dataset_kwargs: {data_files: {test: gsm8k.jsonl}}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: "{{answer}}"
num_fewshot: 0
generation_kwargs: {until: ["Question:", "\\n\\n"], do_sample: false, temperature: 0.0, max_gen_toks: 64}
metric_list: [{metric: exact_match}]
"""
MC_TASK = """task: parity_sums
dataset_path: json
dataset_kwargs: {data_files: {test: sums.jsonl}}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_choice: "{{choices}}"
doc_to_target: "{{label}}"
metric_list: [{metric: acc}]
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="alias, folder or hub id")
    p.add_argument("--limit", type=int, default=20, help="examples per task")
    p.add_argument("--out", default="bench/results/serve_parity.json")
    return p.parse_args(argv)


def write_tasks(folder: Path, limit: int) -> None:
    """The two task YAMLs and their jsonl files in `folder`."""
    import relayrl.data

    gsm8k = Path(relayrl.data.__file__).parent / "builtin" / "gsm8k" / "test.jsonl.xz"
    with lzma.open(gsm8k, "rt") as f:
        rows = [json.loads(line) for line in f.read().splitlines()[:limit]]
    (folder / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rng = random.Random(0)
    sums = []
    for _ in range(limit):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        choices = [a + b, a + b + 1, a + b - 10, a * b]
        rng.shuffle(choices)
        sums.append({"question": f"What is {a} + {b}?", "choices": [f" {c}" for c in choices],
                     "label": choices.index(a + b)})
    (folder / "sums.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sums))
    (folder / "parity_gsm8k.yaml").write_text(GEN_TASK)
    (folder / "parity_sums.yaml").write_text(MC_TASK)


def start_server(model: str, log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "relayrl.cli", "serve", "--model", model, "--dtype", "float32", "--port", "0",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=_common.REPO, stdout=subprocess.PIPE, stderr=log.open("w"), text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"})
    for line in proc.stdout:
        m = READY.search(line)
        if m:
            return proc, m.group(1)
    raise SystemExit(f"relayrl serve did not start: {log.read_text()[-2000:]}")


def evaluate(model: str, args: dict, task: str, folder: Path, limit: int) -> list[dict]:
    """lm-eval's per-document samples of `task`, in document order."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=args, tasks=[task], limit=limit, log_samples=True,
                                  task_manager=TaskManager(include_path=str(folder)), random_seed=0,
                                  numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)
    return sorted(out["samples"][task], key=lambda s: s["doc_id"])


def compare(path: str, url: str, folder: Path, limit: int) -> dict:
    served = {"base_url": url + "/v1/completions", "model": path, "tokenizer": path, "num_concurrent": 1,
              "tokenizer_backend": "huggingface", "tokenized_requests": True, "max_retries": 1}
    native = {"base_url": url + "/generate", "model": path, "tokenizer": path, "num_concurrent": 1,
              "tokenizer_backend": "huggingface", "max_retries": 1}
    hf = {"pretrained": path, "dtype": "float32", "device": "cpu", "batch_size": 1}
    gen = {name: [s["resps"][0][0] for s in evaluate(model, args, "parity_gsm8k", folder, limit)]
           for name, model, args in (("served", "local-completions", served), ("hf", "hf", hf))}
    same = [a == b for a, b in zip(gen["served"], gen["hf"], strict=True)]
    ll = {name: [[float(r[0][0]) for r in s["resps"]] for s in evaluate(model, args, "parity_sums", folder, limit)]
          for name, model, args in (("local-completions", "local-completions", served),
                                    ("sglang-generate", "sglang-generate", native), ("hf", "hf", hf))}
    diffs = {name: max(abs(a - b) for doc, ref in zip(ll[name], ll["hf"], strict=True)
                       for a, b in zip(doc, ref, strict=True)) for name in ("local-completions", "sglang-generate")}
    return {"greedy_identical": sum(same), "greedy_examples": len(same),
            "differing": [{"doc": i, "served": gen["served"][i], "hf": gen["hf"][i]} for i, ok in enumerate(same)
                          if not ok],
            "loglikelihood_max_abs_diff": diffs, "loglikelihood_choices": sum(len(d) for d in ll["hf"])}


def main() -> None:
    a = parse_args()
    from relayrl.models import resolve_model_path

    path = resolve_model_path(a.model)
    res = {**_common.result_header("serve_parity"), "model": a.model, "limit": a.limit}
    with tempfile.TemporaryDirectory(prefix="bench_parity_") as tmp:
        folder = Path(tmp)
        write_tasks(folder, a.limit)
        proc, url = start_server(path, folder / "serve.log")
        try:
            os.environ.update(HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
            os.chdir(folder)  # the task YAMLs name their jsonl files relative to here
            res |= compare(path, url, folder, a.limit)
        finally:
            os.chdir(_common.REPO)
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print(json.dumps(res, indent=2))
    _common.write_json(a.out, res)


if __name__ == "__main__":
    main()
