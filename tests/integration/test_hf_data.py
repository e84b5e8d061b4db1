"""Data through Hugging Face `datasets` (parquet, csv, tsv, arrow, folders, save_to_disk), field mapping
(`columns`, `map`), hub ids for datasets and models read from a local HF cache built in tmp_path the way the
hub lays it out (blobs, snapshot symlinks, refs/main), and the GSM8K copy shipped in the package.
Everything is real files; nothing touches the network."""

import hashlib
import io
import json
import lzma
import os
import shutil
import subprocess
import sys
from pathlib import Path

import datasets
import pandas as pd
import pytest

from relayrl.common.errors import InputError
from relayrl.config import ConfigError
from relayrl.config.schema import DatasetConfig, load_run_config
from relayrl.data import find_gsm8k, load_rows
from relayrl.data.datasets import BUILTIN_GSM8K, gsm8k_search_path
from relayrl.models import load_model, load_tokenizer, resolve_model_path

REPO = Path(__file__).resolve().parents[2]
ROWS = pd.DataFrame({"problem": ["1+1?", "2+3?", "7*6?"], "solution": [2, 5, 42], "level": [1, 1, 3]})
MAPS = '''
def boxed(row):
    """Keep easy problems only; the answer becomes a GSM8K-style '#### n'."""
    if row["level"] > 1:
        return None
    return {**row, "answer": f"#### {row['solution']}"}

def fails_on_five(row):
    if row["solution"] == 5:
        raise KeyError("five")
    return row

def gives_list(row):
    return [row]

def two_args(row, extra):
    return row

NOT_A_FUNCTION = 3
'''


@pytest.fixture(autouse=True)
def hf_caches(tmp_path, monkeypatch):
    """Both HF caches inside tmp_path (the user's are never read or written), offline (hub ids come from that
    cache; downloads are tests/integration/test_hub_download.py's), map functions importable."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    (tmp_path / "maps").mkdir()
    (tmp_path / "maps" / "row_maps.py").write_text(MAPS)
    monkeypatch.syspath_prepend(str(tmp_path / "maps"))
    return tmp_path


def cfg(source, **kw) -> DatasetConfig:
    """The mapping every format test uses: problem -> question, answer from `map`, hard rows dropped."""
    return DatasetConfig(source=str(source), columns={"problem": "question"}, map="row_maps:boxed", **kw)


def write(path: Path, fmt: str) -> Path:
    """ROWS as a real file of `fmt`, written by pandas / pyarrow / datasets."""
    if fmt == "parquet":
        ROWS.to_parquet(path)
    elif fmt in ("csv", "tsv"):
        ROWS.to_csv(path, index=False, sep="," if fmt == "csv" else "\t")
    elif fmt == "arrow":  # the arrow stream file save_to_disk writes
        datasets.Dataset.from_pandas(ROWS).save_to_disk(path.parent / "saved")
        shutil.copy(next((path.parent / "saved").glob("*.arrow")), path)
    elif fmt == "jsonl.xz":
        path.write_bytes(lzma.compress("".join(json.dumps(r) + "\n" for r in ROWS.to_dict("records")).encode()))
    return path


@pytest.mark.parametrize("fmt", ["parquet", "csv", "tsv", "arrow", "jsonl.xz"])
def test_each_file_format_with_columns_and_map(tmp_path, fmt):
    rows = load_rows(cfg(write(tmp_path / f"d.{fmt}", fmt)))
    assert [(r["question"], r["answer"]) for r in rows] == [("1+1?", "#### 2"), ("2+3?", "#### 5")]
    assert rows[0]["solution"] == 2 and "problem" not in rows[0]  # other fields kept, renamed one gone


def test_save_to_disk_and_folder_of_files_pick_the_split(tmp_path):
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_pandas(ROWS),
                               "test": datasets.Dataset.from_pandas(ROWS[1:2])})
    dd.save_to_disk(tmp_path / "dd")
    datasets.Dataset.from_pandas(ROWS).save_to_disk(tmp_path / "one")
    (tmp_path / "files").mkdir()
    ROWS.to_csv(tmp_path / "files" / "train.csv", index=False)
    ROWS[2:].to_csv(tmp_path / "files" / "test.csv", index=False)
    assert [r["question"] for r in load_rows(cfg(tmp_path / "dd", split="test"))] == ["2+3?"]
    assert len(load_rows(cfg(tmp_path / "one"))) == 2
    assert len(load_rows(cfg(tmp_path / "files", split="train"))) == 2
    with pytest.raises(InputError, match=r"has splits \['train', 'test'\]: choose one with data.eval.split"):
        load_rows(cfg(tmp_path / "dd"), "data.eval")
    with pytest.raises(InputError, match=r"has no split 'valid' \(splits: \['train', 'test'\]\)"):
        load_rows(cfg(tmp_path / "files", split="valid"))


def test_broken_parquet_names_the_file(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match=r"bad.parquet: cannot read with Hugging Face datasets"):
        load_rows(DatasetConfig(source=str(tmp_path / "bad.parquet")))


@pytest.mark.parametrize("spec, message", [
    ("row_maps:missing", "data.train.map: module 'row_maps' has no attribute 'missing'"),
    ("no_such_module:f", "data.train.map: cannot import module 'no_such_module'"),
    ("row_maps:NOT_A_FUNCTION", "data.train.map: 'row_maps:NOT_A_FUNCTION' is a int, not a function"),
    ("row_maps:two_args", "data.train.map: 'row_maps:two_args' must take one argument"),
])
def test_map_function_is_checked_before_any_file_is_read(tmp_path, spec, message):
    with pytest.raises(ConfigError, match=message):  # the source does not even exist: the map fails first
        load_rows(DatasetConfig(source=str(tmp_path / "later.parquet"), map=spec))


def test_map_and_columns_failures_name_the_row(tmp_path):
    src = write(tmp_path / "d.parquet", "parquet")
    with pytest.raises(InputError, match=r"d.parquet\[train\]\[1\]: data.train.map 'row_maps:fails_on_five' "
                                         r"failed: KeyError"):
        load_rows(DatasetConfig(source=str(src), map="row_maps:fails_on_five", prompt_key="problem",
                                answer_key="solution"))
    with pytest.raises(InputError, match=r"\[0\]: data.train.map 'row_maps:gives_list' returned a list"):
        load_rows(DatasetConfig(source=str(src), map="row_maps:gives_list"))
    with pytest.raises(InputError, match=r"\[0\]: row has no 'prob' \(renamed by data.eval.columns"):
        load_rows(DatasetConfig(source=str(src), columns={"prob": "question"}), "data.eval")
    with pytest.raises(InputError, match=r"d.parquet\[train\]\[0\]: row has no 'question'.*data.train.columns"):
        load_rows(DatasetConfig(source=str(src)))


def test_subset_and_split_are_refused_for_named_sources():
    with pytest.raises(ConfigError, match="split: applies to hub ids and data folders only"):
        DatasetConfig(source="gsm8k:train", split="test").validate()
    with pytest.raises(ConfigError, match="map: must look like 'package.module:function'"):
        DatasetConfig(source="x.jsonl", map="just_a_name").validate()


# ---- a local Hugging Face hub cache, laid out as huggingface_hub writes it --------------------------------
def add_to_hub_cache(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes],
                     commit: str = "a" * 40, ref: bool = True) -> Path:
    """<cache>/<type>s--org--name/{blobs/<sha256>, snapshots/<commit>/<file> -> ../../blobs/..., refs/main}."""
    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for rel, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
- config_name: hard
  data_files:
  - split: train
    path: hard/train-*
---
# tiny math
"""


