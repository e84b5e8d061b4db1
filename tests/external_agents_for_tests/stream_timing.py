"""An agent program that streams one long call and reports, as a JSON line on stdout, when its first and last
content chunks arrived (seconds after the call), how many came, and the text; then its reward line. The test checks
that the chunks arrive while the tokens are being generated, not all at the end."""

import json
import sys
import time

import openai

row = json.loads(sys.stdin.read())
client = openai.OpenAI(max_retries=0)
t0 = time.monotonic()
stamps, text = [], ""
for chunk in client.chat.completions.create(model="relayrl-policy", stream=True, max_tokens=int(sys.argv[1]),
                                            messages=[{"role": "user", "content": row["question"]}]):
    for choice in chunk.choices:
        if choice.delta.content:
            stamps.append(time.monotonic() - t0)
            text += choice.delta.content
print(json.dumps({"first": stamps[0], "last": stamps[-1], "chunks": len(stamps), "text": text}))
print(json.dumps({"reward": 1.0}))
