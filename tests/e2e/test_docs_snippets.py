"""docs/agents.md's code blocks, run as a reader would run them, so that the guide cannot drift from the code.

Why: a guide whose snippets no longer run teaches the wrong API. Each fenced block of docs/agents.md is a test
(its id: the section and the block's number there), in document order, handled by its language:
- ```jsonl: written to a file and loaded with relayrl.data.load_rows (every row validated as a run would);
- ```python whose first line names a file (`# my_rewards.py`): written to that file, then imported in a
  subprocess (its top-level asserts, e.g. "try them on a few strings", run there). Later blocks see the files the
  earlier ones wrote, the newest version of each name, as a reader following the guide would have them;
- other ```python blocks: run in a subprocess as `python snippet.py` (`<!-- test: notebook -->`: as a notebook
  cell), their folder the current directory and on PYTHONPATH, unchanged but for every config they build or train
  with made tiny (the random tiny model, one step, 2 x 2 samples; see RUNNER): calling relayrl.train trains;
- ```yaml: loaded with load_run_config (a dataset source it names that is not there is written first), its
  datasets loaded and its user code checked (check_user_code: rewards, tools, environment, agent options) as a
  run does before any model loads; with `<!-- test: train -->` it also trains one tiny step with `relayrl train`.

An HTML comment on the line before a block changes that; it is invisible in the rendered guide, and a directive
that runs less says why in parentheses:
- `<!-- test: skip (why) -->`: not run (counted and reported by test_skips_are_few_and_say_why);
- `<!-- test: needs MODULE (why) -->`: run only where MODULE imports, else skipped with that reason;
- `<!-- test: file (why) -->`: a file block only written (a program another block runs), not imported;
- `<!-- test: shape-only KEY (why) -->`: a YAML block whose KEY (MCP servers) is checked for shape, not started.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from bounds import bound
from conftest import TESTS, write_sums

REPO = Path(__file__).resolve().parents[2]
# $DOCS_SNIPPETS_DOC: another copy of the guide, e.g. one with a snippet broken on purpose to see the test fail
DOC = Path(os.environ.get("DOCS_SNIPPETS_DOC", REPO / "docs" / "agents.md"))

# what the test changes in a snippet's run: the tiny model (added per test), one step on 2 prompts x 2 samples of
# 8 tokens, a 2-prompt final evaluation, one judge worker, no samples printed, no TensorBoard, no saved model
TINY = {"engine.dtype": "float32", "model.autocast_bf16": False, "data.batch_size": 2, "data.group_size": 2,
        "data.train.size": 8, "sampling.max_new_tokens": 8, "run.steps": 1, "judge.workers": 1,
        "run.print_samples": 0, "run.tensorboard": False, "run.save_final": False, "eval.at_start": False,
        "eval.size": 2, "eval.n": 1}

# Runs a Python snippet as `python snippet.py` would (`script`), or as a notebook cell (`cell`: in a __main__ with
# no file, as Jupyter's), with TINY (in $DOCS_TINY) on top of every config it loads and the tiny model in place of
# any `model=` it passes: the snippet's own text is not touched. The judge's workers start with spawn, which
# imports a script's __main__ again: hence the guard here, and the one a script snippet needs.
RUNNER = '''
import dataclasses, json, os, runpy, sys

import relayrl.api as api

TINY = json.loads(os.environ["DOCS_TINY"])
_load_run_config, _with_inputs = api.load_run_config, api._with_inputs


def load_run_config(path, overrides=()):
    return _load_run_config(path, [*overrides, *(f"{k}={json.dumps(v)}" for k, v in TINY.items())])


def with_inputs(cfg, inputs, folder):
    if inputs.model is not None:
        inputs = dataclasses.replace(inputs, model=TINY["model.path"])
    return _with_inputs(cfg, inputs, folder)


api.load_run_config, api._with_inputs = load_run_config, with_inputs
'''
SCRIPT = RUNNER + '''
if __name__ == "__main__":
    sys.argv = sys.argv[1:]
    runpy.run_path(sys.argv[0], run_name="__main__")
'''

MARKER = re.compile(r"<!--\s*test:\s*(?P<directive>[\w-]+)\s*(?P<arg>[^\s(]*)\s*(?:\((?P<why>.*)\))?\s*-->")
FENCE = re.compile(r"```(?P<lang>\w*)")
FILE_LINE = re.compile(r"#\s*(?P<name>[\w/]+\.py)\s*")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced block of the guide, where it is, and what the marker on the line before it says."""

    line: int
    section: str  # the heading above it and the block's number under it: a test id that survives edits elsewhere
    lang: str
    body: str
    directive: str | None = None
    arg: str = ""
    why: str | None = None

    @property
    def file(self) -> str | None:
        """The file a Python block defines (`# my_rewards.py` on its first line), else None."""
        found = FILE_LINE.fullmatch(self.body.splitlines()[0]) if self.lang == "python" and self.body else None
        return found["name"] if found else None

    @property
    def id(self) -> str:
        return f"{self.section}-{self.lang}" + (f"-{self.file}" if self.file else "")


