"""OpenAI's chat-completions wire format: the errors, a checked request (`ChatRequest`; the
checking is `request.py`'s), the response and stream chunk bodies (the shapes of
`openai.types.chat`).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from dataclasses import dataclass
from typing import Any, overload

from composer_lightning.chat.tool_calls import call_start, may_begin, split_reply


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
    ) -> None:
        # a message or field name may quote a client's text: kept sendable as UTF-8 JSON
        message, param = _sendable(message), _sendable(param)
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = (
            status,
            message,
            param,
            code,
            type,
        )

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": {**error, "code": self.code}}


@overload
def _sendable(text: str) -> str: ...
@overload
def _sendable(text: None) -> None: ...
def _sendable(text: str | None) -> str | None:
    """`text` with what UTF-8 cannot carry (a lone surrogate) written as its escape."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat-completions request.

    Attributes:
        messages: the chat, content parts joined into text (what is rendered and stored).
        tools: the tool specs passed to the chat template; None when none.
        model, n, temperature, top_p, seed, user, stream: as in OpenAI's API.
        max_tokens: the most reply tokens asked for; None: the server's default.
        stop: stop strings (up to 4).
        include_usage: a streamed reply ends with a usage chunk.
        session: the session id (header `X-Session-Id` or field `session_id`); "" for a side
            turn without one.
        session_done: this is the session's last request.
        side: a side turn (`X-Turn-Type: side`): served, never recorded.
    """

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    model: str
    n: int
    max_tokens: int | None
    temperature: float | None  # None: the server's default (the training temperature)
    top_p: float
    stop: list[str]
    seed: int | None
    user: str | None
    stream: bool
    include_usage: bool
    session: str
    session_done: bool
    side: bool = False


@dataclass(frozen=True)
class Choice:
    """One reply as served: its text (cut at a stop string) and why it ended; with tool calls,
    the text outside them and the calls in OpenAI's form (`finish_reason` "tool_calls")."""

    text: str | None
    finish_reason: str
    tool_calls: list[dict[str, Any]] | None = None


def with_tool_calls(choice: Choice, offered_tools: bool, fmt: str = "auto") -> Choice:
    """`choice` as OpenAI returns a reply that calls tools (`chat.tool_calls.split_reply`):
    content = the text outside the calls (None when empty), `tool_calls` (each with an id of its
    own), finish reason "tool_calls". Unchanged when the request offered no tools, the reply has no call, or it
    was cut by `max_tokens`. Calls are read in format `fmt`."""
    if not offered_tools or choice.text is None or choice.finish_reason == "length":
        return choice
    content, calls = split_reply(choice.text, fmt=fmt)
    if not calls:
        return choice
    # each call its own id, as OpenAI's are: a harness keys its tool results by them
    calls = [dataclasses.replace(c, id=new_call_id()) for c in calls]
    return Choice(content or None, "tool_calls", [c.openai() for c in calls])


def new_id() -> str:
    """A completion id in OpenAI's form."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def new_call_id() -> str:
    """A tool call's id in OpenAI's form (`call_` and 24 characters), unique per call."""
    return f"call_{uuid.uuid4().hex[:24]}"


def weights_label(version: int, launch: int = 0) -> str:
    """The reply's `system_fingerprint`: `weights-l<launch>-v<version>` (`weights-v<version>`
    for an app serving no launch). No label names two sets of weights (`serve/lineage.py`), and
    labels order as the weights were served: by launch, then by version (a resumed run's first
    label, `l2-v33`, follows the lost run's last, `l1-v36`)."""
    return f"weights-v{version}" if launch < 1 else f"weights-l{launch}-v{version}"


def _head(req: ChatRequest, cid: str, kind: str, version: int, launch: int) -> dict[str, Any]:
    """The fields a completion and each of its chunks share."""
    return {
        "id": cid,
        "object": kind,
        "created": int(time.time()),
        "model": req.model,
        "system_fingerprint": weights_label(version, launch),
    }


def completion_body(
    req: ChatRequest,
    cid: str,
    choices: list[Choice],
    usage: dict[str, int],
    version: int,
    launch: int = 0,
) -> dict[str, Any]:
    """A `chat.completion` object."""
    return {
        **_head(req, cid, "chat.completion", version, launch),
        "choices": [
            {
                "index": i,
                "message": _message_of(c),
                "logprobs": None,
                "finish_reason": c.finish_reason,
            }
            for i, c in enumerate(choices)
        ],
        "usage": usage,
    }


def _message_of(c: Choice) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text}
    if c.tool_calls:
        message["tool_calls"] = c.tool_calls
    return message


