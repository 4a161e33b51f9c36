"""`EngineBackend` streams on transformers too: `HFEngine.generate_stream` reports each step's
tokens as `generate` samples them (exactly the completions `generate` returns), and `serve`
sends them while the engine call still runs; an engine that cannot report tokens streams its
reply at the end of the call."""

from __future__ import annotations

import threading

import httpx
import pytest
from transformers import AutoTokenizer

from composer_lightning.engines import HFEngine, SamplingConfig, TokenStreamEngine
from composer_lightning.models.tiny import tiny_policy_path, tiny_tool_policy_path
from composer_lightning.serve import BackgroundServer, EngineBackend, TurnStore, make_app
from tests.serve.test_step_backend import _prompt, _sse, _wait


@pytest.fixture(scope="module")
def hf():
    return HFEngine(model_path=tiny_policy_path(), seed=0)


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingConfig(temperature=1.0, max_tokens=12, seed=5),
        SamplingConfig(temperature=0.0, max_tokens=12),
        SamplingConfig(temperature=0.8, max_tokens=12, seed=3, repetition_penalty=1.2),
        SamplingConfig(temperature=0.7, max_tokens=3, seed=3, top_p=0.9),
        SamplingConfig(temperature=1.3, max_tokens=40, seed=9, top_k=5),
    ],
    ids=["sampled", "greedy", "penalty", "top_p_cut", "top_k"],
)
def test_generate_stream_reports_each_step_as_generate_samples_it(hf, sampling):
    """Reassembled, each sample's deltas are its `Completion` exactly (ids, log-probs bit for
    bit, and the finish reason on the last delta only), and the call returns what `generate`
    returns for the same seed: the log-probs are those of the warped scores sampled from
    (temperature, top-p, penalties), not the raw logits."""
    assert isinstance(hf, TokenStreamEngine)
    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    prompts = [_prompt(tok, "What is 3 + 4?"), _prompt(tok, "Hello there, what is 12 + 30?")]
    n = 2 if sampling.temperature > 0 else 1
    got: dict[tuple[int, int], list] = {}
    streamed = hf.generate_stream(prompts, n, sampling, lambda i, d: got.setdefault((i, d.index), []).append(d))  # fmt: skip
    plain = hf.generate(prompts, n, sampling)
    assert streamed == plain
    for i, row in enumerate(plain):
        for j, c in enumerate(row):
            deltas = got.pop((i, j))
            assert [t for d in deltas for t in d.token_ids] == c.token_ids
            assert [lp for d in deltas for lp in d.logprobs] == c.logprobs
            assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [
                c.finish_reason
            ]
    assert not got


class GatedHF(HFEngine):
    """`HFEngine` whose streamed call holds after `free` steps until `gate` is set."""

    def __init__(self, *a, free: int = 3, **kw) -> None:
        super().__init__(*a, **kw)
        self.gate, self.free, self.steps = threading.Event(), free, 0

    def generate_stream(self, prompts, n, sampling, on_delta):
        def held(i, delta):
            on_delta(i, delta)
            self.steps += 1
            if self.steps >= self.free:
                assert self.gate.wait(60), "the test never released the engine"

        return super().generate_stream(prompts, n, sampling, held)


def test_serve_on_transformers_streams_while_the_engine_call_runs(tmp_path):
    """With the engine call held after its third token, the client already holds content and
    nothing is recorded; released, the streamed text equals the non-streamed reply of the
    same seed and the recorded turn."""
    path = tiny_tool_policy_path()  # its replies (a call, written out) are long enough
    engine = GatedHF(model_path=path, seed=0)
    tok = AutoTokenizer.from_pretrained(path)
    store = TurnStore(tmp_path / "turns.db")
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is 12 + 30?"}],
        "max_tokens": 16, "temperature": 1.0, "seed": 5, "session_id": "s", "stream": True,
    }  # fmt: skip
    with BackgroundServer(make_app(EngineBackend(engine, tok), store, model_name="tiny")) as server:
        got: list = []
        reader = threading.Thread(target=_sse, args=(server.url, body, got))
        reader.start()
        _wait(lambda: engine.steps == 3, "the engine call held after its third token")
        _wait(
            lambda: any(
                c["choices"] and c["choices"][0]["delta"].get("content") for c in list(got)
            ),
            "content streamed while the engine call is held",
        )
        assert engine.steps == 3 and store.counts()["recorded"] == 0
        engine.gate.set()
        reader.join(timeout=60)
        plain = httpx.post(
            f"{server.url}/v1/chat/completions",
            json={**body, "stream": False, "session_id": "t"}, timeout=60,
        ).json()  # fmt: skip
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c["choices"])
    assert text and text == plain["choices"][0]["message"]["content"]
    assert len(tok(text)["input_ids"]) > 3  # the reply went on after the held step
    (turn,) = store.session_turns("s")
    assert turn.response_text == text


class NoStream:
    """An engine that only has `generate` (no token reports)."""

    def __init__(self, hf: HFEngine) -> None:
        self.hf = hf
        self.start, self.generate, self.load_weights = hf.start, hf.generate, hf.load_weights

    weight_version = property(lambda self: self.hf.weight_version)
    model = property(lambda self: self.hf.model)


def test_a_greedy_n_streams_every_choice_and_an_engine_without_reports_streams_at_the_end(
    hf, tmp_path
):
    tok = AutoTokenizer.from_pretrained(tiny_policy_path())
    body = {
        "model": "tiny", "messages": [{"role": "user", "content": "What is 2 + 2?"}],
        "max_tokens": 8, "temperature": 0, "n": 2, "session_id": "g", "stream": True,
    }  # fmt: skip
    texts = []
    for engine in (hf, NoStream(hf)):
        backend = EngineBackend(engine, tok)
        with BackgroundServer(make_app(backend, TurnStore(tmp_path / f"{len(texts)}.db"), model_name="tiny")) as server:  # fmt: skip
            chunks = [c for c in _sse(server.url, body) if c["choices"]]
        by_choice = ["".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"][0]["index"] == i) for i in range(2)]  # fmt: skip
        assert by_choice[0] == by_choice[1] != ""
        finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
        assert sorted(f["index"] for f in finishes) == [0, 1]
        texts.append(by_choice[0])
    assert texts[0] == texts[1]
