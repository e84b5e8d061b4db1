"""Policy losses, by name: algo.policy_loss names a registered one or a user's by import path.

Every module of this package is imported here, so a new built-in is one module (a function decorated with
`@LOSSES.register("name")`) and its test; base.py documents the signature.
"""

import importlib
import pkgutil

from relayrl.trainer.losses.base import LOSSES, PolicyLoss, loss_for

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["LOSSES", "PolicyLoss", "loss_for"]
