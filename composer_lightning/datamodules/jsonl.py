"""File inputs: reading JSONL with errors that name the file and line, and the shuffled
endless order in which a datamodule walks the lines."""

from __future__ import annotations

import functools
import json
import os
import random
from collections.abc import Callable
from typing import Any


def read_jsonl(
    path: str, kind: str, check: Callable[[dict[str, Any]], str | None]
) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file, one per non-blank line.

    Args:
        path: the file.
        kind: what a line holds ("prompt", "trace"), for messages.
        check: returns what is wrong with an object, or None when it is fine.

    Raises:
        FileNotFoundError: no such file. ValueError: a malformed line (`file:line: why`: not
            UTF-8, not JSON, not an object, or what `check` says), or no line at all.
    """
    return [obj for _, obj in read_jsonl_lines(path, kind, check)]


def read_jsonl_lines(
    path: str, kind: str, check: Callable[[dict[str, Any]], str | None]
) -> list[tuple[int, dict[str, Any]]]:
    """`read_jsonl` with each object's line number (from 1), for messages about a line."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{kind} file {path!r} does not exist")
    out = []
    with open(path, "rb") as f:  # decoded per line, so that bad bytes are placed
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte "
                    f"{err.start + 1} of the line); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            problem = (
                f"expected a JSON object, got {type(obj).__name__}"
                if not isinstance(obj, dict)
                else check(obj)
            )
            if problem:
                raise ValueError(f"{path}:{lineno}: {problem}")
            out.append((lineno, obj))
    if not out:
        raise ValueError(f"{kind} file {path!r} holds no {kind}s")
    return out


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> tuple[int, ...]:
    order = list(range(n))
    random.Random(f"{seed}/epoch{epoch}").shuffle(order)
    return tuple(order)


def stream_positions(start: int, stop: int, n: int, seed: int) -> list[int]:
    """Line indices at positions `start..stop-1` of an endless stream over `n` lines, each pass
    a fresh seeded permutation: a pure function of the position, so a resumed stream continues
    exactly where it stopped."""
    return [_epoch_order(n, seed, k // n)[k % n] for k in range(start, stop)]
