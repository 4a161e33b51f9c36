"""Tasks, verdicts, and the score / hint provider contracts.

A *problem* is a plain dict: at least `"messages"` (a chat, a list of `{"role", "content"}`)
and `"task"` (the task's short name or dotted class path, so a verifier can be found again),
plus task fields such as `"answer"`. A `Task` samples problems and verifies completions; the
rollout side turns verdicts into scores (`ScoreProvider`) and hints (`HintProvider`), the two
inputs of the four-way dispatch (DESIGN.md).

Provider failures are per sample: a reward function that raises, returns something that is not
a number, or runs past its timeout (`tasks/calls.py`) gives `None` for that sample (counted in
`provider.failures`), never a crashed or stuck batch. Reward functions (`FunctionScore`, TRL's
batched form included) live in `tasks/rewards.py`. Whether "every sample failed" is an error
is the caller's decision; `ScoringError.raise_if_all_failed` makes it a clear one.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from composer_lightning.tasks.calls import BadValue, as_hint, call_each, check_timeout

logger = logging.getLogger(__name__)

#: Seconds one reward, verifier or hint call may take by default before its sample fails.
DEFAULT_TIMEOUT = 60.0

Problem = dict[str, Any]


@dataclass(frozen=True)
class Verdict:
    """A verifier's judgement of one completion.

    Attributes:
        reward: in [0, 1]; 1.0 is an exact answer.
        hint: for a wrong answer, error-derived information that would help a second attempt
            (e.g. "The answer has 2 digits; the last digit is 7."); None when correct.
    """

    reward: float
    hint: str | None = None

    def __post_init__(self) -> None:
        if not 0.0 <= self.reward <= 1.0:
            raise ValueError(f"reward must be in [0, 1], got {self.reward!r}")


class Task(ABC):
    """A source of problems with a programmatic verifier.

    Subclasses set `name` and implement `sample` and `verify`. `sample` must put
    `"messages"` and `"task"` into the problem it returns.
    """

    name: str = "task"
    #: Fields of a problem the verifier reads besides "messages" (checked when prompts load).
    required_fields: tuple[str, ...] = ()

    @abstractmethod
    def sample(self, rng: random.Random) -> Problem:
        """Draw one problem using only `rng` (so a seeded stream is reproducible)."""

    @abstractmethod
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Score `completion` (decoded response text) against `problem`."""

    def hint_candidates(self, problem: Problem, completion: str, n: int) -> list[str]:
        """Up to `n` candidate hints for a wrong `completion`, the verifier's own hint first
        ([] when it is right); top-k OPD selects among them. By default the verifier's hint
        alone; a task overrides this to offer other true statements about the answer."""
        hint = self.verify(problem, completion).hint
        return [] if hint is None else [hint]

    def environment(self, problem: Problem) -> Any:
        """A fresh environment (`envs.Environment`) for one episode on `problem`. By default a
        single turn: the problem's chat, one assistant turn, scored by the verifier."""
        from composer_lightning.envs.base import SingleTurn

        return SingleTurn()

    def samples(self, n: int, seed: int = 0) -> list[Problem]:
        """`n` problems from a fresh `random.Random(seed)`."""
        rng = random.Random(seed)
        return [self.sample(rng) for _ in range(n)]


class ScoringError(RuntimeError):
    """No sample of a batch received a usable score or hint because the provider failed."""

    @classmethod
    def raise_if_all_failed(cls, values: Sequence[Any], failures: int, what: str = "score") -> None:
        """Raise when every value is None *and* every one of them was a failure.

        Args:
            values: a provider's output for one batch.
            failures: how many of them were failures (exceptions) in this batch.
            what: noun used in the message ("score", "hint").
        """
        if values and failures >= len(values) and all(v is None for v in values):
            raise cls(
                f"all {len(values)} {what} calls of the batch raised; see the logged "
                "exceptions (the reward function or verifier is broken)"
            )


class ScoreProvider(ABC):
    """Scores completions. `None` means no usable score (the sample gets `has_reward=False`)."""

    failures: int = 0

    @abstractmethod
    def score(self, problems: list[Problem], completions: list[str]) -> list[float | None]:
        """One score in [0, 1] (or None) per (problem, completion) pair."""


class HintProvider(ABC):
    """Produces hints. `None` means no accepted hint (the sample gets `has_teacher=False`)."""

    failures: int = 0

    @abstractmethod
    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        """One hint (or None) per (problem, completion) pair."""


def _check_lengths(problems: Sequence[Any], completions: Sequence[Any]) -> None:
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")


class _VerifierBase:
    """Shared lookup of a problem's verifier and per-sample failure accounting."""

    _consequence = "it gets no score/hint"

    def __init__(self, task: Task | str | None = None, timeout: float | None = DEFAULT_TIMEOUT):
        if isinstance(task, str):
            from composer_lightning.tasks.registry import get_task

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
            from composer_lightning.tasks.registry import get_task

            self._cache[name] = get_task(name)
        return self._cache[name]

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

    def _verify(self, problem: Problem, completion: str) -> Verdict:
        return self._task_for(problem).verify(problem, completion)

    def _verdicts(self, problems: list[Problem], completions: list[str]) -> list[Verdict | None]:
        _check_lengths(problems, completions)
        verdicts, failures = call_each(
            self._verify,
            problems,
            completions,
            self.timeout,
            "verifier",
            self._consequence,
            _as_verdict,
        )
        self.failures += failures
        return verdicts


def _as_verdict(value: Any) -> Verdict:
    if not isinstance(value, Verdict):
        raise BadValue(f"{type(value).__name__} {value!r}", "a Verdict")
    return value


class VerifierScore(_VerifierBase, ScoreProvider):
    """Scores with the task verifier: always usable unless the verifier raises or times out.

    Args:
        task: the task (instance, short name or class path); None looks up `problem["task"]`.
        timeout: seconds one `verify` call may take before its sample gets no score (the call
            runs on in a background thread, see `tasks/calls.py`); None: no limit, and calls run
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
        _check_lengths(problems, completions)
        values, failures = call_each(
            self._candidates,
            problems,
            completions,
            self.timeout,
            "verifier",
            self._consequence,
            as_hint,
        )
        self.failures += failures
        return values


class FunctionHint(HintProvider):
    """Hints from a plain function `fn(problem, completion) -> str | None` (None: no hint).

    A call that raises, returns anything but a string or None, or runs past `timeout` gives no
    hint for that sample, one warning line, and counts in `failures`.

    Args:
        fn: the hint function.
        timeout: seconds one call may take before its sample gets no hint (it runs on in a
            background thread, see `tasks/calls.py`); None: no limit, and calls run in the
            training loop's thread.
    """

    def __init__(
        self, fn: Callable[[Problem, str], str | None], timeout: float | None = DEFAULT_TIMEOUT
    ) -> None:
        self.fn = fn
        self.timeout = check_timeout(timeout, "FunctionHint")
        self.failures = 0

    def hints(self, problems: list[Problem], completions: list[str]) -> list[str | None]:
        _check_lengths(problems, completions)
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
        _check_lengths(problems, completions)
        return [
            None
            if p.get("tool_error") is None
            else self.template.replace("{error}", str(p["tool_error"]))
            for p in problems
        ]
