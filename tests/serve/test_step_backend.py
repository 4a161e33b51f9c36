"""StepBackend: requests join a continuously scheduled engine between its steps, tokens stream as
they are generated, a weight push waits for the running replies; and `serve`'s stream on it.

The engine here is `SteppedHF`: the tiny policy on `HFEngine`, each reply sampled whole when
it is added (the same seeds as `generate`) and handed out one token per `step`, each step only
once the test allows it. vLLM's own `add`/`step` is checked against `generate` in the engine
contract (tests/engines) and end to end by `bench/serve_load.py`'s smoke test.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer
from transformers.utils import get_json_schema

from composer_lightning.chat import render_ids
from composer_lightning.chat.tool_calls import call_start, may_begin
from composer_lightning.engines import Delta, HFEngine, SamplingConfig, StepEngine
from composer_lightning.models.tiny import tiny_policy_path, tiny_tool_policy_path
from composer_lightning.serve import BackgroundServer, TurnStore, make_app
from composer_lightning.serve.backend import StepBackend
from composer_lightning.serve.protocol import streamable

LONG = SamplingConfig(temperature=1.0, max_tokens=6, seed=11, ignore_eos=True)


class SteppedHF:
    """A `StepEngine` over `HFEngine`: `add` samples the whole reply (as `generate` would),
    `step` hands out one token of every running sample, after taking a permit from `gate` when
    one is set. `events` records adds, steps' finished samples and weight loads in order."""

    def __init__(self, path: str, gate: threading.Semaphore | None = None) -> None:
        self.hf = HFEngine(model_path=path, seed=0)
        self.gate, self.running, self.events = gate, {}, []
        self.ignore_eos, self.gated_steps = False, 0  # steps that asked the gate

    model = property(lambda self: self.hf.model)
    weight_version = property(lambda self: self.hf.weight_version)

    def start(self, context=None) -> None:
        self.hf.start(context)

    def load_weights(self, weights, version) -> None:
        self.hf.load_weights(weights, version)
        self.events.append(("load", version))

    def add(self, request, prompt, n, sampling) -> None:
        if self.ignore_eos:
            sampling = SamplingConfig(**{**sampling.__dict__, "ignore_eos": True})
        for j, c in enumerate(self.hf.generate([prompt], n, sampling)[0]):
            self.running[(request, j)] = [c, 0]
        self.events.append(("add", request))

    def step(self) -> list[Delta]:
        if self.gate is not None:
            self.gated_steps += 1
            assert self.gate.acquire(timeout=60), "the test never let the engine step"
        out = []
        for (request, j), (c, k) in list(self.running.items()):
            finish = c.finish_reason if k + 1 >= len(c.token_ids) else None
            out.append(Delta(request, j, c.token_ids[k : k + 1], c.logprobs[k : k + 1], finish))
            self.running[(request, j)][1] = k + 1
            if finish is not None:
                del self.running[(request, j)]
                self.events.append(("done", request))
        return out

    def abort(self, request, n) -> None:
        for j in range(n):
            self.running.pop((request, j), None)
        self.events.append(("abort", request))


def _prompt(tok, text="What is 2 + 3?"):
    return render_ids(tok, [{"role": "user", "content": text}], True)


def _wait(predicate, what: str) -> None:
    for _ in range(6000):
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError(f"never happened: {what}")


@pytest.fixture
def stepped():
    gate = threading.Semaphore(0)
    engine = SteppedHF(tiny_policy_path(), gate)
    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    backend = StepBackend(engine, tok)
    yield engine, backend, gate, tok
    for _ in range(1000):
        gate.release()
    backend.close()


def test_the_protocol_is_recognised_and_other_engines_are_refused():
    assert isinstance(SteppedHF(tiny_policy_path()), StepEngine)
    with pytest.raises(TypeError, match="HFEngine.*EngineBackend"):
        StepBackend(HFEngine(model_path=tiny_policy_path()), None)