def parquet_bytes(df: pd.DataFrame) -> bytes:
    buf = io.BytesIO()
    df.to_parquet(buf)
    return buf.getvalue()


def test_hub_dataset_id_is_read_from_the_local_cache(hf_caches):
    files = {"README.md": CARD.encode(), "main/train-00000-of-00001.parquet": parquet_bytes(ROWS),
             "main/test-00000-of-00001.parquet": parquet_bytes(ROWS[1:2]),
             "hard/train-00000-of-00001.parquet": parquet_bytes(ROWS[2:])}
    add_to_hub_cache(hf_caches / "hub", "dataset", "tinyorg/tiny_math", files)
    test = load_rows(cfg("tinyorg/tiny_math", subset="main", split="test"))
    assert [(r["question"], r["answer"]) for r in test] == [("2+3?", "#### 5")]
    hard = load_rows(DatasetConfig(source="hf:tinyorg/tiny_math", subset="hard", split="train",
                                   prompt_key="problem", answer_key="solution"))
    assert [r["answer"] for r in hard] == ["42"]
    with pytest.raises(InputError, match=r"tinyorg/tiny_math \(main\) at .* has splits \['train', 'test'\]"):
        load_rows(cfg("tinyorg/tiny_math", subset="main"))


def test_hub_dataset_without_refs_uses_its_snapshot(hf_caches):
    """load_dataset fetches by commit hash and may leave no refs/main: the cached snapshot still serves."""
    files = {"data/train-00000-of-00001.parquet": parquet_bytes(ROWS)}
    add_to_hub_cache(hf_caches / "hub", "dataset", "tinyorg/no_refs", files, commit="b" * 40, ref=False)
    assert len(load_rows(cfg("tinyorg/no_refs"))) == 2