def chunk_bodies(
    req: ChatRequest,
    cid: str,
    choices: list[Choice],
    usage: dict[str, int],
    version: int,
    launch: int = 0,
) -> list[dict[str, Any]]:
    """The `chat.completion.chunk` objects of a finished reply: per choice its role, its text,
    its finish reason; then the usage when asked for (`stream_options.include_usage`)."""
    out = []
    for i, c in enumerate(choices):
        out.append(chunk_body(req, cid, version, launch, i, {"role": "assistant", "content": ""}))
        out += end_chunks(req, cid, version, launch, i, c, sent="")
    if req.include_usage:
        out.append(usage_chunk(req, cid, version, launch, usage))
    return out


def chunk_body(
    req: ChatRequest,
    cid: str,
    version: int,
    launch: int,
    index: int,
    delta: dict[str, Any],
    finish: str | None = None,
) -> dict[str, Any]:
    """One `chat.completion.chunk`: choice `index`'s `delta` (and its finish reason)."""
    head = _head(req, cid, "chat.completion.chunk", version, launch)
    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    return {**head, "choices": [choice], **({"usage": None} if req.include_usage else {})}


def end_chunks(
    req: ChatRequest, cid: str, version: int, launch: int, index: int, c: Choice, sent: str
) -> list[dict[str, Any]]:
    """A choice's last chunks once it is done, after `sent` (the text already streamed, a
    prefix of its content): the rest of its text, its calls (OpenAI's delta form, one call a
    chunk), its finish reason."""
    out = []
    text = c.text or ""
    if text.startswith(sent):
        rest = text[len(sent) :]
    else:  # the content came back stripped (a reply with calls): what follows what was sent
        rest = text[len(sent.strip()) :] if text.startswith(sent.strip()) else ""
    if rest:
        out.append(chunk_body(req, cid, version, launch, index, {"content": rest}))
    for k, call in enumerate(c.tool_calls or []):
        out.append(
            chunk_body(req, cid, version, launch, index, {"tool_calls": [{"index": k, **call}]})
        )
    out.append(chunk_body(req, cid, version, launch, index, {}, c.finish_reason))
    return out


def usage_chunk(
    req: ChatRequest, cid: str, version: int, launch: int, usage: dict[str, int]
) -> dict[str, Any]:
    """The last chunk when `stream_options.include_usage` asks for it."""
    return {
        **_head(req, cid, "chat.completion.chunk", version, launch),
        "choices": [],
        "usage": usage,
    }


def streamable(text: str, stops: list[str], call_format: str | None) -> str:
    """How much of a reply's text so far may be streamed: none of an incomplete character
    (a trailing U+FFFD), nothing from where a stop string begins or may begin, and, when the
    request offered tools (`call_format`: the format calls are read in), nothing from where a
    call begins or may begin, nor trailing whitespace (a reply with calls is served stripped).
    What is held back is sent, or dropped, when the reply is done (`end_chunks`)."""
    text = text.rstrip("\ufffd")
    cut = len(text)
    for stop in stops:
        cut = min(cut, may_begin(text, stop))
    if call_format is None:
        return text[:cut]
    cut = min(cut, call_start(text, call_format))
    return text[:cut].rstrip()