def test_each_step_reaches_its_request_and_the_reply_is_generate_s(stepped):
    """A request's tokens arrive one engine step at a time, and the finished reply equals
    `generate` with the same seed, token for token, log-prob for log-prob."""
    engine, backend, gate, tok = stepped
    prompt = _prompt(tok)
    alone = engine.hf.generate([prompt], 2, LONG)[0]
    stream = backend.open(prompt, 2, LONG)
    for k in (1, 2, 3):
        gate.release()
        _wait(lambda k=k: backend.engine_steps == k, f"step {k}")
        tokens, _ = stream.completions()
        assert [len(c.token_ids) for c in tokens] == [k, k]
    for _ in range(3):
        gate.release()
    completions, version = stream.result(timeout=60)
    assert version == 0
    for got, want in zip(completions, alone, strict=True):
        assert (got.token_ids, got.logprobs, got.finish_reason) == (
            want.token_ids, want.logprobs, want.finish_reason,
        )  # fmt: skip


def test_a_request_joins_the_running_batch_between_steps(stepped):
    """A second request sent during the first's third step joins at the next step, which
    serves both (one engine step, two replies); the second finishes after the first."""
    engine, backend, gate, tok = stepped
    first = backend.open(_prompt(tok), 1, LONG)
    gate.release()
    gate.release()
    _wait(lambda: backend.engine_steps == 2, "two steps of the first")
    _wait(lambda: engine.gated_steps == 3, "the third step under way")
    second = backend.open(_prompt(tok, "What is 4 + 4?"), 1, LONG)
    gate.release()
    gate.release()
    _wait(lambda: backend.engine_steps == 4, "the third step, then one of both")
    assert [len(s.completions()[0][0].token_ids) for s in (first, second)] == [4, 1]
    for _ in range(5):
        gate.release()
    first.result(timeout=60)
    second.result(timeout=60)
    assert engine.events.index(("done", first.request)) < engine.events.index(("done", second.request))  # fmt: skip


@pytest.mark.parametrize("during_first_step", [False, True])
def test_a_push_waits_for_the_running_replies_and_new_requests_wait_for_the_push(
    stepped, during_first_step
):
    """Pushed while a reply runs (after its first step, or during it: the request has just
    joined): the weights load only after its last token, a request sent meanwhile joins only
    after the load and reports the new version: no reply mixes two, no step meets a load."""
    engine, backend, gate, tok = stepped
    running = backend.open(_prompt(tok), 1, LONG)
    if during_first_step:
        _wait(lambda: engine.gated_steps == 1, "the first step under way")
    else:
        gate.release()
        _wait(lambda: backend.engine_steps == 1, "the first step")
    weights = list(engine.hf.model.state_dict().items())
    pushed = threading.Thread(target=backend.push, args=(weights, 1))
    pushed.start()
    _wait(lambda: backend._pushes == 1, "the push waiting")
    waiting = backend.open(_prompt(tok, "What is 1 + 1?"), 1, LONG)
    time.sleep(0.2)
    assert ("load", 1) not in engine.events and waiting.version is None
    for _ in range(12):
        gate.release()
    pushed.join(timeout=60)
    assert running.result(timeout=60)[1] == 0 and waiting.result(timeout=60)[1] == 1
    events = engine.events
    assert events.index(("done", running.request)) < events.index(("load", 1)) < events.index(("add", waiting.request))  # fmt: skip


def test_a_cancelled_request_is_aborted_in_the_engine(stepped):
    engine, backend, gate, tok = stepped
    stream = backend.open(_prompt(tok), 2, LONG)
    gate.release()
    _wait(lambda: backend.engine_steps == 1, "the first step")
    backend.cancel(stream)
    gate.release()
    with pytest.raises(ConnectionAbortedError):
        stream.result(timeout=60)
    _wait(lambda: ("abort", stream.request) in engine.events, "the abort")
    assert not engine.running


def test_streamable_holds_back_stops_calls_and_broken_characters():
    """Hand-derived: what may be streamed of a reply so far."""
    assert may_begin("the answer <tool", "<tool_call>") == 11
    assert may_begin("the answer <tool_call>{", "<tool_call>") == 11
    assert may_begin("plain", "<tool_call>") == 5
    assert call_start("Sure. [TOOL_C", "mistral") == 6
    assert call_start("Sure. [TOOL_C", "hermes") == 13
    assert call_start('  {"name": "add"', "llama3_json") == 0
    assert call_start("Sure {", "llama3_json") == 6
    assert streamable("Hello wor", ["world"], None) == "Hello "
    assert streamable("Hello world and more", ["world"], None) == "Hello "
    assert streamable("caf\ufffd", [], None) == "caf"
    assert streamable("Let me add. <tool_", [], "hermes") == "Let me add."
    assert streamable("12 + 30 = 42", [], "auto") == "12 + 30 = 42"
    assert streamable("   ", [], "auto") == ""


