"""The `relayrl` command: train, eval, show-trajectories, plot, models, serve, doctor.

Each subcommand imports what it runs (training, serving, models and plots pull in torch, transformers, fastapi
or matplotlib: seconds), so `relayrl --help`, `--version`, `--help-config` and config errors answer at once."""

from __future__ import annotations

import argparse
import errno
import importlib.metadata
import json
import os
import platform
import signal
import sys
import threading
from pathlib import Path

import yaml

from relayrl import __version__
from relayrl.common import logs
from relayrl.common.errors import InputError, Terminated, install_hint
from relayrl.common.files import atomic_write_text
from relayrl.common.memory import tune_allocator
from relayrl.config import ConfigError, to_dict
from relayrl.config.docs import describe
from relayrl.config.schema import Config, load_run_config
from relayrl.serve.args import add_arguments as add_serve_arguments

SERVE_EXTRA = ("uvicorn",)  # the packages of the `serve` extra (pyproject.toml): the HTTP server


def _sigterm_handler(main_pid: int):
    """The SIGTERM handler of process `main_pid`: raise Terminated there; in a forked child that inherited it, die
    as SIGTERM means."""
    def on_sigterm(signum: int, frame: object) -> None:
        if os.getpid() != main_pid:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the cleanup short
        raise Terminated
    return on_sigterm


def _train(args: argparse.Namespace) -> int:
    if args.help_config:
        print(describe(Config))
        return 0
    cfg = load_run_config(args.config, args.overrides)
    if args.print_config:
        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    from relayrl.run.launch import launch  # Ray, torchrun or this process: chosen there

    return launch(cfg, ["train", *([f"--config={args.config}"] if args.config else []), *args.overrides])


def _eval(args: argparse.Namespace) -> int:
    from relayrl.run.loop import evaluate

    extra = [f"model.path={args.model}"] if args.model else []
    cfg = load_run_config(args.config, [*args.overrides, *extra])
    if not any(o.startswith("run.name=") for o in args.overrides):
        cfg.run.name = f"{cfg.run.name}-eval"
    metrics = evaluate(cfg)
    for k, v in sorted(metrics.items()):
        print(f"{k:32s} {v:.4f}")
    if args.out:
        atomic_write_text(args.out, json.dumps({"model": cfg.model.path, **metrics}, indent=2) + "\n")
    return 0


def _show(args: argparse.Namespace) -> int:
    from relayrl.tracking.trajectories import show

    colour = sys.stdout.isatty() and not args.no_color
    print(show(args.run_dir, args.version, args.limit, args.only, colour=colour), end="")
    return 0


def _plot(args: argparse.Namespace) -> int:
    from relayrl.tracking.plot import PNG, plot_run

    out = args.out or Path(args.run_dirs[0]) / PNG
    print(plot_run(args.run_dirs, out))
    return 0


def _models(args: argparse.Namespace) -> int:
    from relayrl.models import MODEL_ALIASES, build_tiny_model, build_tiny_vlm
    from relayrl.models.aliases import ALIAS_ABOUT, ALIAS_DIRS
    from relayrl.models.store import is_complete

    if args.action == "list":  # what each alias is and where it comes from: its weights are not the original's
        for alias, about in ALIAS_ABOUT.items():
            folder = ALIAS_DIRS[alias]()
            state = "prepared" if is_complete(folder) else f"prepared on first use, or: relayrl models prepare {alias}"
            print(f"{alias}: {about}\n  folder: {folder} ({state})")
        print("hub ids (model.path: org/name[@revision]) download into the Hugging Face cache on first use; "
              "HF_HUB_OFFLINE=1 or run.offline: true keeps runs offline")
        return 0
    if args.name is None:
        print(f"relayrl models {args.action} needs a name (prepare ALIAS | tiny OUT_DIR | tiny-moe OUT_DIR | "
              f"tiny-vlm OUT_DIR)",
              file=sys.stderr)
        return 2
    if args.action == "prepare":
        if args.name not in MODEL_ALIASES:
            print(f"unknown model {args.name!r}; known: {', '.join(MODEL_ALIASES)}", file=sys.stderr)
            return 2
        print(f"{args.name}: {ALIAS_ABOUT[args.name]}", file=sys.stderr)
        print(MODEL_ALIASES[args.name](force=args.force))
    elif args.action == "tiny":
        print(build_tiny_model(args.name))
    elif args.action == "tiny-moe":
        print(build_tiny_model(args.name, arch="qwen3_moe"))
    elif args.action == "tiny-vlm":
        print(build_tiny_vlm(args.name))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from relayrl.serve.security import ServeRefused, check_options, resolve_api_key

    try:  # at once, before torch and the model load
        api_key = resolve_api_key(args.api_key, args.api_key_file, dict(os.environ))
        check_options(args.host, api_key, args.insecure, args.weights_root)
    except ServeRefused as e:
        print(f"relayrl serve: {e}", file=sys.stderr)
        return 2
    try:
        from relayrl.serve.server import ServeOptions, serve
    except ModuleNotFoundError as e:
        if e.name not in SERVE_EXTRA:
            raise
        print(f"relayrl serve: needs the {e.name} package: {install_hint('serve')}", file=sys.stderr)
        return 2

    options = ServeOptions(api_key=api_key, insecure=args.insecure, weights_root=args.weights_root,
                           max_n=args.max_n, max_tokens=args.max_tokens, max_prompt_tokens=args.max_prompt_tokens,
                           max_tokens_in_flight=args.max_tokens_in_flight, max_body_bytes=args.max_body_bytes,
                           kv_dtype=args.kv_dtype, served_model_names=tuple(args.served_model_name or ()),
                           allowed_hosts=tuple(args.allowed_hosts or ()),
                           allowed_origins=tuple(args.allowed_origins or ()), max_connections=args.max_connections,
                           idle_timeout=args.idle_timeout, escape_special_tokens=args.escape_special_tokens)
    try:
        serve(args.model, host=args.host, port=args.port, dtype=args.dtype, max_batch_size=args.max_batch_size,
              device=args.device, max_seq_len=args.max_seq_len, seed=args.seed,
              log_level=logs.resolve(args.log_level), options=options)
    except ServeRefused as e:
        print(f"relayrl serve: {e}", file=sys.stderr)
        return 2
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from relayrl.run.doctor import report

    print(version_line())
    for line in report(remeasure=args.remeasure):
        print(line, flush=True)
    return 0


