"""How a channel endpoint sleeps and is woken: spin briefly, then block on an OS pipe.

The protocol (both directions alike; "waiter" is the consumer waiting for data or the
producer waiting for room, "waker" the other side, "flag" the waiter's sleeping word):

    waker                                  waiter
    1 publish its position (data / room)   1 set flag = 1
    2 fence                                2 fence
    3 if flag: flag = 0, write one byte    3 if the condition holds: flag = 0, done
    3' store its progress as looked at     4 block on the pipe (at most WATCHDOG_SECONDS)
                                           5 flag = 0, drain the pipe, re-check: go to 1

Why no wake-up can be lost
    * Steps 1-2 on both sides make a Dekker pair: without the fences each side could read
      the other's word before its own store is visible. With them, either the waiter's
      check (3) sees the published position, or the waker's check (3) sees the flag and
      writes a byte that the block (4) will see.
    * Only the waiter reads the pipe, and only in step 5: after it woke and *before* it
      re-checks the condition. A byte drained there was written for a position that the
      re-check sees. Draining anywhere else (say in a non-blocking ``poll()``, between a
      check and a block) could swallow the byte of a position published after that check:
      the waiter would then sleep on data that is there. ``poll()`` therefore never reads
      the pipe; it asks the kernel about end-of-file (``POLLHUP``) only.
    * A byte that arrives after the waiter has seen its condition some other way is stale:
      the next block returns at once, step 5 drains it, and the waiter blocks again. A flag
      cleared late by a slow waker is always followed by a byte, so it is harmless too.
    * A byte is written only when the peer said it sleeps, so a busy channel makes no
      system calls.

The watchdog: robust even against a bug not found yet
    A blocked waiter never trusts the byte alone: it wakes every ``WATCHDOG_SECONDS``
    and re-checks its condition. A missed wake-up therefore costs at most that much
    latency, never a hang. When the watchdog finds the condition true while the flag was
    still set (no waker had begun to wake it), it tells two cases apart:

    * *late*: the waker has published (1) but not yet looked at the flag (3). It was kept
      off the CPU in between, by a loaded machine or by another thread of its process
      holding the GIL; it will find the flag cleared and write nothing. Busy machines
      only, never a bug: counted as ``Traffic.late_wakeups``.
    * *rescue*: the waker had looked after publishing and still wrote no byte. The
      protocol above says it never happens; a non-zero ``Traffic.rescues`` is a bug to
      report, not a state to live with.

    A waker tells which by storing its progress (what the waiter may wait for) in a word
    of its own after each look (3'): the waiter reads that word, then the progress, then
    the flag. If the word had caught up, the look came after the waiter's flag was set
    (the Dekker pair) and before the waiter's read of the flag, so a waker that keeps the
    protocol cleared it: a flag still set is a rescue. Every path that publishes looks,
    so a word behind means a look still to come.
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
from typing import Any, TypeVar

# Spin for about as long as a sleep/wake round trip through a pipe costs before blocking
# (figures in docs/benchmarks-history.md, Design figures). The spin yields the CPU at every
# turn: on a machine with more runnable processes than cores, that lets the peer (or
# anyone) run instead of burning the time slice, and it cut sleeps (and their system calls)
# to almost none in the one-int-per-message benchmark on a busy machine.
SPIN_SECONDS = 20e-6
# A spin that fails costs its CPU for nothing: that was most of what a process waiting
# for each large item spent, so spinning stops after a few misses in a row (figures in
# docs/benchmarks-history.md, Design figures). A wait that does not spin still yields
# once before it sleeps: see Sleeper.wait.
SPIN_MISSES = 4
SPIN_PROBE = 16

# The bounded re-check of a blocked waiter (see the module's docstring). 100 ms: rare
# enough to cost nothing measurable (ten wake-ups a second per *sleeping* endpoint), short
# enough that a lost wake-up, should one ever happen, is a hiccup rather than a stall.
WATCHDOG_SECONDS = 0.1
_WATCHDOG_MS = round(WATCHDOG_SECONDS * 1000)

# Tests only: called with a label ("armed") between a waiter's last check and its block,
# where a delay widens the window a waker has to race with. None in production.
race_hook: Callable[[str], None] | None = None

_fence_lock = threading.Lock()
_blocking = threading.local()
_T = TypeVar("_T")


def note_blocking(note: Callable[[float], None] | None) -> None:
    """Report the calling thread's sleeps in channel waits: ``note(time.monotonic())`` as
    it goes to sleep, ``note(0.0)`` once it is awake again (a watchdog turn does not wake
    it in this sense). A runtime uses this to tell a wait that can never end from a slow
    one; None stops the reports. The rings' sleeper reports only after its spin, so a
    wait that a spin ends costs nothing."""
    _blocking.note = note


def asleep(wait: Callable[[], _T]) -> _T:
    """``wait()``, a blocking wait of the calling thread, reported to its
    ``note_blocking`` callback as one sleep."""
    note = getattr(_blocking, "note", None)
    if note is None:
        return wait()
    note(time.monotonic())
    try:
        return wait()
    finally:
        note(0.0)


def fence() -> None:
    """A full memory barrier between this thread's stores and its later loads.

    Acquiring and releasing an uncontended lock executes locked (atomic) instructions,
    which x86-64 orders with every earlier store and later load. That is why the
    shared-memory transport is used on x86-64 only (see ``__init__``).

    It never waits on the shared lock. A signal's exception (Ctrl-C's KeyboardInterrupt)
    can be raised in the main thread right after the acquire, so the lock may stay held
    for good; and another thread may hold it for an instant. Either way a lock of its own
    makes the barrier, and the shared lock is replaced (a blocking acquire here would
    deadlock the stop of a service that Ctrl-C interrupted).
    """
    lock = _fence_lock
    if lock.acquire(False):
        lock.release()
        return
    spare = threading.Lock()
    spare.acquire()
    spare.release()
    _new_fence_lock()


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

    ``flag`` is the control word this side sets while it sleeps; ``counts`` the words
    where it counts its watchdog's rescues and late wake-ups; ``peer_lags(ctl)`` says whether
    the waker has published progress it has not yet looked at the flag for (it reads the
    waker's word (3') first). ``fd`` is the read end of its wake-up pipe; the watched
    waitables (process sentinels, descriptors, objects with ``fileno()``) end a wait as
    ``Outcome.WATCHED``.
    """

    def __init__(
        self,
        ctl: memoryview,
        flag: int,
        fd: int,
        counts: tuple[int, int],
        peer_lags: Callable[[memoryview], bool],
    ) -> None:
        self._ctl = ctl
        self._flag = flag
        self._fd = fd
        self._rescues, self._late = counts
        self._peer_lags = peer_lags
        self._poller: Any = None
        self._poller_also: tuple[Any, ...] = ()  # the ``also`` waitables _poller covers
        self._probe: Any = None
        self._watched: tuple[Any, ...] = ()
        self.hits: list[Any] = []  # the ``also`` waitables that ended the last wait
        self.peer_gone = False
        self._waits = 0
        self._misses = 0  # spins in a row that ended in a sleep

    def watch(self, waitables: Iterable[Any]) -> None:
        self._watched = tuple(waitables)
        self._poller = None

    def wait(self, ready: Callable[[], Any], deadline: float | None = None, also: tuple[Any, ...] = ()) -> int:
        """Return ``Outcome.READY`` as soon as ``ready()`` is true; otherwise the reason
        the wait ended. ``deadline`` is on the ``time.monotonic`` clock. The ``also``
        waitables end the wait as watched ones do; those that did are left in ``hits``."""
        self.hits = []
        if ready():
            return Outcome.READY
        # Spin only while spinning pays: after SPIN_MISSES spins in a row that ended in a
        # sleep anyway (the peer is slow: large items, real work), every wait but one in
        # SPIN_PROBE goes to sleep after one yield, and a spin that succeeds brings spinning
        # back. That one yield is not for this wait: a loop that slept at once, woken by
        # the worker whose batch it waited for, ran on that worker's core and took it from
        # the workers for every batch (rows, 2 workers on 2 cores: a sleep for 1 batch in
        # 3, 0.21 us of the loop's CPU a sample); after a yield it sleeps for 1 in 11, and
        # the loop takes its batches in runs, 0.13 us a sample, +11% samples/s (figures in
        # docs/benchmarks.md, Cheap samples).
        self._waits += 1
        if (self._misses < SPIN_MISSES or self._waits % SPIN_PROBE == 0) and (
            deadline is None or deadline > time.monotonic()
        ):
            spin_end = time.perf_counter() + SPIN_SECONDS
            while time.perf_counter() < spin_end:
                if ready():
                    self._misses = 0
                    return Outcome.READY
                os.sched_yield()
            self._misses += 1
        else:
            os.sched_yield()  # see above: the cost of a system call, once a wait
        poller = self._poller if self._poller is not None and self._poller_also == also else self._new_poller(also)
        return asleep(lambda: self._sleep(ready, deadline, also, poller))

    def _sleep(self, ready: Callable[[], Any], deadline: float | None, also: tuple[Any, ...], poller: Any) -> int:
        """Steps 1-5 of the protocol, until ``ready()`` or the end of the wait."""
        ctl, flag = self._ctl, self._flag
        while True:
            if self.peer_gone:
                return Outcome.READY if ready() else Outcome.PEER_GONE
            ctl[flag] = 1
            fence()
            if ready():
                ctl[flag] = 0
                return Outcome.READY
            timeout_ms = _WATCHDOG_MS
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    ctl[flag] = 0
                    return Outcome.TIMEOUT
                timeout_ms = min(timeout_ms, math.ceil(left * 1000))
            if race_hook is not None:
                race_hook("armed")
            events = poller.poll(timeout_ms)
            # Read before the flag (see The watchdog); only a silent block pays for it.
            lagging = not events and self._peer_lags(ctl)
            unwoken = ctl[flag]  # still set: no waker has begun to wake us
            ctl[flag] = 0  # the waker may have cleared it already; either way we are awake
            watched = False
            for fd, _ in events:
                if fd == self._fd:
                    if drain(fd):
                        self.peer_gone = True
                else:
                    watched = True
            if watched and also:
                fired = {fd for fd, _ in events}
                self.hits = [w for w in also if (w if isinstance(w, int) else w.fileno()) in fired]
            if ready():
                if not events and unwoken and timeout_ms == _WATCHDOG_MS:
                    self.count_watchdog_wake(late=lagging)
                return Outcome.READY
            if watched:
                return Outcome.WATCHED

    def count_watchdog_wake(self, late: bool) -> None:
        """The watchdog found the condition true with no wake-up under way: ``late``
        when the waker had not yet looked at the flag, a rescue otherwise."""
        self._ctl[self._late if late else self._rescues] += 1

    def check_peer_gone(self) -> bool:
        """Without blocking: is the peer gone? Never reads the pipe (see the protocol):
        end-of-file shows as ``POLLHUP`` once every write end is closed."""
        if self.peer_gone:
            return True
        if self._probe is None:
            self._probe = select.poll()
            self._probe.register(self._fd, select.POLLIN)
        for _, event in self._probe.poll(0):
            if event & select.POLLHUP:
                self.peer_gone = True
        return self.peer_gone

    def drain(self) -> None:
        """The waiter, after waking and before re-checking: discard the wake-up bytes."""
        if drain(self._fd):
            self.peer_gone = True

    def _new_poller(self, also: tuple[Any, ...] = ()) -> Any:
        poller = select.poll()
        poller.register(self._fd, select.POLLIN)
        for waitable in (*self._watched, *also):
            fd = waitable if isinstance(waitable, int) else waitable.fileno()
            if fd != self._fd:
                poller.register(fd, select.POLLIN)
        self._poller, self._poller_also = poller, also
        return poller
