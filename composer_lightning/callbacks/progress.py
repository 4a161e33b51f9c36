"""`StepProgress`: progress in optimizer steps, with the figures of an RL run.

Lightning's bars count batches of an epoch ("Epoch 0/-2" for an endless prompt stream) and show
`v_num`. This one shows `step / max_steps`, the rollout reward, seconds per step and the latest
validation figures (`val/...`) with the step they were measured at (`val@20`): the step line
is drawn before that step's evaluation runs. When stdout is not a terminal (a log file, a
cluster job) it prints one plain line every `every_n_steps` steps instead of redrawing a bar,
and one line with each evaluation's figures when it ends.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import ProgressBar, RichProgressBar, TQDMProgressBar

#: Metrics shown, in this order, under these labels (all `val/...` metrics follow).
SHOWN = (("reward", "reward"), ("loss", "loss"), ("s/step", "s/step"))


class StepProgress(ProgressBar):
    """A progress bar over optimizer steps (a plain line per N steps off a terminal).

    Args:
        every_n_steps: steps between plain lines when stdout is not a terminal.
    """

    def __init__(self, every_n_steps: int = 10):
        super().__init__()
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._enabled = True
        self._bar: Any = None
        self._val: dict[str, float] = {}
        self._val_step: int | None = None

    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        trainer = getattr(self, "_trainer", None)
        return self._enabled and (trainer is None or trainer.is_global_zero)

    def _figures(self, trainer: L.Trainer) -> str:
        metrics = trainer.progress_bar_metrics
        parts = [f"{label} {float(metrics[key]):.3g}" for key, label in SHOWN if key in metrics]
        return "  ".join(parts + ([self._val_figures()] if self._val else []))

    def _val_figures(self) -> str:
        return f"val@{self._val_step} " + "  ".join(
            f"{k.removeprefix('val/')} {v:.3g}" for k, v in sorted(self._val.items())
        )

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self._val = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")
        }
        self._val_step = trainer.global_step
        if not self.is_enabled or not self._val:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(self._figures(trainer), refresh=True)
        else:
            print(self._val_figures(), flush=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.is_enabled or not sys.stdout.isatty():
            return
        from tqdm.auto import tqdm

        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._bar = tqdm(
            total=total,
            initial=trainer.global_step,
            desc="step",
            unit="step",
            dynamic_ncols=True,
            file=sys.stdout,
            leave=True,
        )

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if not self.is_enabled:
            return
        step, total = trainer.global_step, trainer.max_steps
        if self._bar is not None:
            self._bar.n = step
            self._bar.set_postfix_str(self._figures(trainer), refresh=True)
        elif step % self.every_n_steps == 0 or step == total:
            of = f"/{total}" if total and total > 0 else ""
            print(f"step {step}{of}  {self._figures(trainer)}", flush=True)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def print(self, *args: Any, **kwargs: Any) -> None:
        if self._bar is not None:
            self._bar.write(" ".join(map(str, args)))
        else:
            print(*args, **kwargs)


def in_place_of_the_default_bar(trainer: L.Trainer) -> list[L.Callback]:
    """`[StepProgress()]` in place of Lightning's default bar (a plain `RichProgressBar`, or
    `TQDMProgressBar` without rich; taken out of `trainer.callbacks`), for a `Trainer` built in
    Python; `[]` when the trainer has another bar (a `StepProgress` from the command line, a
    subclass of Lightning's) or none (`enable_progress_bar=False`)."""
    bar = getattr(trainer, "progress_bar_callback", None)
    if type(bar) not in (RichProgressBar, TQDMProgressBar):
        return []
    trainer.callbacks.remove(bar)  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
    return [StepProgress()]
