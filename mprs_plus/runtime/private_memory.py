"""A process's private memory: the pages it alone holds, copies of pages it once shared
with the main process included. Read rarely, since reading it walks the page tables.

    private   Private_Clean + Private_Dirty (+ Private_Hugetlb) of /proc/self/smaps_rollup
              (Linux), else psutil's USS (macOS); 0: unknown
    resident  Rss of the same file, else psutil's RSS

Why both: a forked worker starts with the main process's pages shared. Reading a Python
object there changes its reference count, and the kernel copies the page: the worker's
private memory grows while its resident memory does not (the page was resident already,
as a shared one). Memory the worker allocates for itself grows both. Growth of the first
beyond the second is the dataset being copied (``mprs_plus/stats.py`` names it).

A read of ``smaps_rollup`` costs about a millisecond per 50 MiB of the process (16 ms for
a 450 MiB one, measured on a loaded machine; 16 ms too for a worker forked from a process
holding 600 MB of rows, quiet), so a child reads it when its stream of the first epoch
ends (a short epoch is seen), then at most every ``EVERY`` seconds (less often where a
read takes longer: never more than 1% of its time), at an epoch's end included
(``stats.py``); never per item. Its growth is measured from its start:

* a child forked from a process that had loaded this module (fork; forkserver, where the
  server preloaded it) holds nothing of its own at its fork: every page it has is its
  parent's too. Its start is private 0 and its resident size then (``statm``, read as the
  fork returns in the child, before it unpickles anything), so no read of its page tables
  falls in its first items: both workers reading 16 ms at once, just after their first
  items, cost the first epoch of 600k rows 5-7% of its rate;
* any other (spawn, a Ray actor's thread) reads ``smaps_rollup`` once its lane has handed
  on its first item (never a delay of that item): what it unpickled is its own.

The main process reads only its resident size (``/proc/self/statm``: microseconds).
"""

from __future__ import annotations

import os

EVERY = 2.0  # seconds between two samples while items flow, at least
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_PRIVATE = (b"Private_Clean:", b"Private_Dirty:", b"Private_Hugetlb:")
_at_fork: int | None = None  # resident bytes as this process was forked (``resident_at_fork``)


def resident_at_fork() -> int | None:
    """This process's resident bytes as it was forked, where its parent had loaded this
    module: every page it had then was its parent's too, so its private memory then was
    nothing. None in a process that was not forked so (its start is sampled instead)."""
    return _at_fork


def _note_fork() -> None:
    """In every child forked from this process: ``statm`` only (microseconds), never
    psutil, whose import would cost each fork milliseconds where there is no ``statm``."""
    global _at_fork
    _at_fork = _statm_resident() or None  # None: no statm (not Linux), sampled after the first item


def sample() -> tuple[int, int]:
    """(private, resident) bytes of this process; (0, 0) where neither can be read."""
    try:
        with open("/proc/self/smaps_rollup", "rb") as f:
            text = f.read()
    except OSError:
        return _from_psutil()
    private = resident = 0
    for line in text.splitlines():
        if line.startswith(_PRIVATE):
            private += int(line.split()[1]) * 1024
        elif line.startswith(b"Rss:"):
            resident = int(line.split()[1]) * 1024
    return private, resident


def resident() -> int:
    """This process's resident bytes, cheaply; 0 where unknown."""
    found = _statm_resident()
    return found if found is not None else _from_psutil()[1]


def _statm_resident() -> int | None:
    """Resident bytes from ``/proc/self/statm`` (microseconds); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return None


def _from_psutil() -> tuple[int, int]:
    try:
        import psutil

        info = psutil.Process().memory_full_info()
        return int(getattr(info, "uss", 0)), int(info.rss)
    except Exception:  # no psutil, or a platform where it cannot tell: unknown, never an error
        return 0, 0


if hasattr(os, "register_at_fork"):
    # Read in the child as the fork returns, before it unpickles anything (a forkserver's
    # child is sent its dataset after its fork): growth is then measured from one moment.
    os.register_at_fork(after_in_child=_note_fork)
