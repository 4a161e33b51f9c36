"""OpenAI's chat-completions wire format: the request checked into a `ChatRequest`, the errors,
the response and stream chunk bodies (the shapes of `openai.types.chat`).

Accepted: every field the `openai` client can send (`CompletionCreateParams`, read from the
installed package) plus `stream`, and OpenClaw-RL's `session_id` / `session_done`. Used:
`messages`, `model`, `n`, `max_completion_tokens` (or the older `max_tokens`), `temperature`,
`top_p`, `stop`, `tools`, `stream`, `stream_options.include_usage`, `seed`, `user`. The other
client fields (penalties, `logprobs`, `response_format`, `tool_choice`, ...) are accepted and
ignored; any other field is a 400, so a typo is not silently dropped.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from openai.types.chat.completion_create_params import CompletionCreateParamsBase

from composer_lightning.chat.tool_calls import call_start, may_begin, split_reply

SESSION_HEADER = "x-session-id"
SESSION_DONE_HEADER = "x-session-done"
#: OpenClaw-RL's turn types: "main" turns are recorded and trained on; "side" turns (a judge's,
#: a summariser's, any auxiliary call of the harness) are served and never recorded
TURN_TYPE_HEADER = "x-turn-type"
CLIENT_FIELDS = frozenset(
    CompletionCreateParamsBase.__required_keys__ | CompletionCreateParamsBase.__optional_keys__
)
ACCEPTED_FIELDS = CLIENT_FIELDS | {"stream", "session_id", "session_done"}
ROLES = ("system", "developer", "user", "assistant", "tool", "function")


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


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


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


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(key, f"'{key}' must be an integer {bounds}, got {value!r}")
    return value


def _number(
    body: dict[str, Any], key: str, lo: float, hi: float, default: float | None
) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _bad(key, f"'{key}' must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def _message(i: int, m: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(param, f"{param} must be an object with 'role' and 'content', got {m!r}")
    if m.get("role") not in ROLES:
        raise _bad(f"{param}.role", f"{param}.role must be one of {ROLES}, got {m.get('role')!r}")
    content = m.get("content")
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise _bad(f"{param}.content", f"{param}.content: only text parts are served")
        content = "".join(str(p.get("text", "")) for p in content)
    elif content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
        raise _bad(f"{param}.content", f"{param}.content is missing (null needs tool_calls)")
    elif content is not None and not isinstance(content, str):
        raise _bad(f"{param}.content", f"{param}.content must be a string, got {content!r}")
    return {**m, "content": content}


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not (isinstance(stops, list) and len(stops) <= 4) or not all(
        isinstance(s, str) and s for s in stops
    ):
        raise _bad("stop", f"'stop' must be a string or up to 4 non-empty strings, got {value!r}")
    return list(stops)


def _session(body: dict[str, Any], headers: dict[str, str], side: bool = False) -> tuple[str, bool]:
    header, field = headers.get(SESSION_HEADER), body.get("session_id")
    if field is not None and (not isinstance(field, str) or not field):
        raise _bad("session_id", f"'session_id' must be a non-empty string, got {field!r}")
    if header and field and header != field:
        raise _bad("session_id", f"header X-Session-Id {header!r} != body session_id {field!r}")
    session = header or field
    if not session and not side:
        raise _bad("session_id", "a session id is required: header X-Session-Id or 'session_id'")
    done = body.get("session_done") or False
    if not isinstance(done, bool):
        raise _bad("session_done", f"'session_done' must be true or false, got {done!r}")
    done = done or headers.get(SESSION_DONE_HEADER, "").lower() in ("1", "true")
    return session, done


def parse_request(body: Any, headers: dict[str, str], *, max_n: int) -> ChatRequest:
    """Check a decoded JSON body (and the session headers) into a `ChatRequest`.

    Raises:
        ApiError: a 400 naming the bad field and what was expected.
    """
    if not isinstance(body, dict):
        raise _bad("body", f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - ACCEPTED_FIELDS)
    if unknown:
        raise _bad(unknown[0], f"unrecognized request argument supplied: {', '.join(unknown)}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"'model' must be a non-empty string, got {model!r}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"'messages' must be a non-empty list, got {messages!r}")
    tools = body.get("tools")
    if tools is not None and not (
        isinstance(tools, list) and all(isinstance(t, dict) and "type" in t for t in tools)
    ):
        raise _bad("tools", f"'tools' must be a list of tool objects with 'type', got {tools!r}")
    if not isinstance(body.get("stream") or False, bool):
        raise _bad("stream", f"'stream' must be true or false, got {body['stream']!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", f"'stream_options' must be an object, got {options!r}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"'user' must be a string, got {user!r}")
    max_tokens = _int(body, "max_completion_tokens", 1)
    turn_type = headers.get(TURN_TYPE_HEADER, "main").lower()
    if turn_type not in ("main", "side"):
        raise _bad("X-Turn-Type", f"header X-Turn-Type must be 'main' or 'side', got {turn_type!r}")
    session, session_done = _session(body, headers, side=turn_type == "side")
    return ChatRequest(
        messages=[_message(i, m) for i, m in enumerate(messages)],
        tools=tools or None,
        model=model,
        n=_int(body, "n", 1, max_n) or 1,
        max_tokens=max_tokens if max_tokens is not None else _int(body, "max_tokens", 1),
        temperature=_number(body, "temperature", 0.0, 2.0, None),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        stop=_stop(body.get("stop")),
        seed=_int(body, "seed", -(2**63)),
        user=user,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage", False)),
        session=session or "",
        session_done=session_done,
        side=turn_type == "side",
    )


@dataclass(frozen=True)
class Choice:
    """One reply as served: its text (cut at a stop string) and why it ended; with tool calls,
    the text outside them and the calls in OpenAI's form (`finish_reason` "tool_calls")."""

    text: str | None
    finish_reason: str
    tool_calls: list[dict[str, Any]] | None = None


def with_tool_calls(choice: Choice, offered_tools: bool, fmt: str = "auto") -> Choice:
    """`choice` as OpenAI returns a reply that calls tools (`chat.tool_calls.split_reply`):
    content = the text outside the calls (None when empty), `tool_calls`, finish reason
    "tool_calls". Unchanged when the request offered no tools, the reply has no call, or it
    was cut by `max_tokens`. Calls are read in format `fmt`."""
    if not offered_tools or choice.text is None or choice.finish_reason == "length":
        return choice
    content, calls = split_reply(choice.text, fmt=fmt)
    if not calls:
        return choice
    return Choice(content or None, "tool_calls", [c.openai() for c in calls])


def new_id() -> str:
    """A completion id in OpenAI's form."""
    return f"chatcmpl-{uuid.uuid4().hex}"


def weights_label(version: int, launch: int = 0) -> str:
    """The reply's `system_fingerprint`: `weights-v<version>`, and `-l<launch>` after it from
    the second launch of a store on (`serve/lineage.py`), so no label names two sets of
    weights."""
    return f"weights-v{version}" if launch <= 1 else f"weights-v{version}-l{launch}"


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
