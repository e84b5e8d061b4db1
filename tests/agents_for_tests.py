"""Agents that tests name by import path (configs refer to user code this way); the rewards are in
rewards_for_tests, which judge workers import in milliseconds."""

from __future__ import annotations

import asyncio

from relayrl.agents.single_turn import SingleTurnAgent
from relayrl.sample import Sample


class FlakyAgent(SingleTurnAgent):
    """Raises for the first sample of every group and hangs for the second; the rest behave."""

    async def generate_sample(self, sample: Sample) -> Sample:
        if sample.index == 0:
            raise RuntimeError("user agent bug")
        if sample.index == 1:
            await asyncio.sleep(3600)
        return await super().generate_sample(sample)


async def two_call_episode(client, row):
    """A multi-call agent written against the openai package: answer, then reconsider."""
    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="relayrl-policy", messages=messages, max_tokens=8,
                                                 logprobs=True, extra_body={"return_token_ids": True})
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "user", "content": "Are you sure? Answer again."})
    second = await client.chat.completions.create(model="relayrl-policy", messages=messages, max_tokens=8,
                                                  logprobs=True, extra_body={"return_token_ids": True})
    row.setdefault("_responses", []).extend([first, second])  # for the test to inspect
    return 1.0 if "4" in (second.choices[0].message.content or "") else 0.0


async def per_call_reward_episode(client, row):
    from relayrl.agents import session_of

    messages = [{"role": "user", "content": row["question"]}]
    first = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Again."}]
    second = await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
    session_of(client).set_reward(first.id, -1.0)
    session_of(client).set_reward(second.id, 1.0)


async def two_conversations_episode(client, row):
    for q in ("one", "two"):
        await client.chat.completions.create(model="m", messages=[{"role": "user", "content": q}], max_tokens=4)
    return 0.5


async def tool_history_episode(client, row):
    """A conversation that already contains a tool call and its result, continued by the policy."""
    tools = [{"type": "function", "function": {"name": "calculator", "description": "math",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "user", "content": "What is 2+2?"}]
    first = await client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=6)
    messages.append({"role": "assistant", "content": first.choices[0].message.content})
    messages.append({"role": "tool", "tool_call_id": "call_0", "content": "4"})
    await client.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=6)
    return 1.0


class LongTailAgent(SingleTurnAgent):
    """Single-turn agent whose response lengths are random and long-tailed (seeded per sample)."""

    async def generate_sample(self, sample: Sample) -> Sample:
        import random
        from dataclasses import replace

        rng = random.Random(sample.seed)
        n = 2 + int(rng.paretovariate(1.2)) % 40
        self.sampling = replace(self.sampling, max_new_tokens=n, ignore_eos=True)
        return await super().generate_sample(sample)


def failing_prompt_fn_rows(n: int = 20):
    """Rows where the 7th question makes the data pipeline itself fail (not an agent)."""
    return [{"question": "BOOM" if i == 6 else f"{i}+1?", "answer": str(i + 1)} for i in range(n)]


class BrokenInitAgent(SingleTurnAgent):
    """Fails when constructed: in separate placement that happens inside the producer process."""

    def __init__(self, *args, **kwargs):
        raise ValueError("broken agent: bad kwargs")


class SoloAgent(SingleTurnAgent):
    """Sets a NaN reward itself (bypassing the judge) on every sample but the first of a SOLO row's group,
    which leaves that group with one trainable sample."""

    async def generate_sample(self, sample: Sample) -> Sample:
        sample = await super().generate_sample(sample)
        if "SOLO" in sample.data["question"] and sample.index > 0:
            sample.reward = float("nan")
        return sample
