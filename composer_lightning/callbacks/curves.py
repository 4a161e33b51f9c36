"""`Curves`: a PNG of the run's reward, validation figures and per-head terms against step.

At the end of `fit` (and when a signal stops it) rank 0 writes `curves.png` into the run
directory: the rollout reward with the validation figures (`val/...`), each head's term (the
mean advantage of an advantage head, the loss of a loss head) and each head's effective weight,
all against the optimizer step. TensorBoard has the same scalars; this is the one-look summary.
"""

from __future__ import annotations

import os
from collections import defaultdict
from typing import Any

import lightning as L

from composer_lightning.runtime.rundir import run_dir


class Curves(L.Callback):
    """Collect the scalars worth a look every step; draw them when the run ends.

    Args:
        filename: the PNG's name in the run directory.
    """

    def __init__(self, filename: str = "curves.png"):
        self.filename = filename
        self.series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def _collect(self, trainer: L.Trainer) -> None:
        step = trainer.global_step
        for key, value in trainer.callback_metrics.items():
            if (
                key == "rollout/reward_mean"
                or key.startswith("val/")
                or key.endswith(("/adv_mean", "/loss", "/weight"))
                and not key.startswith(("train/", "ppo/"))
            ):
                points = self.series[key]
                if not points or points[-1][0] != step:
                    points.append((step, float(value)))

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._collect(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._collect(trainer)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.draw(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        try:
            self.draw(trainer)
        except OSError:
            # the run stops on `exception`, which must be what is reported; a figure that
            # cannot be written then (most likely the same full or read-only disk) must not
            # replace it
            pass

    def draw(self, trainer: L.Trainer) -> str | None:
        """Write the PNG (rank 0); returns its path, or None when there is nothing to draw."""
        if not trainer.is_global_zero or not self.series:
            return None
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = [
            ("reward and validation", lambda k: k == "rollout/reward_mean" or k.startswith("val/")),
            (
                "head terms (advantage heads: mean advantage; loss heads: loss)",
                lambda k: k.endswith(("/adv_mean", "/loss")),
            ),
            ("effective head weights", lambda k: k.endswith("/weight")),
        ]
        fig, axes = plt.subplots(len(panels), 1, figsize=(8, 9), sharex=True)
        for ax, (title, wanted) in zip(axes, panels, strict=True):
            for key in sorted(k for k in self.series if wanted(k)):
                steps, values = zip(*self.series[key], strict=True)
                ax.plot(steps, values, label=key, marker="." if len(steps) < 30 else None)
            ax.set_title(title, fontsize=10)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=7, loc="best")
        axes[-1].set_xlabel("optimizer step")
        fig.tight_layout()
        path = os.path.join(run_dir(trainer), self.filename)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path
