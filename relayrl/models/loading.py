"""Model and tokenizer loading by folder, alias or hub id (a hub id is read from the local Hugging Face cache and
downloaded into it on first use unless HF_HUB_OFFLINE is set: `relayrl.models.hub`)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import warnings
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from relayrl.common.device import resolve_device
from relayrl.models.aliases import ALIAS_DIRS, MODEL_ALIASES
from relayrl.models.hub import hub_snapshot, looks_like_repo_id
from relayrl.models.store import atomic_build, is_complete
from relayrl.models.vision import is_vision_config

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")  # AutoProcessor's, besides the tokenizer
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


def save_pretrained_atomic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                           path: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """Save model + tokenizer as a plain HF folder; readers never see a half-written one.
    `state_dict`: the full weights when the model's own are shards (FSDP)."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)
        source = Path(model.name_or_path)
        for name in PROCESSOR_FILES if (source / "config.json").is_file() and is_vlm_folder(str(source)) else ():
            if (source / name).is_file():  # a vision-language model's image processor: the folder loads whole
                shutil.copyfile(source / name, tmp / name)

    return atomic_build(Path(path), write, force=True)


def resolve_model_path(path_or_alias: str | os.PathLike, prepare: bool = True) -> str:
    """Turn an alias (prepared on first use), a model folder or a hub id into an absolute folder path.

    An alias is a bare name in MODEL_ALIASES; a local folder that shares the name is reached as
    './smollm2'. A hub id ('org/name' or 'org/name@rev' that is not an existing folder) is its snapshot folder in
    the Hugging Face cache, downloaded first when it is not there (HF_HUB_OFFLINE=1: the cache only), as
    `from_pretrained` does, so `relayrl serve --model org/name` and the Python API behave like a run's config.
    """
    name = os.fspath(path_or_alias)
    if name in MODEL_ALIASES:
        if prepare:
            return str(MODEL_ALIASES[name]())
        folder = ALIAS_DIRS[name]()
        if not is_complete(folder):
            raise FileNotFoundError(f"model alias {name!r} is not prepared at {folder}; "
                                    f"call relayrl.models.resolve_model_path({name!r}) to prepare it")
        return str(folder)
    path = Path(name).expanduser().resolve()
    if not path.exists() and looks_like_repo_id(name):
        path = hub_snapshot(name, "model")
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (aliases: {sorted(MODEL_ALIASES)}; "
                                f"hub ids are 'org/name')")
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {path} has no config.json")
    return str(path)


def stored_parameters(folder: str | os.PathLike) -> int | None:
    """How many parameters a model folder's safetensors files hold, read from their headers (nothing is loaded):
    what a run's precision is decided from before any weight is read. None without safetensors files."""
    files = sorted(Path(folder).glob("*.safetensors"))
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                n = 1
                for d in entry["shape"]:
                    n *= d
                total += n
    return total if files else None


# ---- loading -----------------------------------------------------------------------------------------
def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerBase:
    """Load a tokenizer offline; pad falls back to eos so batched padding always works."""
    tok = AutoTokenizer.from_pretrained(resolve_model_path(path), local_files_only=True)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    if not tok.chat_template:
        warnings.warn(f"tokenizer at {path} has no chat template; relayrl will use raw prompts", stacklevel=2)
    return tok


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32",
               device: str | torch.device | None = None) -> PreTrainedModel:
    """Load a causal LM offline in eval mode (transformers 5 always loads on meta first: low memory).

    `device` (relayrl.common.device.resolve_device: auto, cpu, cuda, cuda:N; None = cpu): where the weights go. They
    are read on the CPU and moved once, the same path for every device (no accelerate device map and its hooks).
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    target = resolve_device(device or "cpu")  # an unusable device fails before the weights are read
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar per model drowns the run log
    folder = resolve_model_path(path)
    # a vision-language model (relayrl.models.vision) is not a causal LM to transformers' auto classes
    auto = AutoModelForImageTextToText if is_vlm_folder(folder) else AutoModelForCausalLM
    model = auto.from_pretrained(folder, dtype=dtype, local_files_only=True, attn_implementation="sdpa")
    if target.type != "cpu":
        model.to(target)
    return model.eval()


def is_vlm_folder(folder: str) -> bool:
    """Whether a model folder's config has a vision tower (read from config.json, nothing loaded)."""
    return is_vision_config(json.loads((Path(folder) / "config.json").read_text()))


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_path: str | os.PathLike | None) -> list[int]:
    """The ids that end a generation: the tokenizer's eos plus generation_config's (int or list)."""
    ids: list[int] = [] if tokenizer.eos_token_id is None else [int(tokenizer.eos_token_id)]
    if model_path is not None:
        folder = Path(resolve_model_path(model_path))
        if (folder / "generation_config.json").is_file():
            extra = GenerationConfig.from_pretrained(folder, local_files_only=True).eos_token_id
        else:
            extra = AutoConfig.from_pretrained(folder, local_files_only=True).eos_token_id
        extra = [] if extra is None else [extra] if isinstance(extra, int) else list(extra)
        ids += [int(i) for i in extra if int(i) not in ids]
    return ids
