"""Tool calls in a model's text and in OpenAI's form: the one parser that `serve`, the tool
environments (`envs.python_tools`) and the OpenEnv adapter (`envs.openenv_env`) share.

A reply's calls are read from, in this order:
- OpenAI's `tool_calls` field of the message (a client sends its history in this form);
- Hermes / Qwen blocks, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (also
  SmolLM2's, and this library's tiny tool policy's);
- Mistral's `[TOOL_CALLS]` followed by a JSON list of `{"name", "arguments"}` objects;
- a reply that is only a JSON call, `{"name": ..., "parameters": {...}}` or `"arguments"` (Llama
  3.1 / 3.2's JSON tool calling), or a list of them.
The text outside the calls is the reply's content. A call whose JSON does not give a name and an
arguments object is still a call, with `error` saying why: one bad call is the model's lesson (a
tool error), not a crashed batch or a 500.

Which formats count is a choice (`tool_call_format`): `"auto"` reads all three in the order
above; `"hermes"`, `"mistral"` or `"llama3_json"` reads that one only (a Hermes-tuned model's
stray JSON reply is then its answer, not a call); `"template"` takes the format the tokenizer's
chat template writes (`format_of_template`: `<tool_call>` → hermes, `[TOOL_CALLS]` → mistral,
Llama 3's `<|python_tag|>` / `ipython` → llama3_json; a template that shows none → auto). Calls
written back into a reply's text (`with_calls_as_text`) take the same format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

Message = dict[str, Any]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_MARK = "[TOOL_CALLS]"
_HERMES = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One tool call of an assistant message; `error` says why it cannot be made."""

    id: str
    name: str | None
    arguments: dict[str, Any]
    error: str | None = None

    def openai(self) -> dict[str, Any]:
        """The call in OpenAI's `tool_calls` form (arguments as a JSON string)."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name or "", "arguments": json.dumps(self.arguments)},
        }


#: the formats a reply's calls may be read in (see the module docstring)
FORMATS = ("auto", "hermes", "mistral", "llama3_json")


def check_format(fmt: str, owner: str = "tool_call_format") -> str:
    """`fmt` when it names a format (or `"template"`), else a ValueError naming it."""
    if fmt not in (*FORMATS, "template"):
        raise ValueError(
            f"{owner}: unknown tool-call format {fmt!r}; expected one of "
            f"{', '.join(repr(f) for f in (*FORMATS, 'template'))}"
        )
    return fmt


def format_of_template(tokenizer: Any) -> str:
    """The format the tokenizer's chat template writes calls in; "auto" when it shows none."""
    template = str(getattr(tokenizer, "chat_template", None) or "")
    if HERMES_OPEN in template:
        return "hermes"
    if MISTRAL_MARK in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return "auto"


def resolve_format(fmt: str, tokenizer: Any = None) -> str:
    """`fmt`, with `"template"` read off `tokenizer`'s chat template (`format_of_template`)."""
    check_format(fmt)
    return format_of_template(tokenizer) if fmt == "template" else fmt


def find_tool_calls(text: str, fmt: str = "auto") -> tuple[str, list[str]]:
    """The text outside a reply's calls, and each call's raw JSON, in order, read in format
    `fmt` (one of `FORMATS`).

    Only complete calls count: a `<tool_call>` without its close is left in the text (a
    reply cut by `max_tokens`)."""
    if fmt not in FORMATS:
        raise ValueError(f"find_tool_calls: fmt must be one of {FORMATS}, got {fmt!r}")
    if fmt in ("auto", "hermes"):
        bodies = _HERMES.findall(text)
        if bodies:
            return _HERMES.sub("", text), [b.strip() for b in bodies]
    if fmt in ("auto", "mistral") and MISTRAL_MARK in text:
        before, _, after = text.partition(MISTRAL_MARK)
        try:
            calls = json.loads(after)
        except json.JSONDecodeError:
            return text, []
        calls = calls if isinstance(calls, list) else [calls]
        return before, [json.dumps(c) for c in calls]
    stripped = text.strip()
    if fmt in ("auto", "llama3_json") and stripped[:1] in ("{", "["):
        try:
            value = json.loads(stripped)
        except json.JSONDecodeError:
            return text, []
        values = value if isinstance(value, list) else [value]
        if values and all(_looks_like_call(v) for v in values):
            return "", [json.dumps(v) for v in values]
    return text, []


