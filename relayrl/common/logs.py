"""Logging for relayrl's processes: one level, one format, on stderr.

The level comes from `--log-level` (the CLI), else from RELAYRL_LOG_LEVEL, else INFO. INFO is where relayrl says
which automatic choices it made (kernels, attention, LM head, tool-call format, ...), once each. stdout is the
run's own report (the start block, the metrics table), so log records go to stderr only.

The level travels to every process of a run through RELAYRL_LOG_LEVEL: `configured` sets it for the duration
of a command, so the judge's workers, the producer, torchrun's ranks and launched servers inherit it, and each
calls `from_env` at start. Third-party libraries (httpx, urllib3, huggingface_hub, ray, uvicorn, ...) stay at
WARNING unless the level is debug: their INFO lines (one per HTTP request, for some) would bury relayrl's.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator

from relayrl.common.errors import InputError

ENV = "RELAYRL_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
DEFAULT = "info"
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%H:%M:%S"


class _Handler(logging.StreamHandler):
    """relayrl's handler on the root logger: found again (and replaced) by its type, never duplicated."""


def resolve(flag: str | None) -> str:
    """The level in force: the flag, else RELAYRL_LOG_LEVEL, else INFO. A bad variable is the user's error."""
    if flag:
        return flag
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return DEFAULT
    if value not in LEVELS:
        raise InputError(f"{ENV}={os.environ[ENV]!r}: expected one of {', '.join(LEVELS)}")
    return value


def third_party_level(level: str) -> str:
    """Other libraries' level under relayrl's `level`: WARNING, or quieter, unless debugging."""
    return level if level in ("debug", "error") else "warning"


def install(level: str) -> None:
    """Send log records to stderr in one format: relayrl's at `level`, everyone else's at `third_party_level`.
    Idempotent: a second call replaces the handler and the levels. On a torchrun rank other than 0, relayrl's
    INFO is dropped: every rank makes the same choices, and rank 0 reports them."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(handler)
    handler = _Handler(sys.stderr)
    handler.setFormatter(logging.Formatter(FORMAT, DATE_FORMAT))
    root.addHandler(handler)
    root.setLevel(third_party_level(level).upper())
    own = "warning" if level == "info" and os.environ.get("RANK", "0") != "0" else level
    logging.getLogger("relayrl").setLevel(own.upper())
    logging.getLogger("ray").setLevel(third_party_level(level).upper())  # Ray's own handler: it does not propagate


@contextlib.contextmanager
def configured(flag: str | None) -> Iterator[str]:
    """Logging at the resolved level for one command (its child processes inherit it through RELAYRL_LOG_LEVEL);
    afterwards the handler, the levels and the variable are as they were, so a caller that runs `relayrl.cli.main`
    in-process (a test, a notebook) keeps its own logging."""
    level = resolve(flag)
    root, own = logging.getLogger(), logging.getLogger("relayrl")
    saved = (os.environ.get(ENV), root.level, own.level, [h for h in root.handlers if isinstance(h, _Handler)])
    os.environ[ENV] = level
    install(level)
    try:
        yield level
    finally:
        previous, root_level, own_level, handlers = saved
        for handler in [h for h in root.handlers if isinstance(h, _Handler)]:
            root.removeHandler(handler)
        for handler in handlers:
            root.addHandler(handler)
        root.setLevel(root_level)
        own.setLevel(own_level)
        if previous is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = previous


def from_env() -> None:
    """In a child process of a relayrl command (a judge worker, the producer, a rank): log as the command does.
    Without RELAYRL_LOG_LEVEL (a library user's own process) logging is left as the program set it up."""
    if os.environ.get(ENV):
        install(resolve(None))
