"""A configuration error as one line: jsonargparse's error tree cut to what it is about.

jsonargparse reports a value nested in classes and unions as a tree (each union's alternatives,
`NoneType` among them, with type dumps); the command line prints one line instead
(`config_error_line`): the innermost errors, each after the dotted key it is about, with an
unknown key turned into the keys the class does accept.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re


def config_error_line(error: BaseException) -> str:
    """A parser or constructor error as one line.

    jsonargparse reports a value nested in classes and unions as a tree (each union's
    alternatives, `NoneType` among them, with type dumps); the line keeps the innermost errors,
    each after the dotted key it is about (`rollout.sampling: ...`), and turns "Option 'x' is
    not accepted" into the keys the class does accept."""
    leaves = _error_leaves(str(error))
    if not leaves:
        return " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    by_key: dict[str, list[str]] = {}
    for key, class_path, message in leaves:
        text = _unknown_key(message, class_path) or (
            f"{class_path}: {message}" if class_path else message
        )
        if text not in by_key.setdefault(key, []):
            by_key[key].append(text)
    return "; ".join(f"{key}: {'; '.join(m)}" if key else "; ".join(m) for key, m in by_key.items())


_PARSER_KEY = re.compile(r'^Parser key "([^"]+)":$')
_CLASS_PATH = re.compile(r"^Problem with given class_path '([^']+)':$")
_NOISE = (
    "Does not validate against any of the Union",
    "Subtypes:",
    "Errors:",
    "Given value",
    "Expected a <class 'NoneType'>",
)


def _error_leaves(text: str) -> list[tuple[str, str | None, str]]:
    """`(dotted key, class_path, message)` of each innermost error of jsonargparse's tree;
    `class_path` is the class the error is about (a class with an error of its own, not one
    of its keys), else None."""
    stack: list[tuple[int, str, str]] = []  # (indent, "key" | "class", value)
    leaves = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line:
            continue
        indent = len(raw) - len(raw.lstrip())
        if line.startswith("- "):
            line, indent = line[2:], indent + 2
        while stack and stack[-1][0] >= indent:
            stack.pop()
        for kind, pattern in (("key", _PARSER_KEY), ("class", _CLASS_PATH)):
            match = pattern.match(line)
            if match:
                stack.append((indent, kind, match.group(1)))
                break
        else:
            if not line.startswith(_NOISE):
                key = ".".join(v for _, kind, v in stack if kind == "key")
                about = stack[-1][2] if stack and stack[-1][1] == "class" else None
                leaves.append((key, about, line))
    return leaves


def _unknown_key(message: str, class_path: str | None) -> str | None:
    """ "unknown key 'temprature' (did you mean 'temperature'?); SamplingConfig takes ..." for
    jsonargparse's "Option 'temprature' is not accepted", else None."""
    match = re.search(r"Option '([^']+)' is not accepted", message)
    if match is None:
        return None
    key = match.group(1)
    inline = re.search(r"class_path='([^']+)'", message)
    class_path = inline.group(1) if inline else class_path
    try:
        module, _, name = (class_path or "").rpartition(".")
        params = [
            p.name
            for p in inspect.signature(
                getattr(importlib.import_module(module), name)
            ).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
    except (ImportError, AttributeError, ValueError, TypeError):
        return f"unknown key {key!r}"
    close = difflib.get_close_matches(key, params, n=1)
    guess = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown key {key!r}{guess}; {name} takes {', '.join(params)}"
