"""The `relayrl` command: train, plot, models."""

from __future__ import annotations

import argparse
import sys

from relayrl.config import ConfigError


def _train(args: argparse.Namespace) -> int:
    from relayrl.config import describe, to_dict
    from relayrl.config.schema import Config, load_run_config

    if args.help_config:
        print(describe(Config))
        return 0
    cfg = load_run_config(args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
        return 0
    from relayrl.loop import train

    final = train(cfg)
    if final:
        print("final eval: " + ", ".join(f"{k}={v:.4f}" for k, v in final.items() if "pass" in k or "reward" in k))
    return 0


def _plot(args: argparse.Namespace) -> int:
    from relayrl.plot import plot_run

    out = args.out or f"{args.run_dirs[0].rstrip('/')}/reward.png"
    print(plot_run(args.run_dirs, out))
    return 0


def _models(args: argparse.Namespace) -> int:
    from relayrl.models import MODEL_ALIASES, build_tiny_model

    if args.action == "prepare":
        if args.name not in MODEL_ALIASES:
            print(f"unknown model {args.name!r}; known: {', '.join(MODEL_ALIASES)}", file=sys.stderr)
            return 2
        print(MODEL_ALIASES[args.name](force=args.force))
    elif args.action == "tiny":
        print(build_tiny_model(args.name))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="relayrl", description="RL training for LLM agents")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a policy from a YAML config")
    t.add_argument("--config", help="YAML config file (see examples/)")
    t.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.lr=1e-6 run.steps=10")
    t.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    t.add_argument("--help-config", action="store_true", help="list every config key with its default")
    t.set_defaults(fn=_train)
    pl = sub.add_parser("plot", help="plot reward / pass-rate curves of one or more runs to PNG")
    pl.add_argument("run_dirs", nargs="+")
    pl.add_argument("--out", help="PNG path (default: RUN_DIR/reward.png)")
    pl.set_defaults(fn=_plot)
    m = sub.add_parser("models", help="prepare local models")
    m.add_argument("action", choices=["prepare", "tiny"], help="prepare ALIAS | tiny OUT_DIR")
    m.add_argument("name", help="alias (smollm2) for prepare; output folder for tiny")
    m.add_argument("--force", action="store_true")
    m.set_defaults(fn=_models)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
