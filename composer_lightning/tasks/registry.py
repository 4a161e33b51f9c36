"""Lookup of tasks by short name or dotted class path (no import-time registry).

A task built once by its class path (a user's `data.task: my_pkg.tasks.MyTask`) is then also
known in this process by its `name`, so that its rows may say `"task": self.name` as the
built-in tasks' rows do; a name that is a built-in one stays the built-in task.
"""

from __future__ import annotations

import importlib
from typing import Any

from composer_lightning.tasks.base import Task

BUILTIN_TASKS: dict[str, str] = {
    "arithmetic": "composer_lightning.tasks.arithmetic.Arithmetic",
    "chat_arithmetic": "composer_lightning.tasks.chat_math.ChatArithmetic",
    "chat_boxed": "composer_lightning.tasks.chat_math.ChatBoxed",
    "chat_tagged": "composer_lightning.tasks.chat_math.ChatTagged",
    "chat_answer_line": "composer_lightning.tasks.chat_math.ChatAnswerLine",
    "chat_sums": "composer_lightning.tasks.chat_math.ChatSums",
    "word_problems": "composer_lightning.tasks.chat_math.WordProblems",
    "reverse": "composer_lightning.tasks.reverse.ReverseDigits",
    "tool_calc": "composer_lightning.tasks.tool_calc.ToolCalc",
}

#: The `name` of each task built here by its class path -> that path.
_BUILT_BY_PATH: dict[str, str] = {}


def _import_class(path: str) -> type:
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"not a dotted class path: {path!r}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"cannot import task class {path!r}: {err}") from err


def get_task(name_or_class_path: str, **kwargs: Any) -> Task:
    """Build a task from a built-in short name or a dotted class path.

    Args:
        name_or_class_path: e.g. "arithmetic", "chat_arithmetic", "word_problems", "reverse",
            "tool_calc" or "my_pkg.tasks.MyTask".
        **kwargs: passed to the task's constructor.

    Raises:
        ValueError: unknown name (the message lists the built-in names), an import failure,
            or a class that is not a `Task`.
    """
    return task_class(name_or_class_path)(**kwargs)


def task_class(name_or_class_path: str) -> type[Task]:
    """The task class a short name or dotted class path names (`get_task`, without building
    it); a class path also makes its class's `name` known here."""
    path = BUILTIN_TASKS.get(name_or_class_path) or _BUILT_BY_PATH.get(name_or_class_path)
    if path is None:
        if "." not in name_or_class_path:
            raise ValueError(
                f"unknown task {name_or_class_path!r}; known names: {sorted(BUILTIN_TASKS)}"
                f"{' and ' + str(sorted(_BUILT_BY_PATH)) if _BUILT_BY_PATH else ''}, "
                "or give a dotted class path (package.module.Class)"
            )
        path = name_or_class_path
    cls = _import_class(path)
    if not (isinstance(cls, type) and issubclass(cls, Task)):
        raise ValueError(f"{path!r} is not a Task subclass")
    name = getattr(cls, "name", None)
    if path == name_or_class_path and isinstance(name, str) and name not in BUILTIN_TASKS:
        _BUILT_BY_PATH.setdefault(name, path)
    return cls
