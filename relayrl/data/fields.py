"""Per-row field mapping of a dataset: `columns` renames fields, then the `map` function rewrites the row.

The map function is imported and checked when the dataset is loaded (before any model), and every row goes
through it then, so a function that fails on some row is reported with that row's location, not mid-run.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from relayrl.common.errors import InputError
from relayrl.config.loader import ConfigError, import_named
from relayrl.config.schema import DatasetConfig

RowFn = Callable[[dict[str, Any]], "dict[str, Any] | None"]


def row_function(cfg: DatasetConfig, key: str) -> RowFn | None:
    """Import `<key>.map` and check it can take one row; a ConfigError names the key otherwise."""
    if cfg.map is None:
        return None
    fn = import_named(cfg.map, f"{key}.map", function=True)
    try:
        inspect.signature(fn).bind({})
    except TypeError:
        raise ConfigError(f"{cfg.map!r} must take one argument (the row dict)", key=f"{key}.map") from None
    except ValueError:  # no signature to read (a builtin): calling it will tell
        pass
    return fn


def map_row(where: str, row: dict[str, Any], cfg: DatasetConfig, fn: RowFn | None,
            key: str) -> dict[str, Any] | None:
    """Apply `columns` then `map` to one row; None when the map function drops it."""
    if cfg.columns:
        missing = [old for old in cfg.columns if old not in row]
        if missing:
            raise InputError(f"{where}: row has no {missing[0]!r} (renamed by {key}.columns; keys: {sorted(row)})")
        row = {cfg.columns.get(k, k): v for k, v in row.items()}
    if fn is None:
        return row
    try:
        out = fn(row)
    except Exception as e:  # user code: any failure is reported with the row it failed on
        raise InputError(f"{where}: {key}.map {cfg.map!r} failed: {type(e).__name__}: {e}") from e
    if out is not None and not isinstance(out, dict):
        raise InputError(f"{where}: {key}.map {cfg.map!r} returned a {type(out).__name__}, expected a dict "
                         f"(or None to drop the row)")
    return out
