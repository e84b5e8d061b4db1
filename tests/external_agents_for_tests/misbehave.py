"""Agent programs that misbehave, chosen by argv[1]: hang (one call, then sleeps, with a child that sleeps too),
crash (one call, then exits 3), flood (calls until refused), other (calls another episode's URL, given in
argv[2] as "URL KEY"-less: with its own key), judge (one call, no reward line: the judge decides)."""

import json
import os
import subprocess
import sys
import time

import openai

row = json.loads(sys.stdin.read())
mode = sys.argv[1]
client = openai.OpenAI(max_retries=0)


def call():
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": row["question"]}],
                                          max_tokens=4)


if mode == "other":  # another episode's URL, read from the file the test names
    with open(sys.argv[2]) as f:
        other = f.read().strip()
    try:
        openai.OpenAI(base_url=other, max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        print(json.dumps({"reward": 1.0, "other": "served"}))
    except openai.APIStatusError as e:
        print(json.dumps({"reward": 0.0, "metrics": {"status": e.status_code}}))
    call()
    sys.exit(0)
call()
if mode == "hang":
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(sys.argv[2], "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    time.sleep(600)
elif mode == "crash":
    print("about to crash", file=sys.stderr)
    sys.exit(3)
elif mode == "flood":
    try:
        while True:
            call()
    except openai.RateLimitError as e:
        with open(sys.argv[2], "w") as f:
            f.write(str(e.status_code))
        time.sleep(600)  # relayrl stops the program once the episode has failed
elif mode == "judge":
    print("no reward line")
