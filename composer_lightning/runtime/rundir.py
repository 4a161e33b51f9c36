"""The run's directory: where its logs, samples, curves and checkpoints go."""

from __future__ import annotations

import json
import os
from typing import Any

import lightning as L


def run_dir(trainer: L.Trainer) -> str:
    """The run's directory, where its checkpoints go too: `<save_dir>/<name>/<version>` of the
    first logger, as `ModelCheckpoint` resolves it (TensorBoard and CSV: the logger's
    `log_dir`; W&B: `<save_dir>/<project>/<run id>`; MLflow: `<save_dir>/<experiment
    id>/<run id>`), else `default_root_dir`.

    Not `trainer.log_dir`: that is a broadcast from rank 0 (a collective), and this is called
    on rank 0 alone."""
    if not trainer.loggers:
        return trainer.default_root_dir
    logger = trainer.loggers[0]
    if logger.version is None and hasattr(logger, "experiment"):
        _ = logger.experiment  # W&B names its run when the run starts (as Lightning's setup does)
    version = logger.version
    version = version if isinstance(version, str) else f"version_{version}"
    return os.path.join(logger.save_dir or trainer.default_root_dir, str(logger.name), version)


def append_rows(trainer: L.Trainer, filename: str, rows: list[dict[str, Any]]) -> str | None:
    """Append `rows` as JSON lines to `filename` in the run's directory, on rank 0 of a run
    with a logger (as `rollouts.jsonl` is written); returns the file's path, or None when
    nothing was written."""
    if not rows or not trainer.is_global_zero or not trainer.loggers:
        return None
    directory = run_dir(trainer)
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, filename)
    with open(path, "a", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path
