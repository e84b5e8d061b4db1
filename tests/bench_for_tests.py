"""Running a bench/ script as a test does: a subprocess in the repository, offline, its JSON result read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_bench(script: str, *args: str, out: Path, env: dict[str, str] | None = None) -> dict:
    """Run `bench/<script> <args> --out <out>` to completion (asserting it succeeded) and return what it wrote."""
    proc = subprocess.run([sys.executable, f"bench/{script}", *args, "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())
