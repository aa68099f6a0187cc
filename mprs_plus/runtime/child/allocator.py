"""A worker's C allocator told where large allocations go, so that it never falls into
mapping and unmapping fresh pages for every sample.

glibc's ``malloc`` serves a request of ``M_MMAP_THRESHOLD`` bytes or more with its own
``mmap``, and gives the top of its heap back to the kernel once ``M_TRIM_THRESHOLD`` bytes
of it are free. Left alone, both thresholds move: each ``free`` of a mapped block raises
them, up to 32 MiB and 64 MiB. Where they settle depends on what the process happened to
free first, and a process can settle where every 1 MiB tensor a dataset makes is a fresh
mapping (or a fresh stretch of heap, trimmed again at its ``free``): every page of every
sample is then a page fault. Measured with 8,000 samples of 1 MiB in batches of 8, one
worker of two spent 300-330 us of CPU per sample against the other's 135-150 us, in every
run, and the loop ran at the slow worker's pace (about one fresh process in three was slow
in a longer series, with ten times the page faults of a fast one).

Each process this engine starts therefore pins both thresholds where glibc's own
adjustment ends at most: 32 MiB and 64 MiB. The worker then reuses the heap for anything
under 32 MiB from its first sample on, as a process that has run a while usually does
already. The memory this costs: a worker may keep up to 64 MiB of freed heap at its top
rather than return it at once, which glibc's own adjustment may do too; nothing is kept
that glibc would not have kept at its own maximum, and no allocation is made larger. The
user's main process is left as it is: its allocator is the user's to set, and the batches
it receives live in the channels' shared memory, not in its heap.

Only where glibc is the C library (``mallopt`` has these meanings there); elsewhere
(musl, macOS) nothing is done. An environment that sets ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` keeps its own choice.
"""

from __future__ import annotations

import os
from typing import Any

# mallopt's parameter numbers (glibc's malloc.h).
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit: where its own adjustment stops
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD  # as glibc pairs them when it raises the first

_pinned = False


def pinned() -> bool:
    """Whether this process's thresholds were pinned by ``pin_thresholds`` (tests, stats)."""
    return _pinned


def pin_thresholds(libc: Any = None, environ: Any = None) -> bool:
    """Pin glibc's mmap and trim thresholds in this process (see the module); True when
    they were. ``libc`` and ``environ`` stand in for the C library and ``os.environ``
    (tests). Never raises: a worker is never failed over its allocator."""
    global _pinned
    environ = os.environ if environ is None else environ
    try:
        if libc is None:
            if not _is_glibc():
                return False
            import ctypes

            libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        done = True
        if "MALLOC_MMAP_THRESHOLD_" not in environ:
            done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and done
        if "MALLOC_TRIM_THRESHOLD_" not in environ:
            done = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)) and done
    except Exception:
        return False
    _pinned = done
    return done


def _is_glibc() -> bool:
    try:
        return (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc")
    except (AttributeError, ValueError, OSError):
        return False
