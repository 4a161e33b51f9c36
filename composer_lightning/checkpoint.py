"""What a checkpoint holds beyond weights and optimizer, and the loop settings it resumes with.

Lightning saves the weights, the optimizer, the loops' progress and the data module's state;
`ComposerModule` adds the policy version the engine is synced to, every head's state (schedules,
replay buffers and their samplers) and the global torch / CUDA / Python RNG states, so that a
resumed run continues exactly.

Lightning writes these additions from rank 0 alone, but heads and RNGs differ between ranks
(each rank records its own replay pairs and draws its own numbers): they are gathered, in rank
order (while saving, every rank holds every rank's buffers once), and each rank restores its
own. Resuming with another number of ranks is a `ConfigError`: a replay buffer or an RNG state
has no sound share-out over other ranks. The data module's stream position needs none of this:
it is the same on every rank (rank r's batch i is a function of the seed, i and r).
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import torch

from composer_lightning.distributed import own, per_rank, world
from composer_lightning.heads.base import Head


def save_state(policy_version: int, heads: list[Head]) -> dict[str, Any]:
    """The module's own part of a checkpoint; call on every rank (a collective).

    Returns:
        `policy_version` (the same on every rank) and `ranks`: each rank's heads' and RNG
        states, in rank order.
    """
    mine = {"heads": {h.name: h.state_dict() for h in heads}, "rng": rng_state()}
    return {"policy_version": policy_version, "ranks": per_rank(mine)}


def load_state(state: dict[str, Any], heads: list[Head]) -> tuple[int, dict[str, Any] | None]:
    """Restore this rank's heads from what `save_state` saved.

    Also reads the layout of checkpoints written before state was saved per rank (`heads` and
    `rng` at the top): every rank restores that one state, which is exact for one process.
    Resuming with other heads than the checkpoint's warns, naming the state that is dropped.

    Returns:
        The policy version, and this rank's RNG states for `set_rng_state` (None if none saved).

    Raises:
        ConfigError: the checkpoint was written by another number of ranks.
    """
    if "ranks" in state:
        mine = own(state["ranks"])
    else:
        mine = state
        if "heads" in state and world()[1] > 1:
            warnings.warn(
                "this checkpoint holds one rank's head and RNG state (it predates per-rank "
                "state): every rank resumes from it",
                stacklevel=3,
            )
    saved, names = mine.get("heads", {}), {h.name for h in heads}
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
    return int(state.get("policy_version", 0)), mine.get("rng")


def rng_state() -> dict[str, Any]:
    """This process's global RNG states: torch (CPU, and the current CUDA device's once CUDA
    is in use) and Python's `random`."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any] | None) -> None:
    """Restore what `rng_state` returned (a CUDA state only where CUDA is available); None
    changes nothing."""
    if state is None:
        return
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


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