def blocks(text: str) -> list[Block]:
    """The fenced blocks of `text` in order, each with its section and the `<!-- test: ... -->` marker on the line
    before it."""
    lines, out, heading, seen = text.splitlines(), [], "top", {}
    i = 0
    while i < len(lines):
        if lines[i].startswith("#"):
            heading = re.sub(r"[^a-z0-9]+", "-", lines[i].lstrip("#").strip().lower()).strip("-")
        elif fence := FENCE.fullmatch(lines[i].strip()):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            seen[heading] = seen.get(heading, 0) + 1
            mark = MARKER.fullmatch(lines[i - 1].strip()) if i else None
            out.append(Block(i + 1, f"{heading}-{seen[heading]}", fence["lang"], "\n".join(lines[i + 1:end]) + "\n",
                             *((mark["directive"], mark["arg"], mark["why"]) if mark else ())))
            i = end
        i += 1
    return out


BLOCKS = blocks(DOC.read_text())


def skip_reason(block: Block) -> str | None:
    """Why `block` does not run here, or None."""
    if block.directive == "skip":
        return block.why
    if block.directive == "needs" and importlib.util.find_spec(block.arg) is None:
        return f"needs {block.arg}: {block.why}"
    return None


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest):
    """A reader's folder at `block`: the files every earlier block defined (newest version of each name), the
    repository's examples/, a small dataset; the current directory and sys.path there. Modules imported from it
    are dropped afterwards, so the next block imports its own version of my_rewards."""
    block: Block = request.node.callspec.params["block"]
    for earlier in BLOCKS[:BLOCKS.index(block)]:
        if earlier.file and skip_reason(earlier) is None:
            (tmp_path / earlier.file).write_text(earlier.body)
    (tmp_path / "examples").symlink_to(REPO / "examples")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    yield tmp_path
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def child_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The environment of a snippet's process: its folder and tests/ importable, this venv's `python` first on
    PATH (a config's `command: [python, my_agent.py]` runs it), no hub downloads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), TESTS, *filter(None, [env.get("PYTHONPATH")])])
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env | {"HF_HUB_OFFLINE": "1", **extra}


def run(cmd: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """`cmd` in the snippet's folder; fails the test with its output's tail unless it exits 0."""
    proc = subprocess.run(cmd, cwd=tmp_path, env=child_env(tmp_path, **env), capture_output=True, text=True,
                          timeout=bound(180))
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return proc


def assert_trained(runs: Path, proc: subprocess.CompletedProcess) -> None:
    """Every run under `runs` logged a training step and lost no sample to a failing episode (a broken tool,
    environment or agent program fails its samples, not the run: the metric shows it, the run's output says why)."""
    found = sorted(runs.glob("*/metrics.jsonl"))
    assert found, f"no run under {runs}"
    for file in found:
        records = [json.loads(line) for line in file.read_text().splitlines()]
        failed = sum(r.get("rollout/failed", 0) for r in records)
        assert not failed, f"{file}: {failed:g} samples failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        assert any("train/loss" in r for r in records), f"{file}: no training step"


def write_missing_sources(data: dict[str, Any], root: Path) -> None:
    """Write a file for each dataset source a YAML block names that the reader would bring (`data/train.jsonl`):
    two rows in its format, prompted by its `prompt_key` (chat messages) and answered unless `answer_key: null`."""
    for split in ("train", "eval"):
        ds = (data.get("data") or {}).get(split) or {}
        source = ds.get("source", "")
        if not re.fullmatch(r"[\w./-]+\.(jsonl|json|parquet|csv)", source) or (root / source).exists():
            continue
        key = ds.get("prompt_key") or "question"
        rows = [{key: [{"role": "user", "content": f"What is {i}+{i}?"}] if "prompt_key" in ds else f"What is {i}+{i}?"}
                | ({} if "answer_key" in ds and ds["answer_key"] is None else {"answer": str(2 * i)})
                for i in range(2)]
        path = root / source
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), path)
        else:
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def config_overrides(data: dict[str, Any], tmp_path: Path, tiny: str) -> dict[str, Any]:
    """What a YAML block needs besides itself to be a run: the tiny model, somewhere to write, and a dataset
    unless it names its own."""
    over: dict[str, Any] = {"model.path": tiny, "run.output_dir": str(tmp_path / "runs")}
    if "train" not in (data.get("data") or {}):
        over["data.train.source"] = write_sums(tmp_path / "sums.jsonl", 8)
    return over


