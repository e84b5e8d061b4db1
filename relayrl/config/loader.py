"""Typed dataclass configs from YAML files plus dotted ``key=value`` overrides.

Generic machinery only: schemas (the dataclasses) live elsewhere. Every error is a `ConfigError` naming the
dotted key (and the file) so a user can fix a typo without reading a traceback.

Decisions worth knowing:
- YAML is read with a SafeLoader that also reads ``1e-5`` / ``3E+2`` as floats (PyYAML follows YAML 1.1 and
  would keep them as strings) and rejects duplicate keys (PyYAML silently keeps the last one).
- int/float fields also accept strings that look like numbers (``"1e-5"``), so a quoted or hand-built value
  still works; nothing else is converted from a string. ints are accepted for floats, integral floats
  (``1e3``) for ints; bools are never numbers.
- numbers must be finite: ``.nan`` / ``.inf`` are refused for every int/float field (no key means "infinite";
  keys that can be unlimited take ``null``), so a NaN cannot slip past ``x > 0``-style checks.
- a file that is not UTF-8 or not valid YAML is reported with its line (and column), never a traceback.
- aliases are bounded (`MAX_ALIASES`, `MAX_ALIAS_GROWTH`, `MAX_DEPTH`): PyYAML shares an aliased node, but
  everything downstream (validation, deepcopy, `--print-config`, config.yaml) expands it, so a few hundred bytes
  of nested aliases ("billion laughs") would hang the run or write gigabytes. Legitimate configs use a handful.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
import types
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from relayrl.common.files import atomic_write_text
from relayrl.common.imports import import_from_path

T = TypeVar("T")
PresetsHook = Callable[[dict[str, Any]], Mapping[str, Any]]
_NO_SOURCE = "<dict>"
_MISSING = dataclasses.MISSING


class ConfigError(ValueError):
    """A config problem, rendered as ``source: dotted.key: message`` so the user knows where to look."""

    def __init__(self, message: str, *, key: str | None = None, source: str | None = None) -> None:
        self.message, self.key, self.source = message, key or None, source
        super().__init__(str(self))

    def __str__(self) -> str:
        return ": ".join([*(p for p in (self.source, self.key) if p and p != _NO_SOURCE), self.message])

    def _amend(self, *, prefix: str = "", source: str | None = None, note: str = "") -> None:
        """Add what an outer layer knows (sub-config path, file, override) as the error bubbles up."""
        self.key = _join(prefix, self.key or "") or None
        self.source, self.message = self.source or source, self.message + note
        self.args = (str(self),)


def import_named(path: str, key: str, *, function: bool = False) -> Any:
    """The object a config key names by import path ('pkg.mod:name'), imported before any model loads: a typo,
    or (function=True) something that is not callable, is a ConfigError naming the key."""
    try:
        obj = import_from_path(path)
    except (ImportError, ValueError) as e:
        raise ConfigError(str(e), key=key) from None
    if function and not callable(obj):
        raise ConfigError(f"{path!r} is a {type(obj).__name__}, not a function", key=key)
    return obj


def check(cond: bool, key: str, msg: str) -> None:
    """Raise ConfigError for ``key`` unless ``cond``; for ``validate()`` methods, which name only their own
    fields: the machinery prepends the dotted path of the sub-config."""
    if not cond:
        raise ConfigError(msg, key=key)


MAX_ALIASES = 100  # `*name` references in one document
MAX_ALIAS_GROWTH = 1_000_000  # values + characters that aliases add once expanded
MAX_DEPTH = 64  # nesting of mappings and lists, aliases expanded


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scientific floats, duplicate-key detection and bounded aliases (see module
    docstring)."""

    def __init__(self, stream: Any) -> None:
        super().__init__(stream)
        self._aliases = self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_ALIASES:
                raise yaml.composer.ComposerError(None, None, f"more than {MAX_ALIASES} aliases (*name); write the "
                                                  "values out", event.start_mark)
            return super().compose_node(parent, index)
        self._depth += 1  # checked while composing: PyYAML's composer recurses, a deep file would crash it
        try:
            if self._depth > MAX_DEPTH:
                raise yaml.composer.ComposerError(None, None, f"nested more than {MAX_DEPTH} levels deep",
                                                  event.start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_document(self) -> Any:
        node = super().compose_document()
        if node is not None:
            _check_expansion(node)
        return node


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose aliases, expanded, nest deeper than MAX_DEPTH, add more than MAX_ALIAS_GROWTH
    (values + characters), or refer to themselves. Each distinct node is visited once (sizes memoised), and the
    walk keeps its own stack: an expanded path can be MAX_ALIASES x MAX_DEPTH long."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    distinct = 0
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if children_done:
            kids = _children(node)
            own = 1 + (len(node.value) if isinstance(node, yaml.ScalarNode) else 0)
            size[key] = own + sum(size[id(k)] for k in kids)
            height[key] = 1 + max((height[id(k)] for k in kids), default=0)
            distinct += own
            open_nodes.discard(key)
            problem = (f"aliases nest more than {MAX_DEPTH} levels deep" if height[key] > MAX_DEPTH else
                       f"aliases expand to more than {MAX_ALIAS_GROWTH:,} values and characters beyond the file's "
                       "own (an alias bomb?); write the values out" if size[key] - distinct > MAX_ALIAS_GROWTH
                       else None)
            if problem:
                raise yaml.composer.ComposerError(None, None, problem, node.start_mark)
        elif key in open_nodes:
            raise yaml.composer.ComposerError(None, None, "an alias refers to a value that contains it",
                                              node.start_mark)
        elif key not in size:
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((k, False) for k in _children(node) if id(k) not in size)


_SCI_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _SCI_FLOAT, list("-+.0123456789"))


