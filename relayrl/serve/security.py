"""Who may talk to `relayrl serve`: the API key, the refusal to listen on a network without one, and the refusal
of requests a web page in the user's browser could send.

Every route but /health (the liveness probe) needs `Authorization: Bearer KEY` once a key is set, compared
in constant time. Without a key anyone who can reach the port can generate, pause and abort, load weights
and join weight-broadcast groups, so binding an address other than loopback without a key is refused
at start (before the model is loaded) unless --insecure says that is intended. The key comes from
--api-key-file, the RELAYRL_API_KEY environment variable or --api-key (`resolve_api_key`); the last is
visible to every local user in /proc/<pid>/cmdline, so it is warned about.

Loopback is not private from a browser: any page the user opens can send requests to 127.0.0.1. `SiteGuard`
refuses, before a route sees them (docs/security.md, "relayrl serve and the browser"):
- a POST whose body is not `Content-Type: application/json` (415): a form or a `text/plain` fetch is a
  "simple" request that no browser preflights; JSON is not, so the browser asks first and we never say yes.
  vLLM and SGLang refuse non-JSON bodies too, and their clients (the openai SDK, lm-eval, RemoteEngine) all
  send JSON;
- a `Host` that names neither this server nor an allowed host (400): DNS rebinding points a page's own name
  at 127.0.0.1, so its requests are "same-origin" to the browser but carry the page's name. Allowed: IP
  literals (rebinding needs a name), `localhost`, the --host name, and --allowed-hosts (`*`: any). With an
  API key any Host passes: a rebinding page cannot know the key;
- an `Origin` that is neither the request's own origin nor in --allowed-origins (403): browsers send it on
  every cross-origin POST, and programs send none. The allowed origins also get CORS answers, so a web
  client the user trusts can call the API.
"""

from __future__ import annotations

import ipaddress
import logging
import secrets
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import HTTPException, Request

from relayrl.common.net import is_loopback
from relayrl.serve.args import KEY_ENV
from relayrl.serve.errors import error_response

log = logging.getLogger("relayrl.serve")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
_BODY_METHODS = (b"POST", b"PUT", b"PATCH")


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
    return (f"refusing to listen on {host} without an API key: anyone who can reach it could generate, pause, "
            "abort and load weights. Give a key (--api-key-file FILE or the RELAYRL_API_KEY environment variable; "
            "clients send 'Authorization: Bearer KEY'), bind 127.0.0.1, or pass --insecure if the network is "
            "trusted.")


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


def resolve_api_key(flag: str | None, key_file: str | None, env: dict[str, str]) -> str | None:
    """The API key from exactly one of --api-key-file, --api-key, or RELAYRL_API_KEY (when neither flag is
    given); ServeRefused naming the source when it is unusable. A key file others may read is warned about,
    as --api-key is (other local users see a process's arguments)."""
    if flag is not None and key_file is not None:
        raise ServeRefused("give the API key once: --api-key or --api-key-file, not both")
    if key_file is not None:
        path = Path(key_file)
        try:
            key = path.read_text(encoding="utf-8").strip()
            mode = path.stat().st_mode
        except (OSError, UnicodeDecodeError) as e:
            raise ServeRefused(f"--api-key-file {key_file}: cannot read it ({type(e).__name__}: {e})") from None
        if not key or len(key.splitlines()) != 1:
            raise ServeRefused(f"--api-key-file {key_file}: must hold the key on one line")
        if mode & (stat.S_IRGRP | stat.S_IROTH):
            log.warning("--api-key-file %s can be read by other users (chmod 600 it)", key_file)
        return key
    if flag is not None:
        if not flag.strip():
            raise ServeRefused("--api-key: must not be empty")
        log.warning("--api-key is visible to every local user in the process list; prefer --api-key-file or "
                    "the %s environment variable", KEY_ENV)
        return flag
    key = env.get(KEY_ENV)
    if key is not None and not key.strip():
        raise ServeRefused(f"{KEY_ENV} is set but empty")
    return key.strip() if key else None


# ---- requests a browser could send ----------------------------------------------------------------------
def _hostname(host: str) -> str:
    """The name of a Host header or an Origin's authority, without port, brackets or a trailing dot."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        host = host.split(":", 1)[0]
    return host.rstrip(".")


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SitePolicy:
    """Which Hosts and Origins `SiteGuard` lets through (module doc)."""

    bind_host: str
    api_key_set: bool = False
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()

    def host_allowed(self, host: str) -> bool:
        names = {_hostname(h) for h in self.allowed_hosts}
        if self.api_key_set or "*" in names:
            return True
        name = _hostname(host)
        bound = _hostname(self.bind_host)
        return _is_ip(name) or name == "localhost" or name in names or (name == bound and bound not in
                                                                        WILDCARD_HOSTS)

    def origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        allowed = {o.strip().rstrip("/").lower() for o in self.allowed_origins}
        return "*" in allowed or origin in allowed or origin in (f"http://{host.lower()}", f"https://{host.lower()}")


class SiteGuard:
    """ASGI middleware: refuses cross-site requests (module doc) in the API's error shape, before any route."""

    def __init__(self, app: Any, policy: SitePolicy):
        self.app, self.policy = app, policy

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            refusal = self.refusal(scope["method"].encode(), _headers(scope["headers"]))
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, method: bytes, headers: dict[bytes, str]) -> Any:
        host, origin = headers.get(b"host", ""), headers.get(b"origin")
        if host and not self.policy.host_allowed(host):
            return error_response(400, f"Host: {_hostname(host)[:100]!r} is not a name of this server (start it "
                                  "with --allowed-hosts NAME to serve it)", "Host", "host_not_allowed")
        if origin is not None and not self.policy.origin_allowed(origin, host):
            return error_response(403, f"Origin: requests from {origin[:100]!r} are not allowed (start the server "
                                  "with --allowed-origins ORIGIN to allow a web client)", "Origin",
                                  "origin_not_allowed")
        if method in _BODY_METHODS and _has_body(headers) and not _is_json(headers.get(b"content-type")):
            shown = (headers.get(b"content-type") or "none")[:100]
            return error_response(415, f"Content-Type: must be application/json, got {shown!r}", "Content-Type",
                                  "unsupported_media_type")
        return None


def _headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[bytes, str]:
    """The first value of each header (names are lower case in ASGI)."""
    out: dict[bytes, str] = {}
    for name, value in raw:
        out.setdefault(name, value.decode("latin-1"))
    return out


def _has_body(headers: dict[bytes, str]) -> bool:
    """A body is coming (chunked, or a length other than 0), or a Content-Type says what an empty one is."""
    length = headers.get(b"content-length", "").strip()
    return (b"transfer-encoding" in headers or (length not in ("", "0")) or b"content-type" in headers)


def _is_json(content_type: str | None) -> bool:
    return content_type is not None and content_type.split(";", 1)[0].strip().lower() == "application/json"

