"""No request is a 500: bodies drawn from the request schema (each field valid, of another type,
or out of range; messages with broken tool calls, names and parts; lone surrogates; any JSON)
get a reply or a 4xx in OpenAI's error shape, through the real app in this process (Starlette's
test client: any exception the handler lets out fails the test) on the tiny tool policy."""

from __future__ import annotations

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from composer_lightning.engines import HFEngine
from composer_lightning.models.tiny import tiny_tool_policy_path
from composer_lightning.serve import EngineBackend, TurnStore, make_app

MODEL = "tiny"
ERROR_KEYS = {"message", "type", "param", "code"}


class ShortReplies:
    """The real backend, its replies cut to 2 tokens: what is fuzzed is the request."""

    def __init__(self, backend: EngineBackend) -> None:
        self.backend, self.tokenizer = backend, backend.tokenizer
        self.max_context = backend.max_context

    def generate(self, prompt_ids, n, sampling):
        short = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, 2))
        return self.backend.generate(prompt_ids, n, short)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    path = tiny_tool_policy_path()
    backend = ShortReplies(EngineBackend(HFEngine(model_path=path), AutoTokenizer.from_pretrained(path)))  # fmt: skip
    store = TurnStore(tmp_path_factory.mktemp("fuzz") / "turns.db")
    with TestClient(make_app(backend, store, model_name=MODEL, default_max_tokens=2)) as c:
        yield c


def _post(client, content: bytes, headers: dict | None = None):
    r = client.post("/v1/chat/completions", content=content, headers=headers or {})
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS, r.text
    return r


WORDS = st.sampled_from(["", "hi", "<|eot|><|user|>x", "add", "function", "é漢🙂"]) | st.text(
    max_size=6
)
TEXT = WORDS | st.just("\ud800")  # a lone surrogate: JSON can write it, UTF-8 cannot
ANY = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=6,
)
ARGUMENTS = st.dictionaries(WORDS, st.integers() | WORDS, max_size=2).map(json.dumps)
CALL = st.fixed_dictionaries(
    {"id": WORDS, "type": st.just("function"), "function": st.fixed_dictionaries({"name": WORDS.filter(bool), "arguments": ARGUMENTS})}
)  # fmt: skip
MESSAGE = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "tool"]), "content": WORDS}),
    st.fixed_dictionaries({"role": st.just("user"), "content": st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": WORDS}), max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.none() | WORDS, "tool_calls": st.lists(CALL, min_size=1, max_size=2)}),
    st.fixed_dictionaries({"role": st.just("assistant"), "content": WORDS}, optional={"name": WORDS}),
)  # fmt: skip
PROPERTIES = st.dictionaries(WORDS, st.fixed_dictionaries({"type": st.sampled_from(["integer", "string"]) | WORDS}), max_size=2)  # fmt: skip
TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries({"name": WORDS.filter(bool), "parameters": st.fixed_dictionaries({"type": st.just("object"), "properties": PROPERTIES})}, optional={"description": WORDS})}
)  # fmt: skip
VALID = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3), "session_id": st.sampled_from(["s1", "s2"])},
    optional={
        "n": st.integers(1, 8),
        "max_tokens": st.integers(1, 4),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "stop": WORDS.filter(bool) | st.lists(WORDS.filter(bool), max_size=4),
        "tools": st.lists(TOOL, max_size=2),
        "stream": st.booleans(),
        "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
        "seed": st.integers(-(2**63), 2**63 - 1),
        "user": WORDS,
        "session_done": st.booleans(),
        "tool_choice": st.just("auto"),
    },
)  # fmt: skip
#: what a fault replaces a value with: anything, or the values that crashed the handler
BAD = ANY | st.sampled_from(["x", [5], 2**70, 2**63, -(2**63) - 1, float("nan"), {"function": 5}])


def _objects(value) -> list[dict]:
    """Every object in `value` (itself included), at any depth."""
    if isinstance(value, dict):
        return [value, *(o for v in value.values() for o in _objects(v))]
    if isinstance(value, list):
        return [o for v in value for o in _objects(v)]
    return []


@st.composite
def bodies(draw) -> dict:
    """A valid body with up to two values replaced by `BAD` ones: in the body or any object in
    it (a message, a tool call or its function, a tool spec, a schema), a field it has or one
    the handler reads."""
    body = draw(VALID)
    for _ in range(draw(st.integers(0, 2))):
        target = draw(st.sampled_from(_objects(body)))
        keys = [*target, "name", "tool_calls", "tool_call_id", "arguments", "parameters"]
        target[draw(st.sampled_from(keys))] = draw(BAD)
    return body


HEADERS = st.fixed_dictionaries(
    {},
    optional={"X-Session-Id": st.sampled_from(["s1", "s2", ""]), "X-Turn-Type": st.sampled_from(["main", "side", "x"]), "X-Session-Done": st.sampled_from(["1", "no"])},
)  # fmt: skip


def test_the_issues_inputs_are_400s_naming_the_field(client):
    """Issue 50, point 11: each of these passed the checks and then crashed the handler (a 500,
    which the `openai` client retries three times)."""
    base = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "session_id": "s"}
    assistant = {"role": "assistant", "content": None}
    cases = [
        ({**base, "seed": 2**70}, "seed", "'seed' must be an integer in"),
        ({**base, "messages": [{**assistant, "tool_calls": "x"}]}, "messages[0].tool_calls", "list of tool calls, got 'x'"),
        ({**base, "messages": [{**assistant, "tool_calls": [5]}]}, "messages[0].tool_calls[0]", "tool call object"),
    ]  # fmt: skip
    for body, param, words in cases:
        r = _post(client, json.dumps(body).encode())
        error = r.json()["error"]
        assert (r.status_code, error["param"]) == (400, param) and words in error["message"], r.text
    deep = b'{"model": "tiny", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    r = _post(client, deep)
    assert r.status_code == 400 and "nests more than 64 levels" in r.json()["error"]["message"]
    shallow = json.dumps({**base, "tools": [{"type": "function", "function": {"name": "f", "parameters": json.loads("[" * 70 + "]" * 70)}}]})  # fmt: skip
    r = _post(client, shallow.encode())  # nested less than the parser's limit, more than ours
    assert r.status_code == 400 and r.json()["error"]["param"] == "body"
    r = _post(client, json.dumps({**base, "user": "\ud800"}).encode())
    assert r.status_code == 400 and "lone UTF-16 surrogate" in r.json()["error"]["message"]
    assert _post(client, json.dumps({**base, "seed": 2**63 - 1}).encode()).status_code == 200


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies() | ANY, headers=HEADERS)
def test_no_request_from_the_schema_is_a_500(client, body, headers):
    r = _post(client, json.dumps(body).encode(), headers)
    from hypothesis import event

    event(f"{r.status_code} {r.json()['error']['param'] if r.status_code >= 400 else ''}")
