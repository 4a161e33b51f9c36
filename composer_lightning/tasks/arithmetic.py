"""Integer arithmetic with adjustable difficulty, verified exactly.

The verifier reads the first integer of the completion (an optional minus sign and digits) and
gives reward 1.0 when it equals the answer, 0.0 otherwise (no partial credit). A wrong answer
gets a hint derived from the error: the number of digits of the answer and the rightmost digit
the guess got wrong (digits right-aligned, where carries start), e.g. "The answer has 2 digits;
the last digit is 7.". `verify` reads only the problem's fields, so any instance verifies any
problem.
"""

from __future__ import annotations

import random
import re

from composer_lightning.tasks.base import Problem, Task, Verdict

_INT = re.compile(r"-?\d+")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def first_integer(text: str) -> int | None:
    """The first integer in `text` (e.g. "-12" in "x = -12, y = 3"), or None."""
    m = _INT.search(text)
    return int(m.group()) if m else None


def _digit_name(i: int, n: int) -> str:
    """A readable name for digit `i` (0 = leftmost) of an `n`-digit number."""
    if i == n - 1:
        return "the last digit"
    if i == 0:
        return "the first digit"
    return f"digit {i + 1} (from the left)"


def wrong_digit(answer: int, guess: int | None) -> int:
    """The rightmost digit of `answer` that `guess` got wrong, digits right-aligned (the first
    digit when only the length or sign is wrong; the last digit when nothing was guessed)."""
    digits = str(abs(answer))
    n = len(digits)
    if guess is None:
        return n - 1
    g = str(abs(guess)).zfill(n)[-n:]  # right-aligned, as digits are added
    wrong = [i for i in range(n) if g[i] != digits[i]]
    return wrong[-1] if wrong else 0  # only the length (or sign) is wrong: the first digit


def number_hint(answer: int, guess: int | None, digit: int | None = None) -> str:
    """Error-derived hint for a wrong integer `guess` of `answer`.

    States the sign (when negative), the digit count, and the value of one digit: `digit`
    (0 = leftmost), by default the rightmost digit the guess got wrong (`wrong_digit`).
    """
    digits = str(abs(answer))
    n = len(digits)
    parts = ["The answer is negative"] if answer < 0 else []
    parts.append(f"the answer has {n} digit{'s' if n > 1 else ''}")
    idx = wrong_digit(answer, guess) if digit is None else digit
    parts.append(f"{_digit_name(idx, n)} is {digits[idx]}")
    text = "; ".join(parts) + "."
    text = text[0].upper() + text[1:]
    if guess is None:
        text = "Reply with a number. " + text
    return text


class IntegerAnswer(Task):
    """A task whose answer is an integer (`problem["answer"]`): reward 1.0 when the reply's
    `guess` equals it, else 0.0 and a hint naming the digit count and one digit."""

    required_fields = ("answer",)

    def guess(self, completion: str) -> int | None:
        """The integer the reply gives: its first (the tiny policy answers with a number)."""
        return first_integer(completion)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        answer = int(problem["answer"])
        guess = self.guess(completion)
        if guess == answer:
            return Verdict(1.0, None)
        return Verdict(0.0, number_hint(answer, guess))

    def hint_candidates(self, problem: Problem, completion: str, n: int) -> list[str]:
        """The verifier's hint, then the same hint naming each other digit, rightmost first."""
        answer = int(problem["answer"])
        guess = self.guess(completion)
        if guess == answer:
            return []
        first = wrong_digit(answer, guess)
        others = [i for i in reversed(range(len(str(abs(answer))))) if i != first]
        return [number_hint(answer, guess, d) for d in [first, *others]][:n]


class Arithmetic(IntegerAnswer):
    """`a <op> b` for integers drawn uniformly from [min_value, max_value].

    Args:
        min_value: smallest operand.
        max_value: largest operand (difficulty grows with it).
        ops: operators to draw from, any of "+", "-", "*".
        allow_negative: if False, "-" problems are ordered so the answer is ≥ 0.
        template: the user message; `{a}`, `{op}`, `{b}` are filled in.
        carry_only: draw only "+" problems whose units digits carry (a % 10 + b % 10 ≥ 10): the
            shipped tiny policy's weak spot, a sparse-reward task (its `build_info.json` has the
            measured accuracies under `arithmetic_carry/`).
    """

    name = "arithmetic"

    def __init__(
        self,
        min_value: int = 0,
        max_value: int = 20,
        ops: tuple[str, ...] | list[str] = ("+",),
        allow_negative: bool = False,
        template: str = "What is {a} {op} {b}?",
        carry_only: bool = False,
    ) -> None:
        if min_value > max_value:
            raise ValueError(f"min_value {min_value} > max_value {max_value}")
        unknown = [op for op in ops if op not in _OPS]
        if unknown or not ops:
            raise ValueError(f"ops must be a non-empty subset of {sorted(_OPS)}, got {list(ops)}")
        self.min_value, self.max_value = min_value, max_value
        self.ops = tuple(ops)
        self.allow_negative = allow_negative
        self.template = template
        units = {v % 10 for v in range(min_value, min(max_value, min_value + 9) + 1)}
        if carry_only and (self.ops != ("+",) or 2 * max(units) < 10):
            raise ValueError(
                f"carry_only needs ops ['+'] and operands that can carry, got "
                f"ops {list(self.ops)}, max_value {max_value}"
            )
        self.carry_only = carry_only

    def make(self, a: int, op: str, b: int) -> Problem:
        """The problem `a <op> b` (used by `sample` and by tests)."""
        answer = _OPS[op](a, b)
        content = self.template.format(a=a, op=op, b=b)
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": content}],
            "a": a,
            "op": op,
            "b": b,
            "answer": str(answer),
        }

    def sample(self, rng: random.Random) -> Problem:
        a = rng.randint(self.min_value, self.max_value)
        b = rng.randint(self.min_value, self.max_value)
        while self.carry_only and a % 10 + b % 10 < 10:  # rejection: the same rng stream
            a, b = (
                rng.randint(self.min_value, self.max_value),
                rng.randint(self.min_value, self.max_value),
            )
        op = rng.choice(self.ops)
        if op == "-" and not self.allow_negative and b > a:
            a, b = b, a
        return self.make(a, op, b)
