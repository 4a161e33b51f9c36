"""The task verifier as score and hint provider: `VerifierScore`, `VerifierHint`.

A problem names its task (`problem["task"]`, a short name or a dotted class path) unless the
provider was given one; the task is looked up once per name (`tasks/registry.py`) and its
`verify` gives the sample's score and hint. Calls fail per sample (`runtime/calls.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from composer_lightning.runtime.calls import BadValue, as_hint, call_each, check_timeout
from composer_lightning.tasks.base import (
    DEFAULT_TIMEOUT,
    HintProvider,
    Problem,
    ScoreProvider,
    Task,
    Verdict,
    check_lengths,
)
from composer_lightning.tasks.registry import get_task


class _VerifierBase:
    """Shared lookup of a problem's verifier and per-sample failure accounting."""

    _consequence = "it gets no score/hint"

    def __init__(self, task: Task | str | None = None, timeout: float | None = DEFAULT_TIMEOUT):
        if isinstance(task, str):
            task = get_task(task)
        self.task = task
        self.timeout = check_timeout(timeout, type(self).__name__)
        self.failures = 0
        self._cache: dict[str, Task] = {}

    def _task_for(self, problem: Problem) -> Task:
        if self.task is not None:
            return self.task
        name = problem.get("task")
        if not name:
            raise ValueError(
                "problem has no 'task' field and the provider was built without a task"
            )
        if name not in self._cache:
            self._cache[name] = get_task(name)
        return self._cache[name]

    def bind_task(self, name: str, task: Task) -> None:
        """Judge problems whose `"task"` is `name` with `task` (the run's data built it, with
        its arguments), instead of a fresh one built from the name alone."""
        self._cache[name] = task

    def check(self, problems: Sequence[Problem]) -> str | None:
        """What keeps this verifier from judging `problems` (no task to look up, an unknown
        task, a field its verifier reads missing), said once for the first such problem; None
        when it can judge them all. Called before a run starts, so that a misconfiguration is
        one line instead of a warning per sample."""
        for i, problem in enumerate(problems):
            try:
                task = self._task_for(problem)
            except (ValueError, KeyError, ImportError) as err:
                return f"problem {i}: {err}"
            missing = [f for f in task.required_fields if f not in problem]
            if missing:
                return f"problem {i}: the {task.name!r} verifier needs field(s) {missing}"
        return None

    def _each(
        self,
        fn: Any,
        problems: list[Problem],
        completions: list[str],
        subject: str,
        convert: Any = as_hint,
    ) -> list[Any]:
        """`convert(fn(problem, completion))` for each sample, under this provider's timeout; a
        call that raises, times out or returns what `convert` refuses fails its sample (None,
        one warning line, counted in `failures`)."""
        check_lengths(problems, completions)
        values, failures = call_each(
            fn, problems, completions, self.timeout, subject, self._consequence, convert
        )
        self.failures += failures
        return values

    def _verify(self, problem: Problem, completion: str) -> Verdict:
        return self._task_for(problem).verify(problem, completion)

    def _verdicts(self, problems: list[Problem], completions: list[str]) -> list[Verdict | None]:
        return self._each(self._verify, problems, completions, "verifier", _as_verdict)


def _as_verdict(value: Any) -> Verdict:
    if not isinstance(value, Verdict):
        raise BadValue(f"{type(value).__name__} {value!r}", "a Verdict")
    return value


class VerifierScore(_VerifierBase, ScoreProvider):
    """Scores with the task verifier: always usable unless the verifier raises or times out.

    Args:
        task: the task (instance, short name or class path); None looks up `problem["task"]`.
        timeout: seconds one `verify` call may take before its sample gets no score (the call
            runs on in a background thread, see `runtime/calls.py`); None: no limit, and calls run
            in the training loop's thread.
    """

    _consequence = "it gets no score"

    def score(self, problems: list[Problem], completions: list[str]) -> list[float | None]:
        return [
            None if v is None else float(v.reward) for v in self._verdicts(problems, completions)
        ]


class VerifierHint(_VerifierBase, HintProvider):
    """Hints from the task verifier's error-derived `Verdict.hint` (None when correct).

    Args:
        task: the task (instance, short name or class path); None looks up `problem["task"]`.
        timeout: seconds one `verify` call may take before its sample gets no hint; None: no
            limit (see `VerifierScore`).
        candidates: up to this many candidate hints per wrong sample (`Task.hint_candidates`,
            the verifier's hint first), for top-k OPD's hint selection; 1: the hint alone.
    """

    _consequence = "it gets no hint"

    def __init__(
        self,
        task: Task | str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        candidates: int = 1,
    ):
        super().__init__(task, timeout)
        if isinstance(candidates, bool) or not isinstance(candidates, int) or candidates < 1:
            raise ValueError(
                f"VerifierHint: candidates must be an integer >= 1, got {candidates!r}"
            )
        self.candidates = candidates

    def _candidates(self, problem: Problem, completion: str) -> list[str]:
        return self._task_for(problem).hint_candidates(problem, completion, self.candidates)[
            : self.candidates
        ]

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        if self.candidates == 1:
            return [None if v is None else v.hint for v in self._verdicts(problems, completions)]
        return self._each(self._candidates, problems, completions, "verifier")


class AnswerHint(_VerifierBase, HintProvider):
    """The reference answer as the hint of a reply the verifier finds wrong (where it would
    give its own hint); None for a right one.

    Privileged information for the teacher only (OPD's and SDPO's hinted context): the student
    never sees it, and learns from how the policy, told the answer, would have scored its own
    reply's tokens. On SmolLM2's chat arithmetic this told the teacher far more than the
    verifier's digit hint (docs/benchmarks/smollm2.md).

    Args:
        task, timeout: as `VerifierHint`'s.
        template: the hint, formatted with the problem's fields (`{answer}`); a field the
            problem lacks fails its sample (no hint, one warning line).
    """

    _consequence = "it gets no hint"

    def __init__(
        self,
        task: Task | str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        template: str = "The correct answer is {answer}.",
    ):
        super().__init__(task, timeout)
        self.template = template

    def _hint(self, problem: Problem, completion: str) -> str | None:
        if self._verify(problem, completion).hint is None:
            return None  # right, as the verifier judges it
        return self.template.format_map(problem)

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        return self._each(self._hint, problems, completions, "answer hint")
