"""Tasks this project never tuned on, written as a user would, to check that a hint head
composed with Dr. GRPO at its defaults does no harm (issue 49, docs/benchmarks/composition.md).

- `SumInWords`: "What do you get when you add 23 and 48?", checked on the reply's last number
  (a chat model answers in a sentence), with the verifier's own error-derived hint (the answer's
  digit count and one digit) — the composition a new user tries first.
- `DistanceApart`: "How far apart are 71 and 36 on the number line?" (|a − b|), another
  phrasing and another operation, checked on the last number.
- Hints beside the verifier's own: `useless_hint` (no information at all), and with
  `composer_lightning.tasks.AnswerHint` the answer (`template: "The correct answer is
  {answer}."`) or a worked reply (`template: "A right reply: {a} + {b} = {answer}."`).

A config names them by dotted path, nothing is registered:
    --data.init_args.task=examples.fresh_tasks.tasks.SumInWords
"""

from __future__ import annotations

import random

from composer_lightning.tasks.arithmetic import number_hint
from composer_lightning.tasks.base import Problem, Task, Verdict
from composer_lightning.tasks.chat_math import final_integer


class _LastNumber(Task):
    """Two two-digit operands (10 to 49), the answer read from the reply's last number."""

    required_fields = ("answer",)
    template = ""

    def answer(self, a: int, b: int) -> int:
        raise NotImplementedError

    def sample(self, rng: random.Random) -> Problem:
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": self.template.format(a=a, b=b)}],
            "a": a,
            "b": b,
            "op": "+",
            "answer": str(self.answer(a, b)),
        }

    def verify(self, problem: Problem, completion: str) -> Verdict:
        answer, guess = int(problem["answer"]), final_integer(completion)
        if guess == answer:
            return Verdict(1.0, None)
        return Verdict(0.0, number_hint(answer, guess))


class SumInWords(_LastNumber):
    """ "What do you get when you add a and b?" — a + b."""

    name = "sum_in_words"
    template = "What do you get when you add {a} and {b}?"

    def answer(self, a: int, b: int) -> int:
        return a + b


class DistanceApart(_LastNumber):
    """ "How far apart are a and b on the number line?" — |a − b|."""

    name = "distance_apart"
    template = "How far apart are {a} and {b} on the number line?"

    def answer(self, a: int, b: int) -> int:
        return abs(a - b)


def useless_hint(problem: Problem, completion: str) -> str | None:
    """A hint that says nothing about the problem, for a reply the verifier finds wrong (as the
    other hints are given): what a teacher told it can only change the tone."""
    guess = final_integer(completion)
    if guess is not None and str(guess) == str(problem["answer"]):
        return None
    return "Take a deep breath and answer carefully."
