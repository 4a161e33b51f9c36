"""Hint providers beside the verifier's: a plain function, the tool's own error, and one that
hints a turn by its place in the episode."""

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
    (SDPO's hint at the erroneous tool turn, from the live rollout): a turn whose next
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


class EpisodeHint(HintProvider):
    """Hints by where a turn stands in its episode: a turn with a next state (a tool call and
    the tool's reply, a message and the user's answer) gets `turns`' hint, the episode's last
    turn (its answer) gets `answer`'s. E.g. `turns=ToolErrorHint()` and `answer=VerifierHint()`
    on a chain of tool calls: a call the tool rejected is hinted with the tool's error, an
    answer that stopped the chain early with what it left out (`tool_calc`'s partial sums),
    and a correct call gets no hint (the verifier would read it as an answer with no number).

    A turn with a next state is one whose problem carries `turn` (its index), as the rollout
    gives it (`rollout/turns.py`, `turn_problem`); single-turn samples are answers.

    Args:
        answer: the provider of the episode's last turn; None: that turn gets no hint.
        turns: the provider of every other turn; None: those turns get no hint.
    """

    def __init__(
        self, answer: HintProvider | None = None, turns: HintProvider | None = None
    ) -> None:
        if answer is None and turns is None:
            raise ValueError("EpisodeHint needs a provider: give `answer`, `turns` or both")
        self.answer, self.turns = answer, turns

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        check_lengths(problems, completions)
        out: list[str | None] = [None] * len(problems)
        for provider, is_turn in ((self.turns, True), (self.answer, False)):
            picked = [i for i, p in enumerate(problems) if ("turn" in p) == is_turn]
            if provider is None or not picked:
                continue
            values = provider.hints([problems[i] for i in picked], [completions[i] for i in picked])
            check_lengths(picked, values)
            for i, value in zip(picked, values, strict=True):
                out[i] = value
            self.failures += provider.failures  # counted here, as `provider_values` reads it
            provider.failures = 0
        return out
