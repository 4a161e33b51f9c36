"""A price list behind a `lookup` tool, written to OpenEnv's session contract (`openenv-core`).

Each episode is one OpenEnv `ResourceSession`: a small price list drawn from the episode's seed,
one tool (`lookup(item)` → the item's price, or an error naming the items there are), and a
question about one item's price. The episode ends when the model answers without a tool call;
`verify` gives the environment's own reward: 1.0 when the answer's last number is the price,
else 0.0. `LookupSessions` is the factory `OpenEnvTask` calls (`factory: lookup_env:LookupSessions`
in config.yaml).

Nothing here knows composer_lightning: the same sessions run under OpenEnv's own loop
(`MCPHarnessAdapter`), and an environment served over HTTP is reached the same way through
OpenEnv's `StepEnvSessionAdapter`.
"""

from __future__ import annotations

import random
import re
from typing import Any

from openenv.core.env_server.mcp_types import Tool
from openenv.core.harness import ResourceSession, ResourceSessionFactory, ToolResult, VerifyResult

ITEMS = ("apple", "bread", "cheese", "grapes", "lemon", "milk", "rice", "tea")
LOOKUP = Tool(
    name="lookup",
    description="Look up the price of an item in the shop's price list.",
    input_schema={
        "type": "object",
        "properties": {"item": {"type": "string", "description": "the item's name"}},
        "required": ["item"],
    },
)
_NUMBER = re.compile(r"-?\d+")


class LookupSession(ResourceSession):
    """One episode: a seeded price list of 4 items, a question about one of them."""

    def __init__(self, seed: int | None = None) -> None:
        rng = random.Random(seed)
        self.prices = {item: rng.randint(2, 99) for item in rng.sample(ITEMS, 4)}
        self.item = rng.choice(sorted(self.prices))
        self.lookups = 0

    def initial_messages(self) -> list[dict[str, Any]]:
        question = f"How much does {self.item} cost in the shop? Use the lookup tool."
        return [{"role": "user", "content": question}]

    def list_tools(self) -> list[Tool]:
        return [LOOKUP]

    def call_tool(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        if name != "lookup":
            return ToolResult(error=f"unknown tool {name!r}; the tool is lookup(item)")
        item = str(arguments.get("item", "")).strip().lower()
        self.lookups += 1
        if item not in self.prices:
            there = ", ".join(sorted(self.prices))
            return ToolResult(error=f"no item {item!r} in the price list; it has {there}")
        return ToolResult(data=self.prices[item])

    def verify(self, transcript: list[dict[str, Any]], final_state: Any = None) -> VerifyResult:
        answers = [m for m in transcript if m.get("role") == "assistant"]
        text = str(answers[-1].get("content") or "") if answers else ""
        numbers = _NUMBER.findall(text)
        right = bool(numbers) and int(numbers[-1]) == self.prices[self.item]
        return VerifyResult(
            env_reward=1.0 if right else 0.0, done=True, metrics={"lookups": self.lookups}
        )

    def close(self) -> None:
        pass


class LookupSessions(ResourceSessionFactory):
    """Makes one `LookupSession` per episode (its seed comes from the problem)."""

    def create(
        self, task: Any = None, seed: int | None = None, episode_id: str | None = None
    ) -> LookupSession:
        return LookupSession(seed)
