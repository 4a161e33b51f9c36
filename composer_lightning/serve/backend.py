"""What the serving app generates with: the `ServeBackend` protocol, `EngineBackend` (any
engine) and `StepBackend` (an engine that schedules continuously: vLLM's).

`EngineBackend` wraps any `RolloutEngine`: one lock orders generations and weight pushes, so a
push lands between two generations, never inside one, and every generation reports the weight
version that produced all of its completions. Requests that arrive while the engine is busy
wait in a queue; the next free request thread takes all of them and makes one engine call per
kind of sampling (the engine batches their prompts), so concurrent clients share engine calls
instead of taking turns. A seeded request runs in a call of its own: batched, the engine would
give it another seed than it asked for. With an engine that reports tokens as it samples them
(`TokenStreamEngine`: `HFEngine`), `open` streams each request's tokens during the call.

`StepBackend` wraps a `StepEngine` (`VLLMEngine`): a request joins vLLM's running batch at the
next engine step instead of waiting for the current call to end (continuous batching), its
tokens reach the app as each step generates them (`ReplyStream`, for `stream: true`), and a
client that leaves has its request aborted. A push waits for the running requests to finish
while new ones wait for the push, so every reply is sampled by one weight version. Each request
keeps its own seed, as `generate` gives it.

Why this file is long: the two backends are the two ways `serve` shares one engine among
concurrent clients and weight pushes; their locking rules are the file's subject, side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import itertools
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Any, Literal, Protocol, cast, runtime_checkable

import torch

from composer_lightning.engines.base import (
    Completion,
    Delta,
    EngineContext,
    RolloutEngine,
    SamplingConfig,
    StepEngine,
    TokenStreamEngine,
)
from composer_lightning.engines.fingerprint import Fingerprint


@runtime_checkable
class ServeBackend(Protocol):
    """A policy that answers one prompt at a time (`generate`, called from many threads at once).
    A backend that streams also has `open(prompt_ids, n, sampling) -> ReplyStream` and
    `cancel(stream)` (`StepBackend`); the app uses them when present.

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


def engine_max_context(engine: Any) -> int | None:
    """The most tokens (prompt + reply) a started engine takes: a transformers model's
    `max_position_embeddings`, vLLM's `max_model_len`; None when it says neither."""
    config = getattr(getattr(engine, "model", None), "config", None)
    max_positions = getattr(config, "max_position_embeddings", None)
    if max_positions is not None:
        return int(max_positions)
    vllm_config = getattr(
        getattr(getattr(engine, "llm", None), "llm_engine", None), "model_config", None
    )
    length = getattr(vllm_config, "max_model_len", None)
    return None if length is None else int(length)


@dataclasses.dataclass(eq=False)
class _Request:
    prompt_ids: list[int]
    n: int
    sampling: SamplingConfig
    done: bool = False
    result: tuple[list[Completion], int] | None = None
    error: BaseException | None = None
    stream: ReplyStream | None = None


