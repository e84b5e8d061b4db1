"""The package as users get it: a wheel built from this checkout, installed with --no-deps into a fresh virtualenv
that sees the project's installed dependencies minus the optional extras, and run from an empty folder (so the
checkout is not on sys.path). Also `relayrl --version` and `python -m relayrl` from the checkout.

The fresh venv reaches torch and the other core dependencies through a `.pth` line naming a folder of symlinks to
the project venv's site-packages: `venv --system-site-packages` run by a venv's python exposes the *base*
interpreter's site-packages, not the project venv's, and nothing may be downloaded here. The extras' packages are
left out of that folder, so the core paths are checked against a real install without them.
"""

import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from bounds import bound

import relayrl
from relayrl.cli import main

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 180
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".npz", ".so", ".pyc")
SHIPPED = ("relayrl", "pyproject.toml", "README.md")  # what building the wheel reads


def source_files(root: Path) -> list[str]:
    """The files a wheel is built from, relative to root: git's view of the checkout (tracked, or new and not
    ignored) where there is one, else every file but caches."""
    git = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *SHIPPED], cwd=root, capture_output=True,
                         text=True)
    if git.returncode == 0 and git.stdout:
        return [rel for rel in git.stdout.splitlines() if (root / rel).is_file()]
    files = [root / SHIPPED[1], root / SHIPPED[2], *(root / SHIPPED[0]).rglob("*")]
    return [str(f.relative_to(root)) for f in files if f.is_file() and "__pycache__" not in f.parts]


def _run(cmd: list[str], cwd: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """A subprocess that sees no PYTHONPATH but the one given (so only the installed relayrl can be imported)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=bound(TIMEOUT), env=env)


def extra_distributions(metadata: str) -> set[str]:
    """The distributions only the extras require (relayrl's own extras, which `dev` names, aside)."""
    names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower()
             for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.M) if "extra ==" in r}
    return names - {"relayrl", "pytest", "pytest-timeout", "ruff", "hypothesis", "setuptools"}


