"""relayrl: reinforcement learning for LLM agents.

The public face: `Agent`, `Sample`, `Status`, `Turn`, `load_config`, `train`, `evaluate` (relayrl.api); the
command line is `relayrl` (relayrl.cli). Components and how they fit: docs/design.md.
"""

from typing import TYPE_CHECKING, Any

from relayrl.sample import Sample, Status, Turn

if TYPE_CHECKING:
    from relayrl.agents import Agent
    from relayrl.api import TrainResult, evaluate, load_config, train

__all__ = ["Agent", "Sample", "Status", "TrainResult", "Turn", "evaluate", "load_config", "train"]
__version__ = "0.1.0"

_LAZY = {"Agent": "relayrl.agents", "load_config": "relayrl.api", "train": "relayrl.api", "evaluate": "relayrl.api",
         "TrainResult": "relayrl.api"}


def __getattr__(name: str) -> Any:
    """Agent and the API functions load torch and transformers: imported on first use, so `import relayrl`
    (and `from relayrl import Sample`) stays light."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'relayrl' has no attribute {name!r}")
