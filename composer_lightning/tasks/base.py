"""Tasks, verdicts, and the score / hint provider contracts.

A *problem* is a plain dict: at least `"messages"` (a chat, a list of `{"role", "content"}`)
and `"task"` (the task's short name or dotted class path, so a verifier can be found again),
plus task fields such as `"answer"`. A `Task` samples problems and verifies completions; the
rollout side turns verdicts into scores (`ScoreProvider`) and hints (`HintProvider`), the two
inputs of the four-way dispatch (docs/design.md, "The four-way dispatch").

Provider failures are per sample: a reward function that raises, returns something that is not
a number, or runs past its timeout (`runtime/calls.py`) gives `None` for that sample (counted in
`provider.failures`), never a crashed or stuck batch. Reward functions (`FunctionScore`, TRL's
batched form included) live in `tasks/rewards.py`. Whether "every sample failed" is an error
is the caller's decision; `ScoringError.raise_if_all_failed` makes it a clear one.
"""

from __future__ import annotations

import logging
import random
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from composer_lightning.runtime.moved import moved_attribute

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
    #: the episode's environment gives the opening chat (`reset`): its problems may have none
    opens_in_environment: bool = False

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


def check_lengths(problems: Sequence[Any], completions: Sequence[Any]) -> None:
    if len(problems) != len(completions):
        raise ValueError(f"{len(problems)} problems but {len(completions)} completions")


def __getattr__(name: str) -> object:  # the providers that moved out (runtime/moved.py)
    return moved_attribute(__name__, name)
