"""lm-eval's log-likelihood (what every multiple-choice benchmark runs) against `relayrl serve`: a local task
(tests/fixtures/lm_eval_mc: a YAML over a five-question jsonl, read offline) through both of lm-eval's clients of
such a server, `local-completions` (OpenAI completions with echo) and `sglang-generate` (SGLang's native /generate
with prompt logprobs). Both must finish with an accuracy, and each choice's log-likelihood must equal what lm-eval's
own `hf` backend computes from the same tiny model in this process."""

from __future__ import annotations

from pathlib import Path

import lm_eval  # the dev extra's (pyproject.toml)
import pytest
from serve_for_tests import Server

TASK = "relayrl_tiny_mc"
FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "lm_eval_mc"


@pytest.fixture(scope="module")
def url(tiny_path, tmp_path_factory):
    server = Server(tiny_path, tmp_path_factory.mktemp("lm-eval") / "server.log")
    yield server.wait_ready()
    assert server.stop() == 0


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """lm-eval run from the task's folder (its jsonl path is relative), with HF datasets offline and caching in
    tmp_path, so the test reads nothing but the fixture."""
    import datasets

    monkeypatch.chdir(FIXTURE)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets", raising=False)


def evaluate(model: str, model_args: dict) -> dict:
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], limit=4, log_samples=True,
                                   task_manager=TaskManager(include_path=str(FIXTURE)), random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def loglikelihoods(results: dict) -> list[list[float]]:
    """Per document, each choice's log-likelihood, in document order."""
    docs = sorted(results["samples"][TASK], key=lambda s: s["doc_id"])
    return [[float(r[0][0]) for r in s["resps"]] for s in docs]


def test_multiple_choice_through_both_clients_matches_hf(url, tiny_path, offline):
    served = {
        "local-completions": evaluate("local-completions", {
            "base_url": url + "/v1/completions", "model": tiny_path, "tokenizer": tiny_path,
            "tokenizer_backend": "huggingface", "tokenized_requests": True, "num_concurrent": 1, "max_retries": 1}),
        "sglang-generate": evaluate("sglang-generate", {
            "base_url": url + "/generate", "model": tiny_path, "tokenizer": tiny_path,
            "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1}),
    }
    hf = loglikelihoods(evaluate("hf", {"pretrained": tiny_path, "dtype": "float32", "device": "cpu"}))
    assert len(hf) == 4 and all(len(choices) >= 3 for choices in hf)
    for name, results in served.items():
        acc = results["results"][TASK]["acc,none"]
        assert 0.0 <= acc <= 1.0, name
        got = loglikelihoods(results)
        assert [len(c) for c in got] == [len(c) for c in hf], name
        for doc, ref in zip(got, hf):
            assert doc == pytest.approx(ref, abs=1e-3), name
