"""`OptimizerSteps`: one step axis, optimizer steps, for everything a run counts.

A rollout batch makes `ppo_epochs × minibatches` optimizer steps (k). `trainer.global_step`,
and with it `max_steps`, `ModelCheckpoint(every_n_train_steps=...)` and the heads' schedules,
counts optimizer steps; Lightning's `val_check_interval` counts batches and its loggers' step is
its count of batches. With k > 1 this callback puts those two on optimizer steps as well:
validation every `val_check_interval` optimizer steps, and held-out figures logged at the same
step as the training metrics of the batch they follow (`training/steplog.py` logs those at the
batch's last optimizer step). A `max_steps`, `val_check_interval` or `every_n_train_steps` that
is not a multiple of k (the run can only stop, validate or save between rollout batches) is one
line at setup naming it. A run that an `EarlyStopping` callback ends before `max_steps` says so
in one line, with its reason. `ComposerModule` adds this callback itself.
"""

from __future__ import annotations

import math
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from composer_lightning.runtime.errors import ConfigError


class OptimizerSteps(L.Callback):
    """Count validation and the loggers' steps in optimizer steps (`updates` per batch)."""

    def __init__(self, updates: int) -> None:
        self.updates = int(updates)

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.updates == 1:
            return
        counts: list[tuple[str, Any]] = [("trainer.max_steps", trainer.max_steps)]
        if isinstance(trainer.val_check_interval, int):
            counts.append(("trainer.val_check_interval", trainer.val_check_interval))
        for cb in trainer.callbacks:  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
            if isinstance(cb, ModelCheckpoint) and cb._every_n_train_steps:
                counts.append(("ModelCheckpoint.every_n_train_steps", cb._every_n_train_steps))
        for name, value in counts:
            if value is not None and value > 0 and value % self.updates:
                up = math.ceil(value / self.updates) * self.updates
                raise ConfigError(
                    f"{name}={value} counts optimizer steps, and a rollout batch makes "
                    f"{self.updates} (model.ppo_epochs × model.minibatches): the run can only "
                    f"stop, validate or save between batches; use a multiple of "
                    f"{self.updates} (e.g. {up})"
                )

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning set `val_check_batch` (in batches) from `val_check_interval` just before
        if self.updates > 1 and isinstance(trainer.val_check_interval, int):
            trainer.val_check_batch = max(1, trainer.val_check_interval // self.updates)

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if self.updates > 1:
            # Lightning logs held-out figures at this count (then adds 1 for the batch): the
            # batch's last optimizer step, as the training metrics are logged
            trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step - 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for cb in trainer.callbacks:  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
            reason = getattr(cb, "stopping_reason_message", None)
            if isinstance(cb, EarlyStopping) and reason:
                rank_zero_info(
                    f"stopped early at step {trainer.global_step} of {trainer.max_steps} by "
                    f"EarlyStopping: {reason}"
                )
