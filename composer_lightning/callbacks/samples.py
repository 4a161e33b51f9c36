"""What the model says: sampled prompts, completions, rewards and hints, every N steps.

Rows go to `rollouts.jsonl` in the run directory (one JSON object per sample, with the step) and
to each logger's own table or text API where it has one: TensorBoard's TEXT tab (a Markdown
table), a W&B table (`rollouts`), an MLflow text artifact (`rollouts/step_000010.md`); a CSV
logger has none (the JSONL file is beside its metrics). Rank 0 writes its own samples. A run
without a logger (`logger=False`) writes nothing.
"""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L

from composer_lightning.runtime.rundir import run_dir


def write_samples(trainer: L.Trainer, step: int, rows: list[dict[str, Any]]) -> None:
    """Append `rows` (prompt, completion, reward, hint) of `step` to the run's samples, and
    hand them to each logger's table or text API."""
    if not rows or not trainer.is_global_zero or not trainer.loggers:
        return
    directory = run_dir(trainer)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "rollouts.jsonl"), "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")
    for logger in trainer.loggers:
        log_rows(logger, step, rows)


def log_rows(logger: Any, step: int, rows: list[dict[str, Any]]) -> None:
    """The rows in `logger`'s own table or text API, where it has one."""
    from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger

    if isinstance(logger, TensorBoardLogger):
        logger.experiment.add_text("rollouts", markdown_table(rows), global_step=step)
    elif isinstance(logger, WandbLogger):
        columns = list(rows[0])
        logger.log_table(
            "rollouts", columns=columns, data=[[r.get(k) for k in columns] for r in rows], step=step
        )
    elif isinstance(logger, MLFlowLogger):
        logger.experiment.log_text(
            logger.run_id, markdown_table(rows), f"rollouts/step_{step:06d}.md"
        )


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of the rows (TensorBoard renders Markdown in its TEXT tab)."""

    def cell(value: Any) -> str:
        text = "—" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", " ⏎ ")

    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(cell(r.get(k)) for k in keys) + " |" for r in rows]
    return "\n".join(lines)
