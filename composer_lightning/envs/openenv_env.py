"""OpenEnv environments as episode environments (`pip install composer-lightning[agents]`).

OpenEnv (`openenv-core`, the environment standard TRL trains on) gives a tool-calling rollout
one `ResourceSession` per episode, made by a `ResourceSessionFactory`: `initial_messages()`,
`list_tools()`, `call_tool(name, arguments) -> ToolResult`, `verify(transcript) ->
VerifyResult`. Its own white-box loop (`openenv.core.harness.MCPHarnessAdapter.run_white_box`)
owns the turns; `OpenEnvEpisode` replays that loop one assistant message at a time, so that
our episode loop owns the turns instead:

- `tools`: the session's MCP tool manifest as OpenAI function specs.
- `reset`: a fresh session on the problem's OpenEnv task and seed; its initial messages.
- `step`: an assistant message without tool calls ends the episode; otherwise each call is
  run and answered by a `tool` message (content: the result's data, serialized as OpenEnv
  does); a result with `done`, or the turn / tool-call limits, end it.
- reward at the end: the environment's own, resolved as OpenEnv's rollout function does (the
  last tool result that carries one, else `verify(...).env_reward`); None when it gave none.
- `tool_error`: the result's `error`, or why the call could not be made (unparseable call,
  unknown tool, bad arguments). OpenEnv's loop would raise on the last two; here they are the
  turn's tool error, so that one bad call is a lesson for the policy, not a crashed batch.

Tool calls are read by `chat.tool_calls.parse_tool_calls`, the parser `serve` and
`PythonToolEnv` share: the message's `tool_calls` (OpenAI format) when it has them, else Hermes
/ Qwen `<tool_call>` blocks, Mistral's `[TOOL_CALLS]` or a Llama-style JSON call in its text.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from composer_lightning.chat.tool_calls import (
    ToolCall,
    check_format,
    parse_tool_calls,
    resolve_format,
)
from composer_lightning.envs.base import Message, Observation
from composer_lightning.runtime.moved import moved_attribute


def openai_tool_spec(tool: Any) -> dict[str, Any]:
    """An OpenEnv / MCP `Tool` (name, description, input_schema) as an OpenAI function spec."""
    schema = dict(tool.input_schema or {}) or {"type": "object", "properties": {}}
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": schema},
    }


def _serialize(value: Any) -> str:
    # As OpenEnv's harness writes a tool result into the chat.
    if value is None:
        return ""
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _result_reward(result: Any) -> float | None:
    # The reward a tool result already carries (OpenEnv's harness reads the same two places).
    reward = result.metadata.get("reward")
    if reward is None and isinstance(result.data, dict):
        reward = result.data.get("reward")
    return None if reward is None else float(reward)


class OpenEnvEpisode:
    """One episode of an OpenEnv `ResourceSession` behind our `Environment` protocol.

    Args:
        factory: the OpenEnv `ResourceSessionFactory` that makes the episode's session.
        max_turns: assistant turns before the episode ends (OpenEnv's `HarnessRunLimits`).
        max_tool_calls_per_turn: calls run per turn, the rest dropped (None: all).
        max_total_tool_calls: calls in the whole episode; the one past it ends the episode
            unanswered (None: no limit).
        tool_call_format: the format calls are read in from a message's text
            (`chat.tool_calls.FORMATS`, or "template": the chat template's, which the episode
            loop sets).
    """

    def __init__(
        self,
        factory: Any,
        *,
        max_turns: int = 10,
        max_tool_calls_per_turn: int | None = None,
        max_total_tool_calls: int | None = None,
        tool_call_format: str = "auto",
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns!r}")
        self.factory = factory
        self.max_turns = max_turns
        self.max_tool_calls_per_turn = max_tool_calls_per_turn
        self.max_total_tool_calls = max_total_tool_calls
        self.tool_call_format = check_format(tool_call_format, "OpenEnvEpisode")
        self.tools: list[dict[str, Any]] | None = None
        self.session: Any = None
        self.transcript: list[Message] = []
        self._turns = 0
        self._tool_calls = 0
        self._reward: float | None = None  # the last tool result's own reward
        self._done = False

    def reset(self, problem: dict[str, Any]) -> list[Message]:
        self.close()
        self.session = self.factory.create(
            task=problem.get("openenv_task"),
            seed=problem.get("seed"),
            episode_id=problem.get("episode_id"),
        )
        self.tools = [openai_tool_spec(t) for t in self.session.list_tools()] or None
        messages = list(self.session.initial_messages())
        self.transcript = list(messages)
        self._turns = self._tool_calls = 0
        self._reward, self._done = None, False
        return messages

    def step(self, message: Message) -> Observation:
        if self.session is None or self._done:
            raise RuntimeError("step() needs reset() first, and none after the episode ended")
        fmt = resolve_format(self.tool_call_format)  # "template" unset by the loop: auto
        calls = parse_tool_calls(message, self._turns, fmt)
        self._turns += 1
        self.transcript.append(_assistant_message(message, calls))
        if not calls:
            return self._end([], None)
        if self.max_tool_calls_per_turn is not None:
            calls = calls[: self.max_tool_calls_per_turn]
        replies: list[Message] = []
        errors: list[str] = []
        done = False
        for call in calls:
            if self.max_total_tool_calls is not None and (
                self._tool_calls >= self.max_total_tool_calls
            ):
                return self._end(replies, _joined(errors), truncated=True)
            self._tool_calls += 1
            content, error, done = self._run(call)
            reply = {"role": "tool", "tool_call_id": call.id, "content": content}
            if call.name is not None:
                reply["name"] = call.name
            replies.append(reply)
            if error is not None:
                errors.append(error)
            if done:
                break
        if done or self._turns >= self.max_turns:
            return self._end(replies, _joined(errors))
        self.transcript.extend(replies)
        return Observation(messages=replies, info={"tool_error": _joined(errors)})

    def _run(self, call: ToolCall) -> tuple[str, str | None, bool]:
        """(the tool message's content, the tool error, done) of one call."""
        if call.error is not None:
            return call.error, call.error, False
        try:
            result = self.session.call_tool(call.name, dict(call.arguments))
        except Exception as err:  # noqa: BLE001 - the tool's failure is the turn's information
            failure = f"{type(err).__name__}: {err}"
            return failure, failure, False
        reward = _result_reward(result)
        if reward is not None:
            self._reward = reward
        error = None if result.error is None else str(result.error)
        content = _serialize(result.data) if result.data is not None else (error or "")
        return content, error, bool(result.done)

    def _end(self, replies: list[Message], error: str | None, **metrics: Any) -> Observation:
        self.transcript.extend(replies)
        self._done = True
        verify = self.session.verify(self.transcript)
        reward = self._reward
        if reward is None and verify.env_reward is not None:
            reward = float(verify.env_reward)
        info = {"tool_error": error, "metrics": {**dict(verify.metrics), **metrics}}
        self.close()
        return Observation(messages=replies, done=True, reward=reward, info=info)

    def end(self, messages: list[Message]) -> float | None:
        """The outcome of an episode the loop ended (a turn cut at the token budget, or its
        turn limit first): the session's own verdict on the transcript, the cut turn included,
        as OpenEnv's loop would give it when the model stops."""
        if self.session is None or self._done:
            return None
        if messages and messages[-1].get("role") == "assistant":  # the cut turn, never stepped
            self.transcript.append(_assistant_message(messages[-1], []))
        return self._end([], None, truncated=True).reward

    def close(self) -> None:
        """Release the session (also done when the episode ends)."""
        if self.session is not None:
            self.session.close()
            self.session = None


def _assistant_message(message: Message, calls: Sequence[ToolCall]) -> Message:
    # The transcript's assistant message in OpenAI form, as OpenEnv's harness records it.
    out: Message = {"role": "assistant", "content": message.get("content") or ""}
    valid = [c for c in calls if c.error is None]
    if valid:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in valid
        ]
    return out


def _joined(errors: list[str]) -> str | None:
    return "\n".join(errors) if errors else None


def __getattr__(name: str) -> object:  # OpenEnvTask moved to tasks/openenv.py (runtime/moved.py)
    return moved_attribute(__name__, name)
