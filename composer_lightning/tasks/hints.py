"""Hint providers beside the verifier's: a plain function, and the tool's own error."""

from __future__ import annotations

from collections.abc import Callable

from composer_lightning.runtime.calls import as_hint, call_each, check_timeout
from composer_lightning.tasks.base import DEFAULT_TIMEOUT, HintProvider, Problem, check_lengths


class FunctionHint(HintProvider):
    """Hints from a plain function `fn(problem, completion) -> str | None` (None: no hint).

    A call that raises, returns anything but a string or None, or runs past `timeout` gives no
    hint for that sample, one warning line, and counts in `failures`.

    Args:
        fn: the hint function.
        timeout: seconds one call may take before its sample gets no hint (it runs on in a
            background thread, see `runtime/calls.py`); None: no limit, and calls run in the
            training loop's thread.
    """

    def __init__(
        self, fn: Callable[[Problem, str], str | None], timeout: float | None = DEFAULT_TIMEOUT
    ) -> None:
        self.fn = fn
        self.timeout = check_timeout(timeout, "FunctionHint")
        self.failures = 0

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        check_lengths(problems, completions)
        values, failures = call_each(
            self.fn,
            problems,
            completions,
            self.timeout,
            "hint function",
            "it gets no hint",
            as_hint,
        )
        self.failures += failures
        return values


class ToolErrorHint(HintProvider):
    """The tool's own error message as the hint of the turn that caused it, at no judge cost
    (seed 000's hint at the erroneous tool turn, from the live rollout): a turn whose next
    state carries a `tool_error` gets `template` with `{error}` replaced by it; every other
    turn gets none.

    Args:
        template: the hint text around the error; default the error itself.
    """

    def __init__(self, template: str = "{error}") -> None:
        if "{error}" not in template:
            raise ValueError(f"ToolErrorHint template must contain '{{error}}', got {template!r}")
        self.template = template

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        check_lengths(problems, completions)
        return [
            None
            if p.get("tool_error") is None
            else self.template.replace("{error}", str(p["tool_error"]))
            for p in problems
        ]
