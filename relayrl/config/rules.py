"""Checks of a whole run config that no section's `validate()` makes: numeric ranges, and rules across sections.

Why a table: every numeric key must be finite (the loader refuses NaN and inf) and in range, and a bad value
must fail at load time with its dotted key, before any compute. The sections' own `validate()` methods check
their classic keys; the keys below had no check, so a typo such as `eval.n=0` or `train.betas=[0.9, 1.5]` ran
(or crashed much later). `tests/unit/test_config_rules.py` sets every numeric key of the schema to an absurd
value and expects an error naming it, so a new key without a check fails the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from relayrl.config.loader import ConfigError, check

Rule = tuple[str, Callable[[Any], bool], str]


def _at_least(lo: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v >= lo), f"must be >= {lo:g}"


def _above(lo: float) -> tuple[Callable[[Any], bool], str]:
    return (lambda v: v > lo), f"must be > {lo:g}"


def _fraction() -> tuple[Callable[[Any], bool], str]:
    return (lambda v: 0 <= v < 1), "must be in [0, 1)"


# key -> rule; a None value (an optional key left at null) is not checked; lists are checked item by item
RANGES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "engine.max_seq_len": _at_least(1),
    "engine.prefix_cache_size": _at_least(0),
    "engine.launch_timeout": _above(0),
    "sampling.top_k": _at_least(0),
    "sampling.stop_token_ids": _at_least(0),
    "judge.memory_mb": ((lambda v: v == 0 or v >= 256),
                        "must be >= 256 (a worker's interpreter and reward module need about 200 MiB) or 0: no limit"),
    "judge.max_abs_reward": _above(0),
    "agent.timeout": _above(0),
    "scheduler.producer_threads": _at_least(1),
    "algo.clip_low": _fraction(),  # 1 - clip_low is the lowest ratio kept: it must stay > 0
    "algo.reward_scale": _above(0),  # a negative scale would train away from the reward
    "algo.overlong_penalty": _at_least(0),
    "algo.entropy_coef": _at_least(0),
    "algo.behav_weight_cap": _above(0),
    "train.betas": _fraction(),
    "train.weight_decay": _at_least(0),
    "train.grad_clip": _at_least(0),  # 0: measure the norm, do not clip
    "train.row_tokens": _at_least(1),
    "eval.every": _at_least(0),
    "eval.size": _at_least(1),
    "eval.n": _at_least(1),
    "eval.temperature": _at_least(0),
    "run.threads": _at_least(1),
    "run.print_samples": _at_least(0),
    "ray.num_gpus": _at_least(0),
    "ray.stop_grace": _above(0),
}


def check_rules(cfg: Any) -> None:
    """Raise ConfigError naming the first key out of range, or the first broken cross-section rule."""
    for key, (ok, message) in RANGES.items():
        value = _lookup(cfg, key)
        for v in value if isinstance(value, list | tuple) else [value]:
            if v is not None and not ok(v):
                raise ConfigError(f"{message}, got {v!r}", key=key)
    _check_off_policy(cfg)
    _check_bf16_weights(cfg)


def _check_off_policy(cfg: Any) -> None:
    """Async training with max_staleness > 0 trains samples of older policies: with plain PPO their ratio is 1
    and nothing is clipped (they are treated as on-policy). DERIVED turns algo.decoupled on there; setting it
    off explicitly is refused."""
    s, a = cfg.scheduler, cfg.algo
    check(s.mode == "sync" or s.max_staleness == 0 or a.decoupled, "algo.decoupled",
          f"scheduler.mode=async with max_staleness={s.max_staleness} trains samples of older policies; without "
          "decoupled PPO they count as on-policy (ratio 1, nothing clipped). Leave algo.decoupled unset (it "
          "defaults to true here) or set scheduler.max_staleness=0")


def _check_bf16_weights(cfg: Any) -> None:
    """bf16 weights learn only through relayrl's AdamW, which rounds each update stochastically; FSDP2 shards torch's
    AdamW, which would round to nearest and leave most weights where they are at RL learning rates."""
    check(cfg.model.train_dtype != "bfloat16" or cfg.train.engine == "local", "model.train_dtype",
          "bfloat16 weights need train.engine=local (FSDP2's AdamW would round each update to nearest bf16, and at RL "
          "learning rates most weights would never move); with FSDP use train.fsdp_mixed_precision=true instead")


def _lookup(cfg: Any, key: str) -> Any:
    obj = cfg
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj
