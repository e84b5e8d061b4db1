"""Hugging Face hub ids: read from the local hub cache, downloaded into it on first use.

A model (`model.path: HuggingFaceTB/SmolLM2-135M-Instruct`) or a dataset (`data.train.source: openai/gsm8k`)
already in the cache (`hf download`, an earlier run, `from_pretrained`) is used from there without any request;
one that is not is fetched with huggingface_hub's `snapshot_download` (its progress bars on stderr; HF_ENDPOINT
and HF_TOKEN for gated or private repos are honoured). `org/name@rev` pins a branch, tag or commit.
A model fetches only what loading it needs (top-level config, tokenizer and safetensors files; `.bin` weights
only when the repo has no safetensors), a dataset only the files `datasets` reads.

Offline (HF_HUB_OFFLINE=1, or `run.offline: true` in a config) nothing is fetched and a missing id is an error
saying what to download and where it was looked for. The cache folder, the endpoint, the offline switch and the
timeout are read from the environment on every call (huggingface_hub freezes them at import), so values set by
a launcher or a test take effect.
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path
from typing import Literal

from huggingface_hub import HfApi, snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    IncompleteSnapshotError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

RepoType = Literal["model", "dataset"]
DEFAULT_ENDPOINT = "https://huggingface.co"
# org/name with the characters the hub allows; one slash: "a/b/c" and absolute paths are never ids; an optional
# @revision (branch, tag, commit, refs/pr/N)
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?$")
# what a model folder needs, top level only ("*/*" ignored: onnx/, original/, gguf copies are other formats)
MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
MODEL_FALLBACK_WEIGHTS = ["*.bin"]  # fetched only when the repo has no safetensors
# what `datasets` reads from a repo folder: the card (its configs pick a subset's files) and the data files
DATA_FILES = ["README.md", "*.parquet", "*.arrow", "*.csv*", "*.tsv*", "*.json*", "*.txt*"]
DATA_SUFFIXES = {".parquet", ".arrow", ".csv", ".tsv", ".json", ".jsonl", ".txt", ".gz", ".xz", ".bz2", ".zst"}
_TRUE = {"1", "ON", "YES", "TRUE"}  # huggingface_hub's reading of a boolean variable


def looks_like_repo_id(name: str) -> bool:
    """'org/name' or 'org/name@rev' (no '..', no trailing '.git'): what a hub id can be and a plain relative path
    rarely is."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.partition("@")[0].endswith(".git")


def split_revision(name: str) -> tuple[str, str | None]:
    """'org/name@rev' -> ('org/name', 'rev'); no '@': the repo's default branch (None)."""
    repo_id, _, revision = name.partition("@")
    return repo_id, revision or None


