"""Live statistics: counters every process keeps about itself, readable at any time.

    worker w  --(writes its own row)-->  [ shared float64 table ]  <--(reads)-- main: stats()
    dispatch  --(writes its own row)-->

Each process is the only writer of its row, so no lock is needed: a reader may see a
row mid-update, off by one batch at most, which is fine for statistics. A process
accumulates in plain Python floats and publishes to its row once per message sent or
received, not once per item, so collecting costs a few clock reads per item.

Fields, per process:
    items_in      items received from the previous process (0 for a source segment)
    items_out     items sent to the next process (main: items handed to the main segment)
    busy          seconds running DataPipes (the segment's own work)
    wait_input    seconds blocked waiting for items from the previous process
    wait_output   seconds handing items to the next process: serializing them and
                  waiting for space in its channel (long when the next process is slow)
    bytes_out     bytes written to channels
    messages_out  messages written to channels (a message carries a batch of items)
    queued        messages written to this process's output channels and not yet read
    rescues       wake-ups on those channels that the transport's watchdog stood in for
                  (either end; always 0 unless the transport has a bug)
    late_wakeups  the same where the waking end was kept off the CPU between publishing
                  and waking (a loaded machine, not a bug)
    lent_in_place large buffers sent on those channels from the memory they were built in,
                  without a copy (a worker's batch stacked into the lend area)
    lent_copied   large buffers copied into those channels' lend areas
    in_service    main process only: seconds inside the main segment's ``next()``, that is
                  not in the user's loop (its own DataPipes, reading, waiting included)
    receiving     main process only: seconds taking messages out of the channels and
                  rebuilding their items (not waiting for them)
    first_ask     main process only: seconds from the start until the loop first asked for
                  an item (the service starting, DataLoader2 setting up)
    first_item    main process only: seconds from the start until the first item reached
                  the loop (the above, plus the workers' start and first item)
    private_start children only: bytes of private memory when the lane started (a forked
    private_now   child: 0; any other once its first item was handed on), and as last sampled
                  (``private_memory.py``: at most every few seconds, and when its first
                  epoch ends; never per item)
    resident_start  the same for resident memory, so that pages copied from the main
    resident_now    process (private grows, resident does not) tell from its own allocations

There is one row per *lane* (a thread producing one output, see ``lanes.py``), so that
every row has exactly one writer thread; ``stats()`` adds a process's rows up.

This module is the table and its writers, which both sides use: the main process creates
the table and writes its own row, each child writes its lanes' rows. Reading it as
statistics is the main process's (``main/stats.py``); the figures a user gets are
``mprs_plus.stats``.
"""

from __future__ import annotations

import time
from typing import Any

from ..transport import Sender
from .private_memory import EVERY, resident_at_fork, sample
from .timeline import LaneTrace

FIELDS = (
    "items_in",
    "items_out",
    "busy",
    "wait_input",
    "wait_output",
    "bytes_out",
    "queued",
    "started",
    "rescues",
    "messages_out",
    "in_service",
    "receiving",
    "first_ask",
    "first_item",
    "lent_in_place",
    "lent_copied",
    "private_start",
    "private_now",
    "resident_start",
    "resident_now",
    "late_wakeups",
)
(
    _ITEMS_IN,
    _ITEMS_OUT,
    _BUSY,
    _WAIT_IN,
    _WAIT_OUT,
    _BYTES_OUT,
    _QUEUED,
    _STARTED,
    _RESCUES,
    _MESSAGES_OUT,
    _IN_SERVICE,
    _RECEIVING,
    _FIRST_ASK,
    _FIRST_ITEM,
    _LENT_IN_PLACE,
    _LENT_COPIED,
    _PRIVATE_START,
    _PRIVATE_NOW,
    _RESIDENT_START,
    _RESIDENT_NOW,
    _LATE_WAKEUPS,
) = range(len(FIELDS))


class StatsTable:
    """One row of counters per process, in memory shared with the children."""

    def __init__(self, ctx: Any, rows: int) -> None:
        self.rows = rows
        self._table = ctx.RawArray("d", rows * len(FIELDS))

    def writer(self, row: int) -> StatsWriter:
        return StatsWriter(self._table, row * len(FIELDS), row)

    def read(self, row: int) -> dict[str, float]:
        base = row * len(FIELDS)
        return {name: self._table[base + i] for i, name in enumerate(FIELDS)}


