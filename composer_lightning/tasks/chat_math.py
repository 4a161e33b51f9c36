"""Arithmetic as a chat model answers it: the final number of the reply is the answer.

A pretrained chat model does not reply with a bare number: "To add 7 and 6, ... 7 + 6 equals
13." The built-in `arithmetic` task reads the first integer (the tiny policy's reply format), so
that reply would score 0; these tasks read the answer where a chat model puts it — a
`\\boxed{...}` answer if the reply has one, else its last number (commas between digit groups
allowed) — and hint as `arithmetic` does (digit count and one digit of the answer).

- `chat_arithmetic`: `a <op> b` (`Arithmetic`'s operands and operators).
- `chat_boxed`: `chat_arithmetic` asking for the answer in `\\boxed{}`, and verified only
  there (a strict verifier, as math RL's often are): sparse for SmolLM2-135M-Instruct, which
  adds two-digit numbers (greedy 0.27 on the final number) but boxes 3 % of its replies (0.2 %
  boxed and right, sampled; docs/benchmarks/smollm2_sparse.md).
- `chat_tagged`: the same with the answer asked for between `<answer>` and `</answer>`:
  sparser still, SmolLM2-135M-Instruct writes the tags in 0 of 512 sampled replies (its final
  number is right in 19 %): a reward RL alone never sees, and told a worked reply in the
  tags it still writes none (0 of 16 greedy), so no hint head can teach them either.
- `chat_answer_line`: the same ending with `ANSWER: <number>`: SmolLM2 writes it in 0.4 % of
  sampled replies and never right (0 of 512); told a worked reply ending so, it is right in 16
  of 32 greedy replies. Yet Dr. GRPO alone learns it from its first two right replies (0.656
  held-out at step 20) where SDPO with that hint does not (docs/benchmarks/smollm2_sparse.md, "Sparser tasks").
- `chat_sums`: `a + b + c` (`terms` two-digit numbers): a sparse task for SmolLM2-135M-Instruct
  (greedy 0.016, sampled 0.006 at three terms; docs/benchmarks/smollm2_sparse.md).
- `word_problems`: two-step word problems, "Tom has 29 apples. He buys 13 more and gives away
  4. How many apples does Tom have now?" (answer a + b − c).
"""

from __future__ import annotations

import random
import re

from composer_lightning.tasks.arithmetic import Arithmetic, IntegerAnswer
from composer_lightning.tasks.base import Problem, Verdict

_NUMBER = re.compile(r"-?\d{1,3}(?:,\d{3})+(?!\d)|-?\d+")
_BOXED = re.compile(r"\\boxed\{\s*([^{}]*?)\s*\}")


def boxed_integer(text: str) -> int | None:
    """The integer in the reply's last `\\boxed{...}` that holds one, else None."""
    return _last_integer_in(_BOXED, text)


def _last_integer_in(form: re.Pattern[str], text: str) -> int | None:
    """The last integer of the reply's last match of `form` (its group) that holds one."""
    for candidate in reversed(form.findall(text)):
        numbers = _NUMBER.findall(candidate)
        if numbers:
            return int(numbers[-1].replace(",", ""))
    return None


