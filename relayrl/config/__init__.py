"""Typed configs: dataclass schemas filled from YAML plus dotted ``key=value`` overrides.

See `relayrl.config.loader` for the machinery and its decisions (scientific floats, numeric strings).
"""

from relayrl.config.loader import (
    ConfigError,
    apply_overrides,
    check,
    dump_yaml,
    fill_missing,
    flatten,
    from_dict,
    import_named,
    load_config,
    to_dict,
)

__all__ = [
    "ConfigError",
    "apply_overrides",
    "check",
    "dump_yaml",
    "fill_missing",
    "flatten",
    "from_dict",
    "import_named",
    "load_config",
    "to_dict",
]
