"""An agent program that uses the dialects the openai SDK speaks beyond plain chat, for the proxy's tests.

argv[1]:
- "stop" / "stop-stream": one call with row["stop"] as `stop` and row["seed"] as `seed`, logprobs with
  top_logprobs=3 and token ids; prints {"content", "token_ids", "logprobs", "top", "finish"} (streamed: the
  deltas joined);
- "tools-stream": a streamed call with row["tools"], the tool call gathered from its deltas, then the tool's result
  sent back in a second (unstreamed) call; prints {"calls", "finish", "content", "second_prompt"}.
The reward line comes last.
"""

import json
import sys

import openai

row = json.loads(sys.stdin.read())
mode = sys.argv[1]
client = openai.OpenAI(max_retries=0)
messages = [{"role": "user", "content": row["question"]}]
ids = {"extra_body": {"return_token_ids": True}}

if mode.startswith("stop"):
    kw = {"model": "relayrl-policy", "messages": messages, "stop": [row["stop"]], "logprobs": True,
          "top_logprobs": 3, "seed": row["seed"], **ids}
    if mode == "stop-stream":
        content, token_ids, logprobs, top, finish = "", [], [], [], None
        for chunk in client.chat.completions.create(stream=True, **kw):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                token_ids += (choice.model_extra or {}).get("token_ids") or []
                for lp in (choice.logprobs.content if choice.logprobs else None) or []:
                    logprobs.append(lp.logprob)
                    top.append([[a.token, a.logprob] for a in lp.top_logprobs])
                finish = choice.finish_reason or finish
    else:
        choice = client.chat.completions.create(**kw).choices[0]
        content, token_ids, finish = choice.message.content, choice.model_extra["token_ids"], choice.finish_reason
        logprobs = [lp.logprob for lp in choice.logprobs.content]
        top = [[[a.token, a.logprob] for a in lp.top_logprobs] for lp in choice.logprobs.content]
    print(json.dumps({"content": content, "token_ids": token_ids, "logprobs": logprobs, "top": top,
                      "finish": finish}))
elif mode == "tools-stream":
    calls, finish, content = {}, None, ""
    for chunk in client.chat.completions.create(model="relayrl-policy", messages=messages, tools=row["tools"],
                                                stream=True, **ids):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or []:  # OpenAI's deltas: pieces of each call, by index
                call = calls.setdefault(d.index, {"id": "", "type": "function",
                                                  "function": {"name": "", "arguments": ""}})
                call["id"] += d.id or ""
                call["function"]["name"] += d.function.name or ""
                call["function"]["arguments"] += d.function.arguments or ""
            finish = choice.finish_reason or finish
    calls = [calls[i] for i in sorted(calls)]
    messages += [{"role": "assistant", "content": content or None, "tool_calls": calls},
                 *[{"role": "tool", "tool_call_id": c["id"], "content": "42"} for c in calls]]
    second = client.chat.completions.create(model="relayrl-policy", messages=messages, tools=row["tools"],
                                            max_tokens=2, **ids)
    print(json.dumps({"calls": calls, "finish": finish, "content": content,
                      "second_prompt": second.choices[0].model_extra["prompt_token_ids"]}))
print(json.dumps({"reward": 1.0}))
