"""Plain Python functions as the tools of an episode (TRL's `tools=[fn]`).

Each tool is a type-annotated function with a Google-style docstring; its OpenAI-style spec
comes from `transformers.utils.get_json_schema(fn)` and is shown to the model through the chat
template (`env.tools`). The assistant calls a tool in the Hermes / Qwen style, one call per
message, anywhere in its text::

    <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>

Calls are found by `chat.tool_calls.find_tool_calls`, the parser `serve` and the OpenEnv adapter
share (a Mistral `[TOOL_CALLS]` list or a Llama-style JSON reply is a call too). Calls are strict: the JSON must parse to `{"name": str, "arguments": dict}`, the name must be a
tool, and the arguments must bind to the function's signature with the annotated types (an int
is not a float's stand-in for an `int`, a bool is not an int). A good call answers with the
result as a `tool` message; any failure (malformed call, unknown tool, bad arguments, a tool
that raises or runs past `timeout`) answers with a `tool` message holding an error that says
what was expected, the same text in `info["tool_error"]`, and the episode goes on. A message
without a tool call is the final answer: the episode ends with `reward=None` (the run's
verifier scores the answer). Simplified on purpose: no parallel calls, argument types checked
for plain types, `Optional` / unions and bare containers only.
"""

from __future__ import annotations

import inspect
import json
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any

from transformers.utils import get_json_schema

from composer_lightning.chat import problem_messages
from composer_lightning.chat.tool_calls import HERMES_CLOSE, HERMES_OPEN, find_tool_calls
from composer_lightning.envs.base import Message, Observation
from composer_lightning.runtime.calls import CallTimeout, call_with_timeout, check_timeout

CALL_OPEN, CALL_CLOSE = HERMES_OPEN, HERMES_CLOSE
CALL_FORMAT = f'{CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{CALL_CLOSE}'


