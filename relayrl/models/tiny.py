"""Tiny random models for tests and benches: a real architecture (qwen2/llama, or qwen3_moe for mixture-of-experts
code) and a real BPE tokenizer trained on a small deterministic corpus, built once per argument set into the cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors, trainers
from tokenizers.models import BPE
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

from relayrl.common.files import cache_dir
from relayrl.models.store import CHATML_TEMPLATE, atomic_build, make_portable

ARCHS = ("qwen2", "llama", "qwen3_moe")
_TINY_VERSION = 1  # bump when build_tiny_model's output changes, so cached tiny models are rebuilt


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
                     tie_word_embeddings: bool = True, num_experts: int = 8, experts_per_token: int = 2) -> Path:
    """Save a random-init causal LM with its own ChatML tokenizer: a real HF folder for fast tests.

    arch "qwen3_moe" is Qwen3-MoE's architecture (every layer sparse, `num_experts` experts of
    intermediate_size // 4 each, `experts_per_token` routed per token, top-k weights renormalised as in
    Qwen3-30B-A3B)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {', '.join(ARCHS)}, not {arch!r}")
    out = Path(out_dir)
    tok = _train_tiny_tokenizer(vocab_size, max_position_embeddings)
    pad, eos = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>"])
    config = AutoConfig.for_model(
        arch, vocab_size=len(tok), hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
        bos_token_id=pad, eos_token_id=eos, pad_token_id=pad, **_moe_settings(arch, hidden_size, num_heads,
                                                                              intermediate_size, num_experts,
                                                                              experts_per_token))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    make_portable(out, chat_template=CHATML_TEMPLATE, model_max_length=max_position_embeddings)
    return out


def _moe_settings(arch: str, hidden_size: int, num_heads: int, intermediate_size: int, num_experts: int,
                  experts_per_token: int) -> dict:
    """The config keys a tiny qwen3_moe adds (none for the dense archs)."""
    if arch != "qwen3_moe":
        return {}
    return {"head_dim": hidden_size // num_heads, "num_experts": num_experts, "num_experts_per_tok": experts_per_token,
            "moe_intermediate_size": max(1, intermediate_size // 4), "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": False}


def tiny_model(arch: str = "qwen2", **kw) -> Path:
    """A tiny model built once per argument set into cache_dir()/tiny/<hash>; tests and processes share it."""
    key = json.dumps({"arch": arch, "version": _TINY_VERSION, **kw}, sort_keys=True)
    target = cache_dir() / "tiny" / hashlib.sha256(key.encode()).hexdigest()[:16]
    return atomic_build(target, lambda tmp: build_tiny_model(tmp, arch=arch, **kw))