def _construct_map(loader: _Loader, node: yaml.MappingNode) -> Any:
    seen: set[str] = set()
    for key_node, _ in node.value:  # checked before merge keys (<<) are flattened in: those may repeat
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key_node.value!r}", key_node.start_mark)
            seen.add(key_node.value)
    return loader.construct_yaml_map(node)


_Loader.add_constructor("tag:yaml.org,2002:map", _construct_map)


def read_yaml(path: str) -> dict[str, Any]:
    """Read a YAML mapping (a config, a checkpoint's config.yaml) with the checks above; an empty file is an empty
    config. Every problem is a ConfigError naming the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise ConfigError("config file not found", source=path) from None
    except OSError as e:
        raise ConfigError(f"cannot read config file: {e}", source=path) from e
    try:
        data = yaml.load(decode_utf8(raw), Loader=_Loader)  # a SafeLoader
    except ValueError as e:  # not UTF-8: decode_utf8 names the line
        raise ConfigError(str(e), source=path) from None
    except yaml.YAMLError as e:
        raise ConfigError(_yaml_message(e), source=path) from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"the top level must be a mapping of keys to values, got {_describe(data)}",
                          source=path)
    return data or {}


def decode_utf8(raw: bytes) -> str:
    """``raw`` as text; raises ValueError naming the line and column of the first byte that is not UTF-8."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        column = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise ValueError(f"line {line}, column {column}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                         "save the file as UTF-8") from None


def _yaml_message(e: yaml.YAMLError) -> str:
    """'invalid YAML: line L, column C: problem' (PyYAML counts from 0 and names the stream, not the file)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    problem = " ".join(str(p) for p in (getattr(e, "context", None), getattr(e, "problem", None)) if p) or str(e)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    return f"invalid YAML: {where}{problem}"


def apply_overrides(data: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with each ``a.b.c=value`` set; the value is parsed as YAML (``null`` -> None,
    ``[1, 2]`` -> list, ``1e-5`` -> float, an empty value -> None). Missing intermediate mappings are created.

    Keys are not checked here: `from_dict` reports unknown ones with their dotted path.
    """
    if isinstance(overrides, str):
        raise TypeError("overrides must be a list of 'key=value' strings, not a single string")
    out = copy.deepcopy(dict(data))
    for override in overrides:
        key, sep, raw = override.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(p and p == p.strip() for p in parts):
            raise ConfigError(f"malformed override {override!r}: expected dotted.key=value")
        try:
            value = yaml.load(raw, Loader=_Loader)  # a SafeLoader
        except yaml.YAMLError as e:
            raise ConfigError(f"cannot parse the value of override {override!r}: {e}", key=key.strip()) from e
        node = out
        for i, part in enumerate(parts[:-1]):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ConfigError(f"cannot set {override!r}: the value here is {_describe(node)}, not a dict",
                                  key=".".join(parts[: i + 1]))
        node[parts[-1]] = value
    return out


