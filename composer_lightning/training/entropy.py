"""Adaptive entropy control (Skywork-OR1, He et al. 2025, https://arxiv.org/abs/2505.22312;
TRL's `use_adaptive_entropy`): the entropy bonus's coefficient follows the policy's entropy.

After every optimizer step the mean entropy of the response tokens the bonus acts on (every
rank's, token-weighted) is measured: at or below `target` the coefficient rises by `delta`
(up to `coef_max`), above it falls by `delta` (down to `coef_min`). The next step applies the
coefficient only while the last measured entropy is at or below `target`, as TRL's
`_compute_loss` does; it starts from `model.entropy_coef`. The coefficient and the last
measurement are saved in checkpoints.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass
class AdaptiveEntropy:
    """The controller's settings (TRL's `entropy_target`, `entropy_coef_delta`,
    `entropy_coef_min`, `entropy_coef_max`).

    Attributes:
        target: the mean per-token entropy (nats) below which the bonus acts.
        delta: the coefficient's step per optimizer step, > 0.
        coef_min: its lower bound, >= 0.
        coef_max: its upper bound, >= coef_min.
    """

    target: float = 0.2
    delta: float = 0.005
    coef_min: float = 0.0
    coef_max: float = 1.0

    def __post_init__(self) -> None:
        values = (self.target, self.delta, self.coef_min, self.coef_max)
        if not all(math.isfinite(v) for v in values):
            raise ValueError(f"adaptive_entropy settings must be finite, got {self}")
        if not self.delta > 0:
            raise ValueError(f"adaptive_entropy.delta must be > 0, got {self.delta}")
        if not 0 <= self.coef_min <= self.coef_max:
            raise ValueError(
                f"adaptive_entropy needs 0 <= coef_min <= coef_max, got coef_min="
                f"{self.coef_min}, coef_max={self.coef_max}"
            )


class EntropyControl:
    """The running state: the coefficient and the last measured entropy.

    Args:
        settings: the controller's settings.
        coef: the starting coefficient (`model.entropy_coef`).
    """

    def __init__(self, settings: AdaptiveEntropy, coef: float):
        self.settings, self.coef, self.last = settings, float(coef), math.inf

    def applied(self) -> float:
        """The coefficient this step's bonus uses: 0 while the last entropy is above target."""
        return self.coef if self.last <= self.settings.target else 0.0

    def update(self, entropy: float) -> None:
        """After an optimizer step: `entropy` is its mean over every rank's bonus tokens."""
        s = self.settings
        if entropy <= s.target:
            self.coef = min(self.coef + s.delta, s.coef_max)
        else:
            self.coef = max(self.coef - s.delta, s.coef_min)
        self.last = float(entropy)

    def state_dict(self) -> dict[str, Any]:
        return {"coef": self.coef, "last": self.last}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.coef, self.last = float(state["coef"]), float(state["last"])
