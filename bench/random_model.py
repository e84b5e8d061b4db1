#!/usr/bin/env python
"""Write a model folder with a real model's shape and tokenizer but random weights (seeded), for benches on a machine
the real weights cannot reach: the GPU machine gets the repository and a few MB beside it, not 270 MB of SmolLM2.

Compute and memory per token depend on the shape alone, so step times and peaks measured on such a folder are the
real model's; what it generates is not (random weights rarely emit EOS, so rollouts run to max_new_tokens). The
shapes are bench/scaling.py's SIZES (published configs); the tokenizer folder is any HF folder whose tokenizer files
are copied (the prepared SmolLM2 folder, or a copy of its tokenizer files).

    .venv/bin/python bench/random_model.py --shape smollm2-135m \
        --tokenizer ~/.cache/relayrl/models/SmolLM2-135M-Instruct --out /tmp/smollm2-random
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

RANDOM_MARK = "RANDOM_WEIGHTS"  # a file in the folder: says what the weights are to people and scripts
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def parse_args(argv=None) -> argparse.Namespace:
    from scaling import QUICK_SIZES, SIZES

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", required=True, choices=sorted({**SIZES, **QUICK_SIZES}))
    p.add_argument("--tokenizer", required=True, help="folder holding tokenizer.json (and its config/template)")
    p.add_argument("--out", required=True, help="folder to write (must not exist)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def build(shape: str, tokenizer: Path, out: Path, seed: int = 0) -> Path:
    """Save a random-init model of `shape` in fp32 safetensors plus `tokenizer`'s files, atomically (temp + rename)."""
    import torch
    from scaling import QUICK_SIZES, SIZES
    from transformers import AutoConfig, AutoModelForCausalLM

    from relayrl.models.store import atomic_build

    if not (tokenizer / "tokenizer.json").is_file():
        sys.exit(f"random_model: {tokenizer} has no tokenizer.json")
    hf_config = dict({**SIZES, **QUICK_SIZES}[shape][0])

    def write(tmp: Path) -> None:
        config = AutoConfig.for_model(**hf_config)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(tmp)
        for name in TOKENIZER_FILES:
            if (tokenizer / name).is_file():
                shutil.copy2(tokenizer / name, tmp / name)
        (tmp / RANDOM_MARK).write_text("random-init weights: they never learn (scripts/gpu_check.sh skips learning)\n")

    return atomic_build(out, write)


def main() -> None:
    a = parse_args()
    out = Path(a.out).expanduser().resolve()
    if out.exists():
        sys.exit(f"random_model: {out} exists; give a new folder")
    path = build(a.shape, Path(a.tokenizer).expanduser(), out, a.seed)
    print(f"random_model: {a.shape} with random weights (seed {a.seed}) written to {path}")


if __name__ == "__main__":
    main()