def fill_missing(data: Mapping[str, Any], defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``data`` with keys of ``defaults`` added only where absent (recursing into mappings).

    The helper for presets hooks: a preset supplies values without clobbering what the user wrote in the
    file or on the command line (an explicit ``null`` counts as written).
    """
    out = dict(data)
    for k, v in defaults.items():
        if k not in out:
            out[k] = copy.deepcopy(v)
        elif isinstance(out[k], Mapping) and isinstance(v, Mapping):
            out[k] = fill_missing(out[k], v)
    return out


def load_config(cls: type[T], path: str | None, overrides: Iterable[str] = (), *,
                presets_hook: PresetsHook | None = None) -> T:
    """Read ``path`` (None: start empty), apply ``overrides``, expand presets, build and validate ``cls``.

    ``presets_hook(data) -> data`` sees the merged file + override data (a private copy it may mutate) and
    must only fill keys that are absent (see `fill_missing`): that is how explicit values beat presets.
    A ValueError it raises (e.g. an unknown preset name) is reported as a ConfigError.
    """
    overrides = list(overrides)
    source = _NO_SOURCE if path is None else str(path)
    data = apply_overrides({} if path is None else read_yaml(source), overrides)
    try:
        if presets_hook is not None:
            data = _run_presets_hook(presets_hook, data)
        return from_dict(cls, data, source=source)
    except ConfigError as e:
        e._amend(source=source, note=_blame_override(e.key, overrides))
        raise


def _run_presets_hook(hook: PresetsHook, data: dict[str, Any]) -> dict[str, Any]:
    try:
        out = hook(data)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(str(e)) from e
    if not isinstance(out, Mapping):
        raise ConfigError(f"presets_hook must return a mapping, got {_describe(out)}")
    return dict(out)


def _blame_override(key: str | None, overrides: list[str]) -> str:
    """Point at the override that set (or created) the failing key: the file alone would mislead."""
    for override in reversed(overrides):
        k = override.partition("=")[0].strip()
        if key and (key == k or key.startswith((k + ".", k + "[")) or k.startswith(key + ".")):
            return f" (see override {override!r})"
    return ""


def from_dict(cls: type[T], data: Mapping[str, Any], *, source: str = _NO_SOURCE, prefix: str = "") -> T:
    """Build and validate a (nested) dataclass from plain data; ``prefix`` is the dotted path of ``data``
    inside a larger config, used in messages; ``source`` (a file name) too."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"from_dict needs a dataclass type, got {cls!r}")
    try:
        return _build(cls, data, prefix, coerce=True)
    except ConfigError as e:
        e._amend(source=source)
        raise


@functools.cache
def _schema(cls: type) -> dict[str, tuple[dataclasses.Field, Any]]:
    """Init fields with their resolved type hints (get_type_hints copes with ``from __future__ import
    annotations``)."""
    hints = get_type_hints(cls)
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls) if f.init}


def _required(f: dataclasses.Field) -> bool:
    return f.default is _MISSING and f.default_factory is _MISSING


def _build(cls: type[T], data: Any, prefix: str, coerce: bool) -> T:
    if isinstance(data, cls):
        data = to_dict(data)  # rebuilt so that it is checked and validated like any other input
    if not isinstance(data, Mapping):
        raise ConfigError(f"expected a mapping ({cls.__name__}), got {_describe(data)}", key=prefix)
    schema = _schema(cls)
    for k in data:
        if k not in schema:
            close = difflib.get_close_matches(str(k), list(schema), n=3)
            hint = f"did you mean {', '.join(_join(prefix, c) for c in close)}?" if close else \
                f"valid keys here: {', '.join(_join(prefix, c) for c in schema)}"
            raise ConfigError(f"unknown key; {hint}", key=_join(prefix, str(k)))
    kwargs = {}
    for name, (f, tp) in schema.items():
        if name in data:
            kwargs[name] = _convert(tp, data[name], _join(prefix, name), coerce)
        elif _required(f):
            raise ConfigError("missing required key", key=_join(prefix, name))
    try:  # children were built (and validated) above, so validation is post-order
        obj = cls(**kwargs)
        if callable(getattr(obj, "validate", None)):
            obj.validate()
    except ConfigError as e:
        e._amend(prefix=prefix)
        raise
    except ValueError as e:
        raise ConfigError(str(e), key=prefix) from e
    return obj


