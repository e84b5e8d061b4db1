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

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import openai

from relayrl.agents.base import AGENTS, Agent
from relayrl.agents.chat import continuation_ids, end_of_turn_id
from relayrl.agents.reflection import turn_returns
from relayrl.common.imports import import_from_path
from relayrl.engine.base import GenOutput, SamplingParams, TokenCallback
from relayrl.engine.stops import cut_at_stop
from relayrl.judge import REJECTED_PREFIX
from relayrl.sample import Sample, Status
from relayrl.serve import openai_params
from relayrl.serve.chat_tools import ChatTools, ToolChoice
from relayrl.serve.errors import BadRequest
from relayrl.serve.limits import ServerLimits, flag
from relayrl.serve.openai_api import Alternatives, chat_response, make_openai_app
from relayrl.serve.openai_params import Logprobs
from relayrl.serve.streaming import stream_options

_UNBOUNDED = 2**31  # limits a recorded call does not have (the episode proxy sets its own caps)


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
    """Whether a message the client sent back is the assistant reply we produced (openai adds fields; arguments
    come back as JSON strings or, once checked (relayrl.serve.openai_params.messages), as objects)."""
    def args(raw: Any) -> Any:
        if not isinstance(raw, str):
            return raw or {}
        try:
            return json.loads(raw or "{}")
        except ValueError:
            return raw

    def calls(m):
        return [(c["function"]["name"], args(c["function"].get("arguments"))) for c in m.get("tool_calls") or []]

    same_text = (sent.get("content") or "") == (reply.get("content") or "")
    return sent.get("role") == "assistant" and same_text and calls(sent) == calls(reply)