def test_uncached_hub_dataset_names_the_id_and_the_cache(hf_caches):
    where = hf_caches / "hub" / "datasets--openai--gsm8k"
    with pytest.raises(FileNotFoundError, match=rf"data.eval.source: no file or folder 'openai/gsm8k', and dataset "
                                                rf"'openai/gsm8k' is not in the local Hugging Face cache \(looked in "
                                                rf"{where}\).*hf download --repo-type dataset openai/gsm8k"):
        load_rows(DatasetConfig(source="openai/gsm8k", subset="main"), "data.eval")
    with pytest.raises(FileNotFoundError, match=r"dataset file .*missing/file.jsonl does not exist"):
        load_rows(DatasetConfig(source=str(hf_caches / "missing" / "file.jsonl")))
    with pytest.raises(FileNotFoundError, match=r"'a/b/c' is not a hub id 'org/name'"):
        load_rows(DatasetConfig(source="hf:a/b/c"))


def test_hub_model_id_resolves_to_the_cached_snapshot(hf_caches, tiny_path, monkeypatch):
    files = {str(p.relative_to(tiny_path)): p.read_bytes() for p in Path(tiny_path).rglob("*") if p.is_file()}
    snapshot = add_to_hub_cache(hf_caches / "hub", "model", "tinyorg/Tiny-Qwen2", files)
    monkeypatch.chdir(hf_caches)  # no folder named tinyorg/ here: the id is looked up in the cache
    assert resolve_model_path("tinyorg/Tiny-Qwen2") == str(snapshot)
    tok = load_tokenizer("tinyorg/Tiny-Qwen2")
    assert tok.decode(tok("2+2=4")["input_ids"]) == "2+2=4"
    assert load_model("tinyorg/Tiny-Qwen2").config.model_type == "qwen2"
    example = str(REPO / "examples" / "gsm8k_grpo.yaml")  # the config check accepts a cached id
    assert load_run_config(example, ["model.path=tinyorg/Tiny-Qwen2"]).model.path == "tinyorg/Tiny-Qwen2"
    with pytest.raises(ConfigError, match=r"model.path: no folder 'tinyorg/Missing', and model 'tinyorg/Missing' "
                                          r"is not in the local Hugging Face cache"):
        load_run_config(example, ["model.path=tinyorg/Missing"])
    where = hf_caches / "hub" / "models--tinyorg--Missing"
    with pytest.raises(FileNotFoundError, match=rf"model 'tinyorg/Missing' is not in the local Hugging Face cache "
                                                rf"\(looked in {where}\).*hf download tinyorg/Missing"):
        resolve_model_path("tinyorg/Missing")
    local = hf_caches / "tinyorg" / "Tiny-Qwen2"  # a local folder of the same name wins over the cache
    shutil.copytree(tiny_path, local)
    assert resolve_model_path("tinyorg/Tiny-Qwen2") == str(local)


# ---- GSM8K shipped in the package ------------------------------------------------------------------------
def test_shipped_gsm8k_loads_without_any_outside_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("RELAYRL_GSM8K_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # no ../shared around the working folder either
    assert gsm8k_search_path() == [BUILTIN_GSM8K]
    assert find_gsm8k("train") == BUILTIN_GSM8K / "train.jsonl.xz"
    train, test = load_rows(DatasetConfig(source="gsm8k:train")), load_rows(DatasetConfig(source="gsm8k:test"))
    assert (len(train), len(test)) == (7473, 1319)
    assert train[0]["question"].startswith("Natalia sold clips") and train[0]["answer"].endswith("#### 72")
    assert (BUILTIN_GSM8K / "LICENSE").read_text().startswith("MIT License")
    shared = REPO.parent / "shared" / "data" / "gsm8k"
    for split in ("train", "test") if (shared / "train.jsonl").is_file() else ():  # byte-identical to the source
        assert lzma.decompress((BUILTIN_GSM8K / f"{split}.jsonl.xz").read_bytes()) == (shared / f"{split}.jsonl") \
            .read_bytes()


def test_env_folder_comes_before_the_shipped_copy(monkeypatch):
    monkeypatch.setenv("RELAYRL_GSM8K_DIR", str(REPO / "tests" / "fixtures" / "gsm8k"))
    assert len(load_rows(DatasetConfig(source="gsm8k:train"))) == 5


def test_example_config_data_loads_on_a_fresh_copy(tmp_path):
    """The package and the example copied alone (no ../shared, no env): the data section of
    `relayrl train --config examples/gsm8k_grpo.yaml` loads, as on a fresh clone."""
    shutil.copytree(REPO / "relayrl", tmp_path / "clone" / "relayrl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "examples", tmp_path / "clone" / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    code = ("from relayrl.config.schema import load_run_config; from relayrl.data import load_rows; "
            "c = load_run_config('examples/gsm8k_grpo.yaml'); "
            "import relayrl; print(relayrl.__file__, len(load_rows(c.data.train)), "
            "len(load_rows(c.data.eval, 'data.eval')))")
    env = {k: v for k, v in os.environ.items() if k not in ("RELAYRL_GSM8K_DIR", "PYTHONPATH")}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path / "clone", env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(tmp_path / "clone" / "relayrl" / "__init__.py"), "7473", "64"]
    assert load_run_config(str(REPO / "examples" / "gsm8k_grpo.yaml")).data.train.source == "gsm8k:train"
