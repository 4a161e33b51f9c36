"""`CheckpointOnStop`: SIGTERM and Ctrl-C save a checkpoint at the step's end and exit non-zero.

Lightning notices SIGTERM (sent by SLURM, Kubernetes, `kill`) and stops at the end of the
current step, on every rank, with a `SIGTERMException`, but exits with status 0 and saves
nothing. This callback saves `last.ckpt` in the run's checkpoint directory at that point (the
state after a whole step, weights pushed: resuming continues exactly) and makes the exit status
128 + the signal number. Ctrl-C (SIGINT) takes the same path: the first one asks for a stop at
the end of the step, a second one interrupts at once. `ComposerModule` adds this callback itself.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from composer_lightning.callbacks.samples import run_dir


def checkpoint_dir(trainer: L.Trainer) -> str:
    """The run's checkpoint directory: ModelCheckpoint's, else `<log dir>/checkpoints`."""
    callback = trainer.checkpoint_callback
    if callback is not None and getattr(callback, "dirpath", None):
        return callback.dirpath
    return os.path.join(run_dir(trainer), "checkpoints")


class CheckpointOnStop(L.Callback):
    """Save `last.ckpt` when a signal stops the run; exit with 128 + the signal number."""

    def __init__(self) -> None:
        self._signal = signal.SIGTERM
        self._previous_sigint: Any = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        try:  # only the main thread may install handlers
            self._previous_sigint = signal.signal(signal.SIGINT, self._on_sigint)
        except ValueError:
            self._previous_sigint = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._signal == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._signal = signal.SIGINT
        rank_zero_info("Ctrl-C: stopping after this step (checkpoint saved); again to abort now")
        os.kill(os.getpid(), signal.SIGTERM)  # Lightning's own stop at the end of the step

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        path = os.path.join(checkpoint_dir(trainer), "last.ckpt")
        trainer.save_checkpoint(path)  # every rank: a collective under FSDP2
        rank_zero_info(
            f"stopped by signal {int(self._signal)} after step {trainer.global_step}; "
            f"saved {path} (resume with --ckpt_path {path})"
        )
        exception.code = 128 + int(self._signal)

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._previous_sigint is not None:
            signal.signal(signal.SIGINT, self._previous_sigint)
            self._previous_sigint = None
