"""What the serving app generates with: the `ServeBackend` protocol and `EngineBackend`.

`EngineBackend` wraps any `RolloutEngine`: one lock orders generations and weight pushes, so a
push lands between two generations, never inside one, and every generation reports the weight
version that produced all of its completions.
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


class EngineBackend:
    """A `ServeBackend` over a `RolloutEngine`, with weight pushes between generations.

    Args:
        engine: the engine; started here with `context` (a second start does nothing).
        tokenizer: the policy's tokenizer.
        context: where the engine runs; None: a single CPU process.
        max_context: the model's context length; None: read from the engine's model config
            (`max_position_embeddings`) when it has one.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer: Any,
        *,
        context: EngineContext | None = None,
        max_context: int | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self._lock = threading.Lock()
        engine.start(context or EngineContext())
        if max_context is None:
            config = getattr(getattr(engine, "model", None), "config", None)
            max_context = getattr(config, "max_position_embeddings", None)
        self.max_context = max_context

    def generate(
        self, prompt_ids: list[int], n: int, sampling: SamplingConfig
    ) -> tuple[list[Completion], int]:
        # Greedy replies are all the same; HF's generate refuses n > 1 without sampling.
        greedy = sampling.temperature == 0 and n > 1
        with self._lock:
            (completions,) = self.engine.generate([prompt_ids], 1 if greedy else n, sampling)
            version = self.engine.weight_version
        if greedy:
            completions = [dataclasses.replace(completions[0]) for _ in range(n)]
        return completions, version

    def push(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load new weights once the running generation (if any) is done."""
        with self._lock:
            self.engine.load_weights(weights, version)

    @property
    def weight_version(self) -> int:
        """The version the next generation samples with."""
        return self.engine.weight_version
