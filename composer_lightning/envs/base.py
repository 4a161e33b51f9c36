"""The environment protocol: what an agent's episode talks to between its turns.

An episode starts with `reset(problem)`, which returns the opening chat (system / user
messages). The policy then writes one assistant message per turn; `step(message)` answers with
an `Observation`: the messages that follow it in the chat (a `tool` result or error, a user's
reply), whether the episode is over, an optional outcome reward, and structured information
such as `tool_error` (the error message of a failed tool call; hints at error turns are read
from it, never from string matching). The observation is the turn's *next state*: where the
per-turn score and hint come from (docs/design.md, "The agentic setting").

Tools are described to the model by the chat template's tool specs: `tools` is a list of
OpenAI-style function specs (`{"type": "function", "function": {"name", "description",
"parameters"}}`), passed to `apply_chat_template(..., tools=...)`.

An environment instance serves one episode at a time; the episode loop asks `Task.environment`
for a fresh one per episode. A single-turn task is an episode of one turn (`SingleTurn`).

Optionally, `end(messages) -> float | None`: called when the loop ends an episode the
environment did not end (a turn cut at the token budget, or the loop's `max_turns` reached
first) with the whole chat so far; what it returns is the episode's outcome reward (None: the
run's score provider judges the final answer, as without it). An environment whose reward is
its own (an OpenEnv session's `verify`) judges a cut episode this way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

Message = dict[str, Any]


@dataclass
class Observation:
    """What follows an assistant turn.

    Attributes:
        messages: chat messages appended after the assistant's (roles `tool` or `user`); the
            turn's next state.
        done: the episode is over (no further assistant turn).
        reward: the episode's outcome reward, given with `done` (None: the run's score
            provider judges the episode's final answer).
        info: structured information of the turn: `tool_error` (str or None) — the tool's
            own error message when the call failed.
    """

    messages: list[Message] = field(default_factory=list)
    done: bool = False
    reward: float | None = None
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def tool_error(self) -> str | None:
        """The tool's error message of this turn, if its call failed."""
        err = self.info.get("tool_error")
        return None if err is None else str(err)


@runtime_checkable
class Environment(Protocol):
    """One episode's environment (see the module docstring)."""

    #: OpenAI-style tool specs shown to the model through the chat template (None: no tools).
    tools: list[dict[str, Any]] | None

    def reset(self, problem: dict[str, Any]) -> list[Message]:
        """The opening chat of an episode on `problem`."""
        ...

    def step(self, message: Message) -> Observation:
        """The next state after the assistant's `message` (`{"role": "assistant", "content":
        text}`)."""
        ...


class SingleTurn:
    """A single-turn task as an environment: the problem's chat, then one assistant turn that
    ends the episode (its score comes from the run's score provider, as before)."""

    tools: list[dict[str, Any]] | None = None

    def reset(self, problem: dict[str, Any]) -> list[Message]:
        from composer_lightning.chat import problem_messages

        return problem_messages(problem)

    def step(self, message: Message) -> Observation:
        return Observation(done=True)


def _messages(messages: Any, call: str) -> list[Message]:
    """`messages` checked as chat messages, each `{role, content}` (what `call` returned)."""
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m):
            raise TypeError(
                f"{call} returned a malformed message {m!r:.80}, expected {{role, content}}"
            )
    return list(messages)


def checked_observation(value: Any) -> Observation:
    """An environment's step result, checked: an Observation whose messages are chat messages."""
    if not isinstance(value, Observation):
        raise TypeError(f"step returned {type(value).__name__}, expected an Observation")
    _messages(value.messages, "step")
    if value.reward is not None and not isinstance(value.reward, (int, float)):
        raise TypeError(f"step returned reward {value.reward!r}, expected a number or None")
    return value


def checked_opening(value: Any) -> list[Message]:
    """An environment's `reset` result, checked: a non-empty chat."""
    if not isinstance(value, list) or not value:
        raise TypeError(f"reset returned {type(value).__name__}, expected a non-empty chat")
    return _messages(value, "reset")
