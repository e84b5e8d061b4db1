"""An agent written against the `openai` package, trained by relayrl (examples/arithmetic_openai.yaml).

relayrl hands the episode a real `openai.AsyncOpenAI` client whose calls are served by the policy being
trained; every call's tokens, logprobs and policy versions are recorded. Consecutive calls that extend the
conversation become one token-exact multi-turn trajectory. The return value is the episode's reward.
"""

from relayrl.agents import session_of
from relayrl.data import prompt_messages

INSTRUCTION = "\nPut your final answer within \\boxed{}."


async def episode(client, row, max_turns: int = 2, feedback: str = "That is not right. Please try again."):
    session = session_of(client)
    messages = prompt_messages(row, suffix=INSTRUCTION)  # the row's chat messages, or its question as a user turn
    for turn in range(max_turns):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=96)
        text = reply.choices[0].message.content or ""
        if await session.score(text):  # the run's judge, in its worker processes
            return 0.9 ** turn  # discounted: a later success is worth less
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": feedback}]
    return 0.0
