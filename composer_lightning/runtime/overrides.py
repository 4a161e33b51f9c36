"""Command-line overrides that jsonargparse cannot take as written, given to it another way.

A `null` two levels into nested class specs (`--rollout.score.reward_weights=null`: the rollout
callback's score provider's argument) reaches jsonargparse's inner parser as the string
`"None"` (jsonargparse 4.53 re-formats the already parsed value with `str`), which no
`list[float] | None` accepts, while the same `null` in a YAML file works. `null_overlays`
writes each such override as a one-key YAML file in its place (`--config <file>`), so it is
applied in the same order as it was written; every other argument is left as it is. The files
live in a temporary directory made at the first such override and removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import yaml

#: Spellings of null on the command line (YAML's, and Python's).
_NULLS = {"null", "Null", "NULL", "~", "None", "none"}
#: The name every overlay directory starts with (`is_overlay`).
_PREFIX = "composer-overrides-"


def is_overlay(path: str | os.PathLike) -> bool:
    """Whether `path` is a file `null_overlays` wrote (not a config the user gave)."""
    return os.path.basename(os.path.dirname(os.fspath(path))).startswith(_PREFIX)


def null_overlays(args: list[str]) -> list[str]:
    """`args` with every `--a.b.c=null` (a key of three or more parts) replaced by
    `--config <temporary directory>/override-<i>.yaml` holding `{a: {b: {c: null}}}`."""
    out, i, directory = [], 0, None
    while i < len(args):
        arg = args[i]
        key, value = None, None
        if arg.startswith("--") and "=" in arg:
            key, value = arg[2:].split("=", 1)
        elif arg.startswith("--") and i + 1 < len(args) and args[i + 1] in _NULLS:
            key, value = arg[2:], args[i + 1]
        if key is None or value not in _NULLS or key.count(".") < 2:
            out.append(arg)
            i += 1
            continue
        overlay: dict = {}
        node = overlay
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = None
        if directory is None:
            directory = tempfile.mkdtemp(prefix=_PREFIX)
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        path = os.path.join(directory, f"override-{len(out)}.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(overlay, f)
        out += ["--config", path]
        i += 1 if "=" in arg else 2
    return out
