"""Sums too large to add in one's head, with a calculator tool: the tool-use task.

A problem is `a + b` for integers in [min_value, max_value] (by default 2–3 digits), asked in
one of two phrasings: "What is 123 + 45?" or "Let x = 123 and y = 45. What is x + y?" (the
second tempts a call with the wrong argument names, `x` and `y`). Its episode environment
(`environment`) is a `PythonToolEnv` with one tool, `add(a: int, b: int) -> int`; the model
calls it (`<tool_call>{"name": "add", "arguments": {"a": 123, "b": 45}}</tool_call>`) and then
answers with the result, e.g. "The answer is 168.".

With `terms=3` (up to 6) a problem adds that many numbers ("What is 123 + 45 + 678?", "Let
x = 123, y = 45 and z = 678. What is x + y + z?") with the same two-argument tool: the answer
takes a chain of calls, each on the result of the one before. A model shown single calls of
the two-term task (`demonstration`) does not solve it by imitation; RL has a task left.

The verifier reads the final answer: the text after the last `</tool_call>` (so a message that
ends with a call has no answer), and in it the last integer; 1.0 when it is the sum, 0.0
otherwise, with the error-derived hint of `Arithmetic` (the digit count and a wrong digit); with
three or more terms, an answer that is the sum of only the first few ("1088 is the sum of the
first 2 numbers only: add 326 to it.") gets a hint saying what the chain left out.
"""

from __future__ import annotations

import json
import random
import re

from composer_lightning.chat.tool_calls import check_format
from composer_lightning.envs.python_tools import CALL_CLOSE, CALL_OPEN, PythonToolEnv
from composer_lightning.tasks.arithmetic import number_hint
from composer_lightning.tasks.base import Problem, Task, Verdict

_INT = re.compile(r"-?\d+")
PHRASINGS = ("What is {a} + {b}?", "Let x = {a} and y = {b}. What is x + y?")
NAMES = ("x", "y", "z", "u", "v", "w")  # the "Let x = ..." phrasing's names, one per term


