"""A user's own environment, written to the `Environment` protocol: a bank account with two tools.

The episode's problem: "The account holds 120. Deposit 35, then deposit 17, then tell me the
balance." The model calls the tools — `deposit(amount)` changes the account (the environment is
stateful: the balance lives here, not in the chat) and `balance()` reads it — then answers
with the number. The episode ends when a reply makes no call (its answer) or after
`max_calls` calls. Its outcome is decided here, by the environment (`Observation.reward`): 1
when the final answer is the account's balance *and* every deposit asked for was made, else 0.

A failed call (an unknown tool, a bad argument, a deposit that is not a positive whole number)
is answered with the tool's error, and the error is the turn's `tool_error`: a run with
`rollout.hint: ToolErrorHint` turns it into the hint of the turn that caused it. Calls are read
with the library's one parser (`composer_lightning.chat.tool_calls`): Hermes / Qwen
`<tool_call>` blocks, Mistral, Llama JSON or OpenAI's `tool_calls` field, several per message.

    python -m composer_lightning fit --config examples/custom_env/config.yaml
    # (from the repository root; elsewhere, put this directory on PYTHONPATH)
"""

from __future__ import annotations

import random
import re
from typing import Any

from composer_lightning.chat.tool_calls import parse_tool_calls
from composer_lightning.envs.base import Observation
from composer_lightning.tasks.base import Problem, Task, Verdict

_INT = re.compile(r"-?\d+")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "deposit",
            "description": "Deposit money into the account; returns the new balance.",
            "parameters": {
                "type": "object",
                "properties": {"amount": {"type": "integer", "description": "a positive amount"}},
                "required": ["amount"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "balance",
            "description": "The account's balance.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]


class BankEnv:
    """One episode's account (the `Environment` protocol: `tools`, `reset`, `step`)."""

    tools = TOOLS

    def __init__(self, max_calls: int = 4) -> None:
        self.max_calls = max_calls

    def reset(self, problem: Problem) -> list[dict[str, Any]]:
        self.balance = int(problem["start"])
        self.deposits: list[int] = []
        self.asked = [int(a) for a in problem["deposits"]]
        self.calls = 0
        return list(problem["messages"])

    def step(self, message: dict[str, Any]) -> Observation:
        calls = parse_tool_calls(message, turn=self.calls)
        if not calls:  # no call: the reply is the answer, and the episode's outcome is known
            found = _INT.findall(str(message.get("content") or ""))
            answer = int(found[-1]) if found else None
            done_right = answer == self.balance and sorted(self.deposits) == sorted(self.asked)
            return Observation(done=True, reward=float(done_right), info={"tool_error": None})
        results, errors = [], []
        for call in calls:
            self.calls += 1
            text, error = self._run(call.name, call.arguments, call.error)
            results.append({"role": "tool", "tool_call_id": call.id, "content": text or error})
            if error is not None:
                errors.append(error)
        return Observation(
            messages=results,
            done=self.calls >= self.max_calls,
            info={"tool_error": " ".join(errors) if errors else None},
        )

    def _run(
        self, name: str | None, args: dict[str, Any], error: str | None
    ) -> tuple[str, str | None]:
        """(result, None) for a good call, ("", the tool's error) otherwise."""
        if error is not None:
            return "", f"Tool call error: {error}"
        if name == "balance":
            return str(self.balance), None
        if name != "deposit":
            return (
                "",
                f"Tool call error: unknown tool {name!r}; the tools are deposit(amount), balance().",
            )
        amount = args.get("amount")
        if isinstance(amount, bool) or not isinstance(amount, int) or amount <= 0:
            return "", f"deposit: amount must be a positive whole number, got {amount!r}."
        self.balance += amount
        self.deposits.append(amount)
        return str(self.balance), None


class BankTask(Task):
    """Deposits into an account, then its balance (see the module docstring).

    Args:
        max_calls: tool calls an episode may make (the last one ends it).
    """

    name = "bank"
    required_fields = ("start", "deposits", "answer")

    def __init__(self, max_calls: int = 4) -> None:
        self.max_calls = max_calls

    def sample(self, rng: random.Random) -> Problem:
        start = rng.randint(10, 200)
        deposits = [rng.randint(1, 60) for _ in range(rng.randint(1, 2))]
        asks = ", then deposit ".join(str(d) for d in deposits)
        content = f"The account holds {start}. Deposit {asks}, then tell me the balance."
        return {
            "task": self.name,
            "messages": [{"role": "user", "content": content}],
            "start": start,
            "deposits": deposits,
            "answer": str(start + sum(deposits)),
        }

    def environment(self, problem: Problem) -> BankEnv:
        return BankEnv(self.max_calls)

    def verify(self, problem: Problem, completion: str) -> Verdict:
        """The final answer alone (for held-out scoring and runs without the environment's
        outcome): its last number against the expected balance."""
        found = _INT.findall(completion)
        if found and int(found[-1]) == int(problem["answer"]):
            return Verdict(1.0, None)
        return Verdict(0.0, f"The balance after the deposits is {problem['answer']}.")
