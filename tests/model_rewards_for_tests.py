"""Model-based rewards for tests/unit/test_model_rewards.py and tests/integration/test_llm_judge.py: configured
reward objects at module level (as users write them; judge workers import them by path, their settings from the
environment the test sets before the workers start), a tiny random reward model, and a counting HTTP proxy.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from relayrl.judge.models import llm_judge, reward_model

TEMPLATE = "Question: {prompt}\nAnswer: {completion}\nReference: {answer}\nIs the answer right?"

rm = reward_model(os.environ.get("RELAYRL_TEST_RM", "unset"), name="rm", batch_size=3)
# Both judges send the same request for a sample, so with the reply cache on, whichever ran second in a worker
# would be answered from the first's reply and the proxy's count would depend on scheduling: the cache is off.
helpful = llm_judge(name="helpful", model="tiny", template=TEMPLATE, base_url=os.environ.get("RELAYRL_TEST_JUDGE_URL"),
                    max_tokens=4, timeout=float(os.environ.get("RELAYRL_TEST_JUDGE_TIMEOUT", "30")), retries=0,
                    cache=False)

strict = llm_judge(name="strict", model="tiny", template=TEMPLATE, base_url=os.environ.get("RELAYRL_TEST_JUDGE_URL"),
                   max_tokens=4, pattern=r"<score>(\d+)</score>", retries=0, cache=False,
                   timeout=float(os.environ.get("RELAYRL_TEST_JUDGE_TIMEOUT", "30")))  # the tiny model never says so


def length(completions: list[Any], **kwargs: Any) -> list[float]:
    """A second function next to a model reward: the completion's length / 10."""
    return [len(c if isinstance(c, str) else c[-1]["content"]) / 10 for c in completions]


def build_rm(out: Path, tiny_path: str, num_labels: int = 1, chat: bool = True) -> Path:
    """A random qwen2 sequence classifier with the tiny model's tokenizer (without its chat template if not
    `chat`), saved as an HF folder."""
    import torch
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    if not chat:
        tok.chat_template = None
    config = AutoConfig.for_model("qwen2", vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                  num_labels=num_labels, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out)
    tok.save_pretrained(out)
    if not chat:
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


class Proxy:
    """A local HTTP proxy in front of an OpenAI-compatible server that records each request body, counts the
    requests in flight (the most at once in `peak`), holds requests whose text contains `slow_marker` for
    `delay` seconds, and appends `suffix` to every reply's content."""

    def __init__(self, upstream: str, delay: float = 0.0, suffix: str = "", hold: float = 0.0):
        self.upstream, self.delay, self.suffix, self.hold = upstream.rstrip("/"), delay, suffix, hold
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = self.peak = 0
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def forward(self, path: str, body: bytes) -> bytes:
        request = json.loads(body)
        with self.lock:
            self.bodies.append(request)
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            time.sleep(self.hold)  # keeps requests overlapping, so a missing limit shows in `peak`
            if "SLOW" in json.dumps(request["messages"]):
                time.sleep(self.delay)
            req = urllib.request.Request(self.upstream + path.removeprefix("/v1"), data=body,
                                         headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                out = json.loads(r.read())
        finally:
            with self.lock:
                self.in_flight -= 1
        for choice in out["choices"]:
            choice["message"]["content"] = (choice["message"]["content"] or "") + self.suffix
        return json.dumps(out).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                try:
                    out, status = proxy.forward(self.path, body), 200
                except OSError as e:  # the upstream went away (a held request outliving the test's server)
                    out, status = json.dumps({"error": {"message": str(e)}}).encode(), 502
                with contextlib.suppress(OSError):  # the client timed out and left
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(out)))
                    self.end_headers()
                    self.wfile.write(out)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
