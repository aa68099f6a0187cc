"""How a channel endpoint sleeps and is woken: spin briefly, then block on an OS pipe.

    producer                               consumer
    publish write position                 rx_sleeping = 1
    fence                                  fence
    if rx_sleeping: clear, write a byte    if nothing new: block on the pipe (+ watched)

(and the same the other way round when the producer waits for space). The fence makes
the pair safe: without it each side could read the other's flag before its own store is
visible, and the consumer would sleep through a message. A byte is written only when the
peer said it sleeps, so a busy channel makes no system calls.

A blocked endpoint waits on its pipe *and* on the watched waitables with one ``poll``.
Every write end of the pipe belongs to the peer, so a peer that is gone, however it
ended, shows as end-of-file: that is why endpoints must ``release()`` the descriptors
they inherit but do not own.
"""

from __future__ import annotations

import math
import os
import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

# A sleep/wake round trip through a pipe costs about 15-20 us on a 2-core machine; spin
# about that long before blocking. The spin yields the CPU at every turn: on a machine
# with more runnable processes than cores, that lets the peer (or anyone) run instead of
# burning the time slice, and it cut sleeps (and their system calls) from about one
# message in five to almost none in the one-int-per-message benchmark on a busy machine.
SPIN_SECONDS = 20e-6

_fence_lock = threading.Lock()


def fence() -> None:
    """A full memory barrier between this thread's stores and its later loads.

    Acquiring and releasing an uncontended lock executes locked (atomic) instructions,
    which x86-64 orders with every earlier store and later load. That is why the
    shared-memory transport is used on x86-64 only (see ``__init__``).
    """
    _fence_lock.acquire()
    _fence_lock.release()


def _new_fence_lock() -> None:
    global _fence_lock
    _fence_lock = threading.Lock()  # a fork may have copied it while another thread held it


os.register_at_fork(after_in_child=_new_fence_lock)


def wake_pipe() -> tuple[int, int]:
    """A non-blocking pipe (read end, write end) carrying wake-up bytes."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(read_fd, False)
    os.set_blocking(write_fd, False)
    return read_fd, write_fd


def drain(fd: int) -> bool:
    """Discard pending wake-up bytes; True when the pipe is at end-of-file (peer gone)."""
    try:
        while True:
            chunk = os.read(fd, 256)
            if not chunk:
                return True
            if len(chunk) < 256:
                return False
    except BlockingIOError:
        return False


def signal(fd: int) -> bool:
    """Wake the peer; False when it is gone (its read end is closed everywhere)."""
    try:
        os.write(fd, b"\x01")
    except BlockingIOError:
        pass  # the pipe is full of wake-ups already: the peer will wake
    except BrokenPipeError:
        return False
    return True


class Outcome:
    READY = 0
    TIMEOUT = 1
    PEER_GONE = 2
    WATCHED = 3


class Sleeper:
    """Waits for a condition on shared memory, with the protocol above.

    ``flag`` is the control word this side sets while it sleeps; ``fd`` the read end of
    its wake-up pipe; the watched waitables (process sentinels, descriptors, objects
    with ``fileno()``) end a wait as ``Outcome.WATCHED``.
    """

    def __init__(self, ctl: memoryview, flag: int, fd: int) -> None:
        self._ctl = ctl
        self._flag = flag
        self._fd = fd
        self._poller: Any = None
        self._probe: Any = None
        self._watched: tuple[Any, ...] = ()
        self.peer_gone = False

    def watch(self, waitables: Iterable[Any]) -> None:
        self._watched = tuple(waitables)
        self._poller = None

    def wait(self, ready: Callable[[], Any], deadline: float | None = None) -> int:
        """Return ``Outcome.READY`` as soon as ``ready()`` is true; otherwise the reason
        the wait ended. ``deadline`` is on the ``time.monotonic`` clock."""
        if ready():
            return Outcome.READY
        if deadline is None or deadline > time.monotonic():
            spin_end = time.perf_counter() + SPIN_SECONDS
            while time.perf_counter() < spin_end:
                if ready():
                    return Outcome.READY
                os.sched_yield()
        poller = self._poller if self._poller is not None else self._new_poller()
        ctl, flag = self._ctl, self._flag
        while True:
            if self.peer_gone:
                return Outcome.READY if ready() else Outcome.PEER_GONE
            ctl[flag] = 1
            fence()
            if ready():
                ctl[flag] = 0
                return Outcome.READY
            if deadline is None:
                timeout_ms = None
            else:
                left = deadline - time.monotonic()
                if left <= 0:
                    ctl[flag] = 0
                    return Outcome.TIMEOUT
                timeout_ms = math.ceil(left * 1000)
            events = poller.poll(timeout_ms)
            ctl[flag] = 0  # the waker may have cleared it already; either way we are awake
            watched = False
            for fd, _ in events:
                if fd == self._fd:
                    if drain(fd):
                        self.peer_gone = True
                else:
                    watched = True
            if ready():
                return Outcome.READY
            if watched:
                return Outcome.WATCHED

    def check_peer_gone(self) -> bool:
        """Without blocking: is the peer gone? (Drains stale wake-ups on the way.)"""
        if self.peer_gone:
            return True
        if self._probe is None:
            self._probe = select.poll()
            self._probe.register(self._fd, select.POLLIN)
        # A poll is cheaper than a read that fails with EAGAIN, the usual answer here.
        if self._probe.poll(0) and drain(self._fd):
            self.peer_gone = True
        return self.peer_gone

    def _new_poller(self) -> Any:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        for waitable in self._watched:
            fd = waitable if isinstance(waitable, int) else waitable.fileno()
            if fd != self._fd:
                poller.register(fd, select.POLLIN)
        self._poller = poller
        return poller
