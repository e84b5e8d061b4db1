"""lm-eval's generation path against a real `relayrl serve`: `lm_eval.simple_evaluate` with its local-completions
and local-chat-completions models runs a GSM8K-style task (tests/fixtures/lm_eval_tasks: local rows, `until` stop
strings, nothing downloaded) on the tiny model. lm-eval sends `stop` on every generation request, which the
server used to refuse; now the run finishes with a metric and no answer holds a stop string (lm-eval does not cut
completions' text itself: the server does)."""

from pathlib import Path

import pytest
from serve_for_tests import Server

ROOT = Path(__file__).resolve().parents[2]
TASKS = ROOT / "tests" / "fixtures" / "lm_eval_tasks"
TASK = "relayrl_gsm8k_local"
UNTIL = ("Question:", "\n\n")
NAME = "tiny"


@pytest.fixture(scope="module")
def url(tiny_path, tmp_path_factory):
    server = Server(tiny_path, tmp_path_factory.mktemp("serve") / "lm_eval.log", "--served-model-name", NAME)
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize("api", ["local-completions", "local-chat-completions"])
def test_lm_eval_generation_task_against_relayrl_serve(url, tiny_path, api, monkeypatch):
    monkeypatch.chdir(ROOT)  # the task's data_files are relative to the repository root
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # nothing is downloaded: the task reads a local file
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from lm_eval import simple_evaluate  # lm-eval imports in seconds: only this test pays for it
    from lm_eval.tasks import TaskManager

    chat = api == "local-chat-completions"
    args = {"model": NAME, "base_url": url + ("/v1/chat/completions" if chat else "/v1/completions"),
            "num_concurrent": 1, "max_retries": 1, "timeout": 60}
    if not chat:  # completions are sent as token ids, tokenized by lm-eval with the model's tokenizer
        args |= {"tokenizer_backend": "huggingface", "tokenizer": tiny_path}
    out = simple_evaluate(model=api, model_args=args, tasks=[TASK], task_manager=TaskManager(include_path=str(TASKS)),
                          limit=4, apply_chat_template=chat, bootstrap_iters=0, log_samples=True)
    metrics = out["results"][TASK]
    for name in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert 0.0 <= metrics[name] <= 1.0, metrics
    answers = {s["doc_id"]: s["resps"][0][0] for s in out["samples"][TASK]}  # one sample per doc and filter
    assert sorted(answers) == [0, 1, 2, 3]
    for answer in answers.values():
        assert isinstance(answer, str) and not any(u in answer for u in UNTIL), answer