def check_yaml(block: Block, tmp_path: Path, tiny: str) -> None:
    """Load the block as a run's config and make the checks a run makes before any model loads; with `train`,
    train one tiny step from it with the CLI."""
    from relayrl.config.schema import load_run_config
    from relayrl.data import load_rows
    from relayrl.envs.base import resolve_env
    from relayrl.run.build import check_user_code
    from relayrl.tools import mcp

    data = yaml.safe_load(block.body)
    write_missing_sources(data, tmp_path)
    if block.directive == "shape-only":  # e.g. MCP servers: each entry checked for shape, none started
        *parents, last = block.arg.split(".")
        node = data
        for part in parents:
            node = node[part]
        for i, spec in enumerate(node.pop(last)):
            mcp.check_spec(spec, f"{block.arg}[{i}]")
    (tmp_path / "snippet.yaml").write_text(yaml.safe_dump(data))
    over = config_overrides(data, tmp_path, tiny)
    cfg = load_run_config(str(tmp_path / "snippet.yaml"), [f"{k}={json.dumps(v)}" for k, v in over.items()])
    rows = load_rows(cfg.data.train, "data.train", cfg.data.prompt)
    if cfg.data.eval is not None:
        load_rows(cfg.data.eval, "data.eval", cfg.data.prompt)
    check_user_code(cfg, rows)
    if cfg.agent.kind == "env":  # the checks read the class; opening an episode runs it (a game's name, its kwargs)
        env_kwargs = cfg.agent.kwargs.get("env_kwargs") or {}
        opening = resolve_env(cfg.agent.kwargs["env"], env_kwargs)(**env_kwargs).reset(rows[0])
        opening = asyncio.run(opening) if inspect.isawaitable(opening) else opening
        assert opening is None or (isinstance(opening, list) and opening), opening
    if block.directive == "train":
        over = TINY | over
        proc = run([sys.executable, "-m", "relayrl", "train", "--config", "snippet.yaml",
                    *(f"{k}={json.dumps(v)}" for k, v in over.items())], tmp_path)
        assert_trained(tmp_path / "runs", proc)


def check_jsonl(block: Block, tmp_path: Path, tiny: str) -> None:
    """Every row of the block loads as a dataset row."""
    from relayrl.config.schema import DatasetConfig
    from relayrl.data import load_rows

    (tmp_path / "rows.jsonl").write_text(block.body)
    rows = load_rows(DatasetConfig(source=str(tmp_path / "rows.jsonl")))
    assert len(rows) == len(block.body.splitlines())


def check_python(block: Block, tmp_path: Path, tiny: str) -> None:
    """A file block: written, then imported (unless `file`); any other block: run, with configs made tiny."""
    if block.file:
        (tmp_path / block.file).write_text(block.body)
        if block.directive != "file":
            module = block.file.removesuffix(".py").replace("/", ".")
            run([sys.executable, "-c", f"import {module}"], tmp_path)
        return
    settings = TINY | {"model.path": tiny, "run.output_dir": str(tmp_path / "runs")}
    if block.directive == "notebook":
        cmd = [sys.executable, "-c", RUNNER + block.body]
    else:
        (tmp_path / "snippet.py").write_text(block.body)
        (tmp_path / "_docs_runner.py").write_text(SCRIPT)
        cmd = [sys.executable, "_docs_runner.py", "snippet.py"]
    proc = run(cmd, tmp_path, DOCS_TINY=json.dumps(settings))
    if re.search(r"\btrain\(", block.body):  # a snippet that trains must have trained (a guard that never runs...)
        assert_trained(tmp_path / "runs", proc)


RUN_MORE = ("train", "notebook")  # directives that change how a block runs
RUN_LESS = ("skip", "needs", "file", "shape-only")  # directives that run less of it: each says why
CHECKS = {"jsonl": check_jsonl, "yaml": check_yaml, "python": check_python}


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_snippet(block: Block, workdir: Path, tiny_path: str) -> None:
    if (why := skip_reason(block)) is not None:
        pytest.skip(f"docs/agents.md:{block.line}: {why}")
    assert block.lang in CHECKS, f"docs/agents.md:{block.line}: no check for ```{block.lang} blocks"
    CHECKS[block.lang](block, workdir, tiny_path)


def test_skips_are_few_and_say_why() -> None:
    """Every marker is one the test knows and says why; the count of blocks not run is reported and bounded, so a
    new skip is a decision, not a way to silence a broken snippet."""
    lines = DOC.read_text().splitlines()
    for n, line in enumerate(lines[:-1]):  # a marker that does not parse, or not above a block, would be ignored
        if "<!-- test" in line:
            assert MARKER.fullmatch(line.strip()) and FENCE.fullmatch(lines[n + 1].strip()), f"{DOC}:{n + 1}: {line}"
    for b in BLOCKS:
        assert b.directive in (None, *RUN_MORE, *RUN_LESS), f"docs/agents.md:{b.line}: unknown {b.directive!r}"
        assert b.directive not in RUN_LESS or b.why, f"docs/agents.md:{b.line}: say why in the marker"
    skipped = [f"L{b.line} ({why})" for b in BLOCKS if (why := skip_reason(b)) is not None]
    print(f"\ndocs/agents.md: {len(BLOCKS)} blocks, {len(BLOCKS) - len(skipped)} run, {len(skipped)} skipped"
          + "".join(f"\n  skipped {s}" for s in skipped))
    assert len(BLOCKS) >= 18 and len(skipped) <= 2, skipped
