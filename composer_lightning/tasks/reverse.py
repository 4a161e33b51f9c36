"""Reverse a short string of digits: answers take several tokens.

"Reverse 4719." → "9174". A copy-with-reordering task a tiny model can partly learn. The verifier
reads the first run of digits in the completion. Reward: 1.0 for the exact string; otherwise
0.0, or with `partial_credit=True` the fraction of positions that match,
`#{i : guess[i] == answer[i]} / max(len(guess), len(answer))` (< 1 unless exact). A wrong answer
gets a hint naming the length and the first wrong digit from the left, e.g.
"The answer has 4 digits; digit 2 is 1.".
"""

from __future__ import annotations

import random
import re

from composer_lightning.tasks.base import Problem, Task, Verdict

_DIGITS = re.compile(r"\d+")


def first_digits(text: str) -> str | None:
    """The first run of digits in `text`, or None."""
    m = _DIGITS.search(text)
    return m.group() if m else None


def digits_hint(answer: str, guess: str | None) -> str:
    """Error-derived hint: the answer's length and its first digit the guess got wrong."""
    n = len(answer)
    idx = 0
    if guess is not None:
        idx = next((i for i in range(n) if i >= len(guess) or guess[i] != answer[i]), n - 1)
    text = f"The answer has {n} digits; digit {idx + 1} is {answer[idx]}."
    return text if guess is not None else "Reply with the digits only. " + text


class ReverseDigits(Task):
    """Reverse a random digit string of `min_len`–`max_len` digits.

    Args:
        min_len: shortest input (≥ 1).
        max_len: longest input.
        partial_credit: give the fraction of matching positions instead of 0 when wrong.
        template: the user message; `{digits}` is filled in.
    """

    name = "reverse"
    required_fields = ("answer",)

    def __init__(
        self,
        min_len: int = 3,
        max_len: int = 5,
        partial_credit: bool = False,
        template: str = "Reverse {digits}.",
    ) -> None:
        if not 1 <= min_len <= max_len:
            raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
        self.min_len, self.max_len = min_len, max_len
        self.partial_credit = partial_credit
        self.template = template

    def make(self, digits: str) -> Problem:
        """The problem of reversing `digits`."""
        if not digits.isdigit():
            raise ValueError(f"not a digit string: {digits!r}")
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": self.template.format(digits=digits)}],
            "digits": digits,
            "answer": digits[::-1],
            "partial_credit": self.partial_credit,
        }

    def sample(self, rng: random.Random) -> Problem:
        n = rng.randint(self.min_len, self.max_len)
        return self.make("".join(rng.choice("0123456789") for _ in range(n)))

    def verify(self, problem: Problem, completion: str) -> Verdict:
        answer = str(problem["answer"])
        guess = first_digits(completion)
        if guess == answer:
            return Verdict(1.0, None)
        reward = 0.0
        if guess is not None and problem.get("partial_credit", self.partial_credit):
            matches = sum(g == a for g, a in zip(guess, answer, strict=False))
            reward = matches / max(len(guess), len(answer))
        return Verdict(reward, digits_hint(answer, guess))
