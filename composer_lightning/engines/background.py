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

The child only ever samples from a version published in its own process (a resumed run has
published none of the versions before it): it refuses any other, so unwritten ring memory is
never sampled from. It reports the fingerprint of the weights it loaded with every batch
(`engines/fingerprint.py`). It dies with the trainer: the kernel kills it when its parent exits
(`PR_SET_PDEATHSIG`, Linux), and elsewhere it notices within a second. One process per trainer
rank: with several ranks each rank has its own child and ring, generating ahead while its rank
trains.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Hashable, Iterable
from dataclasses import asdict
from typing import Any

import torch
import torch.multiprocessing as mp

from composer_lightning.engines.base import Completion, EngineContext, RolloutEngine, SamplingConfig
from composer_lightning.engines.fingerprint import Fingerprint

__all__ = ["BackgroundEngine", "EngineTimeout"]

#: What a generated batch is: its version, completions, generation seconds and the engine's
#: fingerprint of that version's weights (None when the engine cannot read them back).
Generated = tuple[int, list[list[Completion]], float, Fingerprint | None]

#: The trainer's distributed environment, which must not reach an engine that runs alone.
_LAUNCHER_ENV: tuple[str, ...] = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "NODE_RANK",
)
_LAUNCHER_ENV += ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")


class EngineTimeout(RuntimeError):
    """The engine process did not answer within the timeout: it hangs."""


