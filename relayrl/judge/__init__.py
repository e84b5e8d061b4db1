"""Judges: score finished samples with reward functions, isolated in worker processes.

`Judge` is the component; `math_reward` the default reward (math-verify based; registered as "math" in
`REWARDS`, the names judge.reward_fn may use instead of an import path); `TimeoutPool` the process
pool underneath, usable for any call that may hang or crash (code execution, verifiers). Reward functions are
relayrl's per-sample `(response, row)` or TRL's batched `(prompts, completions, **columns)`, one or several
with weights (relayrl/judge/functions.py, relayrl/judge/batch.py).
"""

from relayrl.judge.functions import (
    BATCHED,
    REWARDS,
    ROW,
    RewardRejected,
    arguments_problem,
    reward_function,
    reward_kwargs_problem,
    reward_problem,
    style_of,
)
from relayrl.judge.judge import (
    DEFAULT_REWARD,
    REJECTED_PREFIX,
    Judge,
    reward_fn_path,
)
from relayrl.judge.math import math_reward
from relayrl.judge.models import llm_reward, rm_reward  # registers the YAML-only model rewards' names
from relayrl.judge.pool import RemoteError, TimeoutPool, WorkerCrashed

__all__ = [
    "BATCHED",
    "DEFAULT_REWARD",
    "REJECTED_PREFIX",
    "REWARDS",
    "Judge",
    "RemoteError",
    "ROW",
    "RewardRejected",
    "TimeoutPool",
    "WorkerCrashed",
    "arguments_problem",
    "llm_reward",
    "math_reward",
    "reward_fn_path",
    "reward_function",
    "reward_kwargs_problem",
    "reward_problem",
    "rm_reward",
    "style_of",
]
