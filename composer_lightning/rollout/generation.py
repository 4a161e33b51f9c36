"""How the rollout callback calls its engine: sampling seeds and tensor-parallel groups
(generation ahead of the trainer is `ahead.py`'s)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Protocol

from composer_lightning.engines.base import Completion, RolloutEngine, SamplingConfig
from composer_lightning.runtime.distributed import world


def sampling_seed(
    base: int,
    step: int,
    rank: int,
    world_size: int,
    tensor_parallel_size: int,
    prompts: int,
    group_size: int,
) -> int:
    """The seed of one generate call: never repeated across steps or ranks.

    Engines seed prompt i, sample j of a call with `seed + i * G + j`, so a call uses the seeds
    `[seed, seed + prompts * G)`; the call of tensor-parallel group c at step s starts at
    `base + (s * groups + c) * prompts * G`, so no two calls' ranges overlap, and the ranks of
    one group (which must sample identically) share it.
    """
    groups = world_size // tensor_parallel_size
    return base + (step * groups + rank // tensor_parallel_size) * max(prompts, 1) * group_size


class Generator(Protocol):
    """What `generate_in_group` uses of an engine (a `RolloutEngine`, or `BackgroundEngine`)."""

    @property
    def tensor_parallel_size(self) -> int: ...

    def generate(
        self, prompts: list[list[int]], n: int, sampling: SamplingConfig
    ) -> list[list[Completion]]: ...


def generate_in_group(
    engine: Generator,
    prompts: list[list[int]],
    n: int,
    sampling: SamplingConfig,
    tp_group: Any = None,
) -> list[list[Completion]]:
    """This rank's completions of `prompts`; with tensor parallelism the ranks of a group
    generate their gathered prompts together (as TRL's colocate mode does; vLLM needs the same
    requests on every rank of a group) and each keeps its own. The group samples with the
    seed of its first rank."""
    tp = engine.tensor_parallel_size
    if tp == 1:
        return engine.generate(prompts, n=n, sampling=sampling)
    import torch.distributed as dist

    parts: list[Any] = [None] * tp  # each rank's (prompts, seed) once gathered
    dist.all_gather_object(parts, (prompts, sampling.seed), group=tp_group)
    offset = sum(len(p) for p, _ in parts[: world()[0] % tp])
    everything = [p for part, _ in parts for p in part]
    outs = engine.generate(everything, n=n, sampling=replace(sampling, seed=parts[0][1]))
    return outs[offset : offset + len(prompts)]


def generate_on_rank(
    engine: RolloutEngine,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    step: int,
    base_seed: int,
    group_size: int,
    tp_group: Any = None,
) -> list[list[Completion]]:
    """This rank's completions of prompt batch `step` (`generate_in_group`), seeded by
    `sampling_seed`."""
    rank, size = world()
    tp = engine.tensor_parallel_size
    total = len(prompts) * tp  # every rank of a group holds as many prompts
    seed = sampling_seed(base_seed, step, rank, size, tp, total, group_size)
    return generate_in_group(engine, prompts, group_size, replace(sampling, seed=seed), tp_group)


def tensor_parallel_group(world_size: int, rank: int, tp: int) -> Any:
    """This rank's group of `tp` consecutive ranks (every rank takes part in forming every
    group, as `new_group` requires); None without tensor parallelism."""
    if tp == 1:
        return None
    import torch.distributed as dist

    mine = None
    for first in range(0, world_size, tp):
        group = dist.new_group(list(range(first, first + tp)))
        if first <= rank < first + tp:
            mine = group
    return mine


def heldout_seed(
    base_seed: int, batch_idx: int, prompts: int, tp: int, samples: int, turns: int = 1
) -> int:
    """The seed of held-out batch `batch_idx` (`prompts` on this rank, episodes of up to
    `turns` turns, each turn a seed range of its own): the training seeds' scheme, shifted, so
    that any tensor parallelism samples alike."""
    rank, size = world()
    return sampling_seed(
        base_seed + 10**9, batch_idx, rank, size, tp, prompts * tp * turns, samples
    )
