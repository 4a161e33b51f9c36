"""The rollout-engine contract: sampling settings, completions, and the `RolloutEngine` protocol.

Engines take prompt **token ids** and return sampled token ids with the log-prob of each
sampled token under the *sampling* distribution (logits / temperature, after penalties, min-p
and top-k/top-p), so the trainer can compare them to its own log-probs (the canary, see
docs/design.md, "Rollout timing and the canary"), or weight by them when the sampler is shaped
(`SamplingConfig.shaped`).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, overload, runtime_checkable

import torch

#: a temperature below this samples greedily, as vLLM's engine does (its `_SAMPLING_EPS`): logits
#: divided by a smaller one overflow float32, and sampling from the NaN that leaves fails
GREEDY_BELOW = 1e-5


@dataclass
class SamplingConfig:
    """How an engine samples completions.

    Attributes:
        temperature: logits are divided by it before sampling, > 0; 0 (or any temperature
            below `GREEDY_BELOW`) means greedy decoding (held-out evaluation; training rollouts
            must sample).
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens; None (or 0) is off.
        min_p: drop tokens less likely than `min_p` × the most likely one's probability, in
            [0, 1); 0 is off.
        repetition_penalty: > 0; 1 is off; > 1 discourages tokens already in the prompt or
            the completion (vLLM's and transformers' penalty).
        generation_kwargs: further sampling options, passed as they are to vLLM's
            `SamplingParams` and transformers' `generate` (TRL's `generation_kwargs`), e.g.
            `{presence_penalty: 0.5}` for vLLM; an option the engine does not know is its
            error.
        max_tokens: the most tokens generated per completion (≥ 1).
        stop_token_ids: generation stops after any of these (the stop token is kept), and
            after any EOS id the model declares.
        stop: texts that end a completion: generation stops after any token whose text holds
            one of them (the token is kept), e.g. `["\n"]` for a base model, which does not
            stop on its own. Engines read token ids only: the rollout callback adds these
            tokens to `stop_token_ids` from the data's tokenizer (`stop_text_ids`); a text
            that spans two tokens is not caught, one character always is.
        seed: a seed for reproducible sampling; None draws fresh randomness.
        ignore_eos: do not stop at the model's EOS ids (fixed-length benchmarks).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    max_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    generation_kwargs: dict[str, Any] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0: greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"top_k must be None, 0 (off) or positive, got {self.top_k!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1) (0: off), got {self.min_p!r}")
        if not self.repetition_penalty > 0:
            raise ValueError(
                f"repetition_penalty must be > 0 (1: off), got {self.repetition_penalty!r}"
            )
        if not isinstance(self.generation_kwargs, dict):
            raise ValueError(
                f"generation_kwargs must be a mapping of option names to values, got "
                f"{self.generation_kwargs!r}"
            )
        self.stop_token_ids = [int(t) for t in self.stop_token_ids]
        if isinstance(self.stop, str) or not all(isinstance(t, str) and t for t in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)

    @property
    def greedy(self) -> bool:
        """Whether this decodes greedily: a temperature of 0, or below `GREEDY_BELOW`."""
        return self.temperature < GREEDY_BELOW

    @property
    def shaped(self) -> bool:
        """Whether the sampler draws from more than `softmax(logits / temperature)` (top-p,
        top-k, min-p, a penalty, further options): its log-probs are then those of a behaviour
        policy the trainer's log-probs are not."""
        return bool(
            self.top_p != 1
            or self.top_k_or_none
            or self.min_p
            or self.repetition_penalty != 1
            or self.generation_kwargs
        )

    def stops(self, eos_token_ids: list[int]) -> list[int]:
        """The ids that end a completion: `stop_token_ids` plus the model's EOS ids."""
        return sorted(set(self.stop_token_ids) | (set() if self.ignore_eos else set(eos_token_ids)))

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
        text: the decoded text, when the engine returns text (a served model); None otherwise.
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"]
    text: str | None = None


@dataclass(frozen=True)
class EngineContext:
    """Where an engine runs, known only once the trainer's process group and device exist.

    Attributes:
        rank: global rank. world_size: number of ranks. local_rank: rank on this node.
        device: the rank's device ("cpu", "cuda:1").
        model_path: the policy's directory, for an engine configured without one.
        tokens_needed: the most tokens (prompt + completion, or an episode's budget) one
            sequence of the run needs, as the rollout callback's setup checks found it
            (`runtime/inputs.tokens_needed`); an engine that sizes its context to the run
            (`VLLMEngine` without `max_model_len`) sizes it from this. None: unknown.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    model_path: str | None = None
    tokens_needed: int | None = None

    @classmethod
    def current(
        cls, model_path: str | None = None, tokens_needed: int | None = None
    ) -> EngineContext:
        """This process's place in the default process group (one process without one)."""
        import os

        import torch.distributed as dist

        rank, size = (
            (dist.get_rank(), dist.get_world_size())
            if (dist.is_available() and dist.is_initialized())
            else (0, 1)
        )
        local = int(os.environ.get("LOCAL_RANK", rank if size > 1 else 0))
        device = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() else "cpu"
        return cls(rank, size, local, device, model_path, tokens_needed)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the rollout callback needs from an inference engine.

    An engine is configured when the config is parsed (cheap, validated) and started with
    `start` once the trainer's process group and device exist (the rollout callback's `setup`);
    `generate` and `load_weights` start it with `EngineContext.current()` if nobody did.
    """

    def start(self, context: EngineContext | None = None) -> None:
        """Build the engine (load the model) for this rank; a second call does nothing."""
        ...

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """Sample `n` completions of each prompt; `result[i]` holds those of `prompts[i]`.

        Generation stops at the model's own EOS ids (its `generation_config`) and at
        `sampling.stop_token_ids`.
        """
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights (HF names), set `weight_version`, reset the cache.

        `weights` is consumed one tensor at a time and never held whole.
        """
        ...

    def reset_cache(self) -> None:
        """Drop cached prefixes (KV) computed with older weights."""
        ...

    def sleep(self) -> None:
        """Free what the engine holds on the device while the trainer updates (or nothing)."""
        ...

    def wake_up(self) -> None:
        """Undo `sleep` before the next push or generation (or nothing)."""
        ...

    @property
    def weight_version(self) -> int:
        """The version of the weights the engine currently samples with."""
        ...

    @property
    def tensor_parallel_size(self) -> int:
        """Ranks that generate together (1: every rank generates alone)."""
        ...


