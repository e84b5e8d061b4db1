"""An LLM judge as a TRL-style batched reward function: ask a model behind any OpenAI-compatible endpoint
(another `relayrl serve`, vLLM, a hosted API) to grade each completion, and parse a score from its reply.

    helpful = llm_judge(name="helpful", base_url="http://127.0.0.1:8000/v1", model="judge",
                        template="Rate 1-10 how well this answers.\\n{prompt}\\n---\\n{completion}\\nScore:")

`llm_judge` returns an `LLMJudge`: a plain picklable object whose `async __call__(prompts, completions,
**columns)` the judge's workers await like any batched function, logged as reward/<name>. Workers import reward
functions by path, so the object lives at the top level of a module (`judge.reward_fn: [my_rewards:helpful]`;
from Python, `train(cfg, reward=[helpful])` finds it there too). YAML alone: `relayrl.judge.models:llm_reward`
with `judge.kwargs.llm_judge: {...}` (relayrl/judge/models.py).

Why these choices:
- The template is `str.format` text over {prompt}, {completion}, {answer} and every column of the row, checked
  against the row at call time (a missing column raises: the batch is rejected, with the name, never scored
  on a half-filled prompt).
- `concurrency` caps this judge's requests in flight to its endpoint across all the run's judge workers
  (relayrl/judge/slots.py: file locks the kernel releases when a worker dies), not per worker: a user sizes it
  to the endpoint. Waiting for a slot counts in judge.timeout, which bounds each batch.
- `timeout` (per request) and `retries` go to the OpenAI SDK, which retries connection errors, 408/409/429
  and 5xx with backoff. A request that still fails raises: the batch's samples are rejected ("error"), never
  trained on a reward with a missing term. judge.timeout bounds the whole batch and must exceed
  timeout x (retries + 1) to let the retries happen.
- A reply that does not parse is None: no reward from this judge for that sample (the others still count);
  each worker counts them (`parse_failures`) and logs the rate, since a judge that stops answering in format
  otherwise looks like a judge that scores nothing.
- The cache maps the exact request (endpoint, model, messages, sampling settings) to the reply, in memory per
  worker process and optionally in `cache_dir` (one file per request, written atomically, shared by workers
  and runs): GRPO samples repeat (short answers, a policy that converged), and a repeat costs no request.
  Replies are cached, not scores, so a changed parser applies to cached replies too.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import logging
import os
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.common.files import atomic_write_text
from relayrl.judge.functions import is_conversational
from relayrl.judge.slots import Slots

logger = logging.getLogger(__name__)

NUMBER = r"(-?\d+(?:\.\d+)?)"  # the last number in the reply: judges reason first and score last
YES_NO = r"\b(yes|no)\b"
PARSERS = {"number": (NUMBER, None), "yes_no": (YES_NO, {"yes": 1.0, "no": 0.0})}

_replies: dict[str, str] = {}  # the in-memory cache: request key -> reply, per worker process
parse_failures: dict[str, list[int]] = {}  # judge name -> [unparsable replies, replies], per worker process


def parse_score(reply: str | None, pattern: str = NUMBER, labels: dict[str, float] | None = None) -> float | None:
    """The score in a judge's reply: the last match of `pattern` (case-insensitive), its first group (or the
    whole match) read as a number, or looked up in `labels` (lower-cased) when given; None if nothing parses."""
    if not reply:
        return None
    matches = list(re.finditer(pattern, reply, flags=re.IGNORECASE))
    if not matches:
        return None
    m = matches[-1]
    text = (m.group(1) if m.groups() else m.group(0)).strip()
    if labels is not None:
        return labels.get(text.lower())
    try:
        return float(text)
    except ValueError:
        return None


def render_prompt(prompt: Any) -> str:
    """A prompt as template text: chat messages become 'role: content' lines (one message: its content)."""
    if not is_conversational(prompt):
        return "" if prompt is None else str(prompt)
    if len(prompt) == 1:
        return str(prompt[0]["content"])
    return "\n".join(f"{m['role']}: {m['content']}" for m in prompt)


def _completion_text(completion: Any) -> str:
    return completion[-1]["content"] if is_conversational(completion) else str(completion)


class LLMJudge:
    """A configured LLM judge (see the module docstring); build it with `llm_judge`."""

    def __init__(self, *, name: str, model: str, template: str, base_url: str | None = None,
                 system: str | None = None, parser: str = "number", pattern: str | None = None,
                 labels: dict[str, float] | None = None, concurrency: int = 8, timeout: float = 60.0,
                 retries: int = 2, max_tokens: int = 256, temperature: float = 0.0, cache: bool = True,
                 cache_dir: str | None = None, api_key_env: str = "OPENAI_API_KEY", module: str | None = None):
        if parser not in PARSERS:
            raise ValueError(f"llm_judge parser must be one of {sorted(PARSERS)} (or give pattern=), got {parser!r}")
        if concurrency < 1 or not timeout > 0 or retries < 0:
            raise ValueError("llm_judge needs concurrency >= 1, timeout > 0 and retries >= 0")
        default_pattern, default_labels = PARSERS[parser]
        self.pattern = pattern or default_pattern
        re.compile(self.pattern)  # a bad regex fails at start-up, not in every batch
        self.labels = {k.lower(): float(v) for k, v in labels.items()} if labels is not None else default_labels
        self.fields = [f for _, f, _, _ in string.Formatter().parse(template) if f]
        self.name, self.model, self.template, self.base_url, self.system = name, model, template, base_url, system
        self.concurrency, self.timeout, self.retries = concurrency, float(timeout), retries
        self.max_tokens, self.temperature, self.cache, self.cache_dir = max_tokens, temperature, cache, cache_dir
        self.api_key_env = api_key_env
        self.__name__ = name  # the metric reward/<name>
        self.__module__ = module or __name__  # where it was built: how the judge finds its import path

    def __repr__(self) -> str:
        return f"llm_judge(name={self.name!r}, model={self.model!r}, base_url={self.base_url!r})"

    async def __call__(self, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
        """One score (or None) per completion, with at most `concurrency` requests of this judge in flight across
        the run's judge workers."""
        rows = [{k: v[i] for k, v in columns.items() if isinstance(v, list) and len(v) == len(prompts)}
                for i in range(len(prompts))]
        requests: dict[str, list[dict[str, str]]] = {}  # key -> messages: a repeat in the batch is asked once
        keys: list[str] = []
        for p, c, row in zip(prompts, completions, rows, strict=True):
            m = self.messages(p, c, row)
            keys.append(self.key(m))
            requests.setdefault(keys[-1], m)
        limit = asyncio.Semaphore(self.concurrency)  # this process's share: never more waiters than slots
        slots = Slots(f"{self.name}|{self.base_url}|{self.model}", self.concurrency)  # the run's: see slots.py
        client = self._client()
        try:
            replies = await asyncio.gather(*(self._reply(client, limit, slots, k, m) for k, m in requests.items()))
        finally:
            await client.close()
        by_key = dict(zip(requests, replies, strict=True))
        scores = [parse_score(by_key[k], self.pattern, self.labels) for k in keys]
        self._count(scores)
        return scores

    def messages(self, prompt: Any, completion: Any, row: dict[str, Any]) -> list[dict[str, str]]:
        """The chat request for one sample: the template filled with the row's fields (a missing one raises)."""
        values = {**row, "prompt": render_prompt(prompt), "completion": _completion_text(completion)}
        missing = [f for f in self.fields if f not in values]
        if missing:
            raise KeyError(f"llm_judge {self.name!r}: template field(s) {missing} are not columns of the row "
                           f"(it has {sorted(values)})")
        user = self.template.format_map(values)
        return ([{"role": "system", "content": self.system}] if self.system else []) + [
            {"role": "user", "content": user}]

    def key(self, messages: list[dict[str, str]]) -> str:
        """The cache key: everything that decides the reply."""
        request = [self.base_url, self.model, messages, self.max_tokens, self.temperature]
        return hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()

    def _client(self) -> Any:
        from openai import AsyncOpenAI  # the SDK is slow to import: paid by workers, not by `import relayrl`

        return AsyncOpenAI(base_url=self.base_url, api_key=os.environ.get(self.api_key_env) or "EMPTY",
                           timeout=self.timeout, max_retries=self.retries)

    async def _reply(self, client: Any, limit: asyncio.Semaphore, slots: Slots, key: str,
                     messages: list[dict[str, str]]) -> str | None:
        cached = self._cached(key)
        if cached is not None:
            return cached
        async with limit, slots.hold():
            out = await client.chat.completions.create(model=self.model, messages=messages,
                                                       max_tokens=self.max_tokens, temperature=self.temperature)
        reply = out.choices[0].message.content if out.choices else None
        if reply is not None and self.cache:
            self._store(key, reply)
        return reply

    def _cached(self, key: str) -> str | None:
        if not self.cache:
            return None
        if key not in _replies and self.cache_dir:
            path = Path(self.cache_dir) / f"{key}.json"
            if path.is_file():
                _replies[key] = json.loads(path.read_text())["reply"]
        return _replies.get(key)

    def _store(self, key: str, reply: str) -> None:
        _replies[key] = reply
        if self.cache_dir:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
            atomic_write_text(Path(self.cache_dir) / f"{key}.json", json.dumps({"reply": reply}))

    def _count(self, scores: Sequence[float | None]) -> None:
        """Count unparsable replies in this worker and log the rate when a batch had some."""
        bad = sum(s is None for s in scores)
        total = parse_failures.setdefault(self.name, [0, 0])
        total[0] += bad
        total[1] += len(scores)
        if bad:
            logger.warning("llm_judge %s: %d of %d replies did not parse (%d of %d in this worker so far); "
                           "those samples get no reward from it", self.name, bad, len(scores), *total)


def llm_judge(*, model: str, template: str, name: str = "llm_judge", base_url: str | None = None,
              **settings: Any) -> LLMJudge:
    """An LLM judge reward function (see the module docstring for every setting and why). Assign it at the top
    level of a module: workers import it by path. base_url None: the OpenAI SDK's (OPENAI_BASE_URL, else
    api.openai.com); the key comes from $OPENAI_API_KEY (api_key_env= names another variable)."""
    caller = inspect.currentframe()
    module = caller.f_back.f_globals.get("__name__") if caller and caller.f_back else None
    return LLMJudge(name=name, model=model, template=template, base_url=base_url, module=module, **settings)
