"""Schedulers: how many trajectories are in flight and when a batch is ready.

`SyncScheduler` produces one batch at a time; `AsyncScheduler` keeps producing beside the trainer with
bounded staleness, over-sampling and a tail batch for prompts that keep expiring.
"""

from relayrl.scheduler.asynchronous import AsyncScheduler, StalenessManager
from relayrl.scheduler.common import group_filter, mixed_rewards, run_agent, run_group
from relayrl.scheduler.sync import SyncScheduler

__all__ = ["AsyncScheduler", "StalenessManager", "SyncScheduler", "group_filter", "mixed_rewards", "run_agent",
           "run_group"]