def may_begin(text: str, mark: str) -> int:
    """Where `mark` begins in `text`, or where a suffix of `text` that `mark` begins with
    starts (the mark may be under way); len(text) when neither."""
    found = text.find(mark)
    if found >= 0:
        return found
    for k in range(min(len(mark) - 1, len(text)), 0, -1):
        if mark.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def call_start(text: str, fmt: str = "auto") -> int:
    """Where a call in format `fmt` begins, or may yet begin, in a reply's text so far (a
    stream): the first `<tool_call>` or `[TOOL_CALLS]` (or a suffix on its way to one), and 0
    for a reply that is, so far, blank or JSON (Llama 3's calls are the whole reply);
    len(text) when no call can start in it."""
    if fmt not in FORMATS:
        raise ValueError(f"call_start: fmt must be one of {FORMATS}, got {fmt!r}")
    cut = len(text)
    if fmt in ("auto", "hermes"):
        cut = min(cut, may_begin(text, HERMES_OPEN))
    if fmt in ("auto", "mistral"):
        cut = min(cut, may_begin(text, MISTRAL_MARK))
    if fmt in ("auto", "llama3_json") and text.strip()[:1] in ("", "{", "["):
        cut = 0
    return cut


def _looks_like_call(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("name"), str)
        and set(value) <= {"name", "arguments", "parameters", "type"}
        and ("arguments" in value or "parameters" in value)
    )


def parse_tool_calls(message: Message, turn: int = 0, fmt: str = "auto") -> list[ToolCall]:
    """The tool calls of an assistant message (see the module docstring for the formats).

    Args:
        message: `{"role": "assistant", "content": text}`, optionally with `tool_calls`.
        turn: the turn's index, for the ids of calls parsed from text (`call_<turn>_<i>`).
        fmt: the format of calls in the text (`FORMATS`).

    Returns:
        One `ToolCall` per call; a call whose JSON does not give a name and an arguments
        object has `error` set.
    """
    if message.get("tool_calls"):
        return [
            _tool_call(call.get("id") or f"call_{turn}_{i}", call.get("function", call))
            for i, call in enumerate(message["tool_calls"])
        ]
    _, bodies = find_tool_calls(message_text(message.get("content")), fmt)
    return [_tool_call(f"call_{turn}_{i}", body) for i, body in enumerate(bodies)]


def split_reply(text: str, turn: int = 0, fmt: str = "auto") -> tuple[str, list[ToolCall]]:
    """A generated reply as OpenAI returns it: its content (the text outside the calls,
    stripped) and its calls, read in format `fmt`."""
    outside, bodies = find_tool_calls(text, fmt)
    return outside.strip(), [_tool_call(f"call_{turn}_{i}", b) for i, b in enumerate(bodies)]


def _tool_call(call_id: str, fn: Any) -> ToolCall:
    try:
        if isinstance(fn, str):
            fn = json.loads(fn)
        name = fn["name"]
        args = fn.get("arguments", fn.get("parameters", {}))
        if isinstance(args, str):
            args = json.loads(args) if args.strip() else {}
        if not isinstance(name, str) or not isinstance(args, dict):
            raise TypeError("'name' must be a string and 'arguments' an object")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        return ToolCall(call_id, None, {}, f"malformed tool call: {type(err).__name__}: {err}")
    return ToolCall(call_id, name, args)


def message_text(content: Any) -> str:
    """The text of a message's content: a string, or OpenAI's list of text parts ("" for None)."""
    if isinstance(content, list):  # OpenAI content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content or ""


