"""The SPDL contender: ``spdl.pipeline.iterate_in_subprocess`` with a ``SharedMemorySegmentPool``.

    main process                                   one subprocess (SPDL's design)
    for item in iterable  <-- envelope (queue) --  item = fn(i); large arrays and tensors
      item views segment k                         written into pool segment k (one copy)
      (segment k reclaimed when the item dies)

SPDL runs one iterable in ONE subprocess, whatever the suite's --workers says; with a pool,
arrays and tensors arrive as views of shared memory, so the main process copies nothing.
The suite imports this module only to run this contender, so spdl stays optional.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Iterator
from multiprocessing import shared_memory
from typing import Any

from spdl.pipeline import SharedMemorySegmentPool, iterate_in_subprocess

from .harness import Loader, SegmentPool, Settings

SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux, the suite's platform


class SpdlLoader(Loader):
    """SPDL's iterable over ``dataset``, with ``pool`` as its arena, or its queue alone.

    Everything is SPDL's default apart from the start method and two things any user of
    it would set the same way: the pool (sized per workload) and a subprocess initializer
    that gives torch one thread (see ``_one_torch_thread``).

    ``close()`` does now what SPDL does when its iterable is collected (ask the subprocess
    to stop, then terminate, then kill, each bounded; close and unlink the pool), so that
    the time falls inside the measurement and nothing is left for the next contender.
    """

    def __init__(self, dataset: Any, settings: Settings, pool: SegmentPool | None) -> None:
        arena = _QuietPool(pool.segment_bytes, pool.count) if pool is not None else None
        # What must be gone from /dev/shm once closed (checked by close()).
        self.segment_names = segment_names(arena) if arena is not None else []
        self._iterator: Any = None
        try:
            iterable = iterate_in_subprocess(
                functools.partial(_itself, dataset),
                mp_context=settings.context,
                arena=arena,
                initializer=_one_torch_thread,
            )
        except BaseException as exc:
            if arena is not None:  # SPDL owns the pool only once it has returned an iterable
                arena.close()
                arena.unlink()
            if arena is not None and "SemLock created in a fork context" in str(exc):
                raise RuntimeError(
                    f"SPDL's SharedMemorySegmentPool makes its condition variable in multiprocessing's "
                    f"default context, which a {settings.context} subprocess cannot share: SPDL's pool "
                    f"runs only with the default start method ({exc})"
                ) from exc
            raise
        super().__init__(iterable, self._shutdown)

    def __iter__(self) -> Iterator[Any]:
        self._iterator = iter(self._iterable)
        return self._iterator

    def _shutdown(self) -> None:
        if self._iterator is not None:
            self._iterator.close()  # leaves the generator; the subprocess lives until shutdown
            self._iterator = None
        shutdown = getattr(self._iterable, "_shutdown", None)
        try:
            if shutdown is not None:
                shutdown()  # what the iterable's finalizer runs when it is collected
        finally:  # even when the harness cut a hung shutdown short
            self._iterable = ()
            left = [name for name in self.segment_names if os.path.exists(os.path.join(SHM_DIR, name))]
            unlink_segments(left)  # so that nothing is left for the next contender
        if left:  # reported beside the figures (see harness.close_within)
            raise RuntimeError(f"SPDL's shutdown left {len(left)} segment(s) of its pool in {SHM_DIR}; removed")


class _QuietPool(SharedMemorySegmentPool):
    """SPDL's pool, with an unlink that keeps multiprocessing's resource tracker quiet.

    Before Python 3.13 every attach to a segment registers it with the tracker, and SPDL
    unregisters right after attaching so that only the owner unlinks; its unlink then
    attaches once more and unregisters twice, and the tracker prints a KeyError per
    segment (the segments are removed all the same). A plain attach and unlink registers
    and unregisters once each. Same segments, same moment, no noise.
    """

    def unlink(self) -> None:
        unlink_segments(segment_names(self))


def unlink_segments(names: list[str]) -> None:
    """Remove shared-memory segments by name: attach, unlink, close (those already gone skipped)."""
    for name in names:
        try:
            segment = shared_memory.SharedMemory(name=name)
        except FileNotFoundError:
            continue
        try:
            segment.unlink()
        finally:
            segment.close()


def segment_names(pool: SharedMemorySegmentPool) -> list[str]:
    """The names of the pool's shared-memory segments (its pickled state carries them)."""
    state = pool.__getstate__()
    return [state["ctrl_name"], *state["seg_names"]]


def _itself(obj: Any) -> Any:
    # iterate_in_subprocess calls a factory in its subprocess; the dataset is that iterable.
    return obj


def _one_torch_thread() -> None:
    """SPDL's subprocess initializer: one torch thread, as torch's DataLoader sets in its
    workers. A child forked after the main process ran torch's OpenMP pool (any large
    tensor op) otherwise hangs in its first parallel torch call."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
