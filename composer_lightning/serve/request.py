"""A chat-completions request checked into a `ChatRequest`: every field the handler reads is
checked here, so bad input is a 400 naming the field and what was expected, never a 500 later.

Accepted: every field the `openai` client can send (`CompletionCreateParams`, read from the
installed package) plus `stream`, and OpenClaw-RL's `session_id` / `session_done`. Used:
`messages`, `model`, `n`, `max_completion_tokens` (or the older `max_tokens`), `temperature`,
`top_p`, `stop`, `tools`, `stream`, `stream_options.include_usage`, `seed`, `user`. The other
client fields (penalties, `logprobs`, `response_format`, `tool_choice`, ...) are accepted and
ignored; any other field is a 400, so a typo is not silently dropped. The body as a whole nests
at most `MAX_DEPTH` levels and holds only text that UTF-8 can carry (no lone surrogates, which
JSON's `\\ud800` escapes can write).
"""

from __future__ import annotations

import json
from typing import Any, overload

from openai.types.chat.completion_create_params import CompletionCreateParamsBase
from starlette.requests import Request

from composer_lightning.serve.protocol import ApiError, ChatRequest

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
#: the deepest nesting of a body (objects and lists); OpenAI's own schemas nest a few levels
MAX_DEPTH = 64
#: OpenAI's `seed` is a 64-bit integer
SEED_RANGE = (-(2**63), 2**63 - 1)