def final_integer(text: str) -> int | None:
    """The answer a chat reply gives: the last `\\boxed{...}` integer, else the last integer
    ("1,234" is 1234), else None."""
    boxed = boxed_integer(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER.findall(text)
    return int(numbers[-1].replace(",", "")) if numbers else None


class _FinalAnswer(IntegerAnswer):
    """Verified on the reply's final integer (`final_integer`), hinted as `arithmetic` is."""

    def guess(self, completion: str) -> int | None:
        return final_integer(completion)


class ChatArithmetic(_FinalAnswer, Arithmetic):
    """`Arithmetic`'s problems (same arguments), verified on the reply's final answer.

    Args: see `Arithmetic`; the default operands are two-digit (10 to 49), where SmolLM2-135M-
    Instruct's greedy accuracy is 0.22 (`docs/benchmarks/smollm2.md`).
    """

    name = "chat_arithmetic"

    def __init__(self, min_value: int = 10, max_value: int = 49, **kwargs) -> None:
        super().__init__(min_value=min_value, max_value=max_value, **kwargs)


class _StrictForm(ChatArithmetic):
    """`chat_arithmetic` with the answer asked for in a set form and read only from there (a
    strict verifier, as math RL's often are): a reply without the form scores 0 and its hint
    says where the answer goes; a wrong number in the form is hinted as `chat_arithmetic`
    hints. A subclass names the form: `form` (a regex whose one group is the answer),
    `marker` (what the template must contain), `unformatted` (the hint of a reply without
    the form) and `default_template` (the question asking for it).

    Args: see `ChatArithmetic`; `template` (default `default_template`) must contain `marker`.
    """

    form: re.Pattern[str]
    marker: str
    unformatted: str
    default_template: str

    def __init__(self, template: str | None = None, **kwargs) -> None:
        template = self.default_template if template is None else template
        if self.marker not in template:
            raise ValueError(
                f"{self.name}: the template must ask for the answer in {self.marker} (only an "
                f"answer there is read), got {template!r}"
            )
        super().__init__(template=template, **kwargs)

    def guess(self, completion: str) -> int | None:
        """The integer in the reply's last answer in the form that holds one, else None."""
        return _last_integer_in(self.form, completion)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        if self.guess(completion) is None:
            return Verdict(0.0, self.unformatted)
        return super().verify(problem, completion)

    def hint_candidates(self, problem: Problem, completion: str, n: int) -> list[str]:
        if self.guess(completion) is None:
            return [self.unformatted][:n]
        return super().hint_candidates(problem, completion, n)


class ChatBoxed(_StrictForm):
    """`chat_arithmetic` with the answer asked for in `\\boxed{}` and read only from there.

    Args: see `_StrictForm`; `template` must ask for the box.
    """

    name = "chat_boxed"
    form = _BOXED
    marker = "\\boxed"
    unformatted = "Work it out, then end the reply with the answer in \\boxed{}."
    default_template = "What is {a} {op} {b}? Put your final answer within \\boxed{{}}."


class ChatTagged(_StrictForm):
    """`chat_arithmetic` with the answer asked for between `<answer>` and `</answer>` (the tags
    of R1-style format rewards) and read only from there.

    Args: see `_StrictForm`; `template` must ask for the tags.
    """

    name = "chat_tagged"
    form = re.compile(r"<answer>\s*([^<>]*?)\s*</answer>")
    marker = "<answer>"
    unformatted = "Work it out, then end the reply with the answer between <answer> and </answer>."
    default_template = "What is {a} {op} {b}? Give the final answer between <answer> and </answer>."


class ChatAnswerLine(_StrictForm):
    """`chat_arithmetic` with the answer asked for after `ANSWER:` at the reply's end and read
    only from there (the last `ANSWER: <number>`; the marker is case-sensitive, as asked).

    Args: see `_StrictForm`; `template` must ask for `ANSWER:`.
    """

    name = "chat_answer_line"
    form = re.compile(r"ANSWER:[ \t]*([^\n]*)")
    marker = "ANSWER:"
    unformatted = "Work it out, then end the reply with 'ANSWER: <number>'."
    default_template = "What is {a} {op} {b}? End your reply with 'ANSWER: <number>'."


class ChatSums(_FinalAnswer):
    """The sum of `terms` numbers drawn uniformly from [min_value, max_value], "What is 13 + 27
    + 15?", verified on the reply's final answer and hinted as `chat_arithmetic` is.

    Args:
        terms: how many numbers (≥ 2).
        min_value, max_value: the range of each number (0 ≤ min_value ≤ max_value).
    """

    name = "chat_sums"

    def __init__(self, terms: int = 3, min_value: int = 10, max_value: int = 49) -> None:
        if not isinstance(terms, int) or terms < 2:
            raise ValueError(f"chat_sums: terms must be an integer >= 2, got {terms!r}")
        if not 0 <= min_value <= max_value:
            raise ValueError(
                f"chat_sums: need 0 <= min_value <= max_value, got {min_value}, {max_value}"
            )
        self.terms, self.min_value, self.max_value = terms, min_value, max_value

    def make(self, numbers: list[int]) -> Problem:
        """The problem of these numbers (used by `sample` and by tests)."""
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": f"What is {' + '.join(map(str, numbers))}?"}],
            "answer": str(sum(numbers)),
        }

    def sample(self, rng: random.Random) -> Problem:
        return self.make([rng.randint(self.min_value, self.max_value) for _ in range(self.terms)])


_NAMES = (("Tom", "He"), ("Anna", "She"), ("Ravi", "He"), ("Mia", "She"), ("Leo", "He"))
_THINGS = ("apples", "stickers", "marbles", "books", "coins", "pencils")


class WordProblems(_FinalAnswer):
    """Two-step word problems: `a` things, `b` more bought, `c` given away; answer a + b − c.

    Args:
        start: the range of `a`.
        bought: the range of `b`.
        given: the range of `c` (never more than a + b).
    """

    name = "word_problems"

    def __init__(
        self,
        start: tuple[int, int] = (10, 49),
        bought: tuple[int, int] = (2, 29),
        given: tuple[int, int] = (1, 19),
    ) -> None:
        for label, (low, high) in (("start", start), ("bought", bought), ("given", given)):
            if not 0 <= low <= high:
                raise ValueError(f"{label} must be a range 0 <= low <= high, got {(low, high)}")
        self.start, self.bought, self.given = tuple(start), tuple(bought), tuple(given)

    def make(self, name: str, pronoun: str, things: str, a: int, b: int, c: int) -> Problem:
        """The problem of these values (used by `sample` and by tests)."""
        content = (
            f"{name} has {a} {things}. {pronoun} buys {b} more and gives away {c}. "
            f"How many {things} does {name} have now?"
        )
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": content}],
            "answer": str(a + b - c),
        }

    def sample(self, rng: random.Random) -> Problem:
        name, pronoun = rng.choice(_NAMES)
        things = rng.choice(_THINGS)
        a, b = rng.randint(*self.start), rng.randint(*self.bought)
        c = min(rng.randint(*self.given), a + b)
        return self.make(name, pronoun, things, a, b, c)
