"""Anonymous shared memory for the channels: a ``memfd`` mapped ``MAP_SHARED``, or where
there is none (macOS, say) an unlinked POSIX shared-memory object or an unlinked file.

Why memfd and not ``multiprocessing.shared_memory``
    A memfd has no name. It lives exactly as long as some process holds its file
    descriptor or a mapping of it, so the kernel frees it when the last holder exits,
    even after SIGKILL: nothing can leak in ``/dev/shm`` and nothing has to be unlinked.
    A named segment must be unlinked by somebody who is still alive, and in Python 3.11
    every process that *attaches* one registers it with the resource tracker too, which
    then warns about, or unlinks, a segment it does not own. Both kinds are shmem pages
    and cost the same to use; a memfd was also the quicker to create, map and first
    write (figures in docs/benchmarks-history.md, Design figures).

Where there is no memfd
    ``anonymous_file`` makes the next best thing with no name either: a POSIX
    shared-memory object (``shm_open``) unlinked at once, else a file in the temporary
    directory unlinked at once. Either lives, like a memfd, exactly as long as a
    descriptor or a mapping of it, so nothing is left behind even after SIGKILL. The
    environment variable ``MPRS_PLUS_LEND_MEMORY`` (``memfd``, ``shm``, ``file``, or
    ``auto``, the default: the first that works) forces one of them, to try or measure a
    fallback on a system that has the better one; it is read when a region is made.

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
    in docs/benchmarks-history.md, Start-up).
"""

from __future__ import annotations

import mmap
import os
import secrets
import tempfile
from multiprocessing import reduction
from typing import Any

try:
    import _posixshmem
except ImportError:  # pragma: no cover - a Python built without it (not POSIX)
    _posixshmem = None  # type: ignore[assignment]

PAGE = mmap.PAGESIZE
MEMORY_KINDS = ("memfd", "shm", "file")


def memory_kinds() -> list[str]:
    """The kinds of anonymous shared memory to try, best first, as ``MPRS_PLUS_LEND_MEMORY``
    allows (see the module's docstring) and this system offers."""
    choice = os.environ.get("MPRS_PLUS_LEND_MEMORY", "auto").strip().lower() or "auto"
    if choice != "auto" and choice not in MEMORY_KINDS:
        raise ValueError(f"MPRS_PLUS_LEND_MEMORY must be 'memfd', 'shm', 'file' or 'auto', not {choice!r}")
    offered = [
        kind
        for kind, present in zip(MEMORY_KINDS, (hasattr(os, "memfd_create"), _posixshmem is not None, True))
        if present
    ]
    if choice == "auto":
        return offered
    if choice not in offered:
        raise RuntimeError(f"MPRS_PLUS_LEND_MEMORY={choice}: this system has no {choice}; it offers {', '.join(offered)}")
    return [choice]


def anonymous_file(name: str, size: int) -> tuple[int, str]:
    """A descriptor of ``size`` zeroed bytes of shared memory that no name reaches (closed
    on exec), and its kind: a memfd, else an unlinked POSIX shared-memory object, else an
    unlinked temporary file (see the module's docstring)."""
    error: OSError | None = None
    for kind in memory_kinds():
        try:
            fd = _open_anonymous(kind, name)
        except OSError as exc:
            error = exc
            continue
        try:
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            raise
        return fd, kind
    raise OSError(f"no shared memory could be made for a channel: {error}") from error


def _open_anonymous(kind: str, name: str) -> int:
    if kind == "memfd":
        return os.memfd_create(name, os.MFD_CLOEXEC)
    if kind == "shm":
        path = f"/mprs_{os.getpid():x}_{secrets.token_hex(5)}"  # macOS allows 31 characters
        fd = _posixshmem.shm_open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        _posixshmem.shm_unlink(path)  # no name from now on: nothing can be left behind
        os.set_inheritable(fd, False)
        return fd
    fd, path = tempfile.mkstemp(prefix="mprs_plus-")
    os.unlink(path)
    return fd


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
        of the page size (the data area may be empty: the pipe transport has none)."""
        if data_size < 0 or data_size % PAGE or lend_size < 0 or lend_size % PAGE:
            raise ValueError(f"internal error: region sizes {data_size}, {lend_size} are not multiples of {PAGE}")
        fd, _kind = anonymous_file(name, PAGE + data_size + lend_size)
        try:
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
