"""`RunReport`: the run report written at the end of every fit (`fit` adds one by default).

At the end of `fit`, and when a run stops on an error or a signal (what went wrong is what a
report is read for), rank 0 flushes the loggers and writes `report.html` into the run
directory (`page.write_report`). Writing it never fails a run: at the end of a fit a failure is
one line on stderr; when the run stops on an error, that error is what is reported, and a page
that cannot be written then (most likely on the same full or read-only disk) is not said.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import lightning as L

from composer_lightning.runtime.rundir import run_dir


class RunReport(L.Callback):
    """Write `report.html` (curves, rollouts, per-token pushes, held-out replies) into the run
    directory when the fit ends.

    Args:
        filename: the page's name in the run directory.
        max_rows: rollout rows (and served turns) the page holds at most, sampled by step.
        max_token_rows: rows of per-token details (`TokenDetails`) the page holds at most.
        heldout_problems: held-out problems shown at every evaluation.
        plain_js: embed plotly.js uncompressed (≈ 5 MB a page) for a browser without
            `DecompressionStream`; default gzip-compressed (≈ 2 MB).
    """

    def __init__(
        self,
        filename: str = "report.html",
        max_rows: int = 400,
        max_token_rows: int = 200,
        heldout_problems: int = 16,
        plain_js: bool = False,
    ):
        for name, value in (
            ("max_rows", max_rows),
            ("max_token_rows", max_token_rows),
            ("heldout_problems", heldout_problems),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RunReport.{name} must be an integer >= 1, got {value!r}")
        self.filename, self.plain_js = filename, bool(plain_js)
        self.limits = {
            "max_rows": max_rows,
            "max_token_rows": max_token_rows,
            "heldout_problems": heldout_problems,
        }
        self.path: str | None = None  # where it was written last

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.write(trainer)

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self.write(trainer, quiet=True)

    def write(self, trainer: L.Trainer, quiet: bool = False) -> str | None:
        """Write the page (rank 0 of a run with a logger); its path, or None. `quiet`: a failure
        is not said."""
        if not trainer.is_global_zero or not trainer.loggers or trainer.fast_dev_run:  # type: ignore[attr-defined]  # Lightning sets it in Trainer.__init__
            return None  # a fast_dev_run's loggers are placeholders: nothing is kept
        try:
            from composer_lightning.report.page import write_report

            for logger in trainer.loggers:  # what the loggers hold back is the run's last steps
                logger.save()
                flush = getattr(getattr(logger, "experiment", None), "flush", None)
                if callable(flush):
                    flush()
            where = run_dir(trainer)
            self.path = write_report(
                where, os.path.join(where, self.filename), plain_js=self.plain_js, **self.limits
            )
        except Exception as exc:  # the report is never worth a failed run
            if quiet:
                return None
            print(
                f"composer_lightning: the run report was not written: {type(exc).__name__}: {exc}",
                file=sys.stderr,
                flush=True,
            )
            return None
        print(f"composer_lightning: run report in {self.path}", flush=True)
        return self.path


def with_run_report(configured: Any, callbacks: list[L.Callback]) -> list[L.Callback]:
    """`callbacks` with a `RunReport` added, unless `configured` (a config's
    `trainer.callbacks`: a list, one callback or None) or `callbacks` has one."""
    configured = configured if isinstance(configured, list) else [configured]
    if any(isinstance(c, RunReport) for c in [*configured, *callbacks]):
        return callbacks
    return [*callbacks, RunReport()]
