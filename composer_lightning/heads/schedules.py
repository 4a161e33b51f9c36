"""Weight schedules: functions of the global step that multiply a head's configured weight."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod


def _check_step(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _check_finite(name: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return float(value)


class Schedule(ABC):
    """A multiplier of the global step."""

    @abstractmethod
    def __call__(self, step: int) -> float: ...


class Constant(Schedule):
    """Always `value` (default 1)."""

    def __init__(self, value: float = 1.0):
        self.value = _check_finite("Constant.value", value)

    def __call__(self, step: int) -> float:
        return self.value


class LinearWarmup(Schedule):
    """0 at step 0, rising linearly to 1 at `warmup_steps`, then 1.

    Args:
        warmup_steps: steps to reach the full weight; 0 means no warm-up.
    """

    def __init__(self, warmup_steps: int):
        self.warmup_steps = _check_step("LinearWarmup.warmup_steps", warmup_steps)

    def __call__(self, step: int) -> float:
        if self.warmup_steps == 0:
            return 1.0
        return min(1.0, step / self.warmup_steps)


class LinearRamp(Schedule):
    """`start` until `start_step`, linear to `end` at `end_step`, then `end`.

    E.g. OPD early → RL late: OPD head `LinearRamp(1, 0, 0, 200)`, RL head `LinearRamp(0, 1, 0, 200)`.
    """

    def __init__(self, start: float, end: float, start_step: int = 0, end_step: int = 100):
        self.start = _check_finite("LinearRamp.start", start)
        self.end = _check_finite("LinearRamp.end", end)
        self.start_step = _check_step("LinearRamp.start_step", start_step)
        self.end_step = _check_step("LinearRamp.end_step", end_step)
        if self.end_step < self.start_step:
            raise ValueError(
                f"LinearRamp.end_step ({end_step}) must be >= start_step ({start_step})"
            )

    def __call__(self, step: int) -> float:
        if step <= self.start_step:
            return self.start
        if step >= self.end_step:
            return self.end
        frac = (step - self.start_step) / (self.end_step - self.start_step)
        return self.start + frac * (self.end - self.start)