def _bad(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


def _shown(value: Any, limit: int = 200) -> str:
    """`repr(value)`, cut to `limit` characters: an error names the bad value, not all of it."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


async def read_json(request: Request, limit: int) -> Any:
    """The request's JSON body, at most `limit` bytes (413 beyond, also while it streams in
    without a length; 400 when it is not JSON)."""
    length = request.headers.get("content-length")
    too_large = ApiError(
        413,
        f"the request body is larger than this server's limit of {limit} bytes",
        code="request_too_large",
    )
    if length is not None and length.isdigit() and int(length) > limit:
        raise too_large
    raw = bytearray()
    async for part in request.stream():
        raw += part
        if len(raw) > limit:
            raise too_large
    try:
        return json.loads(raw)
    except RecursionError:  # nested past what the parser recurses through
        raise _bad("body", f"the body nests more than {MAX_DEPTH} levels deep") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _bad("body", f"the body is not valid JSON: {e}") from None


def check_json(body: Any) -> None:
    """A 400 unless `body` nests at most `MAX_DEPTH` levels and every string in it (keys too)
    is text UTF-8 can carry: what the template, the tokenizer and the store then walk is
    bounded, and an error message that quotes it can be sent."""
    stack: list[tuple[Any, int, str]] = [(body, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                bad = ascii(value[e.start : e.end])
                raise _bad(
                    where, f"{where} holds {bad}, a lone UTF-16 surrogate, not text"
                ) from None
        elif isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _bad("body", f"the body nests more than {MAX_DEPTH} levels deep")
            if isinstance(value, dict):
                stack += [(k, depth, where) for k in value]
                stack += [(v, depth + 1, f"{where}.{ascii(k)[1:-1]}") for k, v in value.items()]
            else:
                stack += [(v, depth + 1, f"{where}[{k}]") for k, v in enumerate(value)]


def _int(body: dict[str, Any], key: str, lo: int, hi: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or value < lo
        or (hi is not None and value > hi)
    ):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise _bad(key, f"'{key}' must be an integer {bounds}, got {_shown(value)}")
    return value


@overload
def _number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float: ...
@overload
def _number(
    body: dict[str, Any], key: str, lo: float, hi: float, default: None
) -> float | None: ...
def _number(
    body: dict[str, Any], key: str, lo: float, hi: float, default: float | None
) -> float | None:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not lo <= value <= hi:
        raise _bad(key, f"'{key}' must be a number in [{lo}, {hi}], got {_shown(value)}")
    return float(value)


def _string(m: dict[str, Any], key: str, param: str) -> None:
    if key in m and m[key] is not None and not isinstance(m[key], str):
        raise _bad(f"{param}.{key}", f"{param}.{key} must be a string, got {_shown(m[key])}")


def _function(fn: Any, param: str, arguments: bool) -> None:
    """A call's or a tool spec's `function` object: a non-empty `name`, and `arguments` (a
    JSON string, or an object) for a call, or a `description` string and a `parameters`
    object for a spec."""
    if not isinstance(fn, dict):
        raise _bad(param, f"{param} must be an object with 'name', got {_shown(fn)}")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise _bad(
            f"{param}.name",
            f"{param}.name must be a non-empty string, got {_shown(fn.get('name'))}",
        )
    if arguments and not isinstance(fn.get("arguments", ""), (str, dict)):
        raise _bad(
            f"{param}.arguments",
            f"{param}.arguments must be a JSON string, got {_shown(fn['arguments'])}",
        )
    if not arguments:
        _string(fn, "description", param)
        if not isinstance(fn.get("parameters", {}), dict):
            raise _bad(
                f"{param}.parameters",
                f"{param}.parameters must be a JSON schema object, got {_shown(fn['parameters'])}",
            )


def _tool_calls(value: Any, param: str) -> None:
    """An assistant message's `tool_calls`: OpenAI's list of `{"id", "type": "function",
    "function": {"name", "arguments"}}`."""
    if not isinstance(value, list):
        raise _bad(param, f"{param} must be a list of tool calls, got {_shown(value)}")
    for k, call in enumerate(value):
        where = f"{param}[{k}]"
        if not isinstance(call, dict) or call.get("type", "function") != "function":
            raise _bad(
                where, f"{where} must be a tool call object of type 'function', got {_shown(call)}"
            )
        _string(call, "id", where)
        _function(call.get("function"), f"{where}.function", arguments=True)


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _bad("tools", f"'tools' must be a list of tool objects, got {_shown(value)}")
    for k, tool in enumerate(value):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise _bad(
                f"tools[{k}]",
                f"tools[{k}] must be an object of type 'function', got {_shown(tool)}",
            )
        _function(tool.get("function"), f"tools[{k}].function", arguments=False)
    return value or None


def _message(i: int, m: Any) -> dict[str, Any]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise _bad(param, f"{param} must be an object with 'role' and 'content', got {_shown(m)}")
    if m.get("role") not in ROLES:
        raise _bad(
            f"{param}.role", f"{param}.role must be one of {ROLES}, got {_shown(m.get('role'))}"
        )
    for key in ("name", "tool_call_id"):
        _string(m, key, param)
    if m.get("tool_calls") is not None:
        _tool_calls(m["tool_calls"], f"{param}.tool_calls")
    content = m.get("content")
    if isinstance(content, list):
        if not all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text", ""), str)
            for p in content
        ):
            raise _bad(f"{param}.content", f"{param}.content: only text parts are served")
        content = "".join(p.get("text", "") for p in content)
    elif content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
        raise _bad(f"{param}.content", f"{param}.content is missing (null needs tool_calls)")
    elif content is not None and not isinstance(content, str):
        raise _bad(f"{param}.content", f"{param}.content must be a string, got {_shown(content)}")
    return {**m, "content": content}


def _stop(value: Any) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not (isinstance(stops, list) and len(stops) <= 4) or not all(
        isinstance(s, str) and s for s in stops
    ):
        raise _bad(
            "stop", f"'stop' must be a string or up to 4 non-empty strings, got {_shown(value)}"
        )
    return list(stops)


def _session(
    body: dict[str, Any], headers: dict[str, str], side: bool = False
) -> tuple[str | None, bool]:  # no session: a side turn's
    header, field = headers.get(SESSION_HEADER), body.get("session_id")
    if field is not None and (not isinstance(field, str) or not field):
        raise _bad("session_id", f"'session_id' must be a non-empty string, got {_shown(field)}")
    if header and field and header != field:
        raise _bad(
            "session_id", f"header X-Session-Id {_shown(header)} != body session_id {_shown(field)}"
        )
    session = header or field
    if not session and not side:
        raise _bad("session_id", "a session id is required: header X-Session-Id or 'session_id'")
    done = body.get("session_done") or False
    if not isinstance(done, bool):
        raise _bad("session_done", f"'session_done' must be true or false, got {_shown(done)}")
    done = done or headers.get(SESSION_DONE_HEADER, "").lower() in ("1", "true")
    return session, done


def parse_request(body: Any, headers: dict[str, str], *, max_n: int) -> ChatRequest:
    """Check a decoded JSON body (and the session headers) into a `ChatRequest`.

    Raises:
        ApiError: a 400 naming the bad field and what was expected.
    """
    check_json(body)
    if not isinstance(body, dict):
        raise _bad("body", f"the body must be a JSON object, got {type(body).__name__}")
    unknown = sorted(set(body) - ACCEPTED_FIELDS)
    if unknown:
        names = ", ".join(unknown)
        raise _bad(unknown[0], f"unrecognized request argument supplied: {names[:200]}")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"'model' must be a non-empty string, got {_shown(model)}")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"'messages' must be a non-empty list, got {_shown(messages)}")
    if not isinstance(body.get("stream") or False, bool):
        raise _bad("stream", f"'stream' must be true or false, got {_shown(body['stream'])}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise _bad("stream_options", f"'stream_options' must be an object, got {_shown(options)}")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise _bad("user", f"'user' must be a string, got {_shown(user)}")
    max_tokens = _int(body, "max_completion_tokens", 1)
    turn_type = headers.get(TURN_TYPE_HEADER, "main").lower()
    if turn_type not in ("main", "side"):
        raise _bad(
            "X-Turn-Type", f"header X-Turn-Type must be 'main' or 'side', got {_shown(turn_type)}"
        )
    session, session_done = _session(body, headers, side=turn_type == "side")
    return ChatRequest(
        messages=[_message(i, m) for i, m in enumerate(messages)],
        tools=_tools(body.get("tools")),
        model=model,
        n=_int(body, "n", 1, max_n) or 1,
        max_tokens=max_tokens if max_tokens is not None else _int(body, "max_tokens", 1),
        temperature=_number(body, "temperature", 0.0, 2.0, None),
        top_p=_number(body, "top_p", 0.0, 1.0, 1.0),
        stop=_stop(body.get("stop")),
        seed=_int(body, "seed", *SEED_RANGE),
        user=user,
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage", False)),
        session=session or "",
        session_done=session_done,
        side=turn_type == "side",
    )
