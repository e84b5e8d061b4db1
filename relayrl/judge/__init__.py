"""Judges: score finished samples with a reward function, isolated in worker processes.

`Judge` is the component; `math_reward` the default reward (math-verify based); `TimeoutPool` the process
pool underneath, usable for any call that may hang or crash (code execution, verifiers).
"""

from relayrl.judge.judge import (
    DEFAULT_REWARD,
    REJECTED_PREFIX,
    Judge,
    RewardRejected,
    reward_fn_path,
    reward_kwargs_problem,
    reward_problem,
)
from relayrl.judge.math import math_reward
from relayrl.judge.pool import RemoteError, TimeoutPool, WorkerCrashed

__all__ = [
    "DEFAULT_REWARD",
    "REJECTED_PREFIX",
    "Judge",
    "RemoteError",
    "RewardRejected",
    "TimeoutPool",
    "WorkerCrashed",
    "math_reward",
    "reward_fn_path",
    "reward_kwargs_problem",
    "reward_problem",
]
