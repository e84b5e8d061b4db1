"""Agents written against the `openai` package, made trainable.

`OpenAIAgent` runs a user episode function `async def episode(client, row) -> reward | None` where
`client` is a real `openai.AsyncOpenAI` whose requests go (over an in-process ASGI transport, no socket)
to relayrl's OpenAI-compatible app. Every call is served by the RolloutController and recorded with its
token ids, logprobs and policy versions. Consecutive calls whose messages extend the previous call's
conversation are tokenized incrementally (earlier tokens reused, only new messages tokenized), so a
multi-turn, multi-call episode becomes one token-exact trajectory; calls that start a new conversation
become separate samples of the same group.

Rewards: the episode's return value (a number) is the episode reward; per-call rewards can be set with
`session_of(client).set_reward(completion.id, r)` and become per-turn returns (reward-to-go with
`discount`); with neither, the judge scores the last assistant message.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from relayrl.agents.base import Agent
from relayrl.agents.chat import continuation_ids, end_of_turn_id
from relayrl.agents.reflection import turn_returns
from relayrl.common.utils import import_from_path
from relayrl.engine.base import GenOutput, SamplingParams, TokenCallback
from relayrl.judge import REJECTED_PREFIX
from relayrl.sample import Sample, Status
from relayrl.serve.openai_api import chat_response, make_openai_app
from relayrl.tools import Tool
from relayrl.tools.calls import parse_tool_calls, tools_system_prompt


@dataclass
class Call:
    id: str
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    out: GenOutput
    reply: dict[str, Any]
    reward: float | None = None


class Session:
    """The calls of one episode, in order; `score` lets episode code ask the run's judge about a text."""

    def __init__(self, sid: str, judge=None, row: dict[str, Any] | None = None):
        self.sid, self.calls, self.judge, self.row = sid, [], judge, row or {}
        self.rejected: dict[str, float] = {}  # judge_rejected_<reason> of failed verdicts: the episode is rejected

    async def score(self, text: str) -> float:
        """The judge's verdict on `text` for this episode's row: its "correct" metric, else its reward."""
        if self.judge is None:
            raise RuntimeError("this agent has no judge")
        reward, metrics, _ = await self.judge.score(text, self.row, self.sid)
        self.rejected |= {k: v for k, v in metrics.items() if k.startswith(REJECTED_PREFIX)}
        return float(metrics.get("correct", reward))

    def set_reward(self, completion_id: str, reward: float) -> None:
        for call in self.calls:
            if call.id == completion_id:
                call.reward = float(reward)
                return
        raise KeyError(f"no completion {completion_id!r} in session {self.sid}")


def session_of(client: openai.AsyncOpenAI) -> Session:
    """The recording session behind a client handed to an episode function."""
    return client._relayrl_session  # type: ignore[attr-defined]


def _same_message(sent: dict[str, Any], reply: dict[str, Any]) -> bool:
    """Whether a message the client sent back is the assistant reply we produced (openai adds fields)."""
    def calls(m):
        return [(c["function"]["name"], json.loads(c["function"]["arguments"] or "{}"))
                for c in m.get("tool_calls") or []]

    same_text = (sent.get("content") or "") == (reply.get("content") or "")
    return sent.get("role") == "assistant" and same_text and calls(sent) == calls(reply)


