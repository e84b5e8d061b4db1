"""The `algo.rollout_correction` section: importance weights for the engine/trainer mismatch.

The engine that samples (bf16 weights, decode kernels, a remote server) is not numerically the policy the
trainer differentiates, so a rollout's tokens come from a slightly different policy than the one trained. The
correction weighs each trained token by pi_trainer / pi_engine, bounded (relayrl.trainer.algo.rollout_correction;
docs/algorithms.md, "Rollout correction", says the order with decoupled PPO and the metrics). Whether it is on
by default depends on the engine and trainer precisions, so "auto" is decided where they are resolved
(relayrl.run.precision.resolve_precision), and config.yaml records the decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from relayrl.config.loader import check


@dataclass
class RolloutCorrectionConfig:
    """Importance weights pi_trainer / pi_engine per trained token (docs/algorithms.md, "Rollout correction")."""

    # auto: on where engine and trainer differ in dtype or kind (a bf16 engine, bf16 trainer matmuls, a bf16 KV
    # cache, remote servers), off where both compute in float32 in this process; decided and said at start
    enabled: bool | Literal["auto"] = "auto"
    # token: each token's own ratio; sequence: the product of its sequence's token ratios (a sum of logs), on every
    # token of the sequence
    level: Literal["token", "sequence"] = "token"
    # truncate: weights outside [lower, upper] are moved to the bound (truncated IS); mask: they are set to 0
    mode: Literal["truncate", "mask"] = "truncate"
    upper: float = 2.0  # the largest weight kept
    lower: float | None = None  # the smallest weight kept (null: no lower bound)
    # a sample with any token ratio below this weighs 0 on every token: the engine sampled a token the trainer
    # finds all but impossible, a numerical fault rather than a policy (null: no veto)
    veto: float | None = 1e-4

    def validate(self) -> None:
        check(self.upper > 0, "upper", f"must be > 0, got {self.upper!r}")
        check(self.lower is None or self.lower > 0, "lower",
              f"must be > 0 (or null: no lower bound), got {self.lower!r}")
        check(self.lower is None or self.lower < self.upper, "lower",
              f"must be < algo.rollout_correction.upper ({self.upper:g}), got {self.lower!r}: the bounds leave no "
              "weight to keep")
        check(self.veto is None or 0 < self.veto < 1, "veto",
              f"must be in (0, 1) (or null: no veto), got {self.veto!r}")
