"""Plain Python functions as the tools of an episode (TRL's `tools=[fn]`).

Each tool is a type-annotated function with a Google-style docstring; its OpenAI-style spec
comes from `transformers.utils.get_json_schema(fn)` and is shown to the model through the chat
template (`env.tools`). The assistant calls tools in the Hermes / Qwen style anywhere in its
text, one or several calls in a message (parallel calls)::

    <tool_call>{"name": "add", "arguments": {"a": 12, "b": 30}}</tool_call>

Calls are found by `chat.tool_calls.find_tool_calls`, the parser `serve` and the OpenEnv adapter
share, in the format `tool_call_format` names ("auto": Hermes blocks, a Mistral `[TOOL_CALLS]`
list or a Llama-style JSON reply; "template": the one the chat template writes, set by the
episode loop from the tokenizer). Calls are strict: each call's JSON must parse to
`{"name": str, "arguments": dict}` (`"parameters"` in the Llama 3 format), the name must be a
tool, and the arguments must bind to the function's signature with the annotated types (an int
is not a float's stand-in for an `int`, a bool is not an int). Each call of a message is
answered by a `tool` message of its own, in order: the result for a good call; for any failure
(malformed call, unknown tool, bad arguments, a tool that raises or runs past `timeout`) an
error that says what was expected, the errors also in `info["tool_error"]` (joined by
newlines), and the episode goes on. A message without a tool call is the final answer: the
episode ends with `reward=None` (the run's verifier scores the answer). Simplified on purpose:
argument types checked for plain types, `Optional` / unions and bare containers only.
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
from composer_lightning.chat.tool_calls import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_MARK,
    check_format,
    find_tool_calls,
    resolve_format,
)
from composer_lightning.envs.base import Message, Observation
from composer_lightning.runtime.calls import CallTimeout, call_with_timeout, check_timeout

CALL_OPEN, CALL_CLOSE = HERMES_OPEN, HERMES_CLOSE
CALL_FORMAT = f'{CALL_OPEN}{{"name": "<tool>", "arguments": {{...}}}}{CALL_CLOSE}'
#: how a call is written, per format (in the errors that say what was expected)
CALL_FORMATS = {
    "auto": CALL_FORMAT,
    "hermes": CALL_FORMAT,
    "mistral": f'{MISTRAL_MARK}[{{"name": "<tool>", "arguments": {{...}}}}]',
    "llama3_json": '{"name": "<tool>", "parameters": {...}}',
}


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
        tool_call_format: the format calls are read in (`chat.tool_calls.FORMATS`, or
            "template": the chat template's, which the episode loop sets).
        parallel_calls: several calls in one message are each answered (False: such a message
            is one tool error, "expected one call").

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
        tool_call_format: str = "auto",
        parallel_calls: bool = True,
    ) -> None:
        if not tools:
            raise ValueError("PythonToolEnv needs at least one tool function, got none")
        if max_calls is not None and (
            isinstance(max_calls, bool) or not isinstance(max_calls, int) or max_calls < 1
        ):
            raise ValueError(f"PythonToolEnv: max_calls must be an integer >= 1, got {max_calls!r}")
        self.timeout = check_timeout(timeout, "PythonToolEnv")
        self.max_calls = max_calls
        self.tool_call_format = check_format(tool_call_format, "PythonToolEnv")
        self.parallel_calls = parallel_calls
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
        fmt = resolve_format(self.tool_call_format)  # "template" unset by the loop: auto
        _, bodies = find_tool_calls(content, fmt)  # chat.tool_calls: the parser serve shares
        if not bodies and CALL_OPEN not in content and CALL_CLOSE not in content:
            return Observation(done=True, reward=None, info={"tool_error": None})
        if not bodies or (len(bodies) > 1 and not self.parallel_calls):
            got = "no complete call" if not bodies else f"{len(bodies)} calls"
            answers: list[tuple[str, str | None]] = [
                ("", f"Tool call error: expected one call {self._format}, got {got}.")
            ]
            self.calls += 1
        else:
            answers = [self._run(body) for body in bodies]
            self.calls += len(bodies)
        errors = [error for _, error in answers if error is not None]
        return Observation(
            messages=[
                {"role": "tool", "content": result if error is None else error}
                for result, error in answers
            ],
            done=self.max_calls is not None and self.calls >= self.max_calls,
            info={"tool_error": "\n".join(errors) if errors else None, "calls": self.calls},
        )

    @property
    def _format(self) -> str:
        return CALL_FORMATS.get(self.tool_call_format, CALL_FORMAT)

    def _signatures(self) -> str:
        return ", ".join(signature_text(fn) for fn in self.functions.values())

    def _run(self, body: str) -> tuple[str, str | None]:
        """(result text, None) for a good call's JSON `body`, ("", error text) otherwise."""
        expected = self._format
        try:
            call = json.loads(body)
        except json.JSONDecodeError as err:
            return "", f"Tool call error: the call is not valid JSON ({err}); expected {expected}."
        key = "parameters" if self.tool_call_format == "llama3_json" else "arguments"
        if self.tool_call_format == "auto" and isinstance(call, dict) and "parameters" in call:
            key = "parameters"  # a Llama-style call read by the lenient parser
        if (
            not isinstance(call, dict)
            or set(call) != {"name", key}
            or not isinstance(call[key], dict)
        ):
            return "", (
                f"Tool call error: expected a JSON object with keys 'name' and '{key}' (an "
                f"object), {expected}, got {body.strip()}."
            )
        name, arguments = call["name"], call[key]
        fn = self.functions.get(name) if isinstance(name, str) else None
        if fn is None:
            return (
                "",
                f"Tool call error: unknown tool {name!r}; the tools are {self._signatures()}.",
            )
        problem = _argument_problem(fn, arguments)
        if problem is not None:
            return "", f"Tool call error: {problem}; expected {signature_text(fn)}."
        try:
            result = call_with_timeout(fn, (), self.timeout, arguments)
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
