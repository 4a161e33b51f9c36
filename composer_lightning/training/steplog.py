"""One write of a step's metrics: the loggers, `trainer.callback_metrics`, the progress figures.

Lightning's `self.log` costs ≈0.5 ms per key on CPU (its result collection checks, moves and
accumulates each value), ≈20 ms for the ≈35 metrics of a step: as long as a tiny policy's
whole update. A step's metrics are reduced over ranks once (`distributed.agree`) and written
here with one call per logger, at the batch's last optimizer step (0-based: with one optimizer
step per rollout batch, the step Lightning would log them at) and on its `log_every_n_steps`
schedule of optimizer steps (`callbacks/steps.py` puts held-out figures on the same axis); callbacks still read them in
`trainer.callback_metrics`, the progress bar in `trainer.progress_bar_metrics`.

Held-out figures (`rollout/validation.py`) go through `self.log` instead (`log_validation`):
torchmetrics means that Lightning reduces over validation batches and ranks.
"""

from __future__ import annotations

from typing import cast

import lightning as L
import torch
from torch import nn
from torchmetrics import MeanMetric


def log_step(
    trainer: L.Trainer,
    step: int,
    metrics: dict[str, float],
    prog_bar: dict[str, float],
    updates: int = 1,
) -> None:
    """Write one rollout batch's reduced `metrics` (and the figures the progress bar shows) at
    `step`, its last optimizer step (0-based); the batch made `updates` optimizer steps, and is
    logged when one of them falls on the `log_every_n_steps` schedule."""
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
    trainer.progress_bar_metrics.update(prog_bar)
    every = trainer.log_every_n_steps  # type: ignore[attr-defined]  # set in Trainer.__init__
    due = every and (step + 1) // every > (step + 1 - updates) // every
    if not trainer.loggers or not every or not (due or trainer.should_stop):
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def log_validation(module: L.LightningModule, figures: dict[str, tuple[float, float]]) -> None:
    """Log one batch's figures (`evaluate`'s `(value, weight)`) as `val/<name>` weighted means
    over batches and ranks."""
    if not hasattr(module, "val_metrics"):
        raise TypeError("log_validation needs the module's `val_metrics` ModuleDict")
    val_metrics = cast(nn.ModuleDict, module.val_metrics)
    for name, (value, weight) in figures.items():
        key = name.replace("@", "_at_").replace(".", "_")  # a ModuleDict key
        if key not in val_metrics:
            val_metrics[key] = MeanMetric().to(module.device)
        metric = cast(MeanMetric, val_metrics[key])
        metric.update(value, weight=weight)
        module.log(
            f"val/{name}",
            metric,
            on_step=False,
            on_epoch=True,
            batch_size=max(1, int(weight)),
            metric_attribute=f"val_metrics.{key}",  # added after Lightning looked for metrics
        )
