"""Named extension points: a name maps to a function or class, and a config may name a user's own by import path.

Each place users extend (advantage estimators, policy losses, remote backends, agents, rewards) keeps one
`Registry`. Built-ins register themselves where they are defined (`@REGISTRY.register("name")`), so adding one to
the package touches its own module and its test, nothing else. A config value is either a registered name or
"package.module:attr"; `get` resolves both, and a bad one is an InputError naming the config key and the choices,
raised before any model loads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from relayrl.common.errors import InputError
from relayrl.common.imports import PICKLE_SCHEME, import_from_path

T = TypeVar("T")


def is_import_path(value: str) -> bool:
    """Whether a config value names an object by import path ("package.module:attr", "package.module.attr", or a
    "pickle:" file) rather than by a registered name, which never holds a dot or a colon."""
    return ":" in value or "." in value or value.startswith(PICKLE_SCHEME)


class Registry(Generic[T]):
    """Names of one kind of extension (`kind`, said in errors), each bound to its function or class."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: bind `name` to the decorated function or class. A name is bound once: two built-ins
        claiming one name is a bug in the package, not something to resolve by import order."""
        if is_import_path(name):
            raise ValueError(f"{self.kind} name {name!r} would read as an import path: use no '.' or ':'")

        def bind(obj: T) -> T:
            if name in self._entries and self._entries[name] is not obj:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = obj
            return obj
        return bind

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, value: str, key: str) -> T:
        """The entry registered as `value`, or the object `value` names by import path; `key` is the config key the
        value came from, named in the error when neither resolves."""
        if value in self._entries:
            return self._entries[value]
        if not is_import_path(value):
            raise InputError(f"{key}: unknown {self.kind} {value!r}; built-in: {', '.join(self.names())}, "
                             "or 'package.module:name' for your own")
        try:
            return import_from_path(value)
        except (ImportError, ValueError) as e:
            raise InputError(f"{key}: {e}") from None
