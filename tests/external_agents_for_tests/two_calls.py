"""An agent program as a user writes one: the openai SDK with no arguments (OPENAI_BASE_URL and OPENAI_API_KEY come
from relayrl), the row on stdin, two calls continuing one conversation, the reward as the last stdout line.
argv[1] "stream" streams both calls. It asks for temperature 0.3, which relayrl ignores (the run samples at its own).
Each call's token ids and logprobs as returned go to stdout, one JSON line per call, for the test."""

import json
import sys

import openai

row = json.loads(sys.stdin.read())
stream = len(sys.argv) > 1 and sys.argv[1] == "stream"
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": row["question"]}]
for turn in range(2):
    kw = {"model": "relayrl-policy", "messages": messages, "max_tokens": 6, "logprobs": True, "temperature": 0.3,
          "extra_body": {"return_token_ids": True}}
    if stream:
        text, ids, logprobs, finish = "", [], [], None
        for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            for choice in chunk.choices:
                text += choice.delta.content or ""
                ids += (choice.model_extra or {}).get("token_ids") or []  # each chunk's own tokens (as vLLM's)
                logprobs += [lp.logprob for lp in (choice.logprobs.content if choice.logprobs else None) or []]
                finish = choice.finish_reason or finish
        reply = {"role": "assistant", "content": text}
    else:
        out = client.chat.completions.create(**kw)
        choice = out.choices[0]
        text, ids = choice.message.content, choice.model_extra["token_ids"]
        logprobs, finish = [lp.logprob for lp in choice.logprobs.content], choice.finish_reason
        reply = choice.message.model_dump(exclude_none=True)
    print(json.dumps({"call": turn, "token_ids": ids, "logprobs": logprobs, "finish": finish}))
    messages += [reply, {"role": "user", "content": "Are you sure? Answer again."}]
print(json.dumps({"reward": 0.25, "metrics": {"turns": 2}}))