class EngineBackend:
    """A `ServeBackend` over a `RolloutEngine`, with weight pushes between generations.

    Args:
        engine: the engine; started here with `context` (a second start does nothing).
        tokenizer: the policy's tokenizer.
        context: where the engine runs; None: a single CPU process.
        max_context: the model's context length; None: the engine's (`engine_max_context`).
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
        self._ids = itertools.count()
        engine.start(context or EngineContext())
        self.max_context = engine_max_context(engine) if max_context is None else max_context

    def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingConfig
    ) -> tuple[list[Completion], int]:
        return self._wait(_Request(list(prompt_ids), n, sampling))

    def open(self, prompt_ids: list[int], n: int, sampling: SamplingConfig) -> ReplyStream:
        """Start a request and return its `ReplyStream`: with an engine that reports tokens as
        it samples them (`TokenStreamEngine`: transformers'), each step's tokens as they come,
        else every token once the engine call ends. It joins the gathered calls as `generate`
        does (on a thread of its own)."""
        stream = ReplyStream(f"req-{next(self._ids)}", list(prompt_ids), n, sampling)
        request = _Request(stream.prompt_ids, n, sampling, stream=stream)
        threading.Thread(target=self._stream, args=(request,), daemon=True).start()
        return stream

    def cancel(self, stream: ReplyStream) -> None:
        """A client that left: its reply is no longer read. transformers' `generate` cannot
        drop one row of a running batch, so the call runs to its end; nothing is recorded."""
        stream.cancelled = True

    def _stream(self, request: _Request) -> None:
        stream = request.stream
        assert stream is not None
        try:
            completions, version = self._wait(request)
        except BaseException as exc:
            stream._feed([], exc)
            return
        if not stream.done:  # an engine that does not report tokens: all of them at once
            stream.version = version
            stream._feed(
                [
                    Delta(stream.request, j, c.token_ids, c.logprobs, c.finish_reason)
                    for j, c in enumerate(completions)
                ]
            )

    def _wait(self, request: _Request) -> tuple[list[Completion], int]:
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
            n = 1 if r.sampling.greedy else r.n
            key = (n, repr(r.sampling)) if r.sampling.seed is None else id(r)
            groups.setdefault(key, (n, []))[1].append(r)
        for n, group in groups.values():
            version = self.engine.weight_version  # no push lands during the call
            for r in group:
                if r.stream is not None:
                    r.stream.version = version
            prompts, sampling = [r.prompt_ids for r in group], group[0].sampling
            try:
                if isinstance(self.engine, TokenStreamEngine) and any(r.stream for r in group):
                    outs = self.engine.generate_stream(
                        prompts, n, sampling, functools.partial(_to_stream, group, n)
                    )
                else:
                    outs = self.engine.generate(prompts, n, sampling)
                self.engine_calls += 1
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


def _to_stream(group: list[_Request], n: int, i: int, delta: Delta) -> None:
    """Hand a delta of prompt `i` of an engine call to its request's stream (a greedy call of
    one sample answers every choice of the request with it)."""
    stream = group[i].stream
    if stream is None:
        return
    choices = range(group[i].n) if n < group[i].n else [delta.index]
    stream._feed([dataclasses.replace(delta, request=stream.request, index=k) for k in choices])


class ReplyStream:
    """One request's samples as a `StepBackend` generates them: read `deltas()` (async, as
    tokens come) or `result()` (blocking, once all are done).

    Attributes:
        version: the weight version that samples every token of it (set when it joins the
            engine's batch; None before).
    """

    def __init__(self, request: str, prompt_ids: list[int], n: int, sampling: SamplingConfig):
        self.request, self.prompt_ids, self.n, self.sampling = request, prompt_ids, n, sampling
        self.version: int | None = None
        self.cancelled = False
        self._tokens: list[list[int]] = [[] for _ in range(n)]
        self._logprobs: list[list[float]] = [[] for _ in range(n)]
        self._finish: list[Literal["stop", "length"] | None] = [None] * n
        self._error: BaseException | None = None
        self._new: list[Delta] = []
        self._cond = threading.Condition()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []

    @property
    def done(self) -> bool:
        return self._error is not None or all(f is not None for f in self._finish)

    def _feed(self, deltas: list[Delta], error: BaseException | None = None) -> None:
        """Called by the engine's thread: new tokens, or the error that ends the request."""
        with self._cond:
            for d in deltas:
                self._tokens[d.index] += d.token_ids
                self._logprobs[d.index] += d.logprobs
                self._finish[d.index] = d.finish_reason
            self._new += deltas
            if error is not None:
                self._error = error
            self._cond.notify_all()
            waiters = list(self._waiters)
        for loop, event in waiters:
            loop.call_soon_threadsafe(event.set)

    async def deltas(self) -> AsyncIterator[list[Delta]]:
        """The deltas as the engine reports them, a step's at a time; raises the engine's
        error."""
        waiter = (asyncio.get_running_loop(), asyncio.Event())
        with self._cond:
            self._waiters.append(waiter)
        try:
            while True:
                with self._cond:
                    waiter[1].clear()
                    new, self._new, done = self._new, [], self.done
                if new:
                    yield new
                if done:
                    break
                await waiter[1].wait()
        finally:
            with self._cond:
                self._waiters.remove(waiter)
        if self._error is not None:
            raise self._error

    def result(self, timeout: float | None = None) -> tuple[list[Completion], int]:
        """Every sample, once done, and the version that sampled them (blocks)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.done, timeout):
                raise TimeoutError(f"request {self.request} not done within {timeout} s")
        return self.completions()

    def completions(self) -> tuple[list[Completion], int]:
        """The samples so far (all of them once `done`) and their version."""
        if self._error is not None:
            raise self._error
        assert self.version is not None
        return [
            Completion(list(t), list(lp), f or "length")
            for t, lp, f in zip(self._tokens, self._logprobs, self._finish, strict=True)
        ], self.version


class _StepRolloutEngine(StepEngine, RolloutEngine, Protocol):
    """What `StepBackend` drives: a `StepEngine` that is a `RolloutEngine` too (vLLM's)."""


class StepBackend:
    """A `ServeBackend` over a `StepEngine` (vLLM's continuous scheduler): requests join the
    running batch between engine steps, and their tokens stream as they are generated.

    One thread owns the engine: it adds the requests that arrived, runs a step, hands each
    request its new tokens, and repeats while any request runs. A weight push waits until the
    running requests finish (new ones wait meanwhile), loads the weights, then lets the waiting
    ones in: every reply is sampled by one weight version, the one its `version` names, so its
    log-probs are those of a known policy (pushing between two steps of a running reply would
    mix two).

    Args:
        engine: a started or startable `StepEngine` (`VLLMEngine`).
        tokenizer: the policy's tokenizer.
        context: where the engine runs; None: a single CPU process.
        max_context: the model's context length; None: the engine's (`engine_max_context`).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        context: EngineContext | None = None,
        max_context: int | None = None,
    ) -> None:
        if not isinstance(engine, StepEngine):
            raise TypeError(
                f"StepBackend needs an engine with add/step/abort (vLLM's); got "
                f"{type(engine).__name__} (serve it with EngineBackend)"
            )
        self.engine = cast(_StepRolloutEngine, engine)  # (only StepEngine is checkable)
        self.tokenizer = tokenizer
        self.engine.start(context or EngineContext())
        self.max_context = engine_max_context(engine) if max_context is None else max_context
        self.engine_steps = 0  # steps run so far
        self._cond = threading.Condition()
        self._waiting: list[ReplyStream] = []
        self._running: dict[str, ReplyStream] = {}
        self._pushes = 0  # pushes waiting for the running requests to finish
        self._busy = False  # the engine thread is adding, stepping or aborting
        self._closed = False
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="composer-engine", daemon=True)
        self._thread.start()

    def open(self, prompt_ids: list[int], n: int, sampling: SamplingConfig) -> ReplyStream:
        """Queue a request; its samples stream from the returned `ReplyStream`."""
        stream = ReplyStream(f"r{next(self._ids)}", list(prompt_ids), n, sampling)
        with self._cond:
            if self._closed:
                raise RuntimeError("the backend is closed")
            self._waiting.append(stream)
            self._cond.notify_all()
        return stream

    def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingConfig
    ) -> tuple[list[Completion], int]:
        return self.open(prompt_ids, n, sampling).result()

    def cancel(self, stream: ReplyStream) -> None:
        """Stop generating `stream` (its client left); the engine's thread aborts it."""
        with self._cond:
            stream.cancelled = True
            self._cond.notify_all()

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> Fingerprint | None:
        """Load new weights once the running requests are done (requests arriving meanwhile
        wait); returns the engine's fingerprint of them, read before any generation runs."""
        with self._cond:
            self._pushes += 1
            try:
                self._cond.wait_for(lambda: not self._running and not self._busy)
                self.engine.load_weights(weights, version)
                read = getattr(self.engine, "weight_fingerprint", None)
                return read() if callable(read) else None
            finally:
                self._pushes -= 1
                self._cond.notify_all()

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def close(self) -> None:
        """Stop the engine's thread (requests still running get an error)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=60)

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        self._closed
                        or bool(self._running)
                        or (bool(self._waiting) and not self._pushes)
                    )
                )
                if self._closed:
                    for stream in [*self._waiting, *self._running.values()]:
                        stream._feed([], RuntimeError("the backend closed"))
                    return
                admit = [] if self._pushes else self._waiting
                if admit:
                    self._waiting = []
                running = dict(self._running)
                self._busy = True  # the engine is this thread's until the end of the round
            for stream in admit:  # the engine is this thread's alone from here
                try:
                    if not stream.cancelled:
                        self.engine.add(
                            stream.request, stream.prompt_ids, stream.n, stream.sampling
                        )
                        stream.version = self.engine.weight_version
                        running[stream.request] = stream
                except Exception as exc:  # a bad request fails alone
                    stream._feed([], exc)
            for request, stream in list(running.items()):
                if stream.cancelled:
                    del running[request]
                    stream._feed([], ConnectionAbortedError(f"request {request} cancelled"))
                    with contextlib.suppress(Exception):  # one that just finished is gone
                        self.engine.abort(request, stream.n)
            if running:
                try:
                    deltas = self.engine.step()
                    self.engine_steps += 1
                except Exception as exc:  # the step's error is every running request's
                    for stream in running.values():
                        stream._feed([], exc)
                    running.clear()
                    deltas = []
                by_request: dict[str, list[Delta]] = {}
                for d in deltas:
                    by_request.setdefault(d.request, []).append(d)
                for request, ds in by_request.items():
                    if request in running:
                        running[request]._feed(ds)
                for request in [r for r, s in running.items() if s.done]:
                    del running[request]
            with self._cond:
                self._running, self._busy = running, False
                self._cond.notify_all()