def same_messages(a: list[Message], b: list[Message]) -> bool:
    """Whether two chats are the same messages: roles, texts (parts joined, ends stripped) and
    tool calls; other fields (names, ids a client adds) are not compared."""
    return len(a) == len(b) and all(
        x.get("role") == y.get("role")
        and message_text(x.get("content")).strip() == message_text(y.get("content")).strip()
        and (x.get("tool_calls") or None) == (y.get("tool_calls") or None)
        for x, y in zip(a, b, strict=True)
    )


def same_reply(message: Message, reply_text: str, fmt: str = "auto") -> bool:
    """Whether an assistant message (text, or OpenAI `tool_calls`) is `reply_text` as the model
    wrote it: the same text outside the calls and the same calls (names and arguments), however
    the client re-serialised them."""
    sent = parse_tool_calls(message, fmt=fmt)
    text, written = split_reply(reply_text, fmt=fmt)
    ours = (text, [(c.name, c.arguments) for c in written])
    outside = find_tool_calls(message_text(message.get("content")), fmt)[0].strip()
    return ours == (outside, [(c.name, c.arguments) for c in sent])


def template_renders_tool_calls(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders an assistant message's `tool_calls`."""
    return "tool_calls" in str(getattr(tokenizer, "chat_template", None) or "")


def calls_as_text(calls: list[ToolCall], fmt: str = "hermes") -> str:
    """`calls` written as a model writes them in format `fmt` (Hermes blocks for "auto")."""
    objects = [{"name": c.name, "arguments": c.arguments} for c in calls]
    if fmt == "mistral":
        return f"{MISTRAL_MARK}{json.dumps(objects)}"
    if fmt == "llama3_json":
        flat = [{"name": o["name"], "parameters": o["arguments"]} for o in objects]
        return json.dumps(flat[0] if len(flat) == 1 else flat)
    return "".join(f"{HERMES_OPEN}{json.dumps(o)}{HERMES_CLOSE}" for o in objects)


def with_calls_as_text(messages: list[Message], fmt: str = "hermes") -> list[Message]:
    """`messages` with each assistant message's OpenAI `tool_calls` written into its content
    in format `fmt` (`calls_as_text`, for a chat template that renders only `content`); others
    unchanged."""
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = calls_as_text(parse_tool_calls(m), fmt)
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = message_text(m.get("content")) + blocks
        out.append(m)
    return out


#: how the tools are shown to a model whose template does not render `tools` (SmolLM2's):
#: in the system message, in the Hermes format its instruct tuning uses
TOOLS_SYSTEM_TEXT = (
    "You may call one or more functions to assist with the user query. The functions are:\n"
    "<tools>{tools}</tools>\n"
    'To call a function, reply with <tool_call>{{"name": <name>, "arguments": <object>}}'
    "</tool_call>."
)


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders the `tools` it is given."""
    return "tools" in str(getattr(tokenizer, "chat_template", None) or "")


def with_tools_in_system(messages: list[Message], tools: list[dict[str, Any]]) -> list[Message]:
    """`messages` with the tools described in the system message (`TOOLS_SYSTEM_TEXT`, after
    the system message's own text, or as a new first message)."""
    text = TOOLS_SYSTEM_TEXT.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0].get("role") == "system":
        first = messages[0]
        return [
            {**first, "content": f"{message_text(first.get('content'))}\n\n{text}"},
            *messages[1:],
        ]
    return [{"role": "system", "content": text}, *messages]


def for_template(messages: list[Message], tokenizer: Any, fmt: str = "hermes") -> list[Message]:
    """`messages` as the tokenizer's template can render them: OpenAI `tool_calls` kept (their
    arguments as objects, as templates expect) where the template renders them, else written
    into the content in format `fmt` (`with_calls_as_text`). (Tools a template does not render
    are described in the system message by `chat.render_ids` itself, for every chat it
    renders.)"""
    if not any(m.get("tool_calls") for m in messages):
        return messages
    if not template_renders_tool_calls(tokenizer):
        return with_calls_as_text(messages, fmt)
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parse_tool_calls(m)
            ]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out
