"""Prompt rows from a JSONL file or a `datasets` dataset, each checked once as it loads.

A row is a problem (`tasks/base.py`): TRL's standard format `{"prompt": "text"}`, its
conversational format `{"prompt": [{"role", "content"}, ...]}`, or `{"messages": [...]}`, plus
any other fields (`answer`, `solution`, ...): they reach the verifier and, by name, TRL-style
reward functions. `columns` renames fields first (`{"question": "prompt"}` for GSM8K). A row
that lacks a prompt or a field its task's verifier reads is one error naming the row
(`file:line`, or `dataset[split] row i`), not a failure per rollout.

`max_prompt_length` is TRL's: a longer prompt keeps its last tokens (`truncate_left`, as
`SDPOTrainer._tokenize_prompts` in TRL 1.16 does, `ids[-max_prompt_length:]`, and as
GRPOTrainer did before TRL 1.0 dropped the option).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from composer_lightning.chat import problem_messages
from composer_lightning.datamodules.jsonl import read_jsonl_lines
from composer_lightning.tasks import Task, get_task
from composer_lightning.tasks.base import Problem

#: `datasets` builders of local files, by suffix.
_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv"}


def rename_columns(row: dict[str, Any], columns: dict[str, str] | None) -> dict[str, Any]:
    """`row` with each field named in `columns` (source → target) renamed."""
    return {(columns or {}).get(k, k): v for k, v in row.items()}


def truncate_left(ids: list[int], max_prompt_length: int | None) -> list[int]:
    """The last `max_prompt_length` ids (TRL's left truncation); all of them for None."""
    return ids if max_prompt_length is None else ids[-max_prompt_length:]


def row_checker(task: str | None) -> Callable[[dict[str, Any]], str | None]:
    """A check of one row: what is wrong with it, or None (its task's verifier is found by the
    row's `task` field, else `task`)."""
    tasks: dict[str, Task] = {}

    def check(obj: dict[str, Any]) -> str | None:
        try:
            problem_messages(obj)
        except ValueError:
            return (
                "needs 'prompt' (a string, or a chat: a list of {role, content}) or 'messages'"
                f" (a chat); this row has {sorted(obj)}"
            )
        name = obj.get("task", task)
        if name is None:
            return None
        if name not in tasks:
            try:
                tasks[name] = get_task(name)
            except (KeyError, ValueError, ImportError) as err:
                return f"unknown task {name!r} ({err})"
        missing = [f for f in tasks[name].required_fields if f not in obj]
        if missing:
            return f"the {name!r} verifier needs field(s) {missing}; this row has {sorted(obj)}"
        return None

    return check


def read_prompt_file(
    path: str, task: str | None = None, columns: dict[str, str] | None = None
) -> list[tuple[str, Problem]]:
    """The rows of a JSONL prompt file, each labelled `file:line`, columns renamed, checked."""
    check = row_checker(task)
    lines = read_jsonl_lines(path, "prompt", lambda obj: check(rename_columns(obj, columns)))
    return [(f"{path}:{n}", rename_columns(obj, columns)) for n, obj in lines]


def load_prompt_dataset(
    path: str,
    name: str | None = None,
    split: str = "train",
    task: str | None = None,
    columns: dict[str, str] | None = None,
) -> list[tuple[str, Problem]]:
    """The rows of a `datasets` dataset, each labelled `path[split] row i`, renamed, checked.

    Args:
        path: a hub id (`openai/gsm8k`), a local parquet / JSON / JSONL / CSV file (loaded with
            the builder of its suffix; its one split is `train`), a local dataset directory,
            or (from Python) a `datasets.Dataset` object, or a `DatasetDict` (its `split`).
        name: the dataset's configuration (`main`), if it has several.
        split: the split (`train`, `train[:1000]`).
        task, columns: as for `read_prompt_file`.
    """
    try:
        import datasets
    except ImportError:
        raise ImportError(
            "RolloutDataModule(dataset=...) needs the `datasets` package: pip install "
            "'composer-lightning[data]'"
        ) from None
    if not isinstance(path, str):  # a `datasets.Dataset` (or `DatasetDict`) object
        data = path[split] if hasattr(path, "keys") and split in path.keys() else path
        label = f"{type(path).__name__} object"
        return _checked_rows(data, label, task, columns)
    builder = _BUILDERS.get(os.path.splitext(path)[1].lower())
    if os.path.isfile(path) and builder is not None:
        data = datasets.load_dataset(builder, data_files=path, split=split)
    elif os.path.isfile(path):
        raise ValueError(
            f"dataset file {path!r}: unknown format, expected one of {sorted(_BUILDERS)}"
        )
    else:
        data = datasets.load_dataset(path, name, split=split)
    return _checked_rows(data, f"{path}[{split}]", task, columns)


def _checked_rows(
    data: Any, label: str, task: str | None, columns: dict[str, str] | None
) -> list[tuple[str, Problem]]:
    check, rows = row_checker(task), []
    for i, raw in enumerate(data):
        row = rename_columns(dict(raw), columns)
        problem = check(row)
        if problem:
            raise ValueError(f"{label} row {i}: {problem}")
        rows.append((f"{label} row {i}", row))
    if not rows:
        raise ValueError(f"dataset {label} has no rows")
    return rows
