"""A tiny random vision-language model: Idefics3's architecture (SmolVLM's family) with its processor.

Why Idefics3: its text model is a plain Llama (1-D positions), and the images enter only as connector features
written over the `<image>` placeholder tokens of the prompt, so relayrl's engine runs it as a text model whose
prefill takes merged embeddings (relayrl.models.vision). Qwen2-VL's 3-D M-RoPE positions would reach into every
attention call of the engine and the trainer.

The tiny one: a 64 x 64 image (no tiling: `do_image_splitting` off), 8 x 8 patches, a pixel shuffle of 2, so 16
image tokens per image; the same BPE tokenizer as the dense tiny model plus Idefics3's image tokens, and a ChatML
template that renders an `{"type": "image"}` content part as `<image>` (the processor expands it).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForImageTextToText, GenerationConfig, Idefics3Config, Idefics3Processor
from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

from relayrl.common.files import cache_dir
from relayrl.models.store import atomic_build, make_portable
from relayrl.models.tiny import _train_tiny_tokenizer

_TINY_VLM_VERSION = 1  # bump when build_tiny_vlm's output changes, so cached tiny VLMs are rebuilt
IMAGE_TOKENS = ["<fake_token_around_image>", "<image>", "<global-img>"]

# ChatML whose content may be a list of parts (TRL's and HF's multimodal messages): text parts as their text,
# image parts as the processor's `<image>` placeholder
VLM_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{ message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' %}{{ '<image>' }}{%- elif part['type'] == 'text' %}{{ part['text'] }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def build_tiny_vlm(out_dir: str | os.PathLike, *, vocab_size: int = 512, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128, image_size: int = 64,
                   patch_size: int = 8, vision_hidden: int = 32, seed: int = 0,
                   max_position_embeddings: int = 1024) -> Path:
    """Save a random-init Idefics3 with its processor (image processor, tokenizer, chat template): a real HF folder
    that AutoProcessor and AutoModelForImageTextToText load."""
    out = Path(out_dir)
    tok = _train_tiny_tokenizer(vocab_size, max_position_embeddings)
    tok.add_special_tokens({"additional_special_tokens": IMAGE_TOKENS})
    tok.chat_template = VLM_CHAT_TEMPLATE
    pad, eos, image = tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_end|>", "<image>"])
    scale = 2
    config = Idefics3Config(
        text_config={"model_type": "llama", "vocab_size": len(tok), "hidden_size": hidden_size,
                     "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
                     "num_key_value_heads": num_kv_heads, "intermediate_size": intermediate_size,
                     "max_position_embeddings": max_position_embeddings, "tie_word_embeddings": True,
                     "pad_token_id": pad, "bos_token_id": pad, "eos_token_id": eos},
        vision_config={"hidden_size": vision_hidden, "intermediate_size": 2 * vision_hidden, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": image_size, "patch_size": patch_size},
        scale_factor=scale, image_token_id=image, tie_word_embeddings=True, pad_token_id=pad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(bos_token_id=pad, eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    seq_len = (image_size // patch_size) ** 2 // scale ** 2
    Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq_len,
                      chat_template=VLM_CHAT_TEMPLATE).save_pretrained(out)
    tok.save_pretrained(out)
    make_portable(out, chat_template=VLM_CHAT_TEMPLATE, model_max_length=max_position_embeddings)
    return out


def tiny_vlm_model(**kw) -> Path:
    """A tiny VLM built once per argument set into cache_dir()/tiny/<hash>; tests and processes share it."""
    key = json.dumps({"arch": "idefics3", "version": _TINY_VLM_VERSION, **kw}, sort_keys=True)
    target = cache_dir() / "tiny" / hashlib.sha256(key.encode()).hexdigest()[:16]
    return atomic_build(target, lambda tmp: build_tiny_vlm(tmp, **kw))
