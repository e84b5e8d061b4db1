"""One episode of a `verifiers` (0.4, `verifiers.v1`) environment, as a relayrl external-agent program.

Runs under the python of the virtualenv verifiers is installed in (`.venv-verifiers`, scripts/setup_verifiers.sh),
never relayrl's: verifiers pins `mcp` and `openai` versions relayrl's extras conflict with. So this file imports
nothing from relayrl, only the standard library and verifiers.

    python verifiers_runner.py TASKSET_ID [ENV_CONFIG_JSON]           # one episode: the row on stdin
    python verifiers_runner.py TASKSET_ID [ENV_CONFIG_JSON] --tasks N  # the taskset's first N tasks, as rows
    python verifiers_runner.py TASKSET_ID [ENV_CONFIG_JSON] --check    # the environment loads (else exit 1)

An episode: the dataset row (stdin, one JSON object) becomes one task of the taskset's own task type (the row's
fields the task data declares; `prompt` from the row's `prompt`, else its `question`), and verifiers runs it as
its eval does (`Env.run_episode`: the taskset's env, harness and interception server, the task's rubric) against
the OpenAI-compatible endpoint in OPENAI_BASE_URL/OPENAI_API_KEY, which relayrl records and trains on. The last
stdout line is `{"reward": <the trace's weighted reward>, "metrics": {each reward's score, each metric}}`.
A failed episode (a trace error: the harness, a reward function, the model endpoint) exits 1 with the error on
stderr, so relayrl fails the episode instead of training on a reward that was never computed.

ENV_CONFIG_JSON is verifiers' env config (`--env.*` of `vf-eval`, as JSON), merged over
`{"taskset": {"id": TASKSET_ID}, "agent": {"runtime": {"type": "subprocess"}}}`: the agent's harness runs as a
local process, as relayrl runs its agent programs (verifiers' default runtime is a remote sandbox).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from typing import Any

import verifiers.v1 as vf

MODEL = "relayrl-policy"  # the proxy serves the run's policy whatever model a call names


def merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """`over` deep-merged onto `base` (nested dicts merge, anything else replaces)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


# harnesses that only chat: any other (verifiers' default `bash`, tool harnesses) runs model-written code, which
# must not run as a plain local process. A task's toolsets (`vf.Toolset` MCP servers) run with the chat harness
# too: they are the taskset author's code, called with the model's arguments, as relayrl's own tools are
CHAT_ONLY_HARNESSES = ("null",)


def load_env(taskset_id: str, overrides: dict[str, Any]) -> vf.Env:
    base = {"taskset": {"id": taskset_id}, "agent": {"runtime": {"type": "subprocess"}}}
    config = vf.resolve_env_config(merged(base, overrides))
    agent = config.model_dump().get("agent") or {}
    harness = (agent.get("harness") or {}).get("id") or "the taskset's default (bash)"
    if (agent.get("runtime") or {}).get("type") == "subprocess" and harness not in CHAT_ONLY_HARNESSES:
        raise SystemExit(f"verifiers harness {harness!r} runs model-written code, and the runtime is a local "
                         "subprocess: set env_config.agent.runtime to a container runtime, or use the chat-only "
                         "harness (env_config: {agent: {harness: {id: \"null\"}}})")
    return vf.load_environment(config)


def row_task(env: vf.Env, row: dict[str, Any]) -> vf.Task:
    """The row as a task of the taskset's task type: the fields its data declares, the prompt from `prompt` or
    relayrl's `question`; the task config is the taskset's, as its own `load()` would give it."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    fields = {k: v for k, v in row.items() if k in data_cls.model_fields}
    if fields.get("prompt") is None:
        fields["prompt"] = row.get("question")
    return task_cls(data_cls.model_validate(fields), env.taskset.config.task)


def client_context() -> vf.ModelContext:
    """The model endpoint: relayrl's per-episode proxy, its key read from OPENAI_API_KEY by verifiers' client."""
    base_url = os.environ.get("OPENAI_BASE_URL")
    if not base_url:
        raise SystemExit("verifiers_runner: OPENAI_BASE_URL is not set (relayrl's external agent sets it)")
    client = vf.EvalClientConfig(base_url=base_url, api_key_var="OPENAI_API_KEY")
    return vf.ModelContext(model=os.environ.get("RELAYRL_MODEL", MODEL), client=client)


def result(episode: vf.Episode) -> dict[str, Any]:
    """The reward line; raises when the episode failed or a reward was never scored."""
    errors = [*episode.errors, *(e for t in episode.traces for e in t.errors)]
    if errors or not episode.ok:
        why = "; ".join(f"{e.type}: {e.message}" for e in errors) or "the episode did not complete"
        raise RuntimeError(f"verifiers episode failed: {why}")
    rewards = {k: r for t in episode.traces for k, r in t.rewards.items()}
    unscored = [k for k, r in rewards.items() if r is None]
    if unscored:
        raise RuntimeError(f"verifiers episode failed: rewards not scored: {', '.join(unscored)}")
    metrics = {k: float(r.score) for k, r in rewards.items() if r is not None}
    metrics |= {k: float(v) for t in episode.traces for k, v in t.metrics.items() if v is not None}
    return {"reward": float(sum(t.reward for t in episode.traces)), "metrics": metrics}


async def run_one(env: vf.Env, row: dict[str, Any]) -> dict[str, Any]:
    task, ctx = row_task(env, row), client_context()
    async with env.serving():
        episode = await env.run_episode(task, ctx)
    return result(episode)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description="one episode of a verifiers environment (see the module doc)")
    parser.add_argument("taskset", help="the verifiers taskset id (an importable package)")
    parser.add_argument("config", nargs="?", default="{}", help="verifiers' env config, as JSON")
    parser.add_argument("--tasks", type=int, metavar="N", help="print the taskset's first N tasks as rows")
    parser.add_argument("--check", action="store_true", help="only load the environment (exit 1 if it fails)")
    args = parser.parse_args(argv)
    try:
        env = load_env(args.taskset, json.loads(args.config))
    except Exception as e:  # a wrong id or config: one line for relayrl's config check, not a traceback
        print(f"{type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if args.check:
        return 0
    if args.tasks is not None:
        for task in env.taskset.take(args.tasks):
            print(json.dumps(task.data.model_dump(mode="json", exclude_defaults=True)))
        return 0
    # verifiers' harness programs find `uv` (which prepares their script environments) next to this python
    os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    row = json.loads(sys.stdin.read())
    try:
        line = asyncio.run(run_one(env, row))
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
