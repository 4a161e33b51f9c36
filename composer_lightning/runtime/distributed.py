"""What every rank must agree on each step: errors and metrics.

Under DDP/FSDP2 a rank that raises while the others enter the next collective leaves them
waiting for the collective timeout (30 minutes by default). So each step has fixed points where
every rank reports whether it failed: if any did, all raise the same `RankError` there, in the
same step. Metrics are reduced at the same points: means weighted over ranks (a mean over all
ranks' samples), counts summed, maxima maxed.

Both ride on one `all_gather_object` of a small dict per point (a few hundred bytes): unlike a
packed all-reduce it stays correct when ranks log different metric names (a head's metrics may
depend on its data), and unlike one collective per metric it costs one round trip. With one
process nothing is communicated.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

import torch.distributed as dist
from torch import Tensor

from composer_lightning.runtime.errors import ConfigError

Kind = Literal["mean", "sum", "max"]


class RankError(RuntimeError):
    """An error on one or more ranks, raised on every rank in the same step."""


def world() -> tuple[int, int]:
    """`(rank, world size)` of the default process group; `(0, 1)` without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def full(t: Tensor) -> Tensor:
    """The whole tensor of a DTensor (a collective), the tensor itself otherwise."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def data_parallel(trainer: object) -> tuple[int, int]:
    """`(rank, size)` along the trainer's data-parallel dimension: the ranks that see different
    data. The `data_parallel` dimension of a `ModelParallelStrategy` mesh (ranks that shard one
    model replica see the same data), else the global rank and world size."""
    try:
        mesh = getattr(getattr(trainer, "strategy", None), "device_mesh", None)
    except RuntimeError:  # ModelParallelStrategy before its processes exist
        mesh = None
    if mesh is not None and "data_parallel" in (mesh.mesh_dim_names or ()):
        dp = mesh["data_parallel"]
        return dp.get_local_rank(), dp.size()
    return getattr(trainer, "global_rank", 0), getattr(trainer, "world_size", 1)


@dataclass
class StepMetrics:
    """One step's metrics on this rank, each with how it is reduced over ranks."""

    _values: dict[str, tuple[Kind, float, float]] = field(default_factory=dict)

    def mean(self, name: str, value: float | Tensor, weight: float = 1.0) -> None:
        """A mean; over ranks each rank's value counts `weight` times (e.g. its sample count)."""
        self._values[name] = ("mean", float(value), float(weight))

    def sum(self, name: str, value: float | Tensor) -> None:
        """A count: summed over ranks."""
        self._values[name] = ("sum", float(value), 1.0)

    def max(self, name: str, value: float | Tensor) -> None:
        """A maximum over ranks."""
        self._values[name] = ("max", float(value), 1.0)

    def update(self, values: Mapping[str, float | Tensor], kind: Kind = "mean") -> None:
        for name, value in values.items():
            getattr(self, kind)(name, value)

    def include(self, other: StepMetrics) -> None:
        """`other`'s metrics, with their reductions, added to these (same names: `other`'s)."""
        self._values.update(other._values)

    def local(self) -> dict[str, float]:
        return {name: v for name, (_, v, _) in self._values.items()}


def agree(
    metrics: StepMetrics | None = None, error: BaseException | None = None
) -> dict[str, float]:
    """Every rank's error and metrics of this point of the step, reduced; call on every rank.

    Returns:
        The metrics reduced over ranks (a name only some ranks logged is reduced over those).

    Raises:
        RankError: on every rank, if any rank passed an `error`; the message names each failed
            rank and its one-line error. With one process the error itself is re-raised.
    """
    metrics = metrics or StepMetrics()
    rank, size = world()
    if size == 1:
        if error is not None:
            raise error
        return metrics.local()
    mine = {"error": None if error is None else _one_line(error), "metrics": metrics._values}
    gathered: list[Any] = [None] * size  # each rank's `mine` once gathered
    dist.all_gather_object(gathered, mine)
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"] is not None]
    if failed:
        message = "; ".join(f"rank {r}: {e}" for r, e in failed)
        raise RankError(message) from error
    return _reduce([g["metrics"] for g in gathered])


def per_rank(obj: object) -> list[object]:
    """Every rank's `obj`, in rank order; call on every rank (a collective).

    Lightning writes a checkpoint's non-tensor parts (callback states, `on_save_checkpoint`'s
    additions) from rank 0 alone, so state that differs between ranks (replay buffers, RNG
    states, batches generated ahead) is saved as this list and each rank restores its own
    entry (`own`)."""
    rank, size = world()
    if size == 1:
        return [obj]
    gathered: list[object] = [None] * size
    dist.all_gather_object(gathered, obj)
    return gathered


def most(value: int) -> int:
    """The largest of every rank's `value` (this rank's alone in one process); call on every
    rank (a collective)."""
    return max(cast(list[int], per_rank(int(value))))


def shared_seed() -> int:
    """A fresh random seed, the same on every rank (rank 0's draw); call on every rank."""
    import os

    return int(cast(list[int], per_rank(int.from_bytes(os.urandom(6), "little")))[0])


def own(saved: list[object]) -> object:
    """This rank's entry of a `per_rank` list saved in a checkpoint.

    Raises:
        ConfigError: (a ValueError) the checkpoint was written by a different number of ranks.
    """
    rank, size = world()
    problem = rank_mismatch(saved, size)
    if problem:
        raise ConfigError(problem)
    return saved[rank]


def rank_mismatch(saved: list[object] | None, world_size: int) -> str | None:
    """What `own` refuses: a `per_rank` list of another length than `world_size` (None: no
    per-rank state, nothing to refuse)."""
    if saved is None or len(saved) == world_size:
        return None
    return (
        f"the checkpoint holds per-rank state of {len(saved)} ranks, this run has {world_size}: "
        "resume with the same number of ranks"
    )


def _reduce(per_rank: list[dict[str, tuple[Kind, float, float]]]) -> dict[str, float]:
    acc: dict[str, list[tuple[Kind, float, float]]] = defaultdict(list)
    for values in per_rank:
        for name, entry in values.items():
            acc[name].append(entry)
    out = {}
    for name, entries in acc.items():
        kind = entries[0][0]
        if kind == "sum":
            out[name] = sum(v for _, v, _ in entries)
        elif kind == "max":
            out[name] = max(v for _, v, _ in entries)
        else:
            weight = sum(w for _, _, w in entries)
            out[name] = (
                sum(v * w for _, v, w in entries) / weight
                if weight > 0
                else sum(v for _, v, _ in entries) / len(entries)
            )
    return out


def _one_line(error: BaseException) -> str:
    return f"{type(error).__name__}: " + " ".join(str(error).split())