def _die_with_parent() -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:  # no libc by that name: the 1 s liveness poll below remains
        pass


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
    _die_with_parent()
    parent = mp.parent_process()
    if parent is not None and not parent.is_alive():  # died before the prctl took effect
        return
    for name in _LAUNCHER_ENV:  # the engine runs alone here, not in the trainer's group
        os.environ.pop(name, None)
    torch.set_num_threads(threads)
    if quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    try:
        engine.start(context)
        slots: dict[int, int] = {}  # ring slot → the version published into it here
        loaded: int | None = None
        fingerprint: Fingerprint | None = None
        while True:
            try:
                message = requests.get(timeout=1.0)
            except queue.Empty:
                if parent is not None and not parent.is_alive():
                    results.cancel_join_thread()
                    return
                continue
            if message is None:
                # Unread results must not keep this process alive at exit (the queue's feeder
                # thread would block on a full pipe nobody reads any more).
                results.cancel_join_thread()
                return
            if message[0] == "publish":
                slots[message[1] % len(ring)] = message[1]
                continue
            _, key, prompts, n, sampling, version = message
            if slots.get(version % len(ring)) != version:
                raise RuntimeError(
                    f"version {version} was requested but is not published in this engine "
                    f"process (its ring holds {sorted(slots.values())}): refusing to sample "
                    "from weights that were never written"
                )
            if loaded != version:
                engine.load_weights(ring[version % len(ring)].items(), version)
                loaded = version
                read = getattr(engine, "weight_fingerprint", None)
                fingerprint = read() if callable(read) else None
            start = time.perf_counter()
            outs = engine.generate(prompts, n, sampling)
            results.put((key, version, outs, time.perf_counter() - start, fingerprint))
    except BaseException:  # reported to the trainer, which raises it: flushed before exit
        results.put(("error", -1, traceback.format_exc(), 0.0, None))
        results.close()
        results.join_thread()


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
        context: what the child starts the engine with (its model path and device; it runs
            alone, as rank 0 of 1).
        named_weights: the policy's `(hf_name, tensor)` pairs: the shapes of the ring.
        max_staleness: k ≥ 1: batch m is generated with the weights of version m − k.
        threads: torch threads of the child.
        timeout: seconds `take` waits for a batch before it declares the engine hung
            (`EngineTimeout`) and stops the child; None waits as long as the child lives.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        context: EngineContext,
        named_weights: Iterable[tuple[str, torch.Tensor]],
        max_staleness: int,
        threads: int = 1,
        timeout: float | None = None,
    ):
        if max_staleness < 1:
            raise ValueError(
                f"max_staleness must be >= 1 for a background engine, got {max_staleness}"
            )
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        self.k, self.timeout = max_staleness, timeout
        shapes = [(n, t.detach()) for n, t in named_weights]
        # Zeros, not empty: no slot ever holds leftover memory (the child refuses unpublished
        # versions anyway).
        self.ring = [
            {n: torch.zeros_like(t, device="cpu").share_memory_() for n, t in shapes}
            for _ in range(self.k + 1)
        ]
        ctx = mp.get_context("spawn")
        self._requests: Any = ctx.Queue()  # each queue None once closed
        self._results: Any = ctx.Queue()
        self._requests.cancel_join_thread()  # exiting never waits on a dead child's pipe
        self._process = ctx.Process(
            target=_serve,
            args=(engine, context, self.ring, self._requests, self._results, threads, _quiet()),
            daemon=True,
        )
        self._process.start()
        self._done: dict[Hashable, Generated] = {}
        self._asked: set[Hashable] = set()
        self.published: int | None = None  # the newest published version
        self.first_published: int | None = None  # the oldest this process published
        self._calls = 0
        # Episodes generated ahead take their turns' results from threads of their own while
        # held-out evaluation takes its own: one reader of the queue at a time.
        self._reading = threading.Lock()

    @property
    def tensor_parallel_size(self) -> int:
        return 1

    @property
    def pid(self) -> int | None:
        return self._process.pid

    def version_of(self, index: int) -> int:
        """The weight version that generates rollout batch `index`: `index − k`, but never one
        this process did not publish (after a resume: the version it started from)."""
        return max(self.first_published or 0, index - self.k)

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
        version = self.version_of(index)
        if self.published is None or version > self.published:
            raise RuntimeError(
                f"batch {index} needs version {version}, but the newest published is "
                f"{self.published}"
            )
        self._asked.add(index)
        self.request(index, prompts, n, sampling, version)

    def request(
        self,
        key: Hashable,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        version: int,
    ) -> None:
        """Queue a generation at `version` under `key`, to be taken with `take(key)`; the
        child refuses a version that was not published in it."""
        requests = self._requests
        if requests is None:
            raise RuntimeError(f"the background engine was closed (asked for {key!r})")
        requests.put(("generate", key, prompts, n, sampling, version))

    def take(self, key: Hashable) -> Generated:
        """Wait for request `key`; returns its version, completions, generation seconds and the
        engine's fingerprint of that version. Safe from several threads: each takes its own
        key, whichever of them reads it off the queue."""
        waited = 0.0
        while True:
            with self._reading:
                if key in self._done:
                    self._asked.discard(key)
                    return self._done.pop(key)
                if self._results is None:
                    raise RuntimeError(f"the background engine was closed (waiting for {key!r})")
                try:
                    got, version, outs, seconds, fingerprint = self._results.get(timeout=0.2)
                except queue.Empty:
                    got = None
                if got == "error":
                    raise RuntimeError(f"the background engine failed:\n{outs}")
                if got is not None:
                    self._done[got] = (version, outs, seconds, fingerprint)
                    continue
            waited += 0.2
            if not self._process.is_alive():
                raise RuntimeError(
                    f"the background engine process died (exit code {self._process.exitcode})"
                )
            if self.timeout is not None and waited >= self.timeout:
                self.close()
                raise EngineTimeout(
                    f"the background engine returned no batch in {self.timeout:g} s "
                    f"(waiting for {key!r}): it hangs; stopped it (raise the rollout "
                    "callback's engine_timeout if generation is that slow)"
                )

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """A synchronous call with the newest published weights (held-out evaluation)."""
        if self.published is None:
            raise RuntimeError("BackgroundEngine.generate before any weights were published")
        self._calls += 1
        key = ("call", self._calls)
        self.request(key, prompts, n, sampling, self.published)
        return self.take(key)[1]

    def pending_state(self) -> dict[int, tuple[Any, ...]]:
        """Every asked batch, generated (waits for them; they stay to be taken), as plain data
        for a checkpoint: `{index: (version, completions as dicts, seconds, fingerprint)}`."""
        for index in sorted(i for i in self._asked if isinstance(i, int)):
            self._done[index] = self.take(index)
        return {
            index: (version, [[asdict(c) for c in row] for row in outs], seconds, fingerprint)
            for index, (version, outs, seconds, fingerprint) in self._done.items()
            if isinstance(index, int)
        }

    def restore_state(self, state: dict[int, tuple[Any, ...]]) -> None:
        """Batches generated before a resume (`pending_state`), to be taken as if asked."""
        for index, (version, outs, seconds, *rest) in state.items():
            completions = [[Completion(**c) for c in row] for row in outs]
            self._done[int(index)] = (version, completions, seconds, rest[0] if rest else None)

    def close(self) -> None:
        """Stop the child at once (batches not taken are dropped) and release the ring and
        the queues; the engine cannot be used afterwards."""
        if self._process.is_alive() and self._requests is not None:
            self._requests.put(None)
            self._process.join(timeout=0.5)  # an idle child exits on the message
            if self._process.is_alive():  # busy generating: nothing of it is wanted any more
                self._process.kill()
                self._process.join(timeout=5)
        with self._reading:  # a thread taking a result finishes its read first
            if self._requests is None:
                return
            for q in (self._requests, self._results):
                q.close()
                q.cancel_join_thread()  # a request the child never read must not hold up exit
            # Dropped, so that their named semaphores (/dev/shm/sem.mp-*) are unlinked: at once,
            # or for the requests' write lock and counter, when its feeder thread has flushed
            # and exited.
            self._requests = self._results = None
            self.ring = []