def _convert(tp: Any, value: Any, key: str, coerce: bool) -> Any:
    """Check ``value`` against the type hint ``tp`` and return it converted (floats, tuples, dataclasses)."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any or tp is object:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _build(tp, value, key, coerce)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, key, coerce)
    if origin is Literal:
        for option in args:
            if value == option and type(value) is type(option):  # type check: True must not match 1
                return option
        close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1) \
            if isinstance(value, str) else []
        hint = f"; did you mean {close[0]!r}?" if close else ""
        options = ", ".join(map(repr, args))
        raise ConfigError(f"expected one of {options}, got {_describe(value)}{hint}", key=key)
    if tp in (list, tuple) or origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise _type_error(tp, value, key)
        items = [_convert(args[0] if args else Any, v, f"{key}[{i}]", coerce) for i, v in enumerate(value)]
        return tuple(items) if (origin or tp) is tuple else items
    if tp is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise _type_error(tp, value, key)
        kt, vt = args or (Any, Any)
        return {_convert(kt, k, _join(key, str(k)), coerce): _convert(vt, v, _join(key, str(k)), coerce)
                for k, v in value.items()}
    if tp in (bool, int, float, str):
        return _convert_scalar(tp, value, key, coerce)
    raise ConfigError(f"unsupported field type {_type_name(tp)}", key=key)


def _convert_union(tp: Any, value: Any, key: str, coerce: bool) -> Any:
    arms = [a for a in get_args(tp) if a is not type(None)]
    if value is None and len(arms) < len(get_args(tp)):
        return None
    if len(arms) == 1:  # X | None: keep X's precise message (e.g. an unknown key inside a sub-config)
        return _convert(arms[0], value, key, coerce)
    for strict in (True, False) if coerce else (True,):  # exact matches first: "5" stays a str in int | str
        for arm in arms:
            try:
                return _convert(arm, value, key, not strict)
            except ConfigError:
                pass
    raise _type_error(tp, value, key)


_INT_STR = re.compile(r"[-+]?[0-9]+")
_FLOAT_STR = re.compile(r"[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?")


def _convert_scalar(tp: type, value: Any, key: str, coerce: bool) -> Any:
    if type(value) is tp and not (tp is float and not math.isfinite(value)):
        return value
    number = None if isinstance(value, bool) or tp in (bool, str) else value  # bools are never numbers
    if coerce and isinstance(value, str) and tp in (int, float):
        text = value.strip()
        if _FLOAT_STR.fullmatch(text):  # ints match too; int() keeps big ints exact
            number = int(text) if _INT_STR.fullmatch(text) else float(text)
    if isinstance(number, float) and not math.isfinite(number):
        raise ConfigError(f"must be a finite number, got {number!r}", key=key)
    if tp is float and isinstance(number, int | float):
        return float(number)
    if tp is int and isinstance(number, int | float) and float(number).is_integer():
        return int(number)
    raise _type_error(tp, value, key)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _type_error(tp: Any, value: Any, key: str) -> ConfigError:
    return ConfigError(f"expected {_type_name(tp)}, got {_describe(value)}", key=key)


def _type_name(tp: Any) -> str:
    """A type hint as a user would write it in the schema: ``float | None``, ``Literal['a', 'b']``."""
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any or tp is type(None):
        return "Any" if tp is Any else "None"
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in args)
    if origin is Literal:
        return f"Literal[{', '.join(map(repr, args))}]"
    if origin is not None and args:
        return f"{origin.__name__}[{', '.join('...' if a is Ellipsis else _type_name(a) for a in args)}]"
    return getattr(tp, "__name__", repr(tp))


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"algo": {"clip_low": 0.2}} -> {"algo.clip_low": 0.2}: a config as dotted keys (the override syntax);
    lists and empty dicts stay whole values."""
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, Mapping) and v:
            out |= flatten(v, f"{prefix}{k}.")
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_dict(obj: Any) -> Any:
    """Plain data (dicts, lists, scalars) from a config: tuples become lists so YAML stays plain; the
    result round-trips through `from_dict`."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {name: to_dict(getattr(obj, name)) for name in _schema(type(obj))}
    if isinstance(obj, Mapping):
        return {k: to_dict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_dict(v) for v in obj]
    return obj


def dump_yaml(obj: Any, path: str) -> None:
    """Write ``obj`` (a config or plain data) as YAML atomically: a crash mid-write must never leave a
    truncated config beside a checkpoint, since resuming reads it back."""
    text = yaml.safe_dump(to_dict(obj), sort_keys=False, allow_unicode=True)  # fails before touching disk
    atomic_write_text(path, text)
