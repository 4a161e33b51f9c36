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

import logging
import random
import warnings
from typing import Any

import torch

from composer_lightning.heads.base import Head
from composer_lightning.runtime.distributed import own, per_rank, world
from composer_lightning.runtime.errors import ConfigError

log = logging.getLogger(__name__)


def save_state(policy_version: int, heads: list[Head]) -> dict[str, Any]:
    """The module's own part of a checkpoint; call on every rank (a collective).

    Returns:
        `policy_version` (the same on every rank) and `ranks`: each rank's heads' and RNG
        states, in rank order.
    """
    mine = {"heads": {h.name: h.state_dict() for h in heads}, "rng": rng_state()}
    return {"policy_version": policy_version, "ranks": per_rank(mine)}


def load_state(
    state: dict[str, Any], heads: list[Head], allow_head_changes: bool = False
) -> tuple[int, dict[str, Any] | None]:
    """Restore this rank's heads from what `save_state` saved.

    Also reads the layout of checkpoints written before state was saved per rank (`heads` and
    `rng` at the top): every rank restores that one state, which is exact for one process.

    Args:
        allow_head_changes: resuming with other heads than the checkpoint's drops the saved
            state of the heads removed and starts the added ones fresh (one warning line);
            without it, that is a `ConfigError`.

    Returns:
        The policy version, and this rank's RNG states for `set_rng_state` (None if none saved).

    Raises:
        ConfigError: the checkpoint was written by another number of ranks, or holds other
            heads than `heads` (unless `allow_head_changes`).
    """
    mine = _own_state(state)
    saved = mine.get("heads", {})
    dropped, fresh = head_changes(state, heads)
    if dropped or fresh:
        if not allow_head_changes:
            raise ConfigError(head_change_message(dropped, fresh))
        if world()[0] == 0:
            log.warning(
                "resuming with other heads than the checkpoint's (allow_head_changes): the saved "
                "state of %s is dropped, %s start fresh",
                dropped,
                fresh,
            )
    for head in heads:
        if head.name in saved:
            head.load_state_dict(saved[head.name])
    return int(state.get("policy_version", 0)), mine.get("rng")


def _own_state(state: dict[str, Any]) -> dict[str, Any]:
    if "ranks" in state:
        return own(state["ranks"])
    if "heads" in state and world()[1] > 1:
        warnings.warn(
            "this checkpoint holds one rank's head and RNG state (it predates per-rank "
            "state): every rank resumes from it",
            stacklevel=4,
        )
    return state


def head_changes(state: dict[str, Any], heads: list[Head]) -> tuple[list[str], list[str]]:
    """The names of the checkpoint's heads `heads` lacks, and of `heads` it lacks (none when
    the checkpoint holds no head state at all). Every rank has the same heads: the first
    rank's entry is read, so this runs before the ranks exist too."""
    mine = state["ranks"][0] if state.get("ranks") else state
    if "heads" not in mine:  # nothing of this module's saved: nothing to compare
        return [], []
    saved, names = set(mine["heads"]), {h.name for h in heads}
    return sorted(saved - names), sorted(names - saved)


def head_change_message(dropped: list[str], fresh: list[str]) -> str:
    """What resuming with other heads would do, and the option that allows it."""
    parts = [f"the saved state of head(s) {dropped} would be dropped"] if dropped else []
    parts += [f"head(s) {fresh} would start fresh"] if fresh else []
    return (
        f"other heads than the checkpoint's: {' and '.join(parts)}; resume with the "
        "checkpoint's heads, or set model.allow_head_changes=true to allow it"
    )


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
    if t is not None and not (t > 0 and t != float("inf")):
        raise ValueError(f"temperature must be > 0 or None (the sampling temperature), got {t}")
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