def question(values: list[int], phrasing: int) -> str:
    """The question of the sum of `values` in phrasing `phrasing` (an index of `PHRASINGS`;
    with two values exactly its text, which the tests check)."""
    if phrasing == 0:
        return f"What is {' + '.join(map(str, values))}?"
    lets = [f"{n} = {v}" for n, v in zip(NAMES, values, strict=False)]
    names = NAMES[: len(values)]
    return f"Let {', '.join(lets[:-1])} and {lets[-1]}. What is {' + '.join(names)}?"


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number.
        b: the second number.

    Returns:
        The sum a + b.
    """
    return a + b


def final_answer(completion: str) -> int | None:
    """The last integer after the last tool call of `completion` (None: no answer there)."""
    found = _INT.findall(completion.rpartition(CALL_CLOSE)[2])
    return int(found[-1]) if found else None


def partial_sum_hint(terms: list[int], guess: int | None) -> str | None:
    """With three or more terms, the hint for an answer that is the sum of the first k < n
    of them (the chain of calls stopped early): which number it left out; else None."""
    for k in range(2, len(terms)):
        if guess == sum(terms[:k]):
            rest = " and then ".join(str(v) for v in terms[k:])
            return f"{guess} is the sum of the first {k} numbers only: add {rest} to it."
    return None


class ToolCalc(Task):
    """`a + b` with a calculator tool (see the module docstring).

    Args:
        min_value: smallest operand.
        max_value: largest operand.
        xy_share: probability of the "Let x = ..." phrasing.
        max_calls: tool calls an episode may make (the last one ends it).
        timeout: seconds one tool call may run.
        tool_call_format: the format the environment reads calls in (`PythonToolEnv`'s:
            "auto", "hermes", "mistral", "llama3_json", or "template", the chat template's).
        terms: numbers to add, 2 to 6: `terms - 1` calls of `add` and an answer, so
            `max_calls` must be at least `terms` (the call that reaches `max_calls` ends the
            episode before its answer).
    """

    name = "tool_calc"
    required_fields = ("answer",)

    def __init__(
        self,
        min_value: int = 10,
        max_value: int = 999,
        xy_share: float = 0.5,
        max_calls: int = 3,
        timeout: float = 5.0,
        tool_call_format: str = "auto",
        terms: int = 2,
    ) -> None:
        if isinstance(terms, bool) or not isinstance(terms, int) or not 2 <= terms <= len(NAMES):
            raise ValueError(
                f"ToolCalc: terms must be an integer in [2, {len(NAMES)}], got {terms!r}"
            )
        if max_calls < terms:
            raise ValueError(
                f"ToolCalc: terms={terms} takes {terms - 1} calls and an answer, so max_calls must "
                f"be >= {terms} (the call that reaches max_calls ends the episode), got {max_calls}"
            )
        if not 0 <= min_value <= max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {min_value}, {max_value}")
        if not 0.0 <= xy_share <= 1.0:
            raise ValueError(f"xy_share must be in [0, 1], got {xy_share!r}")
        self.min_value, self.max_value = min_value, max_value
        self.xy_share, self.terms = xy_share, terms
        self.max_calls, self.timeout = max_calls, timeout
        self.tool_call_format = check_format(tool_call_format, "ToolCalc")

    def make(self, a: int, b: int, phrasing: int = 0, more: tuple[int, ...] = ()) -> Problem:
        """The problem `a + b (+ each of more)` in phrasing `phrasing` (an index of
        `PHRASINGS`)."""
        values = [a, b, *more]
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": question(values, phrasing)}],
            "a": a,
            "b": b,
            "terms": values,
            "phrasing": phrasing,
            "answer": str(sum(values)),
        }

    def sample(self, rng: random.Random) -> Problem:
        # two terms draw a, b, then the phrasing: the problems of every seed as before `terms`
        values = [rng.randint(self.min_value, self.max_value) for _ in range(self.terms)]
        return self.make(values[0], values[1], int(rng.random() < self.xy_share), tuple(values[2:]))

    def environment(self, problem: Problem) -> PythonToolEnv:
        """A fresh calculator environment: the one tool `add`."""
        return PythonToolEnv(
            [add],
            max_calls=self.max_calls,
            timeout=self.timeout,
            tool_call_format=self.tool_call_format,
        )

    def demonstration(self, problem: Problem) -> dict:
        """A right episode of `problem` as a trace record (`TraceDataModule`, `reward: 1.0`):
        the question, the call of `add` in the Hermes format, the tool's result, the answer
        (with more terms, one call per term after the first, each on the last result).
        Demonstrations show a model the tool's call syntax (`SFTHead`) before RL on it."""
        env = self.environment(problem)
        messages = list(env.reset(problem))
        total, *rest = problem.get("terms", [problem["a"], problem["b"]])
        for value in rest:
            call = {"name": "add", "arguments": {"a": total, "b": value}}
            messages.append(
                {"role": "assistant", "content": f"{CALL_OPEN}{json.dumps(call)}{CALL_CLOSE}"}
            )
            observation = env.step(messages[-1])
            if observation.info["tool_error"] is not None:  # the format and the env disagree
                raise RuntimeError(f"the demonstration's own call failed: {observation.info}")
            messages += observation.messages
            total += value
        messages.append({"role": "assistant", "content": f"The answer is {problem['answer']}."})
        return {"messages": messages, "tools": env.tools, "reward": 1.0}

    def verify(self, problem: Problem, completion: str) -> Verdict:
        answer = int(problem["answer"])
        guess = final_answer(completion)
        if guess == answer:
            return Verdict(1.0, None)
        return Verdict(
            0.0, partial_sum_hint(problem.get("terms", []), guess) or number_hint(answer, guess)
        )
