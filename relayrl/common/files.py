"""Files a run writes and reads: atomic writes (temp file, fsync, rename), JSON lines, writable folders, the cache."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a file so that a crash leaves either the old or the new content, never half of it."""
    atomic_write_bytes(path, text.encode())


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """`atomic_write_text` for bytes: temp file in the same folder, fsync, rename over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_writable(path: str | os.PathLike, key: str) -> None:
    """Create `path` and write a file in it, so an unwritable folder fails before compute is spent;
    the error names the config key that chose the folder."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        (path / ".write_test").write_text("ok")
        (path / ".write_test").unlink()
    except OSError as e:
        raise OSError(f"{key}: cannot write to {path}: {e}") from e


def append_jsonl(path: str | os.PathLike, record: dict[str, Any]) -> None:
    """Append one JSON line with a single write() so a crash never leaves a half line behind.

    A line is written whole by one O_APPEND write; a torn final line (no trailing newline) from an
    earlier crash is skipped by `read_jsonl`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """Read complete JSON lines; an unterminated last line (a crash mid-write) is ignored."""
    out = []
    with open(path) as f:
        for line in f:
            if line.endswith("\n") and line.strip():
                out.append(json.loads(line))
    return out


def cache_dir() -> Path:
    """Where prepared and tiny models live: $RELAYRL_CACHE, else ~/.cache/relayrl."""
    return Path(os.environ.get("RELAYRL_CACHE") or Path.home() / ".cache" / "relayrl").expanduser()
