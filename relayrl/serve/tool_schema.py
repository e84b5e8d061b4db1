"""The JSON schemas of a chat request's tools, checked whole before the chat template sees them.

Templates walk a tool's `parameters` as they please (`properties.items()`, `required | join`, `type`), so
a schema of an unexpected shape fails inside the template, where the error no longer says which field. The
keywords that shape a schema are checked here as JSON Schema defines them, at every depth; keywords that
only annotate or bound values (`format`, `minimum`, `default`, ...) pass as they are. A tool's name is what
OpenAI allows and a little more (dots and colons, as MCP servers name tools): it is pasted into prompts and
into the opening of a forced call, so it must not carry quotes, whitespace or special-token text.
"""

from __future__ import annotations

import re
from typing import Any

from relayrl.serve.errors import BadRequest

MAX_DEPTH = 32  # schemas nested deeper than this are refused (real tools nest a few levels)
NAME = re.compile(r"[A-Za-z0-9_.:-]{1,128}")
TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}
_ONE = ("items", "additionalProperties", "not", "contains", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "if", "then", "else", "additionalItems")  # keywords whose value is one schema
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")  # a non-empty list of schemas
_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")  # name -> schema
_TEXT = ("description", "title", "$ref", "$schema", "$id", "pattern", "format")


def check_name(name: Any, field: str) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(field, "must be 1 to 128 letters, digits, '_', '-', '.' or ':'")
    return name


def check_schema(schema: Any, field: str) -> None:
    """A tool's `parameters`: an object schema whose every subschema has the shape JSON Schema gives it;
    BadRequest naming the first bad one (`tools[0].function.parameters.properties.x.type`)."""
    if not isinstance(schema, dict):
        raise BadRequest(field, "must be an object (a JSON schema)")
    stack: list[tuple[Any, str, int]] = [(schema, field, 0)]
    while stack:
        node, where, depth = stack.pop()
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            raise BadRequest(where, "must be a JSON schema (an object or true/false)")
        if depth > MAX_DEPTH:
            raise BadRequest(where, f"nests deeper than {MAX_DEPTH} levels")
        _check_keywords(node, where)
        stack.extend(_children(node, where, depth + 1))


def _check_keywords(node: dict[str, Any], where: str) -> None:
    kind = node.get("type")
    if kind is not None:
        kinds = kind if isinstance(kind, list) else [kind]
        if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
            raise BadRequest(f"{where}.type", f"must be one of {', '.join(sorted(TYPES))} or a list of them")
    required = node.get("required")
    if required is not None and (not isinstance(required, list) or not all(isinstance(r, str) for r in required)):
        raise BadRequest(f"{where}.required", "must be a list of property names")
    enum = node.get("enum")
    if enum is not None and not isinstance(enum, list):
        raise BadRequest(f"{where}.enum", "must be a list")
    for key in _TEXT:
        if key in node and not isinstance(node[key], str):
            raise BadRequest(f"{where}.{key}", "must be a string")


def _children(node: dict[str, Any], where: str, depth: int) -> list[tuple[Any, str, int]]:
    out = []
    for key in _ONE:
        if key in node:
            value = node[key]
            if key == "items" and isinstance(value, list):  # the older tuple form
                out += [(v, f"{where}.items[{i}]", depth) for i, v in enumerate(value)]
            else:
                out.append((value, f"{where}.{key}", depth))
    for key in _LISTS:
        if key in node:
            value = node[key]
            if not isinstance(value, list) or not value:
                raise BadRequest(f"{where}.{key}", "must be a non-empty list of schemas")
            out += [(v, f"{where}.{key}[{i}]", depth) for i, v in enumerate(value)]
    for key in _MAPS:
        if key in node:
            value = node[key]
            if not isinstance(value, dict):
                raise BadRequest(f"{where}.{key}", "must be an object mapping names to schemas")
            for name, sub in value.items():
                if key == "properties" and not isinstance(sub, dict):  # templates read `prop.type` and the like
                    raise BadRequest(f"{where}.{key}.{name}", "must be an object (a JSON schema)")
                out.append((sub, f"{where}.{key}.{name}", depth))
    return out
