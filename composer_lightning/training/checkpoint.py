"""What a checkpoint holds beyond weights and optimizer, the loop settings it resumes with, and
the module's checkpoint hooks (`CheckpointHooks`).

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
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from composer_lightning.heads.base import Head
from composer_lightning.models.lora import adapter_config, is_lora
from composer_lightning.models.stored import read_model_files, reading_checkpoint
from composer_lightning.runtime.distributed import own, per_rank, rank_mismatch, world
from composer_lightning.runtime.errors import ConfigError
from composer_lightning.runtime.resume import (
    Differences,
    differences,
    keep_frozen,
    policy_mismatch,
)

if TYPE_CHECKING:  # the class this mixin goes before, and what the module defines
    from lightning import LightningModule as _Module

    from composer_lightning.runtime.resume import ConfiguredOptimizer
    from composer_lightning.training.objective import Objective
    from composer_lightning.training.refsync import ReferenceSync
else:
    _Module = object

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
        return cast(dict[str, Any], own(state["ranks"]))
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


class CheckpointHooks(_Module):
    """`ComposerModule`'s checkpoint hooks: what it adds to a checkpoint, what a resume may
    change, and the state it restores (a mixin before `L.LightningModule`).

    Reads the module's `policy`, `policy_path`, `policy_version`, `heads`, `hparams`,
    `allow_head_changes`, `trainable_parameters()` and `_optimizer_and_scheduler()`; owns
    `_policy_files`, `_restored_rng`, `_configured` and `_resumed_scheduler`.
    """

    if TYPE_CHECKING:
        policy: nn.Module
        policy_path: str | None
        policy_version: int
        objective: Objective
        reference_sync: ReferenceSync
        allow_head_changes: bool
        _policy_files: dict[str, bytes] | None
        _restored_rng: dict[str, Any] | None
        _configured: ConfiguredOptimizer | None
        _resumed_scheduler: bool | None

        @property
        def heads(self) -> list[Head]: ...
        def trainable_parameters(self) -> list[nn.Parameter]: ...
        def _optimizer_and_scheduler(self, params: Any) -> tuple[torch.optim.Optimizer, Any]: ...

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        """Lightning's `load_from_checkpoint`, from any working directory and machine: a policy
        directory or hub id that no longer resolves is rebuilt from the config files the
        checkpoint stored (`models/stored.py`); the weights are the checkpoint's."""
        with reading_checkpoint(checkpoint_path):
            return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["composer"] = save_state(self.policy_version, self.heads)  # a collective
        if self.objective.entropy_control is not None:  # the same on every rank
            checkpoint["composer"]["entropy_control"] = self.objective.entropy_control.state_dict()
        if self.policy_path is not None:  # config and tokenizer: `export` needs nothing else
            if self._policy_files is None:
                self._policy_files = read_model_files(self.policy_path)
            checkpoint["composer"]["policy_files"] = self._policy_files
        if is_lora(self.policy):  # `export` writes the adapter or the merged model from it
            checkpoint["composer"]["peft_config"] = adapter_config(self.policy)

    def resume_differences(self, checkpoint: dict[str, Any], world_size: int) -> Differences:
        """How this module's configuration differs from the one `checkpoint` was trained with
        on `world_size` ranks: the lines of what is honoured, the phrases of what is refused
        (`runtime/resume.py`)."""
        found = differences(checkpoint.get("hyper_parameters") or {}, dict(self.hparams))
        for problem in (
            policy_mismatch(checkpoint, self.policy),
            rank_mismatch(checkpoint.get("composer", {}).get("ranks"), world_size),
        ):
            if problem:
                found.refused.append(problem)
        dropped, fresh = head_changes(checkpoint.get("composer", {}), self.heads)
        if (dropped or fresh) and not self.allow_head_changes:
            found.refused.append(head_change_message(dropped, fresh))
        return found

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        found = self.resume_differences(checkpoint, world()[1])
        found.raise_refused()
        found.report()
        keep_frozen(checkpoint, ("reference",) if self.reference_sync.enabled else ())
        state = checkpoint.get("composer", {})
        control = self.objective.entropy_control
        if control is not None and "entropy_control" in state:
            control.load_state_dict(state["entropy_control"])
        self.policy_version, self._restored_rng = load_state(
            state, self.heads, self.allow_head_changes
        )
        set_rng_state(self._restored_rng)
        self._resumed_scheduler = bool(checkpoint.get("lr_schedulers"))

    def on_train_start(self) -> None:
        # Lightning restores a checkpoint before the strategy's setup and the train loader's
        # iterator, which draw from the global RNGs: set them again, so that the first step
        # after a resume draws what the uninterrupted run drew.
        set_rng_state(self._restored_rng)
        self._restored_rng = None
        if self._resumed_scheduler is not None and self._configured is not None:
            # the optimizer now holds the checkpoint's settings: the configured ones win
            lines = self._configured.restore(
                cast(torch.optim.Optimizer, self.optimizers(use_pl_optimizer=False)),  # the one
                self.lr_schedulers(),
                lambda: self._optimizer_and_scheduler(
                    [nn.Parameter(torch.empty((0,) * p.ndim)) for p in self.trainable_parameters()]
                ),
                self.global_step,  # the scheduler steps once per optimizer step
                self._resumed_scheduler,
            )
            Differences(lines, []).report()
            self._resumed_scheduler = None