@dataclass
class Delta:
    """What one engine step added to one sample of a request (`StepEngine.step`).

    Attributes:
        request: the id the request was added with. index: which of its n samples.
        token_ids, logprobs: the tokens this step generated and their sampling log-probs.
        finish_reason: None while the sample goes on; "stop" or "length" on its last delta.
    """

    request: str
    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: Literal["stop", "length"] | None = None


@runtime_checkable
class StepEngine(Protocol):
    """An engine that schedules requests continuously: requests join and leave the running
    batch between steps, and each step reports the tokens it generated (vLLM's `LLMEngine`).
    `serve/backend.py`'s `StepBackend` serves through it, streaming as tokens come.

    A request added with `add` samples exactly as `generate([prompt], n, sampling)` would:
    the same seeds, the same stop ids, the same log-probs. The engine is not thread-safe:
    one thread calls `add`, `step` and `abort`, and never beside `load_weights`.
    """

    def add(self, request: str, prompt: list[int], n: int, sampling: SamplingConfig) -> None:
        """Queue `n` samples of `prompt` under the id `request`."""
        ...

    def step(self) -> list[Delta]:
        """Run one scheduling step of every queued or running request; what each generated."""
        ...

    def abort(self, request: str, n: int) -> None:
        """Stop the `n` samples of `request` (a client that left); nothing more is reported."""
        ...


@runtime_checkable
class TokenStreamEngine(Protocol):
    """An engine whose `generate` can report each token as it samples it (transformers'
    `generate`, through a streamer). `serve`'s `EngineBackend` streams through it.

    `generate_stream(prompts, n, sampling, on_delta)` returns what `generate` returns for the
    same seed and calls `on_delta(i, delta)` for prompt `i` after every sampling step, in
    order: each sample's tokens and log-probs exactly as its final `Completion` holds them,
    its last delta with the finish reason.
    """

    def generate_stream(
        self,
        prompts: list[list[int]],
        n: int,
        sampling: SamplingConfig,
        on_delta: Callable[[int, Delta], None],
    ) -> list[list[Completion]]:
        """`generate`, reporting each step's tokens to `on_delta` as they are sampled."""
        ...


@runtime_checkable
class ChatEngine(Protocol):
    """A model that answers chat messages with text (a served judge, e.g. `OpenAIEngine`)."""

    def chat(
        self, conversations: list[list[dict[str, str]]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]:
        """`n` replies to each conversation, as completions with `.text` and `.finish_reason`."""
        ...


def model_eos_ids(model_path: str | None = None, generation_config: object = None) -> list[int]:
    """The EOS ids a model declares (`generation_config.json`, else `config.json`).

    Qwen and Llama-3 instruct models declare several; generation must stop at any of them.
    """
    cfg = generation_config
    if cfg is None and model_path is not None:
        from transformers import AutoConfig, GenerationConfig

        try:
            cfg = GenerationConfig.from_pretrained(model_path)
        except OSError:  # no generation_config.json
            cfg = AutoConfig.from_pretrained(model_path)
    eos = getattr(cfg, "eos_token_id", None)
    if eos is None:
        return []
    return sorted({int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])})


def stop_text_ids(tokenizer: Any, texts: list[str]) -> list[int]:
    """The ids of the tokens whose text holds any of `texts` (`SamplingConfig.stop`): each
    token decoded alone, as the engine will sample it (every token holding a newline, for
    `["\n"]`: Gemma's `\n`, `\n\n`, ...)."""
    if not texts:
        return []
    decoded = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [i for i, text in enumerate(decoded) if any(t in text for t in texts)]


@overload
def resolve_model_dir(model_path: str, owner: str) -> str: ...
@overload
def resolve_model_dir(model_path: None, owner: str) -> None: ...
def resolve_model_dir(model_path: str | None, owner: str) -> str | None:
    """The local directory of an engine's `model_path` (a directory or a hub id, resolved by
    `models/hub.resolve_model`); a configuration error naming it when there is none."""
    if model_path is None:
        return None
    from composer_lightning.models.hub import resolve_model

    return resolve_model(model_path, what=owner)


def check_prompts(prompts: list[list[int]], n: int) -> None:
    """Raise ValueError on an empty prompt or a bad `n` (shared by the engines)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n!r}")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty; engines need at least one prompt token")


def resolve_seed(sampling: SamplingConfig, rng: random.Random) -> int:
    """The call's seed: `sampling.seed`, or a fresh draw from the engine's own generator."""
    if sampling.seed is not None:
        return sampling.seed
    return rng.getrandbits(62)