def _site_view(view: Path, leave_out: set[str]) -> None:
    """Symlinks to every entry of this venv's site-packages except those of the `leave_out` distributions and of
    relayrl itself (here an editable install of the checkout)."""
    site = Path(sysconfig.get_paths()["purelib"])
    skip = set()
    for name in (*leave_out, "relayrl"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        skip |= {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}  # packages and the .dist-info
    view.mkdir()
    for entry in site.iterdir():
        if entry.name not in skip and not entry.name.endswith(".pth"):
            (view / entry.name).symlink_to(entry)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict[str, Path]:
    """Build the wheel from a copy of the checkout's files and install it into a fresh venv."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    for rel in source_files(ROOT):
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, src / rel)
    build = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
                  "-w", str(tmp / "dist"), str(src)], cwd=tmp)
    assert build.returncode == 0, build.stderr[-3000:]
    (wheel,) = (tmp / "dist").glob("relayrl-*.whl")
    venv = tmp / "venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp)
    assert made.returncode == 0, made.stderr
    meta = zipfile.ZipFile(wheel).read(f"relayrl-{relayrl.__version__}.dist-info/METADATA").decode()
    _site_view(tmp / "site-view", extra_distributions(meta))
    (site,) = (venv / "lib").glob("python*/site-packages")
    (site / "project-deps.pth").write_text(f"{tmp / 'site-view'}\n")
    python = venv / "bin" / "python"
    install = _run([str(python), "-m", "pip", "install", "--no-deps", "--no-index", "--ignore-installed", "-q",
                    str(wheel)], cwd=tmp)
    assert install.returncode == 0, install.stderr[-3000:]
    cwd = tmp / "elsewhere"
    cwd.mkdir()
    return {"wheel": wheel, "meta": meta, "src": src, "venv": venv, "python": python, "site": site, "cwd": cwd}


def test_wheel_holds_every_package_file_and_nothing_else(installed):
    names = zipfile.ZipFile(installed["wheel"]).namelist()
    package = {n for n in names if n.startswith("relayrl/")}
    expected = {rel for rel in source_files(installed["src"]) if rel.startswith("relayrl/")}
    assert "relayrl/engine/kernels/decode_attention.c" in package
    assert "relayrl/__main__.py" in package
    assert expected - package == set(), "files under relayrl/ missing from the wheel (pyproject package-data)"
    tops = {n.split("/")[0] for n in names}
    assert tops == {"relayrl", f"relayrl-{relayrl.__version__}.dist-info"}, tops  # no tests/, bench/, examples/
    assert not [n for n in names if n.endswith(WEIGHT_SUFFIXES) or "__pycache__" in n]


def test_wheel_metadata_version_and_extras(installed):
    meta = installed["meta"]
    assert re.search(r"^Version: (.+)$", meta, re.M).group(1) == relayrl.__version__  # one source: __init__.py
    extras = set(re.findall(r"^Provides-Extra: (.+)$", meta, re.M))
    assert extras >= {"serve", "vllm", "ray", "trackers", "lora", "bench", "agents", "envs", "dev"}
    core = [r for r in re.findall(r"^Requires-Dist: (.+)$", meta, re.M) if "extra ==" not in r]
    core_names = {re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() for r in core}
    assert extra_distributions(meta) >= {"uvicorn", "ray", "peft", "trl", "wandb", "mlflow-skinny"}
    assert core_names.isdisjoint(extra_distributions(meta)), core_names & extra_distributions(meta)
    assert {"torch", "transformers", "fastapi", "httpx", "openai"} <= core_names


def test_installed_wheel_runs_outside_the_checkout(installed):
    venv, cwd = installed["venv"], installed["cwd"]
    version = _run([str(installed["python"]), "-m", "relayrl", "--version"], cwd=cwd)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith(f"relayrl {relayrl.__version__} from {installed['site'] / 'relayrl'} (torch ")
    helped = _run([str(venv / "bin" / "relayrl"), "--help"], cwd=cwd)
    assert helped.returncode == 0 and "train" in helped.stdout and "serve" in helped.stdout, helped.stderr
    keys = _run([str(venv / "bin" / "relayrl"), "train", "--help-config"], cwd=cwd)
    assert keys.returncode == 0 and "algo.clip_high" in keys.stdout, keys.stderr
    for module in ("relayrl.engine.attention", "relayrl.trainer.optim"):  # the shipped C sources compile and load
        kernel = _run([str(installed["python"]), "-c", f"from {module} import _SOURCE, load_kernel; "
                       "print(_SOURCE); print(load_kernel() is not None)"], cwd=cwd)
        assert kernel.returncode == 0, kernel.stderr[-2000:]
        source, loaded = kernel.stdout.split()
        assert Path(source).is_file() and Path(source).is_relative_to(installed["site"])
        if shutil.which(os.environ.get("CC", "cc")):
            assert loaded == "True", kernel.stderr[-2000:]


def test_every_module_imports_without_the_extras(installed):
    """Only the HTTP servers need an extra (uvicorn: `relayrl serve`, the external agents' endpoint), the
    TextArena adapter its package (the envs extra), and the verifiers runner verifiers (a program run by
    .venv-verifiers' python, never imported by relayrl): train, eval and the agents import on the core deps."""
    walk = ("import importlib, json, pkgutil, relayrl\nfailed = {}\n"
            "for m in pkgutil.walk_packages(relayrl.__path__, 'relayrl.'):\n"
            "    try:\n        importlib.import_module(m.name)\n"
            "    except ModuleNotFoundError as e:\n        failed[m.name] = e.name\n"
            "print(json.dumps(failed))")
    out = _run([str(installed["python"]), "-c", walk], cwd=installed["cwd"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout) == {"relayrl.serve.server": "uvicorn", "relayrl.agents.proxy": "uvicorn",
                                      "relayrl.serve.connections": "uvicorn",
                                      "relayrl.envs.textarena": "textarena",
                                      "relayrl.envs.verifiers_runner": "verifiers"}


def test_serve_without_its_extra_says_what_to_install(installed):
    out = _run([str(installed["venv"] / "bin" / "relayrl"), "serve", "--model", "smollm2"], cwd=installed["cwd"])
    assert out.returncode == 2
    assert out.stderr.strip() == ("relayrl serve: needs the uvicorn package: pip install -e '.[serve]' in the relayrl "
                                  "checkout")


def test_installed_wheel_trains_a_tiny_model_without_extras(installed, tiny_path, tmp_path):
    """One real GRPO step from the installed package on the core dependencies only."""
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                            for i in range(8)))
    args = {"model.path": tiny_path, "engine.dtype": "float32", "data.train.source": data, "data.batch_size": 2,
            "data.group_size": 2, "sampling.max_new_tokens": 8, "run.steps": 1, "run.output_dir": tmp_path,
            "run.name": "t", "judge.workers": 1, "run.print_samples": 0, "run.save_final": False}
    out = _run([str(installed["venv"] / "bin" / "relayrl"), "train", *[f"{k}={v}" for k, v in args.items()]],
               cwd=installed["cwd"])
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]


def test_version_flag(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    line = capsys.readouterr().out.strip()
    torch_version = importlib.metadata.version("torch")
    where = Path(relayrl.__file__).resolve().parent
    assert line == f"relayrl {relayrl.__version__} from {where} (torch {torch_version}, python " \
                   f"{platform.python_version()})"


def test_python_m_relayrl_is_the_cli(tmp_path):
    version = _run([sys.executable, "-m", "relayrl", "--version"], cwd=tmp_path, pythonpath=ROOT)
    assert version.returncode == 0 and version.stdout.startswith(f"relayrl {relayrl.__version__} from {ROOT}/relayrl")
    usage = _run([sys.executable, "-m", "relayrl"], cwd=tmp_path, pythonpath=ROOT)
    assert usage.returncode == 2 and "usage: relayrl" in usage.stderr  # argparse: a command is required
