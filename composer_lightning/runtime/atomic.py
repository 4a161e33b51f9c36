"""Writing files and directories so that a reader sees the old version or the new one, whole.

A file is written to a temporary file in its own directory (a rename never crosses a
filesystem there, so it is never a copy), fsynced, renamed over the destination, and the
directory fsynced, so that the rename itself survives a power cut. A directory is built beside
its destination and swapped in with one `renameat2(RENAME_EXCHANGE)` (Linux); where the
filesystem or the C library lacks it, the old directory is renamed aside first, which leaves a
moment where the destination is missing but its previous version is whole beside it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import uuid
from collections.abc import Callable
from typing import BinaryIO

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def write_file(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
    """Call `write` on a temporary file beside `path`, then put it in place atomically.

    Raises:
        OSError: from the write, the fsync or the rename; `path` is then unchanged and the
            temporary file removed.
    """
    path = os.path.abspath(os.fspath(path))
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    # os.open with mode 0o666 (not mkstemp's 0o600): the file gets the permissions the umask
    # gives any new file, as the destination would have
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def swap_dir(new: str | os.PathLike, path: str | os.PathLike) -> None:
    """Put the directory `new` at `path` (a directory, a file, or nothing) and delete what was
    there before."""
    new, path = os.fspath(new), os.fspath(path)
    if not os.path.lexists(path):
        os.rename(new, path)
    else:
        try:
            _exchange(new, path)  # `new` now holds the previous version
        except (AttributeError, NotImplementedError):  # no renameat2, or not on this filesystem
            aside = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.old")
            remove(aside)
            os.rename(path, aside)
            os.rename(new, path)
            new = aside
        remove(new)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def fsync_tree(directory: str | os.PathLike[str]) -> None:
    """fsync every file under `directory` and every directory in it, itself included."""
    for root, _, files in os.walk(directory):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(root)


def fsync_dir(directory: str | os.PathLike) -> None:
    """fsync a directory (its entries: a rename in it is then durable)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # filesystems that cannot fsync a directory say EINVAL
            raise
    finally:
        os.close(fd)


def remove(path: str | os.PathLike) -> None:
    """Remove a file or a directory tree if it exists."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _exchange(a: str, b: str) -> None:
    renameat2 = ctypes.CDLL(None, use_errno=True).renameat2  # AttributeError: glibc < 2.28
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        raise NotImplementedError(os.strerror(code))
    raise OSError(code, os.strerror(code), b)
