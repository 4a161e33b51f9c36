"""EngineBackend under concurrent requests: they share engine calls, each gets its own reply."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
from transformers import AutoTokenizer

from composer_lightning.chat import render_ids
from composer_lightning.engines import HFEngine, SamplingConfig
from composer_lightning.models.tiny import tiny_policy_path
from composer_lightning.serve import EngineBackend


@pytest.fixture(scope="module")
def served():
    tokenizer = AutoTokenizer.from_pretrained(tiny_policy_path())
    backend = EngineBackend(HFEngine(model_path=tiny_policy_path()), tokenizer)
    return SimpleNamespace(backend=backend, tok=tokenizer)


class CountingEngine:
    """An engine that records the prompts of every generate call, after a pause long enough
    that requests sent meanwhile queue up behind it."""

    def __init__(self, engine, pause_s: float) -> None:
        self.engine, self.pause_s, self.calls = engine, pause_s, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def generate(self, prompts, n, sampling):
        time.sleep(self.pause_s)
        self.calls.append(len(prompts))
        return self.engine.generate(prompts, n, sampling)


def test_concurrent_requests_share_engine_calls_and_each_gets_its_own_reply(served):
    """16 clients at once: fewer engine calls than requests (the queue gathers what arrives
    while the engine is busy), and every client gets the reply its prompt gets alone; a seeded
    request keeps its own seed (its own call); max_batch=1 is one call per request."""
    engine = CountingEngine(served.backend.engine, pause_s=0.2)
    backend = EngineBackend(engine, served.tok)
    greedy = SamplingConfig(temperature=0.0, max_tokens=6)
    prompts = [render_ids(served.tok, [{"role": "user", "content": f"{i} + {i}"}], True) for i in range(16)]  # fmt: skip
    alone = [served.backend.generate(p, 1, greedy)[0][0].token_ids for p in prompts]
    results = [None] * 16

    def ask(i):
        results[i] = backend.generate(prompts[i], 2, greedy)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(r is not None for r in results)
    assert [[c.token_ids for c in r[0]] for r in results] == [[a, a] for a in alone]
    assert (
        sum(engine.calls) == 16
        and len(engine.calls) < 16
        and backend.engine_calls == len(engine.calls)
    )
    seeded = SamplingConfig(temperature=1.0, max_tokens=6, seed=7)
    own = served.backend.generate(prompts[0], 1, seeded)[0][0].token_ids
    engine.calls.clear()
    pair = [None, None]
    both = [threading.Thread(target=lambda k=k: pair.__setitem__(k, backend.generate(prompts[0], 1, seeded))) for k in (0, 1)]  # fmt: skip
    for t in both:
        t.start()
    for t in both:
        t.join(timeout=60)
    assert [p[0][0].token_ids for p in pair] == [own, own] and engine.calls == [1, 1]
    one_by_one = EngineBackend(CountingEngine(served.backend.engine, 0.0), served.tok, max_batch=1)
    for p in prompts[:3]:
        one_by_one.generate(p, 1, greedy)
    assert one_by_one.engine.calls == [1, 1, 1]
