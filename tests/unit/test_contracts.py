"""Declared interfaces, not probes: engines, rollout sources and trainers are used through what they declare
(relayrl.engine.base.InferenceEngine, relayrl.run.sources.RolloutSource, the TrainController and rank 0's
LeaderController), never found out by hasattr/getattr or forwarded by a `__getattr__`. Read with `ast` from the
source, as tests/unit/test_layout.py reads the imports.

hasattr/getattr stay fine where what is probed is not ours to declare, and so is not checked here:
- Hugging Face configs and models (`head_dim`, `sliding_window`, `name_or_path`, `get_output_embeddings`): the
  fields differ between architectures;
- torch internals (a DTensor's `full_tensor`, `torch.ops.mkldnn` kernels, hook lists) and tokenizers
  (`chat_template`, `added_tokens_decoder`): they differ between versions;
- ctypes libraries (a C symbol that one libc or OpenMP has and another lacks);
- user code (an agent class's `check_kwargs`, an env class's methods, a function's `__qualname__`): a protocol
  check of what the user wrote, which reports what is missing;
- config dataclasses and argparse namespaces read by field name, and yaml errors' optional marks;
- a package's module-level `__getattr__` (lazy public names), which forwards no object.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from relayrl.engine.base import InferenceEngine, NotSupported
from relayrl.engine.local import LocalEngine
from relayrl.engine.remote import RemoteEngine
from relayrl.run.sources import InProcessRollouts, RolloutSource
from relayrl.trainer.leader import LeaderController

ROOT = Path(__file__).resolve().parents[2] / "relayrl"
# what names an engine, a rollout source or a trainer (the probed object's last name: `c.train_ctl.engine` is one,
# `self.engine.model` is a torch module; a bare `e` is as often an exception, so an engine's is told by the member)
CONTRACT_OBJECTS = {"engine", "engines", "_engine", "rollouts", "rollout_ctl", "source", "train_ctl", "ctl",
                    "_ctl", "trainer", "leader"}
# members too common to tell by name alone (an env class's `close` is checked as the user's protocol)
GENERIC = {"close", "start", "stop", "state_dict", "load_state_dict", "version", "stats"}


def _members(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def contract_members() -> set[str]:
    return (_members(InferenceEngine) | _members(RolloutSource) | _members(LeaderController)
            | set(RolloutSource.__annotations__)) - GENERIC


def _last_name(node: ast.expr) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):
        return _last_name(node.value)
    return ""


def probes(source: str) -> list[str]:
    """The probes of contract objects in `source`: hasattr/getattr of an engine, source or trainer (by the probed
    object's name) or of one of their members (by the attribute's name), and `__getattr__` methods."""
    members, found = contract_members(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            found += [f"line {f.lineno}: {node.name}.__getattr__ forwards to another object" for f in node.body
                      if isinstance(f, ast.FunctionDef) and f.name == "__getattr__"]
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                and node.func.id in ("hasattr", "getattr") and len(node.args) >= 2):
            continue
        target, attr = node.args[0], node.args[1]
        name = attr.value if isinstance(attr, ast.Constant) and isinstance(attr.value, str) else None
        if _last_name(target) in CONTRACT_OBJECTS or name in members:
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def test_relayrl_probes_no_engine_source_or_trainer():
    found = {str(p.relative_to(ROOT.parent)): hits for p in sorted(ROOT.rglob("*.py"))
             if (hits := probes(p.read_text()))}
    assert found == {}, "declare the member on the interface instead of probing for it"


@pytest.mark.parametrize("snippet", [
    "staged = [e.stage_weights(t, v) if hasattr(e, 'stage_weights') else None for e in xs]",
    "stats = getattr(engine, 'stats', {})",
    "return [e for e in self.rollout_ctl.engines if hasattr(e, 'rng_state')]",
    "x = getattr(self.rollouts, 'env', None)",
    "full = getattr(self.train_ctl, 'full_state_dict', None)",
    "if getattr(c.train_ctl.engine, 'sharded', False): pass",
    "class P:\n    def __getattr__(self, name):\n        return getattr(self._ctl, name)",
])
def test_the_check_sees_each_kind_of_probe(snippet):
    assert probes(snippet)


@pytest.mark.parametrize("snippet", [
    "d = getattr(cfg, 'head_dim', None)",
    "p = getattr(self.engine.model, 'name_or_path', '')",
    "full = p.full_tensor() if hasattr(p, 'full_tensor') else p",
    "close = getattr(cls, 'close', None)",
    "def __getattr__(name):\n    return 1",  # a module's lazy names
])
def test_the_check_leaves_what_is_not_ours_to_declare(snippet):
    assert probes(snippet) == []


def _engine_calls(path: Path) -> set[str]:
    """Members used on engines in `path`: on the loop names of `for e in ...engines` (and comprehensions, zips)
    and on `...engines[i]`."""
    tree = ast.parse(path.read_text())
    loop_names: set[str] = set()
    for node in ast.walk(tree):
        loops = [node] if isinstance(node, ast.For) else getattr(node, "generators", [])
        for loop in loops:
            if "engines" in ast.unparse(loop.iter):
                targets = loop.target.elts if isinstance(loop.target, ast.Tuple) else [loop.target]
                loop_names |= {t.id for t in targets[:1] if isinstance(t, ast.Name)}
    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            value = node.value
            if isinstance(value, ast.Name) and value.id in loop_names or (
                    isinstance(value, ast.Subscript) and _last_name(value.value) == "engines"):
                used.add(node.attr)
    return used


def test_every_member_callers_use_is_declared_on_the_engine_interface():
    declared = set(dir(InferenceEngine)) | set(InferenceEngine.__annotations__)
    used = _engine_calls(ROOT / "engine" / "rollout.py") | _engine_calls(ROOT / "run" / "sources.py")
    assert {"agenerate", "stage_weights", "load_weights", "release_memory", "rng_state", "stats"} <= used
    assert used - declared == set()
    # what both engines offer is the interface's: a caller holding either needs nothing else (their constructors,
    # such as from_config, are each engine's own: a caller holds an engine already built)
    shared = {n for n in _members(LocalEngine) & _members(RemoteEngine)
              if not isinstance(inspect.getattr_static(RemoteEngine, n), classmethod)}
    assert shared - declared == set()
    assert not inspect.isabstract(LocalEngine) and not inspect.isabstract(RemoteEngine)
    assert issubclass(LocalEngine, InferenceEngine) and issubclass(RemoteEngine, InferenceEngine)


def test_rollout_sources_declare_their_in_process_parts():
    for name in RolloutSource.__annotations__:
        assert name in InProcessRollouts.__dataclass_fields__ or name in _members(InProcessRollouts), name


def test_optional_capabilities_have_their_defaults_in_one_place():
    """A remote engine uses the interface's defaults, with no server: it stages nothing (the tensors are passed on
    unread), frees and restores nothing, and says clearly that it does not score."""
    engine = RemoteEngine("http://127.0.0.1:9")
    try:
        lazy = iter(())
        assert engine.stage_weights(lazy, 1) is lazy
        assert engine.release_memory() == 0
        assert engine.rng_state() is None
        engine.set_rng_state(None)
        with pytest.raises(NotSupported, match="RemoteEngine does not score"):
            engine.score([1, 2])
    finally:
        engine.close()
