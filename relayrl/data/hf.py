"""Datasets read through Hugging Face `datasets`: parquet / csv / tsv / arrow files, folders of data files,
`save_to_disk` folders, and hub ids ('org/name[@revision]' or 'hf:org/name').

A hub id resolves to its snapshot folder in the hub cache, downloaded there on first use unless offline
(`relayrl.models.hub`; a run's config check has fetched it already), which is then read as a local folder: the
dataset card's configs pick the files of `subset`, and `datasets` itself never goes online. The arrow files
`datasets` builds from these sources go to its usual cache (HF_DATASETS_CACHE or HF_HOME/datasets, read at
call time).
Every failure of `datasets` is re-raised as an InputError naming the source, so the CLI prints it plainly.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from datasets import (
    Dataset,
    DatasetDict,
    Image,
    disable_progress_bars,
    enable_progress_bars,
    is_progress_bar_enabled,
    load_dataset,
    load_from_disk,
)

from relayrl.common.errors import InputError
from relayrl.config.schema import DatasetConfig
from relayrl.models.hub import hf_home, hub_dataset_id, hub_snapshot

BUILDERS = {".parquet": ("parquet", {}), ".csv": ("csv", {}), ".tsv": ("csv", {"delimiter": "\t"}),
            ".arrow": ("arrow", {})}
HUB_PREFIX = "hf:"
Located = tuple[str, Any]


def datasets_cache_dir() -> Path:
    """Where `datasets` writes the arrow files it builds: HF_DATASETS_CACHE, else HF_HOME/datasets."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    return hf_home() / "datasets"


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """No 'Generating train split' bars in the run log; the caller's setting is restored after."""
    was_on = is_progress_bar_enabled()
    disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            enable_progress_bars()


def _read(label: str, fn: Any, *args: Any, **kwargs: Any) -> Dataset | DatasetDict:
    """Call a `datasets` loader; any failure becomes an InputError naming the source."""
    try:
        with _quiet():
            return fn(*args, **kwargs)
    except Exception as e:  # datasets raises many types (ValueError, DatasetGenerationError, ArrowInvalid, ...)
        raise InputError(f"{label}: cannot read with Hugging Face datasets: {type(e).__name__}: {e}") from e


def _load_path(path: Path, cfg: DatasetConfig) -> Dataset | DatasetDict:
    """A data file by its suffix, a save_to_disk folder, or a folder of data files (a hub snapshot too)."""
    if path.is_file():
        builder, kwargs = BUILDERS[path.suffix.lower()]
        return _read(str(path), load_dataset, builder, data_files=str(path), cache_dir=str(datasets_cache_dir()),
                     **kwargs)
    if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
        return _read(str(path), load_from_disk, str(path))
    return _read(str(path), load_dataset, str(path), name=cfg.subset, cache_dir=str(datasets_cache_dir()))


def _pick_split(data: Dataset | DatasetDict, cfg: DatasetConfig, label: str, key: str) -> tuple[Dataset, str]:
    """The split named by `<key>.split`; with none named, the only split (never a silent guess among several)."""
    if isinstance(data, Dataset):  # a save_to_disk Dataset: one split, whatever it was called
        return data, str(data.split or "train")
    names = list(data)
    if cfg.split is None:
        if len(names) != 1:
            raise InputError(f"{label} has splits {names}: choose one with {key}.split")
        return data[names[0]], names[0]
    if cfg.split not in data:
        raise InputError(f"{label} has no split {cfg.split!r} (splits: {names}); set {key}.split")
    return data[cfg.split], cfg.split


def hf_rows(cfg: DatasetConfig, key: str) -> Iterator[Located]:
    """Rows of a data file/folder or a hub dataset, each with a 'source[split][i]' location for errors.
    Rows are produced lazily, so `size` rows of a large dataset cost only those rows."""
    src = cfg.source
    path = Path(src).expanduser()
    if src.startswith(HUB_PREFIX) or not path.exists():
        name = src.removeprefix(HUB_PREFIX)
        local = "" if src.startswith(HUB_PREFIX) else f"no file or folder {src!r}, and "
        if hub_dataset_id(src) is None:
            raise FileNotFoundError(f"{key}.source: {local}{name!r} is not a hub id 'org/name'")
        try:
            path = hub_snapshot(name, "dataset")
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{key}.source: {local}{e}") from None
        label = f"{name}" + (f" ({cfg.subset})" if cfg.subset else "") + f" at {path}"
    else:
        name = label = str(path)
    data, split = _pick_split(_load_path(path, cfg), cfg, label, key)
    data = _undecoded_images(data)
    return ((f"{name}[{split}][{i}]", row) for i, row in enumerate(data))


def _undecoded_images(data: Dataset) -> Dataset:
    """Image columns read as {"bytes", "path"} values, for relayrl.data.images to decode under its limits (checked
    size, no decompression bomb) rather than as PIL images `datasets` decoded without them."""
    for name, feature in (data.features or {}).items():
        if isinstance(feature, Image):
            data = data.cast_column(name, Image(decode=False))
        elif isinstance(getattr(feature, "feature", None), Image):  # a list of images
            data = data.cast_column(name, type(feature)(Image(decode=False)))
    return data
