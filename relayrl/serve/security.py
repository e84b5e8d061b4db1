"""Who may talk to `relayrl serve`: the API key, and the refusal to listen on a network without one.

Every route but /health (the liveness probe) needs `Authorization: Bearer KEY` once a key is set, compared
in constant time. Without a key anyone who can reach the port can generate, pause and abort, load weights
and join weight-broadcast groups, so binding an address other than loopback without --api-key is refused
at start (before the model is loaded) unless --insecure says that is intended.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path

from fastapi import HTTPException, Request

from relayrl.common.net import is_loopback


def key_check(api_key: str | None) -> Callable[[Request], None]:
    """A FastAPI dependency: 401 unless the request carries the key (no-op without one)."""
    expected = f"Bearer {api_key}".encode()

    def check(request: Request) -> None:
        given = request.headers.get("authorization", "").encode("latin-1", "replace")
        if api_key is not None and not secrets.compare_digest(given, expected):
            raise HTTPException(status_code=401, detail="invalid API key (send 'Authorization: Bearer KEY')")

    return check


def exposure_error(host: str, api_key: str | None, insecure: bool) -> str | None:
    """Why the server must not start on `host` (None when it may)."""
    if api_key or insecure or is_loopback(host):
        return None
    return (f"refusing to listen on {host} without --api-key: anyone who can reach it could generate, pause, "
            "abort and load weights. Pass --api-key KEY (clients send 'Authorization: Bearer KEY'), bind "
            "127.0.0.1, or pass --insecure if the network is trusted.")


class ServeRefused(Exception):
    """The server will not start as asked (an exposed address without a key, a bad limit); the CLI prints
    the message and exits with 2, no traceback."""


def check_options(host: str, api_key: str | None, insecure: bool, weights_root: str | None) -> Path | None:
    """Refuse what can be refused before anything heavy is imported or loaded; returns the weights root."""
    refusal = exposure_error(host, api_key, insecure)
    if refusal:
        raise ServeRefused(refusal)
    if weights_root is None:
        return None
    if not Path(weights_root).is_dir():
        raise ServeRefused(f"--weights-root {weights_root} is not a directory")
    return Path(weights_root)