@dataclass(frozen=True)
class ChatRequest:
    """A chat call checked whole the way `relayrl serve` checks one (relayrl.serve.openai_params, chat_tools,
    streaming), before any of it is served: the same fields refused with the same 400s."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    choice: ToolChoice
    params: SamplingParams
    asked: Logprobs
    with_ids: bool
    stream: bool | None  # None: not streamed; else whether the usage chunk is asked for


class RecordingBackend:
    """ChatBackend for `make_openai_app`: serves chat calls with the rollout controller and records them. Requests
    are read as `relayrl serve` reads them (`request`), and replies are made by its code: stop strings cut the
    text (the recorded tokens keep every sampled token), top_logprobs, tool calls in the served template's format
    with tool_choice (relayrl.serve.chat_tools)."""

    model_name = "relayrl-policy"

    def __init__(self, rollout_ctl, tokenizer, sampling: SamplingParams):
        self.rollout_ctl, self.tokenizer, self.sampling = rollout_ctl, tokenizer, sampling
        self.eot = end_of_turn_id(tokenizer)
        self.tools = ChatTools(tokenizer)
        # what a call may ask: any length (the proxy caps it), one sample, token ids of the tokenizer
        self.limits = ServerLimits(_UNBOUNDED, len(tokenizer), _UNBOUNDED, _UNBOUNDED, 1, _UNBOUNDED)
        self.sessions: dict[str, Session] = {}

    def request(self, body: dict[str, Any]) -> ChatRequest:
        """The call's body checked (400 naming the field, as `relayrl serve` answers); pure, so the episode proxy
        runs it in its own thread before the call reaches the episode's loop."""
        stream = stream_options(body)
        asked = openai_params.logprob_options(body, chat=True)
        messages = openai_params.messages(body.get("messages"), self.limits)
        tools = openai_params.tools(body.get("tools"))
        choice = self.tools.choice(body.get("tool_choice"), tools, flag(body, "parallel_tool_calls", True))
        if body.get("n") not in (None, 1):
            raise BadRequest("n", "must be 1: each call of an episode is one sample of its trajectory",
                             "unsupported_value")
        asked_tokens = requested_tokens(body, self.sampling.max_new_tokens)
        checked, _ = openai_params.sampling({**body, "max_tokens": None, "max_completion_tokens": None},
                                            self.limits, 0)
        s = self.sampling
        params = dataclasses.replace(
            checked, max_new_tokens=asked_tokens, top_logprobs=asked.top, ignore_eos=s.ignore_eos or checked.ignore_eos,
            temperature=checked.temperature if body.get("temperature") is not None else s.temperature,
            top_p=checked.top_p if body.get("top_p") is not None else s.top_p,
            top_k=checked.top_k if body.get("top_k") is not None else s.top_k,
            stop_token_ids=tuple(dict.fromkeys(s.stop_token_ids + checked.stop_token_ids)))
        return ChatRequest(messages, tools, choice, params, asked, flag(body, "return_token_ids", False), stream)

    def prompt_ids(self, session: Session, req: ChatRequest) -> list[int]:
        messages, tools = req.messages, req.tools
        prefill = self.tokenizer(req.choice.prefill, add_special_tokens=False)["input_ids"] if req.choice.prefill \
            else []
        for call in reversed(session.calls):  # incremental: reuse the tokens of the conversation so far
            n = len(call.messages)
            if len(messages) > n + 1 and messages[:n] == call.messages and _same_message(messages[n], call.reply):
                ids = call.prompt_ids + call.out.output_ids
                if call.out.output_ids[-1:] != [self.eot]:
                    ids = ids + [self.eot]
                native = tools if self.tools.native else None
                return ids + continuation_ids(self.tokenizer, messages[n + 1:], native) + prefill
        rendered, kw = self.tools.template_inputs(messages, tools)
        try:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=True, **kw)
        except Exception as e:  # the messages' fault (roles that do not alternate...): 400, as serve answers
            raise openai_params.render_error(e) from None
        return self.tokenizer(text + req.choice.prefill, add_special_tokens=False)["input_ids"]

    async def chat(self, body: dict[str, Any], sid: str | None) -> dict[str, Any]:
        """The in-process client's calls (OpenAIAgent): checked, served and recorded."""
        req = self.request(body)
        if req.stream is not None:
            raise BadRequest("stream", "is not supported by the in-process client (the episode proxy streams)",
                             "unsupported_value")
        return (await self.serve(req, sid))[0]

    async def serve(self, req: ChatRequest, sid: str | None, on_token: TokenCallback | None = None
                    ) -> tuple[dict[str, Any], GenOutput]:
        """Serve and record one checked call; the reply and the recorded output. `on_token` streams its tokens
        as they are sampled (the episode proxy)."""
        if sid not in self.sessions:
            raise KeyError(f"unknown session {sid!r}")
        session = self.sessions[sid]
        prompt_ids = self.prompt_ids(session, req)
        out = await self.rollout_ctl.generate(prompt_ids, req.params, rid=sid, on_token=on_token)
        content, tool_calls, finish = self.reply(req, out)
        cid = f"chatcmpl-{sid}-{len(session.calls)}"
        reply = {"role": "assistant", "content": content, "tool_calls": tool_calls}
        session.calls.append(Call(cid, req.messages, prompt_ids, out, reply))
        wanted = req.asked.wanted
        tokens = [self.tokenizer.decode([t]) for t in out.output_ids] if wanted else None
        top = [self.alternatives(a) for a in out.top_logprobs or []] if req.asked.top else None
        return chat_response(cid, self.model_name, content, tool_calls, finish, prompt_ids, out.output_ids,
                             out.logprobs if wanted else None, tokens, req.with_ids, top), out

    def reply(self, req: ChatRequest, out: GenOutput) -> tuple[str | None, list[dict[str, Any]] | None, str]:
        """(content, tool_calls, finish_reason) as `relayrl serve` makes them: the text cut before a stop string,
        calls parsed in the template's format per tool_choice."""
        stops = req.params.stop_strings
        text = self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        text = cut_at_stop(text, stops) if out.stop_string is not None else text
        finish = {"length": "length", "abort": "abort"}.get(out.finish_reason, "stop")
        content, calls, finish = self.tools.reply(req.choice, out, text, stops, finish)
        return content or None, calls, finish

    def alternatives(self, alts: list[tuple[int, float]]) -> Alternatives:
        return [(self.tokenizer.decode([t]), lp) for t, lp in alts]

    async def complete(self, body: dict[str, Any], sid: str | None) -> dict[str, Any]:
        raise ValueError("agents use chat completions; /v1/completions is served by `relayrl serve`")


def requested_tokens(body: dict[str, Any], default: int) -> int:
    """The call's own token limit (max_completion_tokens, else max_tokens), else `default`."""
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest("max_tokens", f"must be a positive integer, got {value!r}")
    return value


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
        out = call.out  # the call's prompt is the chain so far, so its routing covers the whole sample
        s.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason, out.routed_experts)
    return samples


@AGENTS.register("openai")
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
