"""The library's own errors: what the command line reports in one line instead of a traceback."""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator

#: OS errors that mean the storage refused a write (full, read-only, no permission, failing).
STORAGE_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO, errno.EFBIG}
)


class ConfigError(ValueError):
    """Parts of the configuration that disagree, found once the trainer is set up (e.g. the
    module's and the sampling temperature); raised before any engine starts."""


class CheckpointWriteError(OSError):
    """A checkpoint that could not be written; the previous one at that path is unchanged.

    An `OSError` with the cause's `errno` and `strerror` and the checkpoint's path as
    `filename` (not the temporary file the error happened in).
    """

    def __init__(self, path: str | os.PathLike, error: OSError):
        super().__init__(error.errno, error.strerror or str(error), os.fspath(path))

    def __str__(self) -> str:
        code = f"[Errno {self.errno}] " if self.errno is not None else ""
        return (
            f"cannot write checkpoint {self.filename}: {code}{self.strerror} "
            "(the previous checkpoint there, if any, is unchanged)"
        )


def os_error(exc: BaseException | None) -> OSError | None:
    """The first `OSError` in `exc`'s chain (`chain`), e.g. the disk error inside torch.save's
    RuntimeError; None if there is none."""
    return next((e for e in chain(exc) if isinstance(e, OSError)), None)


def storage_error(exc: BaseException) -> str | None:
    """One line naming the path and the OS error, if a storage failure (`STORAGE_ERRNOS`) is in
    `exc`'s chain: a logger or a checkpoint that hit a full or read-only disk, however the
    library that met it wrapped it (Lightning's TensorBoard logger turns it into "you tried to
    log 3.0 which is currently not supported"); None if there is none."""
    error = os_error(exc)
    if error is None or error.errno not in STORAGE_ERRNOS:
        return None
    if isinstance(error, CheckpointWriteError):
        return str(error)
    verb = "access" if error.errno == errno.EACCES else "write"  # EACCES: maybe a read
    where = f" {os.fsdecode(error.filename)}" if error.filename is not None else ""
    return f"cannot {verb}{where}: [Errno {error.errno}] {error.strerror}"


def chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc`, then what it was raised from or while handling, and so on (the latest first);
    a torch.distributed.checkpoint exception is followed by its per-rank failures."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            for failure in failures.values():
                yield from chain(failure[0] if isinstance(failure, tuple) else failure)
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
