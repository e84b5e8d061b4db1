"""Where models live and how a model folder is written: built in a temp folder beside its target and renamed
into place, so an interrupted build never leaves a folder that looks complete (a marker file says a build
finished).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

MARKER = ".relayrl_complete"

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + (message['content'] or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)



# ---- atomic folder builds ------------------------------------------------------------------------
def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def atomic_build(target: Path, build: Callable[[Path], None], *, force: bool = False) -> Path:
    """Run build(tmp) in a temp folder beside target, then rename it into place.

    A rename is atomic, so readers see either no folder or a complete one. If another process
    finishes the same target first, its folder is kept and ours is dropped.
    """
    if not force and is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        build(tmp)
        (tmp / MARKER).write_text(json.dumps({"built_at": time.time()}) + "\n")
        for f in tmp.iterdir():  # mkdtemp and safetensors make owner-only files; servers may run as others
            f.chmod(0o644)
        tmp.chmod(0o755)
        if target.exists() and (force or not is_complete(target)):
            old = target.with_name(f".{target.name}.old-{os.getpid()}-{time.time_ns()}")
            os.rename(target, old)
            shutil.rmtree(old, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_complete(target):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _remove_stale_temps(target: Path, max_age_s: float = 3600.0) -> None:
    """Delete temp folders left by killed builds (a build takes seconds, so an hour-old one is dead)."""
    for p in target.parent.glob(f".{target.name}.*-*"):
        if p.is_dir() and time.time() - p.stat().st_mtime > max_age_s:
            shutil.rmtree(p, ignore_errors=True)


def make_portable(folder: Path, *, chat_template: str, model_max_length: int) -> None:
    """Make a saved folder read the same under transformers 4.x (e.g. the one inside vLLM).

    transformers 5 writes tokenizer_class 'TokenizersBackend', the template only in
    chat_template.jinja, and rope_theta only inside rope_parameters (4.x would silently fall back
    to its default theta). PreTrainedTokenizerFast, an inline template and the legacy config keys
    mean the same to both versions.
    """
    tok_path, cfg_path = folder / "tokenizer_config.json", folder / "config.json"
    tok_cfg = json.loads(tok_path.read_text())
    for key in ("is_local", "local_files_only", "backend", "name_or_path"):
        tok_cfg.pop(key, None)
    tok_cfg.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=chat_template,
                   model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    tok_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    cfg = json.loads(cfg_path.read_text())
    if "rope_theta" in (cfg.get("rope_parameters") or {}):
        cfg.setdefault("rope_theta", cfg["rope_parameters"]["rope_theta"])
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg["dtype"])
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
