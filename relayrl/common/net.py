"""Network helpers every layer may need (weight groups, launched servers, rendezvous addresses)."""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def is_loopback(host: str) -> bool:
    """Whether `host` (an address or a name) reaches this machine only. A name counts when every address it
    resolves to is loopback; one that does not resolve does not count (the bind will fail anyway)."""
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    return bool(addresses) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_address(address: str) -> str:
    """`http(s)://host:port` without a trailing slash; anything else is a ValueError naming it."""
    parts = urlsplit(address.strip()) if isinstance(address, str) else None
    try:
        port = parts.port if parts else None
    except ValueError:
        port = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(f"bad engine address {address!r}: expected http(s)://host:port")
    if parts.path.strip("/") or parts.query:
        raise ValueError(f"bad engine address {address!r}: expected no path (http(s)://host:port)")
    return f"{parts.scheme}://{parts.netloc}"