def hub_offline() -> bool:
    """HF_HUB_OFFLINE (or the older TRANSFORMERS_OFFLINE) as huggingface_hub reads it, but now, not at import."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.upper() in _TRUE


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hf_home() -> Path:
    """HF_HOME, else XDG_CACHE_HOME/huggingface, else ~/.cache/huggingface (huggingface_hub's precedence)."""
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser()


def hub_cache_dir() -> Path:
    """The hub cache folder, with huggingface_hub's precedence: HF_HUB_CACHE, HF_HOME/hub, XDG cache."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HUGGINGFACE_HUB_CACHE"):  # the older name, still honoured by huggingface_hub
        return Path(os.environ["HUGGINGFACE_HUB_CACHE"]).expanduser()
    return hf_home() / "hub"


def repo_folder(repo_id: str, repo_type: RepoType) -> Path:
    """Where the cache keeps a repo: <cache>/models--org--name or <cache>/datasets--org--name."""
    return hub_cache_dir() / f"{repo_type}s--{split_revision(repo_id)[0].replace('/', '--')}"


def fetch_command(name: str, repo_type: RepoType) -> str:
    """The shell command that puts `name` into the cache (the same files a download here takes)."""
    repo_id, revision = split_revision(name)
    kind = " --repo-type dataset" if repo_type == "dataset" else ""
    rev = f" --revision {revision}" if revision else ""
    return f"hf download{kind} {repo_id}{rev}"


def _patterns(repo_type: RepoType) -> dict[str, list[str] | None]:
    if repo_type == "model":
        return {"allow_patterns": MODEL_FILES, "ignore_patterns": ["*/*"]}
    return {"allow_patterns": DATA_FILES, "ignore_patterns": None}


def cached_snapshot(name: str, repo_type: RepoType = "model") -> Path:
    """The snapshot folder of a cached repo ('org/name' or 'org/name@rev'), without touching the network.

    The revision is followed through refs/<revision>; a cache with no ref for the default branch (files fetched
    by commit hash, as `load_dataset` does) falls back to its newest snapshot. A dataset snapshot may hold only
    the configs that were fetched, which is normal, so only models must be complete.
    """
    repo_id, revision = split_revision(name)
    folder = repo_folder(repo_id, repo_type)
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=str(hub_cache_dir()),
                                      local_files_only=True, **_patterns(repo_type)))
    except IncompleteSnapshotError as e:
        if repo_type == "dataset":
            return Path(e.snapshot_path)
        raise FileNotFoundError(f"model {name!r} is only partly in the local Hugging Face cache ({folder}); "
                                f"complete it with `{fetch_command(name, repo_type)}`") from None
    except LocalEntryNotFoundError:
        snapshots = sorted((p for p in (folder / "snapshots").glob("*") if p.is_dir()),
                           key=lambda p: p.stat().st_mtime)
        if snapshots and revision is None:
            return snapshots[-1]
    fetch = fetch_command(name, repo_type)
    raise FileNotFoundError(
        f"{repo_type} {name!r} is not in the local Hugging Face cache (looked in {folder}): fetch it with `{fetch}` "
        f"(or `huggingface-cli{fetch.removeprefix('hf')}`), or point HF_HUB_CACHE / HF_HOME at a cache holding it")


def hub_snapshot(name: str, repo_type: RepoType = "model", offline: bool = False) -> Path:
    """The snapshot folder of `name`: from the cache when there (no request), else downloaded, unless `offline`
    or HF_HUB_OFFLINE forbid it. Every failure is a FileNotFoundError naming the id (the CLI prints it plainly)."""
    try:
        return cached_snapshot(name, repo_type)
    except FileNotFoundError as e:
        if offline or hub_offline():
            switch = "run.offline is true" if offline else "HF_HUB_OFFLINE is set"
            raise FileNotFoundError(f"{e}; downloads are off ({switch})") from None
    return download(name, repo_type)


def download(name: str, repo_type: RepoType = "model") -> Path:
    """Fetch `name` into the hub cache with huggingface_hub, progress bars on stderr.

    One repo-info request with a timeout (HF_HUB_ETAG_TIMEOUT, default 10 s) goes first: snapshot_download's own
    has none, so a network that drops packets would otherwise hold the run for the system's connect timeout.
    """
    repo_id, revision = split_revision(name)
    endpoint, cache = hub_endpoint(), hub_cache_dir()
    timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
    print(f"relayrl: downloading {repo_type} {name} from {endpoint} into {cache} "
          f"(HF_HUB_OFFLINE=1 or run.offline: true to stay offline)", file=sys.stderr, flush=True)
    try:
        HfApi(endpoint=endpoint).repo_info(repo_id, repo_type=repo_type, revision=revision, timeout=timeout)
        folder = Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, cache_dir=str(cache),
                                        endpoint=endpoint, etag_timeout=timeout, **_patterns(repo_type)))
        if repo_type == "model" and not any(folder.glob("*.safetensors")):  # an older repo: .bin weights
            snapshot_download(repo_id, revision=folder.name, cache_dir=str(cache), endpoint=endpoint,
                              etag_timeout=timeout, allow_patterns=MODEL_FALLBACK_WEIGHTS, ignore_patterns=["*/*"])
        return folder
    except GatedRepoError:
        why = "is gated: accept its terms on the Hub's page and set HF_TOKEN to a token of that account"
    except RepositoryNotFoundError:
        why = "does not exist (or is private: set HF_TOKEN to a token that can read it)"
    except RevisionNotFoundError:
        why = f"has no revision {revision!r}"
    except Exception as e:  # the network, the server or the disk: its transport errors' types vary by version
        why = (f"cannot be downloaded ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else 'no detail'}); "
               f"check the network or HF_ENDPOINT, or fetch it where there is a network with "
               f"`{fetch_command(name, repo_type)}` and run offline (HF_HUB_OFFLINE=1 or run.offline: true)")
    raise FileNotFoundError(f"{repo_type} {name!r} at {endpoint} {why}") from None


def hub_dataset_id(source: str) -> str | None:
    """The hub id a `data.*.source` names: 'hf:org/name', or 'org/name' that is no local path and no data file
    name (a missing 'data/train.parquet' is reported as a missing file, never looked up on the Hub)."""
    name = source.removeprefix("hf:")
    if not looks_like_repo_id(name):
        return None
    if source.startswith("hf:"):
        return name
    local = Path(source).expanduser()
    return None if local.exists() or local.suffix.lower() in DATA_SUFFIXES else name