def version_line() -> str:
    """`relayrl --version`: this relayrl, where it was imported from (a checkout or an installed wheel: the first
    thing to know about a bug report), and the torch and Python it runs on. torch's version comes from its
    metadata, so the line prints without the seconds of importing torch."""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = "not installed"
    where = Path(__file__).resolve().parent
    return f"relayrl {__version__} from {where} (torch {torch_version}, python {platform.python_version()})"


class _VersionAction(argparse.Action):
    """Like argparse's "version" action, but the line is built only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        print(version_line())
        parser.exit()


def _common() -> argparse.ArgumentParser:
    """The options every subcommand takes."""
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--log-level", choices=logs.LEVELS, help=f"what relayrl logs on stderr (default: ${logs.ENV}, "
                   f"else info: its automatic choices, once each; debug also shows other libraries' logs)")
    return c


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description="RL training for LLM agents")
    p.add_argument("--version", action=_VersionAction, help="print relayrl's version, torch's and python's, and exit")
    sub = p.add_subparsers(dest="command", required=True)
    common = _common()

    def add(name: str, **kwargs: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    t = add("train", help="train a policy from a YAML config")
    t.add_argument("--config", help="YAML config file (see examples/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6 run.steps=10")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("--help-config", action="store_true", help="list every config key: type, default and meaning")
    t.set_defaults(fn=_train)
    e = add("eval", help="evaluate a base model or a run's saved model on the config's eval set")
    e.add_argument("--config", required=True, help="YAML config (its data.eval, agent, judge, eval.* are used)")
    e.add_argument("--model", help="model folder to evaluate, e.g. runs/NAME/model (default: model.path)")
    e.add_argument("--out", help="also write the metrics to this JSON file")
    e.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.n=8 eval.temperature=1.0")
    e.set_defaults(fn=_eval)
    st = add("show-trajectories", help="print a run's logged trajectories with colour")
    st.add_argument("run_dir")
    st.add_argument("--version", type=int, help="only trajectories started by this policy version")
    st.add_argument("--limit", type=int, default=10, help="show the last N (default 10)")
    st.add_argument("--only", choices=["success", "fail"])
    st.add_argument("--no-color", action="store_true")
    st.set_defaults(fn=_show)
    pl = add("plot", help="plot reward / pass-rate curves of one or more runs to PNG")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument("--out", help="PNG path (default: RUN_DIR/reward.png)")
    pl.set_defaults(fn=_plot)
    m = add("models", help="list the model aliases and where they come from; prepare local models")
    m.add_argument("action", nargs="?", default="list", choices=["list", "prepare", "tiny", "tiny-moe", "tiny-vlm"],
                   help="list (default) | prepare ALIAS | tiny OUT_DIR | tiny-moe OUT_DIR | tiny-vlm OUT_DIR")
    m.add_argument("name", nargs="?", help="alias (smollm2) for prepare; output folder for tiny, tiny-moe and "
                   "tiny-vlm")
    m.add_argument("--force", action="store_true")
    m.set_defaults(fn=_models)
    sv = add("serve", help="serve a model over HTTP (SGLang-compatible native API + OpenAI API)")
    add_serve_arguments(sv)
    sv.set_defaults(fn=_serve)
    d = add("doctor", help="print this machine's CPU, what relayrl measured on it and what it chooses")
    d.add_argument("--remeasure", action="store_true", help="drop this machine's cached measurements first")
    d.set_defaults(fn=_doctor)
    return p


def main(argv: list[str] | None = None) -> int:
    tune_allocator()  # before torch starts threads: they must share one malloc arena
    args = parser().parse_args(argv)
    if threading.current_thread() is not threading.main_thread():  # called from a thread: signals are not ours
        return _run(args)
    previous = signal.signal(signal.SIGTERM, _sigterm_handler(os.getpid()))
    try:
        return _run(args)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(args: argparse.Namespace) -> int:
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # user code named by import path in configs lives in the project folder
    try:
        with logs.configured(args.log_level):  # RELAYRL_LOG_LEVEL for the command's child processes too
            return args.fn(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, InputError) as e:  # a user's file: the message names it (and the line)
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if _write_errno(e) is None:
            raise
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except Terminated:
        print("terminated (SIGTERM)", file=sys.stderr)
        return 143
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


# what a full, read-only or immutable disk, or an output path that is a file, raises: the user's to fix, so one
# line naming the path, not a traceback (the writers leave what was there intact: atomic renames, whole lines)
WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM,
                          errno.ENOTDIR, errno.EEXIST, errno.EISDIR, errno.ENAMETOOLONG})


def _write_errno(e: BaseException | None) -> int | None:
    """The write errno of `e` or of an error it was raised from (relayrl re-raises them with the path added)."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            return e.errno
        e = e.__cause__ or e.__context__
    return None


def _one_line(e: OSError) -> str:
    if e.errno and e.strerror:
        return f"{e.strerror}: {e.filename}" if e.filename else e.strerror
    return str(e).replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
