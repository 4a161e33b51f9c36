"""`AtomicCheckpoints`: every checkpoint of the run is written atomically, and a failed write
stops every rank with one error naming the path (`runtime/checkpoint_io.py`)."""

from __future__ import annotations

import lightning as L
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from composer_lightning.runtime.checkpoint_io import AtomicCheckpointIO, atomic_saves


class AtomicCheckpoints(L.Callback):
    """At setup, before any checkpoint is read or written: `AtomicCheckpointIO` in place of
    Lightning's default `TorchCheckpointIO` (a `CheckpointIO` given to the trainer is kept), and
    the strategy's saves made atomic for sharded directories and agreed over ranks.
    `ComposerModule` adds this callback itself."""

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        strategy = trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()
        atomic_saves(strategy)
