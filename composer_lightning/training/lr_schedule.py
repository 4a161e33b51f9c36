"""The learning-rate schedules of transformers' `Trainer` (TRL's `lr_scheduler_type`), as one
scheduler a YAML config can name: linear warmup from 0, then linear or cosine decay to
`min_lr_rate` × lr at `total_steps`, or a constant rate.

`lr_factor` is the same multiplier as transformers' `get_linear_schedule_with_warmup`,
`get_cosine_schedule_with_warmup` (`num_cycles` 0.5), `get_cosine_with_min_lr_schedule_with_warmup`
and `get_constant_schedule_with_warmup` (`tests/test_lr_schedule.py` checks every step), written
as a function of the step rather than a lambda, so the scheduler's state is plain numbers that a
checkpoint saves and a resume compares. Simplified: past `total_steps` the factor stays at its
end value (transformers' cosine turns back up; a run here stops at `max_steps`).
"""

from __future__ import annotations

import math
from typing import Literal, get_args

import torch
from torch.optim.lr_scheduler import LRScheduler

Decay = Literal["linear", "cosine", "constant"]


def lr_factor(
    step: int, *, total_steps: int, warmup_steps: int, decay: Decay, min_lr_rate: float
) -> float:
    """The multiplier of the base lr at optimizer step `step` (0 at the first step).

    Args:
        step: optimizer steps taken before this one.
        total_steps: the run's optimizer steps (`trainer.max_steps`); decay ends there.
        warmup_steps: steps of linear warmup from 0 (step 0 trains at factor 0 when > 0, as
            transformers' schedules do).
        decay: `linear` or `cosine` from 1 down to `min_lr_rate`, or `constant` 1.
        min_lr_rate: the factor decay ends at.

    Returns:
        The factor, in [0, 1].
    """
    if step < warmup_steps:
        return step / max(1, warmup_steps)
    if decay == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    shape = 1.0 - progress if decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_lr_rate + (1.0 - min_lr_rate) * shape


class WarmupDecayLR(LRScheduler):
    """Linear warmup, then linear or cosine decay (or none): transformers' `linear`, `cosine`,
    `cosine_with_min_lr`, `constant` and `constant_with_warmup` schedules, stepped once per
    optimizer step.

    Args:
        optimizer: the optimizer whose groups' lr it sets (each group's lr is its base).
        total_steps: optimizer steps of the run (`trainer.max_steps`), > 0.
        warmup_steps: steps of linear warmup from 0, in [0, total_steps].
        decay: `linear` (transformers' default), `cosine` or `constant`.
        min_lr_rate: the share of the base lr decay ends at, in [0, 1).
        last_epoch: the last step taken (-1: a fresh schedule).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        total_steps: int,
        warmup_steps: int = 0,
        decay: Decay = "linear",
        min_lr_rate: float = 0.0,
        last_epoch: int = -1,
    ):
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 1:
            raise ValueError(
                f"WarmupDecayLR.total_steps must be an integer > 0, got {total_steps!r}"
            )
        if not isinstance(warmup_steps, int) or not 0 <= warmup_steps <= total_steps:
            raise ValueError(
                f"WarmupDecayLR.warmup_steps must be an integer in [0, total_steps = {total_steps}],"
                f" got {warmup_steps!r}"
            )
        if decay not in get_args(Decay):
            raise ValueError(f"WarmupDecayLR.decay {decay!r}; expected one of {get_args(Decay)}")
        if not 0.0 <= min_lr_rate < 1.0:
            raise ValueError(f"WarmupDecayLR.min_lr_rate must be in [0, 1), got {min_lr_rate!r}")
        self.total_steps, self.warmup_steps = total_steps, warmup_steps
        self.decay, self.min_lr_rate = decay, float(min_lr_rate)
        super().__init__(optimizer, last_epoch)

    def get_lr(self) -> list[float | torch.Tensor]:  # LRScheduler's base_lrs may be tensors
        # closed form of the step, so a replayed or restored schedule lands on the same value
        factor = lr_factor(
            self.last_epoch,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            decay=self.decay,
            min_lr_rate=self.min_lr_rate,
        )
        return [base * factor for base in self.base_lrs]
