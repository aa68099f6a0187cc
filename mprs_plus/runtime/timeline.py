"""The timeline's recording: a ring of spans per lane, in memory shared with the children.

    worker w, lane k  --(its own ring)-->  [ TimelineTable: one ring per stats row ]  <--(reads)-- main
    dispatch, lane d  --(its own ring)-->    + one ring for the main process's service events

Recorded only when asked (``timeline=``): every hook is one ``if trace is not None`` on a
local, so a service that records nothing pays one branch per item. The rings are what the
statistics rows are, one per lane, with one writer thread each, so no lock is needed: the
writer stores a record, then the count; a reader takes the count, copies, and drops what
the writer may have overwritten meanwhile (the ring's oldest records). The main process's
loop ring is written by the thread that iterates the service (the loop's, or the feeding's
with ``device=``), the watchdog's warning included; its service ring (epochs, checkpoints,
replacements) has several writer threads and a lock.

A record is four doubles: ``pid * 64 + kind``, start, end, an argument. The pid in each
record gives every life of a process its own track, even after the ring wrapped; the ring
of a dead worker is still there to read, and its replacement goes on writing it with its
own pid. Times are ``time.perf_counter()``: ``CLOCK_MONOTONIC`` on Linux, one clock for
every process of the host, so the tracks line up without an exchange of offsets.

Bounded twice: a lane's spans of its own work (busy; the loop's step in the main process)
that follow each other closer than ``MIN_SPAN`` merge into one run (a fast pipeline writes
a record every ``MAX_RUN`` seconds, not one per item), and any other span shorter than
``MIN_SPAN`` is not recorded (it stays inside the run around it); the ring keeps the last
``capacity`` records.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

# Spans shorter than this are not recorded: they merge into the run of work around them.
MIN_SPAN = 20e-6
# A run of work is written at least this often, so that a reader sees a busy lane's work.
MAX_RUN = 0.25
# Records kept per lane when ``timeline=True``: 1 MiB of shared memory each, committed as
# they are written.
DEFAULT_CAPACITY = 32768
_FIELDS = 4
_KINDS = 64


class Span:
    """What a record says; ``timeline.py`` (the package's) names them for people. Plain
    ints, not an enum: a hook reads one per span, and an enum member costs a lookup."""

    BUSY = 1  # a child's lane runs its DataPipes (its own work)
    WAIT_INPUT = 2  # waiting for items from the previous process
    SENDING = 3  # handing items on: serializing, writing the channel
    ASLEEP = 4  # asleep in a channel wait (within SENDING: waiting for space)
    NEXT = 5  # main: the loop's next(): waiting for a batch, in the service
    STEP = 6  # main: the loop's own time between two next() (the user's step)
    RECEIVING = 7  # main: taking a message out of a channel, rebuilding its items
    STARTUP = 8  # main: from the service's start to the loop's first item
    EPOCH = 9  # main: an epoch begins (instant; argument: the epoch)
    EPOCH_END = 10  # main: an epoch's items are all handed out (instant)
    SAVE = 11  # main: a checkpoint taken
    RESTORE = 12  # main: a checkpoint restored
    DEATH = 13  # main: a dead worker found (instant; argument: its pid)
    REPLACING = 14  # main: a dead worker replaced (argument: the worker)
    WATCHDOG = 15  # main: the stuck-read watchdog warned (instant; argument: the worker)
    LIFE = 16  # a lane began in this process (instant)
    REPLAY = 17  # a lane dropped items the loop already had (a replacement, a restore)
    WAIT_WINDOW = 18  # a worker's lane is as far ahead of the loop as it may be (prefetch_factor)
    RESET = 19  # a child begins an epoch: seeding, reset hooks (argument: the epoch)


INSTANTS = frozenset((Span.EPOCH, Span.EPOCH_END, Span.DEATH, Span.WATCHDOG, Span.LIFE))


class TimelineTable:
    """The rings, made by the main process before its children start: one per statistics
    row, and one more for the main process's service events (``service_row``)."""

    def __init__(self, ctx: Any, rows: int, capacity: int = DEFAULT_CAPACITY) -> None:
        self.rows = rows + 1
        self.service_row = rows
        self.capacity = capacity
        self._stride = 1 + capacity * _FIELDS
        self._table = ctx.RawArray("d", self.rows * self._stride)
        # The service's start on the rings' clock, and the same moment on the wall clock
        # (a merge with torch.profiler's trace aligns with it).
        self.origin, self.wall_origin = _paired_clocks()

    def ring(self, row: int) -> LaneTrace:
        return LaneTrace(self._table, row * self._stride, self.capacity)

    def read(self, row: int) -> list[tuple[int, int, float, float, float]]:
        """Row ``row``'s records, oldest first, as (pid, kind, start, end, argument)."""
        table, base, capacity = self._table, row * self._stride, self.capacity
        count = int(table[base])
        copied = table[base + 1 : base + self._stride]
        # The writer may have gone on meanwhile: the slots it may have written again are dropped.
        first = max(0, count - capacity, int(table[base]) - capacity)
        found = []
        for i in range(first, count):
            at = (i % capacity) * _FIELDS
            code, start, end, argument = copied[at : at + _FIELDS]
            pid, kind = divmod(int(code), _KINDS)
            found.append((pid, kind, start, end, argument))
        return found


def _paired_clocks(tries: int = 5) -> tuple[float, float]:
    """(perf_counter, time) read at one moment: of a few readings, the one whose wall
    reading lies in the shortest interval (a thread preempted in between reads far apart)."""
    best = (float("inf"), 0.0, 0.0)
    for _ in range(tries):
        before = time.perf_counter()
        wall = time.time()
        after = time.perf_counter()
        if after - before < best[0]:
            best = (after - before, (before + after) / 2, wall)
    return best[1], best[2]


class LaneTrace:
    """One ring's writer: ``run`` for a lane's own work (merged), ``span`` for the rest,
    ``item`` for both at once (a lane's loop, once per item)."""

    __slots__ = (
        "_shared", "_table", "_base", "_capacity", "_count", "_code", "_run_kind", "_start", "_end", "_open", "began"
    )

    def __init__(self, table: Any, base: int, capacity: int) -> None:
        self._shared = table  # what pickles (to a spawned child)
        # Stores through a memoryview: a fifth of what a ctypes array's item assignment costs.
        self._table = memoryview(table).cast("B").cast("d")
        self._base, self._capacity = base, capacity
        self._count = int(self._table[base])  # a replacement goes on after its predecessor's records
        self._code = float(os.getpid() * _KINDS)  # a float: the view stores floats cheapest
        self._run_kind = Span.BUSY
        self._start = self._end = 0.0
        self._open = False
        self.began = 0.0  # when the lane began in this process (``begin``)

    def __getstate__(self) -> tuple[Any, int, int]:
        return (self._shared, self._base, self._capacity)

    def __setstate__(self, state: tuple[Any, int, int]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def begin(self, run_kind: int = Span.BUSY) -> None:
        """The lane starts in this process (a child's, after the fork or spawn)."""
        self._count = int(self._table[self._base])
        self._code = float(os.getpid() * _KINDS)  # a float: the view stores floats cheapest
        self._run_kind = run_kind
        self._open = False
        self.began = now = time.perf_counter()
        self.write(Span.LIFE, now, now)

    def open_run(self) -> tuple[int, float, float] | None:
        """The run not written yet, as (kind, start, end); read by another thread, it may be
        a moment old, which is fine for a picture."""
        return (self._run_kind, self._start, self._end) if self._open else None

    def write(self, kind: int, start: float, end: float, argument: float = 0.0) -> None:
        table, count = self._table, self._count
        at = self._base + 1 + (count % self._capacity) * _FIELDS
        table[at] = self._code + kind
        table[at + 1] = start
        table[at + 2] = end
        table[at + 3] = argument
        self._count = count + 1
        table[self._base] = count + 1  # after the record: a reader never sees it half written

    def run(self, start: float, end: float) -> None:
        """The lane's own work from ``start`` to ``end``: joins the open run when it follows
        it closely, else closes it and opens a new one."""
        if self._open and start - self._end < MIN_SPAN and end - self._start < MAX_RUN:
            self._end = end
            return
        if self._open:
            self.write(self._run_kind, self._start, self._end)
        self._start, self._end, self._open = start, end, True

    def item(self, start: float, made: float, done: float, then: int) -> None:
        """``run(start, made)`` and ``span(then, made, done)`` in one call: what a lane's loop
        does per item (its work, then the hand-on; the loop's step, then its ``next()``)."""
        if self._open and start - self._end < MIN_SPAN and made - self._start < MAX_RUN:
            self._end = made
        else:
            if self._open:
                self.write(self._run_kind, self._start, self._end)
            self._start, self._end, self._open = start, made, True
        if done - made >= MIN_SPAN:
            self._open = False
            self.write(self._run_kind, self._start, self._end)
            self.write(then, made, done)

    def span(self, kind: int, start: float, end: float, argument: float = 0.0) -> None:
        """Anything but the lane's own work; not recorded when shorter than ``MIN_SPAN``.
        It closes the open run: the next run starts after it (or around it, when it lies
        within the next piece of work, as a wait for input within ``next()``)."""
        if end - start < MIN_SPAN:
            return
        if self._open:
            self._open = False
            self.write(self._run_kind, self._start, self._end)
        self.write(kind, start, end, argument)

    def flush(self) -> None:
        """Write the open run (the lane stops producing, or the service reads the rings)."""
        if self._open:
            self._open = False
            self.write(self._run_kind, self._start, self._end)

    def sleep_note(self, chained: Callable[[float], None] | None) -> Callable[[float], None]:
        """A ``transport.note_blocking`` callback that records each sleep in a channel wait
        (and passes the note on to ``chained``, the liveness slot's)."""
        asleep = [0.0]
        clock = time.perf_counter

        def note(since: float) -> None:
            if chained is not None:
                chained(since)
            if since:
                asleep[0] = clock()
            elif asleep[0]:
                self.span(Span.ASLEEP, asleep[0], clock())
                asleep[0] = 0.0

        return note


class ServiceTrace:
    """The main process's service events: several threads write them, under a lock."""

    def __init__(self, ring: LaneTrace) -> None:
        self._ring = ring
        self._lock = threading.Lock()

    def instant(self, kind: int, argument: float = 0.0) -> None:
        now = time.perf_counter()
        with self._lock:
            self._ring.write(kind, now, now, argument)

    def span(self, kind: int, start: float, end: float, argument: float = 0.0) -> None:
        with self._lock:
            self._ring.write(kind, start, end, argument)


class TimelineSource:
    """What ``Stats.timeline()`` reads: the rings, and whose each is (role, worker index,
    lane, row); the main process's loop ring, whose open run is read as it stands."""

    def __init__(
        self, table: TimelineTable, rows: tuple[tuple[Any, int, int, int], ...], main: LaneTrace | None
    ) -> None:
        self.table = table
        self.rows = rows
        self._main = main

    def read(self) -> list[tuple[Any, int, int, list[tuple[int, int, float, float, float]]]]:
        """Per ring: (role, index, lane, records), the service's ring last as ("service", 0, 0, ...)."""
        found = []
        for role, index, lane, row in self.rows:
            records = self.table.read(row)
            if role == "main" and self._main is not None:
                pending = self._main.open_run()
                if pending is not None:
                    records.append((os.getpid(), pending[0], pending[1], pending[2], 0.0))
            found.append((role, index, lane, records))
        found.append(("service", 0, 0, self.table.read(self.table.service_row)))
        return found

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # Shared memory pickles only to a child being started: a copy (pickled, deep-copied
        # with its Stats) holds the records as they are now.
        return (ReadTimeline, (self.read(), self.table.origin, self.table.wall_origin))


class ReadTimeline:
    """A timeline's records as read once, with ``TimelineSource``'s surface."""

    def __init__(self, records: list[Any], origin: float, wall_origin: float) -> None:
        self._records = records
        self.table = _Clocks(origin, wall_origin)

    def read(self) -> list[Any]:
        return self._records


class _Clocks:
    def __init__(self, origin: float, wall_origin: float) -> None:
        self.origin, self.wall_origin = origin, wall_origin
