"""What the model says: sampled prompts, completions, rewards and hints, every N steps.

Rows go to `rollouts.jsonl` in the run directory (one JSON object per sample, with the step) and,
with a TensorBoard logger, to its TEXT tab as a table. Rank 0 writes its own samples. A run
without a logger (`logger=False`) has no run directory: nothing is written.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L


def run_dir(trainer: L.Trainer) -> str:
    """The run's directory: the logger's version directory, else `default_root_dir`.

    Not `trainer.log_dir`: that is a broadcast from rank 0 (a collective), and this is called
    on rank 0 alone."""
    logger = trainer.logger
    directory = getattr(logger, "log_dir", None) if logger is not None else None
    return directory or trainer.default_root_dir


def write_samples(trainer: L.Trainer, step: int, rows: list[dict[str, Any]]) -> None:
    """Append `rows` (prompt, completion, reward, hint) of `step` to the run's samples."""
    if not rows or not trainer.is_global_zero or trainer.logger is None:
        return
    directory = run_dir(trainer)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "rollouts.jsonl"), "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_text("rollouts", markdown_table(rows), global_step=step)


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows (TensorBoard renders Markdown in its TEXT tab)."""

    def cell(value: Any) -> str:
        text = "—" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ⏎ ")

    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
