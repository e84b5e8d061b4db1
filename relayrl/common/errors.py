"""The error types for bad user input (printed without a traceback) and for SIGTERM, extras hints, and closing many
parts at once."""

from __future__ import annotations


class InputError(ValueError):
    """A user-supplied file or value is unusable; the message names the file and line (or the key), so the
    CLI prints it without a traceback."""


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler's stop, `kill`, systemd, a benchmark harness). Raised in the main thread like
    Ctrl-C's KeyboardInterrupt (the CLI's handler), so a run stops through the same cleanup (engines, producer,
    judge workers, servers, trackers) instead of dying mid-write; it also stops a run started from a shell that
    ignores SIGINT in background jobs, where Ctrl-C never reaches Python."""


def install_hint(extra: str) -> str:
    """How to add one of pyproject.toml's extras. relayrl is installed from its checkout (scripts/setup.sh,
    editable) until it is published, so `pip install relayrl[x]` would find nothing: every hint says this."""
    return f"pip install -e '.[{extra}]' in the relayrl checkout"


def close_all(closers) -> None:
    """Call every closer in order (None entries skipped) even if one fails, then raise the first failure: one
    part that fails to close must not leak the processes and threads of the others."""
    errors = []
    for close in filter(None, closers):
        try:
            close()
        except Exception as e:  # noqa: PERF203 - keep closing the rest
            errors.append(e)
    if errors:
        raise errors[0]
