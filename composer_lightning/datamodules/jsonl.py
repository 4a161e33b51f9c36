"""Reading JSONL inputs with errors that name the file and line."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any


def read_jsonl(path: str, kind: str, check: Callable[[dict[str, Any]], str | None]) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-blank line.

    Args:
        path: the file.
        kind: what a line holds ("prompt", "trace"), for messages.
        check: returns what is wrong with an object, or None when it is fine.

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed line (`file:line: why`), or no
            line at all.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind} file {path!r} does not exist")
    out = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            problem = (f"expected a JSON object, got {type(obj).__name__}"
                       if not isinstance(obj, dict) else check(obj))
            if problem:
                raise ValueError(f"{path}:{lineno}: {problem}")
            out.append(obj)
    if not out:
        raise ValueError(f"{kind} file {path!r} holds no {kind}s")
    return out
