"""User objects named by import path ("package.module:Name") or saved by value (a "pickle:" file)."""

from __future__ import annotations

import functools
import importlib
import pickle
import sys
from typing import Any

PICKLE_SCHEME = "pickle:"  # "pickle:/abs/path/obj.pkl": an object saved by value (relayrl.api), see below


def import_from_path(spec: str) -> Any:
    """Resolve 'package.module:Name' (or 'package.module.Name') to the named object.

    This is how a config names user code: an agent, a reward function, a dataset or a filter. It also reads
    'pickle:/path/to/obj.pkl', an object relayrl.api saved by value (cloudpickle) because no import path reaches
    it (a notebook's or a script's __main__, a lambda, a closure): every loader, the judge's worker processes
    included, resolves it here, so none needs to know. Loading a pickle runs code, as importing a module does: a
    config is trusted either way.
    """
    if spec.startswith(PICKLE_SCHEME) and spec.endswith(".pkl"):  # never an attribute path: "pkl" follows a dot
        return _unpickle(spec[len(PICKLE_SCHEME):])
    if ":" in spec:
        mod_name, _, attr = spec.partition(":")
    else:
        mod_name, _, attr = spec.rpartition(".")
    if not mod_name or not attr:
        raise ValueError(f"import path {spec!r} must look like 'package.module:Name'")
    try:
        module = importlib.import_module(mod_name)
    except ImportError as e:
        raise ImportError(f"cannot import module {mod_name!r} named by {spec!r}: {e}") from e
    obj = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ImportError(f"module {mod_name!r} has no attribute {attr!r} (named by {spec!r})")
        obj = getattr(obj, part)
    return obj


@functools.cache
def _unpickle(path: str) -> Any:
    """The object in a 'pickle:' file, loaded once per process, so that every resolution of one path gives the
    same object (as an import does: caches keyed by the object, identity checks)."""
    try:
        with open(path, "rb") as f:
            return pickle.load(f)  # a cloudpickle file: it imports cloudpickle's helpers itself
    except OSError as e:
        raise ImportError(f"cannot read the pickled object {path!r}: {e}") from e


def module_level_path(obj: Any) -> str | None:
    """'module:name' of an object bound at the top level of the module named by its `__module__` (a configured
    reward function such as `helpful = llm_judge(...)`, which has no __qualname__ of its own), or None."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    name = next((k for k, v in vars(module).items() if v is obj), None) if module is not None else None
    return None if name is None else f"{module.__name__}:{name}"
