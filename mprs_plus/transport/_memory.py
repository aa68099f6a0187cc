"""Anonymous shared memory for the channels: a ``memfd`` mapped ``MAP_SHARED``.

Why memfd and not ``multiprocessing.shared_memory``
    A memfd has no name. It lives exactly as long as some process holds its file
    descriptor or a mapping of it, so the kernel frees it when the last holder exits,
    even after SIGKILL: nothing can leak in ``/dev/shm`` and nothing has to be unlinked.
    A named segment must be unlinked by somebody who is still alive, and in Python 3.11
    every process that *attaches* one registers it with the resource tracker too, which
    then warns about, or unlinks, a segment it does not own. Both kinds are shmem pages
    and cost the same to use; a memfd was also the quicker to create, map and first
    write (figures in docs/benchmarks.md, Design figures).

Handing it to another process
    fork: the child inherits the mapping. spawn / forkserver: the descriptor travels
    with the process's start arguments through multiprocessing's descriptor passing
    (``reduction.DupFd``) and the child maps it again.

Committing memory
    Nothing is committed when a channel opens: a page of the ring is committed by the
    first message that touches it (a fault plus zeroing), and stays until
    the channel is gone. The traffic of a consumer that keeps up stays in the first pages
    of the ring (see ``_ring.py``: an empty ring restarts at its beginning), so a channel
    at rest holds what its largest burst touched, not its capacity. Prefaulting each ring
    at creation made the first child wait for every channel's pages, and kept them
    committed at rest, for a saving below the noise of steady-state throughput (figures
    in docs/benchmarks.md, Start-up).
"""

from __future__ import annotations

import mmap
import os
from multiprocessing import reduction
from typing import Any

PAGE = mmap.PAGESIZE


class SharedRegion:
    """``[control page][data: data_size bytes][lend area: lend_size bytes]`` shared by the
    two ends of one channel.

    ``ctl`` is the control page as unsigned 64-bit words, ``data`` the data area (the
    ring) as bytes and ``words`` the same area as unsigned 64-bit words; ``lend`` is the
    lend area (``_lend.py``), whose pages are committed only when a buffer is first
    written there, and ``mapping`` the whole mapping, for views that must outlive an
    endpoint: ``release`` drops it (None from then on), so that views still alive are all
    that holds the mapping, and the last of them unmaps it and closes the mmap's own
    descriptor. Both endpoints of a channel in the creating process share one region; it
    is unmapped when the last of them lets go (``acquire`` / ``release`` count them).
    """

    def __init__(self, fd: int, data_size: int, lend_size: int = 0) -> None:
        self.fd: int | None = fd
        self.data_size = data_size
        self.lend_size = lend_size
        self.mapping: mmap.mmap | None = mmap.mmap(fd, PAGE + data_size + lend_size)
        whole = memoryview(self.mapping)
        self.ctl = whole[:PAGE].cast("Q")
        self.data = whole[PAGE : PAGE + data_size]
        self.words = self.data.cast("Q")
        self.lend = whole[PAGE + data_size :]
        self.lend_start = PAGE + data_size
        whole.release()
        self._users = 0
        # Called, in order, before the last user unmaps the region: a receiver that
        # page-locked its lend area unlocks it there (``_lend.py``).
        self.before_release: list[Any] = []

    @classmethod
    def create(cls, data_size: int, name: str, lend_size: int = 0) -> SharedRegion:
        """A fresh zeroed region, none of it committed yet; both sizes must be multiples
        of the page size."""
        if data_size <= 0 or data_size % PAGE or lend_size < 0 or lend_size % PAGE:
            raise ValueError(f"internal error: region sizes {data_size}, {lend_size} are not multiples of {PAGE}")
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, PAGE + data_size + lend_size)
            region = cls(fd, data_size, lend_size)
        except BaseException:
            os.close(fd)
            raise
        return region

    def acquire(self) -> SharedRegion:
        self._users += 1
        return self

    def release(self) -> None:
        """One user fewer; the last one unmaps the region and closes its descriptor."""
        self._users -= 1
        if self._users > 0:
            return
        hooks, self.before_release = self.before_release, []
        for hook in hooks:
            hook()
        for view in (self.words, self.data, self.lend, self.ctl):
            view.release()
        mapping, self.mapping = self.mapping, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                pass  # lent buffers are still alive: they alone hold the mapping now, the last to go unmaps it
            del mapping
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    def __reduce__(self) -> tuple[Any, ...]:
        if self.fd is None:
            raise RuntimeError("internal error: pickling a shared-memory region that was already released")
        return _attach, (reduction.DupFd(self.fd), self.data_size, self.lend_size)


def _attach(dup: Any, data_size: int, lend_size: int) -> SharedRegion:
    """Map a region received from another process (spawn / forkserver)."""
    return SharedRegion(dup.detach(), data_size, lend_size)