def _type_name(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return "Any"
    return annotation.__name__ if isinstance(annotation, type) else str(annotation)


def signature_text(fn: Callable[..., Any]) -> str:
    """`fn`'s call signature as the model should read it, e.g. `add(a: int, b: int)`."""
    hints = typing.get_type_hints(fn)
    params = inspect.signature(fn).parameters.values()
    args = ", ".join(f"{p.name}: {_type_name(hints.get(p.name, p.annotation))}" for p in params)
    return f"{fn.__name__}({args})"


def _matches(value: Any, annotation: Any) -> bool:
    """Whether a JSON value fits a parameter annotation (bool is never an int or float)."""
    if annotation in (inspect.Parameter.empty, Any):
        return True
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    target = origin or annotation
    if target is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if target is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if target in (list, tuple):
        return isinstance(value, list)
    return isinstance(value, target) if isinstance(target, type) else True


class PythonToolEnv:
    """One episode's environment whose tools are plain Python functions.

    Args:
        tools: the tool functions (type-annotated, Google-style docstrings; distinct names).
        max_calls: the episode ends (done) with its `max_calls`-th tool call, good or not;
            None: no limit (the episode loop's turn limit bounds it).
        timeout: seconds one tool call may run before it fails with "timed out" (it runs on in
            a background thread, see `runtime/calls.py`); None: no limit, in the caller's thread.

    Raises:
        ValueError: no tools, a duplicate name, a function `get_json_schema` cannot describe,
            or a bad `max_calls` / `timeout` (each message names the value).
    """

    def __init__(
        self,
        tools: Sequence[Callable[..., Any]],
        *,
        max_calls: int | None = None,
        timeout: float | None = 10.0,
    ) -> None:
        if not tools:
            raise ValueError("PythonToolEnv needs at least one tool function, got none")
        if max_calls is not None and (
            isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1
        ):
            raise ValueError(f"PythonToolEnv: max_calls must be an integer >= 1, got {max_calls!r}")
        self.timeout = check_timeout(timeout, "PythonToolEnv")
        self.max_calls = max_calls
        self.functions: dict[str, Callable[..., Any]] = {}
        self.tools: list[dict[str, Any]] = []
        for fn in tools:
            try:
                spec = get_json_schema(fn)
            except Exception as err:  # transformers' parsing errors say what is missing
                raise ValueError(f"cannot describe tool {fn!r}: {err}") from err
            name = spec["function"]["name"]
            if name in self.functions:
                raise ValueError(f"two tools are named {name!r}")
            self.functions[name] = fn
            self.tools.append(spec)
        self.calls = 0

    def reset(self, problem: dict[str, Any]) -> list[Message]:
        """The problem's chat (`chat.problem_messages`); the call count starts again."""
        self.calls = 0
        return problem_messages(problem)

    def step(self, message: Message) -> Observation:
        """The tool's answer to a call in `message`, or the end of the episode without one."""
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, str):
            raise TypeError(
                f"step needs an assistant message {{'role', 'content': str}}, got {message!r}"
            )
        _, bodies = find_tool_calls(content)  # chat.tool_calls: the parser serve shares
        if not bodies and CALL_OPEN not in content and CALL_CLOSE not in content:
            return Observation(done=True, reward=None, info={"tool_error": None})
        self.calls += 1
        result, error = self._run(content)
        text = result if error is None else error
        return Observation(
            messages=[{"role": "tool", "content": text}],
            done=self.max_calls is not None and self.calls >= self.max_calls,
            info={"tool_error": error, "calls": self.calls},
        )

    def _signatures(self) -> str:
        return ", ".join(signature_text(fn) for fn in self.functions.values())

    def _run(self, content: str) -> tuple[str, str | None]:
        """(result text, None) for a good call, ("", error text) otherwise."""
        _, bodies = find_tool_calls(content)
        if len(bodies) != 1:
            got = "no complete call" if not bodies else f"{len(bodies)} calls"
            return "", f"Tool call error: expected one call {CALL_FORMAT}, got {got}."
        try:
            call = json.loads(bodies[0])
        except json.JSONDecodeError as err:
            return (
                "",
                f"Tool call error: the call is not valid JSON ({err}); expected {CALL_FORMAT}.",
            )
        if (
            not isinstance(call, dict)
            or set(call) != {"name", "arguments"}
            or not isinstance(call["arguments"], dict)
        ):
            return "", (
                f"Tool call error: expected a JSON object with keys 'name' and 'arguments' (an "
                f"object), {CALL_FORMAT}, got {bodies[0].strip()}."
            )
        name = call["name"]
        fn = self.functions.get(name) if isinstance(name, str) else None
        if fn is None:
            return (
                "",
                f"Tool call error: unknown tool {name!r}; the tools are {self._signatures()}.",
            )
        problem = _argument_problem(fn, call["arguments"])
        if problem is not None:
            return "", f"Tool call error: {problem}; expected {signature_text(fn)}."
        try:
            result = call_with_timeout(fn, (), self.timeout, call["arguments"])
        except CallTimeout:
            return "", f"Tool error: {name} timed out after {self.timeout:g} s."
        except Exception as err:  # the tool's failure is the model's information
            return "", f"Tool error: {name} raised {type(err).__name__}: {err}."
        return str(result), None


def _argument_problem(fn: Callable[..., Any], arguments: dict[str, Any]) -> str | None:
    """What keeps `arguments` from binding to `fn` with the annotated types, or None."""
    sig = inspect.signature(fn)
    unexpected = [k for k in arguments if k not in sig.parameters]
    if unexpected:
        return f"unexpected argument(s) {', '.join(map(repr, unexpected))} for {fn.__name__}"
    try:
        sig.bind(**arguments)
    except TypeError as err:
        return f"bad arguments for {fn.__name__}: {err}"
    hints = typing.get_type_hints(fn)
    for key, value in arguments.items():
        annotation = hints.get(key, sig.parameters[key].annotation)
        if not _matches(value, annotation):
            return (
                f"argument {key!r} must be {_type_name(annotation)}, got "
                f"{type(value).__name__} {json.dumps(value)}"
            )
    return None
