"""The rollout-engine contract: sampling settings, completions, and the `RolloutEngine` protocol.

Engines take prompt **token ids** and return sampled token ids with the log-prob of each
sampled token under the *sampling* distribution (logits / temperature, after top-k/top-p), so
the trainer can compare them to its own log-probs (the canary, see DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

import torch


@dataclass
class SamplingConfig:
    """How an engine samples completions.

    Attributes:
        temperature: logits are divided by it before sampling; must be > 0.
        top_p: nucleus mass in (0, 1]; keep 1.0 for training rollouts.
        top_k: keep the k most likely tokens; None (or 0) is off; keep off for training.
        max_tokens: the most tokens generated per completion (≥ 1).
        stop_token_ids: generation stops after any of these (the stop token is kept).
        seed: a seed for reproducible sampling; None draws fresh randomness.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be None, 0 (off) or positive, got {self.top_k!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]

    @property
    def top_k_or_none(self) -> int | None:
        """`top_k` with 0 normalised to None (off)."""
        return self.top_k or None


@dataclass
class Completion:
    """One sampled completion of one prompt.

    Attributes:
        token_ids: generated token ids, ending with the stop token when one was hit.
        logprobs: per generated token, its log-prob under the sampling distribution.
        finish_reason: "stop" (a stop token was generated) or "length" (max_tokens reached).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout callback needs from an inference engine."""

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample `n` completions of each prompt; `result[i]` holds those of `prompts[i]`."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights (HF names), set `weight_version`, reset the cache."""
        ...

    def reset_cache(self) -> None:
        """Drop cached prefixes (KV) computed with older weights."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine currently samples with."""
        ...


def check_prompts(prompts: list[list[int]], n: int) -> None:
    """Raise ValueError on an empty prompt or a bad `n` (shared by the engines)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; engines need at least one prompt token")


def resolve_seed(sampling: SamplingConfig, rng: torch.Generator) -> int:
    """The call's seed: `sampling.seed`, or a fresh draw from the engine's own generator."""
    if sampling.seed is not None:
        return sampling.seed
    return int(torch.randint(0, 2**62, (1,), generator=rng))
