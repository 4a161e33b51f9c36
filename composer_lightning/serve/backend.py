"""What the serving app generates with: the `ServeBackend` protocol and `EngineBackend`.

`EngineBackend` wraps any `RolloutEngine`: one lock orders generations and weight pushes, so a
push lands between two generations, never inside one, and every generation reports the weight
version that produced all of its completions. Requests that arrive while the engine is busy
wait in a queue; the next free request thread takes all of them and makes one engine call per
kind of sampling (the engine batches their prompts), so concurrent clients share engine calls
instead of taking turns. A seeded request runs in a call of its own: batched, the engine would
give it another seed than it asked for.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable
from typing import Any, Protocol, runtime_checkable

import torch

from composer_lightning.engines.base import (
    Completion,
    EngineContext,
    RolloutEngine,
    SamplingConfig,
)
from composer_lightning.engines.fingerprint import Fingerprint


@runtime_checkable
class ServeBackend(Protocol):
    """A policy that answers one prompt at a time.

    Attributes:
        tokenizer: the policy's tokenizer (its chat template renders requests once, server side).
        max_context: the most tokens (prompt + reply) the model takes; None: no limit checked.
    """

    tokenizer: Any
    max_context: int | None

    def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingConfig
    ) -> tuple[list[Completion], int]:
        """`n` completions of one prompt and the weight version that sampled all of them."""
        ...


@dataclasses.dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    n: int
    sampling: SamplingConfig
    done: bool = False
    result: tuple[list[Completion], int] | None = None
    error: BaseException | None = None


class EngineBackend:
    """A `ServeBackend` over a `RolloutEngine`, with weight pushes between generations.

    Args:
        engine: the engine; started here with `context` (a second start does nothing).
        tokenizer: the policy's tokenizer.
        context: where the engine runs; None: a single CPU process.
        max_context: the model's context length; None: read from the engine's model config
            (`max_position_embeddings`) when it has one.
        max_batch: the most requests one engine call takes (1: one request per call, each
            waiting for the engine in turn).
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        context: EngineContext | None = None,
        max_context: int | None = None,
        max_batch: int = 64,
    ) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.engine, self.tokenizer, self.max_batch = engine, tokenizer, max_batch
        self._lock = threading.Lock()  # the engine: one call or one push at a time
        self._queue_lock = threading.Lock()
        self._pending: list[_Request] = []
        self.engine_calls = 0  # how many engine calls served the requests so far
        engine.start(context or EngineContext())
        if max_context is None:
            config = getattr(getattr(engine, "model", None), "config", None)
            max_context = getattr(config, "max_position_embeddings", None)
        self.max_context = max_context

    def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingConfig
    ) -> tuple[list[Completion], int]:
        request = _Request(list(prompt_ids), n, sampling)
        with self._queue_lock:
            self._pending.append(request)
        while not request.done:
            with self._lock:  # whoever gets the engine serves every waiting request
                if request.done:
                    break
                with self._queue_lock:
                    batch = self._pending[: self.max_batch]
                    del self._pending[: self.max_batch]
                self._serve(batch)
        if request.error is not None:
            raise request.error
        assert request.result is not None
        return request.result

    def _serve(self, batch: list[_Request]) -> None:
        """One engine call per kind of request (same n and sampling, unseeded); each request
        gets its own completions and the version that sampled them."""
        groups: dict[Any, tuple[int, list[_Request]]] = {}
        for r in batch:
            # Greedy replies are all the same; HF's generate refuses n > 1 without sampling.
            n = 1 if r.sampling.temperature == 0 else r.n
            key = (n, repr(r.sampling)) if r.sampling.seed is None else id(r)
            groups.setdefault(key, (n, []))[1].append(r)
        for n, group in groups.values():
            try:
                outs = self.engine.generate([r.prompt_ids for r in group], n, group[0].sampling)
                self.engine_calls += 1
                version = self.engine.weight_version
            except BaseException as exc:  # every request of the call gets the engine's error
                for r in group:
                    r.error, r.done = exc, True
                continue
            for r, completions in zip(group, outs, strict=True):
                if n < r.n:
                    completions = [dataclasses.replace(completions[0]) for _ in range(r.n)]
                r.result, r.done = (list(completions), version), True

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Fingerprint | None:
        """Load new weights once the running generation (if any) is done; returns the engine's
        fingerprint of the weights it then holds, read before any generation runs (None: an
        engine that cannot read its weights back)."""
        with self._lock:
            self.engine.load_weights(weights, version)
            read = getattr(self.engine, "weight_fingerprint", None)
            return read() if callable(read) else None

    @property
    def weight_version(self) -> int:
        """The version the next generation samples with."""
        return self.engine.weight_version
