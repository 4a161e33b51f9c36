"""Sums too large to add in one's head, with a calculator tool: the tool-use task.

A problem is `a + b` for integers in [min_value, max_value] (by default 2–3 digits), asked in
one of two phrasings: "What is 123 + 45?" or "Let x = 123 and y = 45. What is x + y?" (the
second tempts a call with the wrong argument names, `x` and `y`). Its episode environment
(`environment`) is a `PythonToolEnv` with one tool, `add(a: int, b: int) -> int`; the model
calls it (`<tool_call>{"name": "add", "arguments": {"a": 123, "b": 45}}</tool_call>`) and then
answers with the result, e.g. "The answer is 168.".

The verifier reads the final answer: the text after the last `</tool_call>` (so a message that
ends with a call has no answer), and in it the last integer; 1.0 when it is the sum, 0.0
otherwise, with the error-derived hint of `Arithmetic` (the digit count and a wrong digit).
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
    ) -> None:
        if not 0 <= min_value <= max_value:
            raise ValueError(f"need 0 <= min_value <= max_value, got {min_value}, {max_value}")
        if not 0.0 <= xy_share <= 1.0:
            raise ValueError(f"xy_share must be in [0, 1], got {xy_share!r}")
        self.min_value, self.max_value = min_value, max_value
        self.xy_share = xy_share
        self.max_calls, self.timeout = max_calls, timeout
        self.tool_call_format = check_format(tool_call_format, "ToolCalc")

    def make(self, a: int, b: int, phrasing: int = 0) -> Problem:
        """The problem `a + b` in phrasing `phrasing` (an index of `PHRASINGS`)."""
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": PHRASINGS[phrasing].format(a=a, b=b)}],
            "a": a,
            "b": b,
            "phrasing": phrasing,
            "answer": str(a + b),
        }

    def sample(self, rng: random.Random) -> Problem:
        a = rng.randint(self.min_value, self.max_value)
        b = rng.randint(self.min_value, self.max_value)
        return self.make(a, b, int(rng.random() < self.xy_share))

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
        the question, the call of `add` in the Hermes format, the tool's result, the answer.
        Demonstrations show a model the tool's call syntax (`SFTHead`) before RL on it."""
        env = self.environment(problem)
        call = {"name": "add", "arguments": {"a": problem["a"], "b": problem["b"]}}
        messages = [
            *env.reset(problem),
            {"role": "assistant", "content": f"{CALL_OPEN}{json.dumps(call)}{CALL_CLOSE}"},
        ]
        observation = env.step(messages[-1])
        if observation.info["tool_error"] is not None:  # the format and the env disagree
            raise RuntimeError(f"the demonstration's own call failed: {observation.info}")
        messages += observation.messages
        messages.append({"role": "assistant", "content": f"The answer is {problem['answer']}."})
        return {"messages": messages, "tools": env.tools, "reward": 1.0}

    def verify(self, problem: Problem, completion: str) -> Verdict:
        answer = int(problem["answer"])
        guess = final_answer(completion)
        if guess == answer:
            return Verdict(1.0, None)
        return Verdict(0.0, number_hint(answer, guess))
