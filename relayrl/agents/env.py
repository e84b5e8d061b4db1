"""`EnvAgent` (`agent.kind: env`): any environment with `reset`/`step` (relayrl/envs/base.py), multi-turn.

Per episode: a fresh environment instance (`env_kwargs`), `reset(row)` for the first messages (None: the prompt
relayrl built from the row), then up to `max_turns` rounds of: generate, `step(text)`, append the environment's
messages. Token in, token out as in ReflectionAgent and ToolAgent: the engine's output ids are appended as they
are (never decoded and re-encoded), and only the environment's new messages are tokenized, as the chat
template's continuation after an end-of-turn token (relayrl/agents/chat.py). Those tokens are context: out of
the loss, version -1. Each generated turn records its policy versions and finish reason (`Turn`), and its
reward from `step` in `Turn.step_reward`; interrupted generations are resumed by the RolloutController as for
every agent.

The sample's reward (`reward`, with `discount` g; None turn rewards count as 0):
- "sum" (default): sum_t g^(t-1) r_t. An episode scored once at its end is that score; one scored per turn
  is its (discounted) total: what the environment handed out is what is maximised.
- "last": the last turn reward given (the environment's verdict on the whole episode).
- "per_turn": each turn's reward-to-go R_t = r_t + g R_(t+1) in `Turn.reward`, so the trainer gives each turn's
  tokens its own advantage (as ReflectionAgent's discount_mode per_turn); the sample's reward is R_1.
An environment that gives no reward at any turn leaves the episode to the judge (`judge.reward_fn` on the last
assistant turn's text, as ToolAgent does): an environment that only plays the other side need not score.

An environment that raises, outlives `env_timeout` (seconds per call) or returns something malformed costs the
episode: the sample is FAILED (counted in rollout/failed, never trained on) and its error names the class.
An environment with a `close()` method has it called after every episode, played out or failed.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from relayrl.agents.base import AGENTS, Agent
from relayrl.agents.chat import continuation_ids, end_of_turn_id
from relayrl.agents.reflection import turn_returns
from relayrl.common.errors import InputError
from relayrl.envs.base import EnvError, Message, as_messages, as_step, call_env, has_close, resolve_env, where
from relayrl.judge import REJECTED_PREFIX
from relayrl.sample import Sample, Status

REWARD_MODES = ("sum", "last", "per_turn")
logger = logging.getLogger(__name__)


@AGENTS.register("env")
class EnvAgent(Agent):
    def __init__(self, rollout_ctl, tokenizer, sampling, judge=None, *, env: str | type,
                 env_kwargs: dict[str, Any] | None = None, max_turns: int = 4, env_timeout: float | None = 30.0,
                 reward: str = "sum", discount: float = 1.0, max_total_tokens: int | None = None):
        super().__init__(rollout_ctl, tokenizer, sampling, judge)
        self.env_kwargs = dict(env_kwargs or {})
        self.check_kwargs(dict(env=env, env_kwargs=self.env_kwargs, max_turns=max_turns, env_timeout=env_timeout,
                               reward=reward, discount=discount))
        self.env_cls = resolve_env(env, self.env_kwargs)
        self.env_name, self.short = where(self.env_cls), self.env_cls.__qualname__  # errors: "MyEnv.step raised ..."
        self.closes = has_close(self.env_cls)
        self.max_turns, self.env_timeout, self.reward_mode, self.discount = max_turns, env_timeout, reward, discount
        self.max_total_tokens = max_total_tokens
        self.eot = end_of_turn_id(tokenizer)
        continuation_ids(tokenizer, [{"role": "user", "content": "x"}])  # a template unfit for turns fails here

    @classmethod
    def check_kwargs(cls, kwargs: dict[str, Any]) -> None:
        """Before any model loads: the environment class imports and implements the protocol, its env_kwargs fit
        its constructor, and the option values make sense."""
        if kwargs.get("env") is None:
            raise InputError("agent.kwargs.env is required: the environment class, 'package.module:MyEnv'")
        resolve_env(kwargs["env"], kwargs.get("env_kwargs") or {})
        turns, timeout, mode = kwargs.get("max_turns", 4), kwargs.get("env_timeout", 30.0), kwargs.get("reward", "sum")
        problems = [("max_turns", turns < 1, f"must be >= 1, got {turns}"),
                    ("env_timeout", timeout is not None and timeout <= 0, f"must be > 0 or null, got {timeout}"),
                    ("reward", mode not in REWARD_MODES, f"must be one of {', '.join(REWARD_MODES)}, got {mode!r}"),
                    ("discount", not 0 <= kwargs.get("discount", 1.0) <= 1,
                     f"must be in [0, 1], got {kwargs.get('discount')}")]
        for key, bad, why in problems:
            if bad:
                raise InputError(f"agent.kwargs.{key} {why}")

    async def generate_sample(self, sample: Sample) -> Sample:
        try:
            rewards, done = await self._episode(sample)
        except EnvError as e:  # the environment's fault: this episode is lost, the run goes on
            sample.status, sample.error = Status.FAILED, f"environment {self.env_name}: {e}"
            sample.metrics["env_failed"] = 1.0
            return sample
        sample.response_text = self.decode(sample.response_ids)
        sample.metrics.update(turns=float(len(sample.turns)), env_done=float(done))
        if not await self._reward(sample, rewards):
            sample.status, sample.error = Status.REJECTED, "no reward: the environment gave none and no judge is set"
            sample.metrics[REJECTED_PREFIX + "no_reward"] = 1.0
            return sample
        sample.status = Status.COMPLETED
        return sample

    async def _episode(self, sample: Sample) -> tuple[list[float | None], bool]:
        """Play one episode into `sample`: (each turn's reward, whether the environment ended it)."""
        env = await self._call(functools.partial(self.env_cls, **self.env_kwargs), (), "__init__")
        try:
            return await self._play(env, sample)
        finally:
            if self.closes:
                await self._close(env, sample)

    async def _play(self, env: Any, sample: Sample) -> tuple[list[float | None], bool]:
        first = as_messages(await self._call(env.reset, (sample.data,), "reset"), f"{self.short}.reset")
        if first:
            sample.prompt_ids = self._ids(first, opening=True)
        rewards: list[float | None] = []
        for turn in range(self.max_turns):
            out = await self.rollout_ctl.generate(sample.input_ids, self.params_for(sample, turn), rid=sample.uid,
                                                  images=tuple(sample.images))  # every turn sees the prompt's images
            sample.append_generated(out.output_ids, out.logprobs, out.versions, out.finish_reason, out.routed_experts)
            step = as_step(await self._call(env.step, (self.decode(out.output_ids),), "step"),
                           f"{self.short}.step")
            rewards.append(step.reward)
            if step.done or turn + 1 == self.max_turns:
                return rewards, step.done
            ids = self._ids(step.messages)
            if self._out_of_room(sample, len(ids)):
                break
            if sample.response_ids[-1:] != [self.eot]:  # cut at the token limit: close the turn as the template would
                sample.append_context([self.eot])
            sample.append_context(ids)
        return rewards, False

    async def _close(self, env: Any, sample: Sample) -> None:
        """The environment's close(), after every episode, played out or failed: it frees what the episode held
        (a game, a browser, a container). Its failure is logged and counted; the episode's data stands."""
        try:
            await self._call(env.close, (), "close")
        except EnvError as e:
            logger.warning("environment %s: %s", self.env_name, e)
            sample.metrics["env_close_failed"] = 1.0

    async def _call(self, fn, args: tuple, name: str) -> Any:
        return await call_env(fn, args, self.env_timeout, f"{self.short}.{name}")

    def _ids(self, messages: list[Message], opening: bool = False) -> list[int]:
        """Token ids of the environment's messages: the whole prompt (`opening`: reset's), else the continuation
        after an assistant turn. Messages the chat template refuses (a role it rejects) cost the episode."""
        try:
            return self.prompt_ids(messages) if opening else continuation_ids(self.tokenizer, messages)
        except Exception as e:
            raise EnvError(f"its messages do not fit the chat template: {type(e).__name__}: {e}") from e

    def prompt_ids(self, messages: list[Message]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _out_of_room(self, sample: Sample, n_context: int) -> bool:
        if self.max_total_tokens is None:
            return False
        return len(sample.input_ids) + n_context + 1 + self.sampling.max_new_tokens > self.max_total_tokens

    async def _reward(self, sample: Sample, rewards: list[float | None]) -> bool:
        """Set the sample's reward from the turn rewards (module docstring), else from the judge. False: none."""
        for t, r in zip(sample.turns, rewards):
            t.step_reward = r
        given = [r for r in rewards if r is not None]
        if not given:
            if self.judge is None:
                return False
            last = sample.turns[-1]
            text = self.decode(sample.response_ids[last.start: last.end])
            reward, metrics, error = await self.judge.score(text, sample.data, sample.uid)
            sample.reward, sample.error = reward, error
            sample.metrics.update(metrics)
            return True
        values = [r or 0.0 for r in rewards]
        if self.reward_mode == "per_turn":
            for t, ret in zip(sample.turns, turn_returns(values, self.discount)):
                t.reward = ret
            sample.reward = sample.turns[0].reward
        elif self.reward_mode == "last":
            sample.reward = given[-1]
        else:
            sample.reward = sum(r * self.discount ** k for k, r in enumerate(values))
        sample.metrics["env_reward"] = float(sum(given))
        return True
