"""A fixed glibc mmap threshold, so that freed tensors go back to the OS.

glibc's malloc serves a request of at least `M_MMAP_THRESHOLD` bytes with a mapping of its own,
unmapped on free. The threshold starts at 128 KiB and by default rises to the size of every
mapped block that is freed, up to 32 MiB. After a training step has freed one 16 MiB tensor,
every tensor up to 16 MiB comes from the heap instead. A step makes and frees many tensors of
that size in an order the heap cannot undo (a chunk's `[n, V]` logits, activations, gradients),
so freed memory stays in the process and the resident size only grows.

Measured with `bench/memory.py` (one step, every head, 16 x 160 tokens, Qwen's 151,936-token
vocabulary, whole process, 1 thread). At hidden 896, the peak is 7.04 GiB with glibc's default
and 4.24 GiB with the threshold fixed at 1 MiB. At hidden 64 with 16 MiB chunks, it is 3.05 GiB
against 0.87 GiB.

Setting the threshold (mallopt(3)) turns the rise off. Larger tensors then cost a fresh mapping
each time: the kernel's page faults, a few percent of a step. The trainer sets it once per
process, at setup. It leaves the threshold alone where the user has set it
(`MALLOC_MMAP_THRESHOLD_`) and where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys

#: mallopt(3)'s parameter number for the mmap threshold (glibc's malloc.h)
M_MMAP_THRESHOLD = -3
#: bytes: a `[chunk, V]` logits tensor or a `[V, H]` gradient is far above this; small tensors
#: stay on the heap, where they are cheap
THRESHOLD = 1 << 20

_done = False


def fix_mmap_threshold(nbytes: int = THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `nbytes`, once per process.

    Returns whether this call set it. It does nothing when it has already run, when the user
    set `MALLOC_MMAP_THRESHOLD_`, or when the process's C library is not glibc.
    """
    global _done
    if _done or "MALLOC_MMAP_THRESHOLD_" in os.environ or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
    except OSError:
        return False
    # glibc only: musl's mallopt ignores every parameter
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = mallopt(M_MMAP_THRESHOLD, int(nbytes)) == 1
    return _done