class RecordingBackend:
    """ChatBackend for `make_openai_app`: serves chat calls with the rollout controller and records them."""

    model_name = "relayrl-policy"

    def __init__(self, rollout_ctl, tokenizer, sampling: SamplingParams):
        self.rollout_ctl, self.tokenizer, self.sampling = rollout_ctl, tokenizer, sampling
        self.eot = end_of_turn_id(tokenizer)
        self.native_tools = "tools" in (getattr(tokenizer, "chat_template", "") or "")
        self.sessions: dict[str, Session] = {}

    def prompt_ids(self, session: Session, messages: list[dict], tools: list[dict] | None) -> list[int]:
        for call in reversed(session.calls):  # incremental: reuse the tokens of the conversation so far
            n = len(call.messages)
            if len(messages) > n + 1 and messages[:n] == call.messages and _same_message(messages[n], call.reply):
                ids = call.prompt_ids + call.out.output_ids
                if call.out.output_ids[-1:] != [self.eot]:
                    ids = ids + [self.eot]
                return ids + continuation_ids(self.tokenizer, messages[n + 1:], tools if self.native_tools else None)
        if tools and not self.native_tools:
            described = [Tool(t["function"]["name"], t["function"].get("description", ""),
                              t["function"].get("parameters", {}), None) for t in tools]
            messages = [{"role": "system", "content": tools_system_prompt(described)}] + messages
        kw = {"tools": tools} if tools and self.native_tools else {}
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def params(self, body: dict[str, Any]) -> SamplingParams:
        s = self.sampling
        return SamplingParams(max_new_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens")
                                                 or s.max_new_tokens),
                              temperature=float(body.get("temperature", s.temperature)),
                              top_p=float(body.get("top_p", s.top_p)), top_k=s.top_k,
                              stop_token_ids=s.stop_token_ids, ignore_eos=s.ignore_eos, seed=body.get("seed"))

    async def chat(self, body: dict[str, Any], sid: str | None, on_token: TokenCallback | None = None
                   ) -> dict[str, Any]:
        """Serve and record one call; `on_token` streams its tokens as they are sampled (the episode proxy)."""
        if sid not in self.sessions:
            raise KeyError(f"unknown session {sid!r}")
        session = self.sessions[sid]
        messages = [dict(m) for m in body["messages"]]
        prompt_ids = self.prompt_ids(session, messages, body.get("tools"))
        out = await self.rollout_ctl.generate(prompt_ids, self.params(body), rid=sid, on_token=on_token)
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        parsed = [c for c in parse_tool_calls(text) if isinstance(c, dict)] if body.get("tools") else []
        tool_calls = [{"id": f"call_{sid}_{len(session.calls)}_{i}", "type": "function",
                       "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])}}
                      for i, c in enumerate(parsed)]
        content = text.split("<tool_call>")[0].strip() if tool_calls else text
        cid = f"chatcmpl-{sid}-{len(session.calls)}"
        reply = {"role": "assistant", "content": content or None, "tool_calls": tool_calls or None}
        session.calls.append(Call(cid, messages, prompt_ids, out, reply))
        finish = "tool_calls" if tool_calls else ("length" if out.finish_reason == "length" else "stop")
        tokens = [self.tokenizer.decode([t]) for t in out.output_ids] if body.get("logprobs") else None
        return chat_response(cid, self.model_name, content or None, tool_calls or None, finish, prompt_ids,
                             out.output_ids, out.logprobs if body.get("logprobs") else None, tokens,
                             bool(body.get("return_token_ids")))

    async def complete(self, body: dict[str, Any], sid: str | None) -> dict[str, Any]:
        raise ValueError("agents use chat completions; /v1/completions is served by `relayrl serve`")


def session_samples(session: Session, base: Sample) -> list[Sample]:
    """Chain consecutive calls that extend each other into one trajectory; each chain is one sample."""
    samples: list[Sample] = []
    for call in session.calls:
        s = samples[-1] if samples else None
        if s is None or call.prompt_ids[: len(s.input_ids)] != s.input_ids:
            s = Sample(prompt_ids=list(call.prompt_ids), data=base.data, group_id=base.group_id,
                       index=base.index * 1000 + len(samples))
            samples.append(s)
        else:
            s.append_context(call.prompt_ids[len(s.input_ids):])
        s.append_generated(call.out.output_ids, call.out.logprobs, call.out.versions, call.out.finish_reason)
    return samples


class OpenAIAgent(Agent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *, episode: str, discount: float = 1.0,
                 **episode_kwargs: Any):
        super().__init__(rollout_ctl, tokenizer, sampling, judge)
        self.episode = import_from_path(episode)
        self.episode_kwargs, self.discount = episode_kwargs, discount
        self.backend = RecordingBackend(rollout_ctl, tokenizer, sampling)
        self.app = make_openai_app(self.backend)

    async def generate_sample(self, sample: Sample) -> list[Sample]:
        session = self.backend.sessions[sample.uid] = Session(sample.uid, self.judge, sample.data)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url="http://relayrl",
                                         timeout=None) as http:
                client = openai.AsyncOpenAI(base_url=f"http://relayrl/sessions/{sample.uid}/v1", api_key="relayrl",
                                            http_client=http, max_retries=0)
                client._relayrl_session = session
                result = await self.episode(client, sample.data, **self.episode_kwargs)
        finally:
            self.backend.sessions.pop(sample.uid, None)
        return await finish_session(session, sample, result, self.judge, self.discount, self.decode)


async def finish_session(session: Session, base: Sample, result: Any, judge, discount: float,
                         decode: Callable[[list[int]], str]) -> list[Sample]:
    """The completed samples of a finished episode (`session_samples`), rewarded by `_reward`. Shared with the
    external agent (relayrl.agents.external), whose program's calls are recorded in the same sessions."""
    if not session.calls:
        raise RuntimeError("the episode made no chat completion calls")
    samples = session_samples(session, base)
    await _reward(samples, session, result, judge, discount)
    for s in samples:
        s.response_text = decode(s.response_ids)
        s.metrics.update(session.rejected)
        s.status = Status.COMPLETED
    return samples


async def _reward(samples: list[Sample], session: Session, result: Any, judge, discount: float) -> None:
    """Per-call rewards (as per-turn returns) if any were set; else `result`; else the judge on the last reply."""
    if any(c.reward is not None for c in session.calls):
        own = [c.reward or 0.0 for c in session.calls]
        by_turn = iter(zip(turn_returns(own, discount), own))
        for s in samples:
            for t in s.turns:
                t.reward, t.step_reward = next(by_turn)
            s.reward = s.turns[0].reward
        return
    if result is None and judge is not None:
        last = session.calls[-1].reply.get("content") or ""
        result, metrics, error = await judge.score(last, samples[0].data, samples[0].uid)
        for s in samples:
            s.metrics.update(metrics)
            s.error = error
    for s in samples:
        s.reward = float(result or 0.0)
