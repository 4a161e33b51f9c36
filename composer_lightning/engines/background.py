"""`BackgroundEngine`: an engine in its own process that generates ahead of the trainer.

With a staleness bound k ≥ 1 the rollout callback asks for rollout batch m + k while the
trainer updates on batch m. The engine (any `RolloutEngine`: `VLLMEngine`, in-process inside
the child, or `HFEngine`) lives in a spawned child process, so generation and the update run at
the same time on different cores.

Versions are pinned, which keeps everything deterministic: batch m is generated with exactly
the weights of version m − k (version 0 for the first k batches), never a mix and never a newer
one, whatever the timing. The trainer publishes version v by copying its weights into slot
v mod (k + 1) of a ring of shared-memory buffers and then queueing a "publish" message; requests
travel on the same queue, after the publish of the version they need, so the child never waits
on a version and reloads from the ring just before the first request at a new version (between
two batches: a batch is never torn). A slot is overwritten (by version v + k + 1, after the
trainer took batch v + k) only once every batch that needs version v is generated, so k + 1 slots
are enough, and the trainer can read a version back from its slot (`version_weights`) while it
trains on a batch of that version, for the canary.
"""

from __future__ import annotations

import queue
import time
import traceback
from collections.abc import Hashable, Iterable
from dataclasses import asdict
from typing import Any

import torch
import torch.multiprocessing as mp

from composer_lightning.engines.base import Completion, EngineContext, RolloutEngine, SamplingConfig

__all__ = ["BackgroundEngine"]


def _serve(
    engine: RolloutEngine,
    context: EngineContext,
    ring: list[dict[str, torch.Tensor]],
    requests: Any,
    results: Any,
    threads: int,
    quiet: bool,
) -> None:
    """The child's loop: publishes and pinned-version generation requests, in order, until
    None or until the trainer's process is gone (killed)."""
    torch.set_num_threads(threads)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    parent = mp.parent_process()
    try:
        engine.start(context)
        published, loaded = -1, False
        while True:
            try:
                message = requests.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    return
                continue
            if message is None:
                return
            if message[0] == "publish":
                published = message[1]
                continue
            _, key, prompts, n, sampling, version = message
            if version > published:
                raise RuntimeError(f"version {version} requested before it was published")
            if not loaded or engine.weight_version != version:
                engine.load_weights(ring[version % len(ring)].items(), version)
                loaded = True
            start = time.perf_counter()
            outs = engine.generate(prompts, n, sampling)
            results.put((key, version, outs, time.perf_counter() - start))
    except BaseException:  # reported to the trainer, which raises it
        results.put(("error", -1, traceback.format_exc(), 0.0))


def _quiet() -> bool:
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return False
    return not hf_logging.is_progress_bar_enabled()


class BackgroundEngine:
    """Generate rollout batches ahead of the trainer in a child process, versions pinned.

    Args:
        engine: the engine to run in the child (configured, not started; it is pickled).
        context: what the child starts the engine with (its model path).
        named_weights: the policy's `(hf_name, tensor)` pairs: the shapes of the ring.
        max_staleness: k ≥ 1: batch m is generated with the weights of version m − k.
        threads: torch threads of the child.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        context: EngineContext,
        named_weights: Iterable[tuple[str, torch.Tensor]],
        max_staleness: int,
        threads: int = 1,
    ):
        if max_staleness < 1:
            raise ValueError(
                f"max_staleness must be >= 1 for a background engine, got {max_staleness}"
            )
        self.k = max_staleness
        shapes = [(n, t.detach()) for n, t in named_weights]
        self.ring = [
            {n: torch.empty_like(t, device="cpu").share_memory_() for n, t in shapes}
            for _ in range(self.k + 1)
        ]
        ctx = mp.get_context("spawn")
        self._requests, self._results = ctx.Queue(), ctx.Queue()
        self._process = ctx.Process(
            target=_serve,
            args=(engine, context, self.ring, self._requests, self._results, threads, _quiet()),
            daemon=True,
        )
        self._process.start()
        self._done: dict[Hashable, tuple[int, list[list[Completion]], float]] = {}
        self._asked: set[Hashable] = set()
        self.published: int | None = None  # the newest published version
        self.first_published: int | None = None  # the oldest this process published
        self._calls = 0

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    def version_of(self, index: int) -> int:
        """The weight version that generates rollout batch `index`."""
        return max(0, index - self.k)

    def publish(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy version `version` into its ring slot; later requests may use it."""
        slot = self.ring[version % len(self.ring)]
        with torch.no_grad():
            for name, tensor in weights:
                slot[name].copy_(tensor)
        self._requests.put(("publish", version))
        self.published = version
        if self.first_published is None:
            self.first_published = version

    def version_weights(self, version: int) -> dict[str, torch.Tensor] | None:
        """The published weights of `version` (shared memory, valid until version + k + 1 is
        published), or None when the ring no longer (or never, in this process) held it."""
        if self.published is None or self.first_published is None:
            return None
        if not max(self.first_published, self.published - self.k) <= version <= self.published:
            return None
        return self.ring[version % len(self.ring)]

    def ask(self, index: int, prompts: list[list[int]], n: int, sampling: SamplingConfig) -> None:
        """Queue rollout batch `index` (at version `version_of(index)`), once."""
        if index in self._asked or index in self._done:
            return
        self._asked.add(index)
        self._requests.put(("generate", index, prompts, n, sampling, self.version_of(index)))

    def take(self, key: Hashable) -> tuple[int, list[list[Completion]], float]:
        """Wait for request `key`; returns its version, completions and generation seconds."""
        while key not in self._done:
            try:
                got, version, outs, seconds = self._results.get(timeout=5.0)
            except queue.Empty:
                if not self._process.is_alive():
                    raise RuntimeError(
                        f"the background engine process died (exit code {self._process.exitcode})"
                    ) from None
                continue
            if got == "error":
                raise RuntimeError(f"the background engine failed:\n{outs}")
            self._done[got] = (version, outs, seconds)
        self._asked.discard(key)
        return self._done.pop(key)

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """A synchronous call with the newest published weights (held-out evaluation)."""
        if self.published is None:
            raise RuntimeError("BackgroundEngine.generate before any weights were published")
        self._calls += 1
        key = ("call", self._calls)
        self._requests.put(("generate", key, prompts, n, sampling, self.published))
        return self.take(key)[1]

    def pending_state(self) -> dict[int, tuple[int, list[list[dict[str, Any]]], float]]:
        """Every asked batch, generated (waits for them; they stay to be taken), as plain data
        for a checkpoint: `{index: (version, completions as dicts, seconds)}`."""
        for index in sorted(self._asked):
            self._done[index] = self.take(index)
        return {
            index: (version, [[asdict(c) for c in row] for row in outs], seconds)
            for index, (version, outs, seconds) in self._done.items()
            if isinstance(index, int)
        }

    def restore_state(
        self, state: dict[int, tuple[int, list[list[dict[str, Any]]], float]]
    ) -> None:
        """Batches generated before a resume (`pending_state`), to be taken as if asked."""
        for index, (version, outs, seconds) in state.items():
            completions = [[Completion(**c) for c in row] for row in outs]
            self._done[int(index)] = (version, completions, seconds)

    def close(self) -> None:
        if self._process.is_alive():
            self._requests.put(None)
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.kill()