def _sse(url, body, events=None):
    """A streamed request's parsed chunks, appended to `events` as they arrive."""
    events = [] if events is None else events
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def test_serve_streams_tokens_while_they_are_generated(tmp_path):
    """With the engine held after its third step, the client already holds content: the
    stream sends what is generated, not the finished reply. Once released, the streamed text
    equals the non-streamed reply of the same seed and the recorded turn's text."""
    gate = threading.Semaphore(0)
    engine = SteppedHF(tiny_policy_path(), gate)
    engine.ignore_eos = True
    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    backend = StepBackend(engine, tok)
    store = TurnStore(tmp_path / "turns.db")
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is 5 + 6?"}],
        "max_tokens": 8, "temperature": 1.0, "seed": 5, "session_id": "s", "stream": True,
    }  # fmt: skip
    with BackgroundServer(make_app(backend, store, model_name="tiny")) as server:
        got: list = []
        reader = threading.Thread(target=_sse, args=(server.url, body, got))
        reader.start()
        for _ in range(3):
            gate.release()
        _wait(lambda: backend.engine_steps == 3, "three steps")
        time.sleep(0.3)
        early = [c for c in list(got) if c["choices"] and c["choices"][0]["delta"].get("content")]
        assert early, "nothing streamed while the engine held the rest of the reply"
        assert store.counts()["recorded"] == 0  # recorded once the reply is done
        for _ in range(20):
            gate.release()
        reader.join(timeout=60)
        plain = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**body, "stream": False, "session_id": "t"}, timeout=60,
        ).json()  # fmt: skip
        for _ in range(20):
            gate.release()
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    (turn,) = store.session_turns("s")
    assert turn.response_text == text and len(turn.response_ids) == 8
    assert got[-1]["choices"][0]["finish_reason"] == "length"
    backend.close()


def test_a_streamed_tool_call_comes_as_tool_calls_and_the_client_leaving_aborts(tmp_path):
    """The tiny tool policy streamed on StepBackend: its call comes as a `tool_calls` delta
    with finish reason "tool_calls", no `<tool_call>` text streamed, the same call as without
    streaming. A client that leaves mid-stream gets its generation aborted and nothing
    recorded."""
    from composer_lightning.tasks.tool_calc import add

    path = tiny_tool_policy_path()
    tok = AutoTokenizer.from_pretrained(path)
    engine = SteppedHF(path)
    backend = StepBackend(engine, tok)
    store = TurnStore(tmp_path / "turns.db")
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
        "tools": [get_json_schema(add)], "max_tokens": 32, "temperature": 0,
        "session_id": "a", "stream": True,
    }  # fmt: skip
    with BackgroundServer(make_app(backend, store, model_name="tiny")) as server:
        chunks = _sse(server.url, body)
        plain = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**body, "stream": False, "session_id": "b"}, timeout=60,
        ).json()  # fmt: skip
        gate = threading.Semaphore(0)
        engine.gate, engine.ignore_eos = gate, True
        left = {**body, "tools": None, "temperature": 1.0, "session_id": "gone"}
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=left, timeout=60) as r:
            gate.release()
            next(r.iter_lines())  # the stream has begun; then the client leaves
        for _ in range(40):
            gate.release()
            time.sleep(0.01)
        _wait(lambda: any(e[0] == "abort" for e in engine.events), "the abandoned stream aborted")
        for _ in range(40):
            gate.release()
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert deltas[-1]["finish_reason"] == "tool_calls"
    streamed_text = "".join(d["delta"].get("content") or "" for d in deltas)
    assert "<tool_call>" not in streamed_text
    (call,) = [d["delta"]["tool_calls"][0] for d in deltas if d["delta"].get("tool_calls")]
    (want,) = plain["choices"][0]["message"]["tool_calls"]
    assert call["function"] == want["function"] and call["index"] == 0
    assert store.session_turns("gone") == []
    backend.close()
