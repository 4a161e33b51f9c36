"""`CheckpointOnStop`: a signal to any rank stops every rank at the end of the same step, with
a checkpoint and a non-zero exit.

SIGTERM (SLURM, Kubernetes, `kill`), Ctrl-C (SIGINT) and SIGUSR1 (a scheduler's pre-emption
notice; taken only where no other handler owns it, e.g. not from Lightning's SLURM requeue)
only set a flag on the rank that receives them. A handler runs between two bytecodes of the
main thread, possibly inside a collective's caller, so it must not start one: Lightning's own
SIGTERM handler broadcasts from rank 0 there, and a signal to another rank leaves that rank
waiting for a broadcast rank 0 never sends. Instead every rank exchanges its flag at the end of
every step (one small collective); if any rank was signalled, every rank stops there through
Lightning's own check (a `SIGTERMException` after the step's bookkeeping), and this callback
saves `last.ckpt` in the run's checkpoint directory (the state after a whole step, weights
pushed: resuming continues exactly) and sets the exit status to 128 + the signal number (the
lowest signalled rank's signal). A second Ctrl-C interrupts at once. `ComposerModule` adds this
callback itself.

Lightning's launcher (rank 0, which starts the other ranks as its children) runs a thread that
SIGKILLs rank 0 within 5 s of any child exiting non-zero: right for a crash, wrong for this
stop, where every rank exits with 128 + the signal on purpose and rank 0 may take a moment
longer to tear down than its children (it then ended with -9, not 128 + the signal). On an
agreed stop, `_accept_exit_status` has that thread count the agreed status as a clean exit;
any other non-zero status still kills.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, cast

import lightning as L
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from composer_lightning.runtime.distributed import per_rank
from composer_lightning.runtime.rundir import run_dir

#: The signals that stop a run at the end of the step.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def checkpoint_dir(trainer: L.Trainer) -> str:
    """The run's checkpoint directory: ModelCheckpoint's, else `<log dir>/checkpoints`."""
    callback = trainer.checkpoint_callback
    dirpath = None if callback is None else getattr(callback, "dirpath", None)
    if dirpath:
        return dirpath
    return os.path.join(run_dir(trainer), "checkpoints")


class CheckpointOnStop(L.Callback):
    """Stop every rank at the end of the step in which any rank got a stop signal; save
    `last.ckpt` there and exit with 128 + the signal number."""

    def __init__(self) -> None:
        self._received = 0  # the first stop signal this rank got, 0 for none
        self._signal = 0  # the one every rank agreed to stop on

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._received = self._signal = 0

    # Lightning installs its handlers after `on_fit_start` and before the sanity check, and
    # restores the ones from before `fit` when it tears down (also after an error): ours
    # replace its handlers at the first hook after that, and are undone with them.
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install()

    def _install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may install handlers
        for signum in STOP_SIGNALS:
            current = signal.getsignal(signum)
            if signum == signal.SIGUSR1 and current not in (signal.SIG_DFL, self._on_signal):
                continue  # someone else's (e.g. Lightning's SLURM auto-requeue)
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self._received == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        if not self._received:
            self._received = signum
        if signum == signal.SIGINT:
            rank_zero_info(
                "Ctrl-C: stopping after this step (checkpoint saved); again to abort now"
            )

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        signals = [
            s for s in cast(list[int], per_rank(self._received)) if s
        ]  # every rank, every step
        if signals and not self._signal:
            self._signal = int(signals[0])
            # The flag Lightning's loops check at the end of the step (and of the epoch, after
            # the last step): every rank raises its `SIGTERMException` there, in this step.
            trainer._signal_connector.received_sigterm = True

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        signum = self._signal or signal.SIGTERM  # Lightning's own stop, before our handlers
        _accept_exit_status(128 + int(signum))  # before the save: no child has exited yet
        path = os.path.join(checkpoint_dir(trainer), "last.ckpt")
        trainer.save_checkpoint(path)  # every rank: a collective under FSDP2
        rank_zero_info(
            f"stopped by signal {int(signum)} after step {trainer.global_step}; "
            f"saved {path} (resume with --ckpt_path {path})"
        )
        exception.code = 128 + int(signum)


def _accept_exit_status(status: int) -> None:
    """Have Lightning's child-process observer (a thread on the launching rank, absent on the
    others and under external launchers) treat a child's exit with `status` as a clean one.

    The observer (`lightning.fabric.strategies.launchers.subprocess_script`) polls its children
    every few seconds and SIGKILLs every process once one has a non-zero return code. Its
    `_run` is replaced, for this process's observers only, by one that counts `status` as 0;
    a different non-zero status still goes to Lightning's own check, which kills as before.
    """
    for thread in threading.enumerate():
        if type(thread).__name__ != "_ChildProcessObserver" or not hasattr(thread, "_run"):
            continue
        lightning_run = thread._run
        children = thread._child_processes  # type: ignore[attr-defined]  # Lightning's private

        def run(children=children, lightning_run=lightning_run) -> bool:
            for proc in children:
                proc.poll()
            codes = [proc.returncode for proc in children]
            if any(code not in (None, 0, status) for code in codes):
                return lightning_run()  # a crash besides the stop: Lightning kills all
            return all(code in (0, status) for code in codes)  # all gone: the thread ends

        thread._run = run
