"""Checkpoints written atomically: a failed write leaves the previous checkpoint as it was and
stops every rank with one `CheckpointWriteError` naming the path and the OS error.

Lightning's `TorchCheckpointIO` writes through a temporary file in the system's temporary
directory and moves it into place: across filesystems that move is a copy, so a full disk left a
truncated `last.ckpt` under its final name. `AtomicCheckpointIO` writes beside the destination
(`atomic.write_file`); it is the `CheckpointIO` plugin for `Trainer(plugins=[...])`.

Two cases are not a `CheckpointIO`'s to handle, so `atomic_saves` wraps the strategy's
`save_checkpoint` as well:
- FSDP2's sharded checkpoints (`ModelParallelStrategy`, the default `save_distributed_checkpoint`)
  are directories that every rank writes through torch.distributed.checkpoint: they are written
  into `.<name>.tmp` beside the destination and swapped in (`atomic.swap_dir`) once every rank
  has written its part.
- With several ranks only rank 0 writes a file checkpoint, and only it would see the error
  while the others wait in the next collective: every save ends with every rank's outcome
  agreed (`distributed.agree`), so all raise in the same save.

`AtomicCheckpoints` (added by `ComposerModule`) installs both at setup; the plugin only where
the trainer has Lightning's default one (a `CheckpointIO` given to the trainer is kept). Not
covered: Lightning's `FSDPStrategy` and DeepSpeed directories (GPU strategies this library does
not use; `ModelParallelStrategy` is its FSDP2), and remote (`s3://...`) paths.
"""

from __future__ import annotations

import errno
import functools
import os
from pathlib import Path
from typing import Any, TypeGuard

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy
from torch.distributed.checkpoint.api import CheckpointException

from composer_lightning.runtime import atomic
from composer_lightning.runtime.distributed import agree
from composer_lightning.runtime.errors import CheckpointWriteError, os_error


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose local writes are atomic: temporary file beside the destination,
    fsync, rename. Remote paths (`s3://...`) are written as Lightning writes them."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save `checkpoint` at `path`.

        Raises:
            CheckpointWriteError: the write failed; the file at `path` is unchanged.
        """
        if storage_options is not None or not _local(path):
            # remote storage is written as Lightning writes it; storage_options: its TypeError
            return super().save_checkpoint(checkpoint, path, storage_options)
        try:
            atomic.write_file(path, lambda f: torch.save(checkpoint, f))
        except Exception as exc:
            raise _write_error(path, exc) from exc


def atomic_saves(strategy: Strategy) -> None:
    """Make `strategy.save_checkpoint` atomic for sharded directories and agreed over ranks
    (see the module's docstring); calling it again changes nothing."""
    save = strategy.save_checkpoint
    if getattr(save, "atomic", False):
        return

    @functools.wraps(save)
    def save_checkpoint(
        checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        if _sharded(strategy):
            return _save_sharded(strategy, save, checkpoint, Path(strategy.broadcast(filepath)))
        error = None
        try:
            save(checkpoint, filepath, storage_options)
        except Exception as exc:  # raised on every rank below, not on this one alone
            error = exc
        agree(error=error)  # one process: the error itself

    save_checkpoint.atomic = True  # type: ignore[attr-defined]
    strategy.save_checkpoint = save_checkpoint  # type: ignore[method-assign]


def _save_sharded(
    strategy: ModelParallelStrategy, save: Any, checkpoint: dict[str, Any], path: Path
) -> None:
    """The sharded directory written as `.<name>.tmp` beside `path`, then swapped in; each
    step's outcome is agreed over ranks before the next starts."""
    tmp = path.with_name(f".{path.name}.tmp")  # the same on every rank
    first = strategy.global_rank == 0

    def prepare() -> None:
        atomic.remove(tmp)  # left by a save that was killed
        tmp.parent.mkdir(parents=True, exist_ok=True)

    def publish() -> None:
        atomic.fsync_tree(tmp)  # rank 0's meta.pt: DCP fsyncs the shards, torch.save does not
        atomic.swap_dir(tmp, path)

    for action, here in (
        (prepare, first),
        (lambda: save(checkpoint, tmp), True),
        (publish, first),
    ):
        error = None
        if here:
            try:
                action()
            except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
                error = _write_error(path, exc)
        try:
            agree(error=error)
        except BaseException:
            if first:  # every rank is done with `tmp`: drop what was written of it
                atomic.remove(tmp)
            raise


def _local(path: Any) -> bool:
    protocol = get_filesystem(path).protocol
    return "file" in ((protocol,) if isinstance(protocol, str) else protocol)


def _sharded(strategy: Strategy) -> TypeGuard[ModelParallelStrategy]:
    distributed = getattr(strategy, "_save_distributed_checkpoint", False)  # no public name
    return isinstance(strategy, ModelParallelStrategy) and distributed


def _write_error(path: Any, exc: BaseException) -> BaseException:
    """`exc` as a `CheckpointWriteError` of `path` when an OS error is behind it."""
    if isinstance(exc, CheckpointWriteError):
        return exc
    error = os_error(exc) or _full(os.path.dirname(os.path.abspath(path)))
    return exc if error is None else CheckpointWriteError(os.fspath(path), error)


def _full(directory: str) -> OSError | None:
    """ENOSPC if `directory`'s filesystem has (almost) no room left. torch.distributed.checkpoint
    gathers each rank's failure to every rank by pickling it, which drops the disk error that
    torch.save's RuntimeError ("unexpected pos") was raised while handling; this tells it again."""
    try:
        stat = os.statvfs(directory)
    except OSError:
        return None
    if stat.f_bavail * stat.f_frsize >= 1 << 20:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
