"""Hugging Face hub ids resolved from the LOCAL hub cache only: relayrl never downloads.

A model (`model.path: HuggingFaceTB/SmolLM2-135M-Instruct`) or a dataset (`data.train.source: openai/gsm8k`)
that `hf download` or an earlier `from_pretrained` / `load_dataset` put in the cache is used from there; one
that is not cached is an error naming the id and the folder looked in, so the user knows what to fetch.
The cache folder is read from the environment on every call (not frozen at import as huggingface_hub does), so
HF_HUB_CACHE / HF_HOME set by a launcher or a test take effect.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

from huggingface_hub import snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError, LocalEntryNotFoundError

RepoType = Literal["model", "dataset"]
# org/name with the characters the hub allows; one slash: "a/b/c" and absolute paths are never ids
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def looks_like_repo_id(name: str) -> bool:
    """'org/name' (no '..', no trailing '.git'): what a hub id can be and a plain relative path rarely is."""
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith(".git")


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
    return hub_cache_dir() / f"{repo_type}s--{repo_id.replace('/', '--')}"


def cached_snapshot(repo_id: str, repo_type: RepoType = "model", revision: str = "main") -> Path:
    """The snapshot folder of a cached repo, without touching the network.

    `revision` is followed through refs/<revision>; a cache with no such ref (files fetched by commit hash,
    as `load_dataset` does) falls back to its newest snapshot. A dataset snapshot may hold only the
    configs that were fetched, which is normal, so only models must be complete.
    """
    folder = repo_folder(repo_id, repo_type)
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision,
                                      cache_dir=str(hub_cache_dir()), local_files_only=True))
    except IncompleteSnapshotError as e:
        if repo_type == "dataset":
            return Path(e.snapshot_path)
        raise FileNotFoundError(f"model {repo_id!r} is only partly in the local Hugging Face cache "
                                f"({folder}): {e}") from None
    except LocalEntryNotFoundError:
        snapshots = sorted((p for p in (folder / "snapshots").glob("*") if p.is_dir()),
                           key=lambda p: p.stat().st_mtime)
        if snapshots:
            return snapshots[-1]
    fetch = "hf download" + (" --repo-type dataset" if repo_type == "dataset" else "")
    raise FileNotFoundError(
        f"{repo_type} {repo_id!r} is not in the local Hugging Face cache (looked in {folder}); relayrl never "
        f"downloads: fetch it first (`{fetch} {repo_id}`), or point HF_HUB_CACHE / HF_HOME at the cache holding it")
