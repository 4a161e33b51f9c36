"""What a checkpoint holds beyond weights and optimizer, and the loop settings it resumes with.

Lightning saves the weights, the optimizer, the loops' progress and the data module's state;
`ComposerModule` adds the policy version the engine is synced to, every head's state (schedules,
replay buffers and their samplers) and the global torch / Python RNG states, so that a resumed
run continues exactly.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

from composer_lightning.heads.base import Head


def save_state(policy_version: int, heads: list[Head]) -> dict[str, Any]:
    """The module's own part of a checkpoint."""
    return {
        "policy_version": policy_version,
        "heads": {h.name: h.state_dict() for h in heads},
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
    }


def load_state(state: dict[str, Any], heads: list[Head]) -> int:
    """Restore what `save_state` saved into `heads` and the RNGs; returns the policy version.

    Resuming with other heads than the checkpoint's warns, naming the state that is dropped.
    """
    saved, names = state.get("heads", {}), {h.name for h in heads}
    dropped, fresh = sorted(set(saved) - names), sorted(names - set(saved))
    if dropped or fresh:
        warnings.warn(
            f"resuming with other heads than the checkpoint's: the saved state of "
            f"{dropped} is dropped, {fresh} start fresh",
            stacklevel=3,
        )
    for head in heads:
        if head.name in saved:
            head.load_state_dict(saved[head.name])
    if "rng" in state:
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
    return int(state.get("policy_version", 0))


#: The module's settings `check_loop_settings` checks.
LOOP_SETTINGS = frozenset(
    {
        "norm_length",
        "temperature",
        "ppo_epochs",
        "minibatches",
        "max_grad_norm",
        "max_logprob_gap",
        "chunk_size",
    }
)


def check_loop_settings(**settings: Any) -> None:
    """ValueError naming the value, for the module's loop settings."""
    t = settings["temperature"]
    if not (t > 0 and t != float("inf")):
        raise ValueError(f"temperature must be > 0, got {t}")
    for name in ("ppo_epochs", "minibatches"):
        v = settings[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    for name in ("norm_length", "chunk_size"):
        v = settings[name]
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"{name} must be an integer >= 1 or None, got {v!r}")
    for name in ("max_grad_norm", "max_logprob_gap"):
        v = settings[name]
        if name == "max_logprob_gap" and v == "auto":
            continue
        if v is not None and (isinstance(v, str) or not v > 0):
            raise ValueError(f"{name} must be > 0 or None, got {v!r}")
