"""`relayrl serve`'s command-line options, apart from the CLI: the CLI builds its subcommand from them, and a run that
launches servers (relayrl.run.launcher) checks engine.server_args against the same parser before any model loads."""

from __future__ import annotations

import argparse

from relayrl.common import logs
from relayrl.common.device import DEVICE_SETTINGS, valid_device_setting

KEY_ENV = "RELAYRL_API_KEY"  # the API key's environment variable (the arguments of a process are visible to all)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _device(text: str) -> str:
    if not valid_device_setting(text):
        raise argparse.ArgumentTypeError(f"must be {DEVICE_SETTINGS}, got {text!r}")
    return text


def add_arguments(sv: argparse.ArgumentParser) -> None:
    """`relayrl serve`'s options (the CLI adds its entry point; a run checks engine.server_args against them)."""
    sv.add_argument("--model", required=True, help="model folder or alias (smollm2)")
    sv.add_argument("--served-model-name", nargs="+", metavar="NAME", help="the names OpenAI requests may give as "
                    "`model` (all listed in /v1/models; responses carry the first; any other name: 404). Default: "
                    "the --model argument")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only; "
                    "any other address needs --api-key or --insecure)")
    sv.add_argument("--port", type=int, default=30000, help="port (0: any free port; the ready line says which)")
    sv.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="auto: bfloat16 where bf16 is native (a GPU with it, an AVX512-BF16/AMX CPU), else float32")
    sv.add_argument("--device", type=_device, default="cpu", help=f"where the engine runs: {DEVICE_SETTINGS} (default "
                    "cpu; auto: cuda when a CUDA device is usable, else cpu)")
    sv.add_argument("--kv-dtype", choices=["auto", "bfloat16", "float32"], default="auto",
                    help="the KV cache's dtype (auto: the model's; bfloat16 under float32 halves its memory, keys and "
                    "values rounded)")
    sv.add_argument("--max-batch-size", type=_positive, default=64, help="most sequences decoded together")
    sv.add_argument("--max-seq-len", type=_positive, help="prompt + output limit (default: the model's)")
    sv.add_argument("--max-tokens-in-flight", type=_positive, help="admission budget of prompt + max_new_tokens "
                    "over running samples; a request needing more is refused (default max-batch-size x max-seq-len)")
    sv.add_argument("--max-n", type=_positive, help="most samples in one request, n x prompts (default "
                    "max-batch-size)")
    sv.add_argument("--max-tokens", type=_positive, help="largest max_new_tokens / max_tokens of a sample "
                    "(default max-seq-len - 1)")
    sv.add_argument("--max-prompt-tokens", type=_positive, help="longest prompt (default max-seq-len - 1)")
    sv.add_argument("--max-body-bytes", type=_positive, help="largest request body (default 16 MiB)")
    sv.add_argument("--weights-root", help="/update_weights_from_disk loads only folders under this directory "
                    "(symlinks resolved); without it the route is disabled")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health (visible to "
                    "other local users in the process list: prefer --api-key-file or RELAYRL_API_KEY)")
    sv.add_argument("--api-key-file", help="read the API key from this file (one line; chmod 600)")
    sv.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    sv.add_argument("--allowed-hosts", nargs="+", metavar="NAME", help="Host names to serve besides IP addresses, "
                    "localhost and --host ('*': any; any Host is served when an API key is set); others get 400 "
                    "(DNS rebinding)")
    sv.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", help="browser origins (https://app.example) "
                    "that may call the API, with CORS answers ('*': any); requests from other origins get 403")
    sv.add_argument("--max-connections", type=_positive, help="most open connections; at the cap the longest-idle "
                    "one is closed (default half the open-files limit, at most 1024)")
    sv.add_argument("--idle-timeout", type=float, default=10.0, help="seconds a connection may take to send a "
                    "request's headers, from its opening or its last answer (default 10)")
    sv.add_argument("--escape-special-tokens", action="store_true", help="tokenize special-token text typed in "
                    "chat messages and tools (<|im_start|>) as text, not as control tokens (default: as vLLM and "
                    "SGLang do, control tokens)")
    sv.add_argument("--seed", type=int, default=0, help="seed of unseeded requests' sampling")


def serve_parser(cls: type[argparse.ArgumentParser] = argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options as a parser of their own (with --log-level, which every subcommand takes)."""
    sv = cls(prog="relayrl serve")
    sv.add_argument("--log-level", choices=logs.LEVELS)
    add_arguments(sv)
    return sv
