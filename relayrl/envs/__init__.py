"""Environments: episodes driven by `reset(row)` and `step(assistant_text)` (relayrl/envs/base.py), run by the
generic `EnvAgent` (`agent.kind: env`). `MathFeedbackEnv` is reflection (retry with feedback) as an environment."""

from relayrl.envs.base import EnvError, Environment, Step, check_env_class, resolve_env
from relayrl.envs.reflection import MathFeedbackEnv

__all__ = ["EnvError", "Environment", "MathFeedbackEnv", "Step", "check_env_class", "resolve_env"]
