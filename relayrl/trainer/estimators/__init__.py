"""Advantage estimators, by name: algo.adv_estimator names a registered one or a user's by import path.

Every module of this package is imported here, so a new built-in is one module (a subclass of
`AdvantageEstimator` decorated with `@ESTIMATORS.register("name")`) and its test; base.py has the interface.
"""

import importlib
import pkgutil

from relayrl.trainer.estimators.base import (
    ESTIMATORS,
    AdvantageEstimator,
    AdvantageInputs,
    Advantages,
    estimator_for,
)

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["ESTIMATORS", "AdvantageEstimator", "AdvantageInputs", "Advantages", "estimator_for"]