class StatsWriter:
    """The owning process's view of its row: accumulate locally, ``publish()`` often."""

    __slots__ = (
        "_table",
        "_base",
        "_row",
        "items_in",
        "items_out",
        "busy",
        "wait_input",
        "wait_output",
        "in_service",
        "receiving",
        "first_ask",
        "first_item",
        "started_at",
        "channels",
        "_memory_due",
        "_ended_sampled",
        "trace",
    )

    def __init__(self, table: Any, base: int, row: int) -> None:
        self._table = table
        self._base = base
        self._row = row
        self.items_in = 0
        self.items_out = 0
        self.busy = 0.0
        self.wait_input = 0.0
        self.wait_output = 0.0
        self.in_service = 0.0
        self.receiving = 0.0
        self.first_ask = 0.0
        self.first_item = 0.0
        self.started_at = 0.0
        self.channels: tuple[Sender, ...] = ()  # output endpoints, for bytes and queue fill
        self._memory_due = 0.0  # when the next memory sample is due (children only)
        self._ended_sampled = False  # an epoch's end was sampled in this process
        # The lane's ring of the timeline (``timeline.py``), when one is recorded.
        self.trace: LaneTrace | None = None

    def __getstate__(self) -> tuple[Any, int, int, LaneTrace | None]:
        return (self._table, self._base, self._row, self.trace)

    def __setstate__(self, state: tuple[Any, int, int, LaneTrace | None]) -> None:
        self.__init__(*state[:3])  # type: ignore[misc]
        self.trace = state[3]

    def start(self) -> None:
        self.started_at = time.monotonic()
        self._table[self._base + _STARTED] = self.started_at
        at_fork = resident_at_fork()
        if at_fork is not None:  # it held nothing of its own then (private_memory.py): no walk
            self._start_memory(0, at_fork)
            self._memory_due = self.started_at + EVERY

    def sample_memory(self, *, due_only: bool = False, at_end: bool = False) -> None:
        """Sample this process's private and resident memory into the row: the first sample
        is its start. ``due_only``: only if the last one is old enough (called where items
        flow: every ``EVERY`` seconds, or a hundred times as long as a sample took, whichever
        is longer, so that sampling never costs a worker more than 1% of its time);
        otherwise now (its first item). ``at_end``: a stream of an epoch ended here: now
        the first time, so that even a short first epoch is seen, then only when due. A
        persistent worker with short epochs would otherwise walk its page tables at every
        epoch's end: 18 ms in a worker forked from a 600 MB process, 2% of a one-second
        epoch, ten times that with a dataset ten times the size."""
        if at_end:
            due_only, self._ended_sampled = self._ended_sampled, True
        now = time.monotonic()
        if due_only and now < self._memory_due:
            return
        private, resident = sample()
        took = time.monotonic() - now
        self._memory_due = now + max(EVERY, 100 * took)
        self._start_memory(private, resident)
        table, base = self._table, self._base
        table[base + _PRIVATE_NOW], table[base + _RESIDENT_NOW] = private, resident

    def sample_start(self) -> None:
        """The lane handed on its first item: where its memory's growth starts from, unless
        its start already said (a forked process, ``start()``)."""
        if not self._memory_started():
            self.sample_memory()

    def _memory_started(self) -> bool:
        table, base = self._table, self._base
        return bool(table[base + _PRIVATE_START] or table[base + _RESIDENT_START])

    def _start_memory(self, private: int, resident: int) -> None:
        if not self._memory_started():
            table, base = self._table, self._base
            table[base + _PRIVATE_START], table[base + _RESIDENT_START] = private, resident

    def publish(self) -> None:
        table, base = self._table, self._base
        table[base + _ITEMS_IN] = self.items_in
        table[base + _ITEMS_OUT] = self.items_out
        table[base + _BUSY] = self.busy
        table[base + _WAIT_IN] = self.wait_input
        table[base + _WAIT_OUT] = self.wait_output
        table[base + _IN_SERVICE] = self.in_service
        table[base + _RECEIVING] = self.receiving
        table[base + _FIRST_ASK] = self.first_ask
        table[base + _FIRST_ITEM] = self.first_item
        if self.channels:
            traffic = [channel.traffic() for channel in self.channels]
            table[base + _BYTES_OUT] = sum(t.bytes for t in traffic)
            table[base + _MESSAGES_OUT] = sum(t.messages for t in traffic)
            table[base + _QUEUED] = sum(t.queued_messages for t in traffic)
            table[base + _RESCUES] = sum(t.rescues for t in traffic)
            table[base + _LATE_WAKEUPS] = sum(t.late_wakeups for t in traffic)
            table[base + _LENT_IN_PLACE] = sum(t.lent_in_place for t in traffic)
            table[base + _LENT_COPIED] = sum(t.lent_copied for t in traffic)
