"""`OpenEnvTask`: episodes of an OpenEnv environment as a task (`pip install
composer-lightning[agents]`).

Problems come from the environment's task list (or fresh seeds), each episode is an
`envs.openenv_env.OpenEnvEpisode` on a session of the factory, and the reward is the
environment's own: there is no separate verifier.
"""

from __future__ import annotations

import importlib
import random
from collections.abc import Callable
from typing import Any

from composer_lightning.envs.openenv_env import OpenEnvEpisode
from composer_lightning.tasks.base import Problem, Task, Verdict


def _import(path: str) -> Callable[..., Any]:
    module, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module:
        raise ValueError(f"not a dotted path: {path!r}")
    return getattr(importlib.import_module(module), attr)


class OpenEnvTask(Task):
    """Episodes of an OpenEnv environment: problems from its task list, rewards from it.

    Args:
        factory: dotted path (`pkg.module.Name` or `pkg.module:Name`) of a class or function
            that returns an OpenEnv `ResourceSessionFactory`.
        factory_args: keyword arguments of `factory`.
        tasks: the environment's task payloads (passed to `factory.create(task=...)`), one
            drawn per problem; None: every episode is `create(task=None)` on a fresh seed.
        max_turns: assistant turns per episode.
        max_tool_calls_per_turn: tool calls run per turn (None: all).
        max_total_tool_calls: tool calls per episode (None: no limit).
        tool_call_format: the format calls are read in from the model's text
            (`chat.tool_calls`: "auto", "hermes", "mistral", "llama3_json", or "template",
            the chat template's).
    """

    name = "openenv"
    opens_in_environment = True  # the session's initial messages open each episode

    def __init__(
        self,
        factory: str,
        factory_args: dict[str, Any] | None = None,
        tasks: list[Any] | None = None,
        *,
        max_turns: int = 10,
        max_tool_calls_per_turn: int | None = None,
        max_total_tool_calls: int | None = None,
        tool_call_format: str = "auto",
    ) -> None:
        self.factory = _import(factory)(**(factory_args or {}))
        self.tasks = list(tasks) if tasks is not None else None
        if self.tasks == []:
            raise ValueError("OpenEnvTask: tasks is empty (None: draw seeds instead)")
        self.episode_args: dict[str, Any] = {
            "max_turns": max_turns,
            "max_tool_calls_per_turn": max_tool_calls_per_turn,
            "max_total_tool_calls": max_total_tool_calls,
            "tool_call_format": tool_call_format,
        }
        OpenEnvEpisode(self.factory, **self.episode_args)  # checks the limits now

    def sample(self, rng: random.Random) -> Problem:
        task = None if self.tasks is None else self.tasks[rng.randrange(len(self.tasks))]
        # The opening chat is the session's (`reset`); a task payload's own messages, if it
        # has them, are the problem's record of it.
        messages = list(task.get("messages", [])) if isinstance(task, dict) else []
        return {
            "messages": messages,
            "task": f"{type(self).__module__}.{type(self).__qualname__}",
            "openenv_task": task,
            "seed": rng.randrange(2**31),
        }

    def verify(self, problem: Problem, completion: str) -> Verdict:
        raise NotImplementedError(
            "an OpenEnv episode's reward is the environment's own (Observation.reward at the "
            "end of the episode); there is no separate verifier"
        )

    def environment(self, problem: Problem) -> OpenEnvEpisode:
        return OpenEnvEpisode(self.factory, **self.episode_args)
