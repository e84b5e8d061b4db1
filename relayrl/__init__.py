"""relayrl: reinforcement learning for LLM agents.

Components (DESIGN.md / seed 002): Sample, InferenceEngine, RolloutController, Judge, Agent, DataManager,
Scheduler, Env, TrainController, Packer, Evaluator. The main loops in `relayrl.loop` compose them.
"""

from relayrl.sample import Sample, Status, Turn

__all__ = ["Sample", "Status", "Turn"]
__version__ = "0.1.0"
