"""One write of a step's metrics: the loggers, `trainer.callback_metrics`, the progress figures.

Lightning's `self.log` costs ≈0.5 ms per key on CPU (its result collection checks, moves and
accumulates each value), ≈20 ms for the ≈35 metrics of a step: as long as a tiny policy's
whole update. A step's metrics are reduced over ranks once (`distributed.agree`) and written
here with one call per logger, at the step Lightning would log them at (the rollout batches
trained before this one) and on its `log_every_n_steps` schedule; callbacks still read them in
`trainer.callback_metrics`, the progress bar in `trainer.progress_bar_metrics`.

Held-out figures (`rollout/validation.py`) go through `self.log` instead (`log_validation`):
torchmetrics means that Lightning reduces over validation batches and ranks.
"""

from __future__ import annotations

import lightning as L
import torch
from torchmetrics import MeanMetric


def log_step(
    trainer: L.Trainer, step: int, metrics: dict[str, float], prog_bar: dict[str, float]
) -> None:
    """Write one step's reduced `metrics` (and the figures the progress bar shows)."""
    trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
    trainer.progress_bar_metrics.update(prog_bar)
    every = trainer.log_every_n_steps
    if not trainer.loggers or not every or not ((step + 1) % every == 0 or trainer.should_stop):
        return
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=step)


def log_validation(module: L.LightningModule, figures: dict[str, tuple[float, float]]) -> None:
    """Log one batch's figures (`evaluate`'s `(value, weight)`) as `val/<name>` weighted means
    over batches and ranks."""
    if not hasattr(module, "val_metrics"):
        raise TypeError("log_validation needs the module's `val_metrics` ModuleDict")
    for name, (value, weight) in figures.items():
        key = name.replace("@", "_at_").replace(".", "_")  # a ModuleDict key
        if key not in module.val_metrics:
            module.val_metrics[key] = MeanMetric().to(module.device)
        module.val_metrics[key].update(value, weight=weight)
        module.log(
            f"val/{name}",
            module.val_metrics[key],
            on_step=False,
            on_epoch=True,
            batch_size=max(1, int(weight)),
            metric_attribute=f"val_metrics.{key}",  # added after Lightning looked for metrics
        )
