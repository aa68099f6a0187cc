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
    queued        messages written to this process's output channels and not yet read
    rescues       wake-ups on those channels that the transport's watchdog stood in for
                  (either end; always 0 unless the transport has a bug)

There is one row per *lane* (a thread producing one output, see ``lanes.py``), so that
every row has exactly one writer thread; ``stats()`` adds a process's rows up.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from ..transport import Lending, lending

FIELDS = ("items_in", "items_out", "busy", "wait_input", "wait_output", "bytes_out", "queued", "started", "rescues")
_ITEMS_IN, _ITEMS_OUT, _BUSY, _WAIT_IN, _WAIT_OUT, _BYTES_OUT, _QUEUED, _STARTED, _RESCUES = range(len(FIELDS))


class StatsTable:
    """One row of counters per process, in memory shared with the children."""

    def __init__(self, ctx: Any, rows: int) -> None:
        self.rows = rows
        self._table = ctx.RawArray("d", rows * len(FIELDS))
        # Per row: since when its lane sleeps in a channel wait (time.monotonic), 0 while
        # it is not. Apart from the counters: a state, not a statistic (``asleep_since``).
        self._asleep = ctx.RawArray("d", rows)

    def writer(self, row: int) -> StatsWriter:
        return StatsWriter(self._table, row * len(FIELDS), self._asleep, row)

    def asleep_since(self, row: int) -> float:
        """Since when the lane of ``row`` sleeps in a channel wait; 0.0 when it does not."""
        return self._asleep[row]

    def read(self, row: int) -> dict[str, float]:
        base = row * len(FIELDS)
        return {name: self._table[base + i] for i, name in enumerate(FIELDS)}


class StatsWriter:
    """The owning process's view of its row: accumulate locally, ``publish()`` often."""

    __slots__ = (
        "_table",
        "_base",
        "_asleep",
        "_row",
        "items_in",
        "items_out",
        "busy",
        "wait_input",
        "wait_output",
        "channels",
    )

    def __init__(self, table: Any, base: int, asleep: Any, row: int) -> None:
        self._table = table
        self._base = base
        self._asleep = asleep
        self._row = row
        self.items_in = 0
        self.items_out = 0
        self.busy = 0.0
        self.wait_input = 0.0
        self.wait_output = 0.0
        self.channels: tuple[Any, ...] = ()  # output endpoints, for bytes and queue fill

    def __getstate__(self) -> tuple[Any, int, Any, int]:
        return (self._table, self._base, self._asleep, self._row)

    def __setstate__(self, state: tuple[Any, int, Any, int]) -> None:
        self.__init__(*state)  # type: ignore[misc]

    def note_asleep(self, since: float) -> None:
        """The transport's ``note_blocking`` callback for this row's lane."""
        self._asleep[self._row] = since

    def start(self) -> None:
        self._table[self._base + _STARTED] = time.monotonic()

    def publish(self) -> None:
        table, base = self._table, self._base
        table[base + _ITEMS_IN] = self.items_in
        table[base + _ITEMS_OUT] = self.items_out
        table[base + _BUSY] = self.busy
        table[base + _WAIT_IN] = self.wait_input
        table[base + _WAIT_OUT] = self.wait_output
        if self.channels:
            traffic = [channel.traffic() for channel in self.channels]
            table[base + _BYTES_OUT] = sum(t.bytes for t in traffic)
            table[base + _QUEUED] = sum(t.queued_messages for t in traffic)
            table[base + _RESCUES] = sum(t.rescues for t in traffic)


@dataclass(frozen=True)
class ProcessStats:
    """What one process did since the service started."""

    role: str  # "dispatch", "worker", "main"
    index: int  # worker id; 0 for the dispatch and main processes
    pid: int
    items_in: int
    items_out: int
    busy_s: float
    waiting_input_s: float
    waiting_output_s: float
    bytes_out: int
    elapsed_s: float
    queued: int  # items waiting in this process's output channel(s), where known
    rescues: int = 0  # lost wake-ups the transport's watchdog made up for (0 unless there is a bug)
    node: str = ""  # the cluster node it runs on, with a backend that places children on nodes

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_wait_fraction(self) -> float:
        return self.waiting_input_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_wait_fraction(self) -> float:
        return self.waiting_output_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


def make_process_stats(role: str, index: int, pid: int, rows: list[dict[str, float]]) -> ProcessStats:
    """Add up the rows of one process's lanes (its elapsed time is its first lane's)."""
    started = min((row["started"] for row in rows if row["started"]), default=0.0)
    elapsed = time.monotonic() - started if started else 0.0
    lanes = max(len(rows), 1)

    def total(field: str) -> float:
        return sum(row[field] for row in rows)

    return ProcessStats(
        role=role,
        index=index,
        pid=pid,
        items_in=int(total("items_in")),
        items_out=int(total("items_out")),
        # Several lanes run side by side: their times are shares of one elapsed time.
        busy_s=total("busy") / lanes,
        waiting_input_s=total("wait_input") / lanes,
        waiting_output_s=total("wait_output") / lanes,
        bytes_out=int(total("bytes_out")),
        elapsed_s=elapsed,
        queued=int(total("queued")),
        rescues=int(total("rescues")),
    )


@dataclass(frozen=True)
class SegmentStats:
    """The processes of one segment, added up (fractions are averages over its processes)."""

    segment: str
    processes: int
    items_in: int
    items_out: int
    busy_fraction: float
    input_wait_fraction: float
    output_wait_fraction: float
    bytes_out: int


@dataclass(frozen=True)
class Stats:
    """A snapshot of a running service: per process, per segment, and a verdict."""

    processes: tuple[ProcessStats, ...]
    segments: tuple[SegmentStats, ...]
    bottleneck: str
    # Large buffers the main process received since the service started: lent as views
    # of shared memory, or copied (the user held too many already, or the worker had no
    # room left to lend); and those held now, by any service of this process (docs/stats.md).
    large_buffers: Lending = Lending(0, 0, 0, 0)

    def segment(self, name: str) -> SegmentStats | None:
        return next((s for s in self.segments if s.segment == name), None)

    def summary(self) -> str:
        lines = [self.bottleneck]
        placed = [p for p in self.processes if p.node]
        if placed:
            lines.append("  on nodes: " + ", ".join(f"{p.role} {p.index}: {p.node}" for p in placed))
        for s in self.segments:
            lines.append(
                f"  {s.segment:<8} x{s.processes}: in {s.items_in:>9,} out {s.items_out:>9,}  "
                f"busy {s.busy_fraction:4.0%}  waiting for input {s.input_wait_fraction:4.0%}  "
                f"waiting for space {s.output_wait_fraction:4.0%}  {s.bytes_out / 1e6:,.1f} MB sent"
            )
        large = self.large_buffers
        if large.lent or large.copied:
            lines.append(
                f"  large buffers: {large.lent:,} handed over as views of shared memory, {large.copied:,} copied "
                f"(too many held, or no room to lend); {large.held_buffers:,} held now, {large.held_bytes / 1e6:,.1f} MB"
            )
        return "\n".join(lines)


def aggregate(processes: list[ProcessStats], large_buffers: Lending | None = None) -> Stats:
    segments = []
    for role in ("dispatch", "worker", "main"):
        members = [p for p in processes if p.role == role]
        if not members:
            continue
        n = len(members)
        segments.append(
            SegmentStats(
                segment=role,
                processes=n,
                items_in=sum(p.items_in for p in members),
                items_out=sum(p.items_out for p in members),
                busy_fraction=sum(p.busy_fraction for p in members) / n,
                input_wait_fraction=sum(p.input_wait_fraction for p in members) / n,
                output_wait_fraction=sum(p.output_wait_fraction for p in members) / n,
                bytes_out=sum(p.bytes_out for p in members),
            )
        )
    large = large_buffers if large_buffers is not None else Lending(0, 0, 0, 0)
    return Stats(tuple(processes), tuple(segments), bottleneck(segments), large)


def bottleneck(segments: list[SegmentStats]) -> str:
    """One sentence naming the stage that limits throughput, and what to do about it."""
    by_name = {s.segment: s for s in segments}
    workers, main, dispatch = by_name.get("worker"), by_name.get("main"), by_name.get("dispatch")
    if workers is None or main is None:
        return "no statistics yet: the service has not run an epoch"
    if main.items_in == 0 and workers.items_out == 0:
        return "no items have moved yet"
    if dispatch is not None and workers.input_wait_fraction > 0.5 and dispatch.busy_fraction > 0.7:
        return (
            f"the dispatch process is the bottleneck: it is {dispatch.busy_fraction:.0%} busy while the workers "
            f"wait {workers.input_wait_fraction:.0%} of the time for items; move work after the dispatcher"
        )
    if workers.output_wait_fraction > 0.5 or (main.busy_fraction > 0.7 and main.input_wait_fraction < 0.3):
        return (
            f"the main process is the bottleneck: it is {main.busy_fraction:.0%} busy (main segment and "
            f"training step) and waits only {main.input_wait_fraction:.0%} of the time for worker output, while "
            f"workers wait {workers.output_wait_fraction:.0%} of the time to hand items on; lighten the main "
            "segment or the training step (more workers will not help)"
        )
    if main.input_wait_fraction > 0.5:
        return (
            f"the workers are the bottleneck: they are {workers.busy_fraction:.0%} busy and the main segment waits "
            f"{main.input_wait_fraction:.0%} of the time on worker output; add workers"
        )
    return (
        f"balanced: workers {workers.busy_fraction:.0%} busy, the main segment waits "
        f"{main.input_wait_fraction:.0%} of the time on worker output"
    )


def network_verdict(stats: Stats) -> str | None:
    """With children on other hosts: the channels (the network) are the bottleneck when the
    workers wait to hand items on and the main process waits for them at the same time,
    neither of them busy. None otherwise."""
    workers, main = stats.segment("worker"), stats.segment("main")
    if workers is None or main is None or not main.items_in:
        return None
    if workers.output_wait_fraction > 0.5 and main.input_wait_fraction > 0.5:
        return (
            f"the network is the bottleneck: workers wait {workers.output_wait_fraction:.0%} of the time to hand "
            f"items on while the main segment waits {main.input_wait_fraction:.0%} of the time for them; send "
            "fewer bytes per item (decode or crop on the workers, compress) or run the workers nearer"
        )
    return None


class StatsView:
    """The main process's view of a running service's statistics: the shared table, the
    main process's own row, and which rows and channels belong to which process (from the
    topology, so no row is found by position)."""

    def __init__(self, table: StatsTable, topology: Any, pid: int) -> None:
        self.table = table
        self.main = table.writer(topology.main_row)  # written by the main process's reads
        self.main.start()
        self._topology = topology
        self._pid = pid
        self._lending_before = lending()  # the process's counters run across services

    def asleep_for(self, seconds: float) -> bool:
        """Whether the lane of every child has slept in one channel wait for at least
        ``seconds``, without waking: then none of them can write or read anything that
        would wake another, and only the main process could."""
        rows = [row for link in self._topology.children() for row in link.stats_rows]
        since = [self.table.asleep_since(row) for row in rows]
        latest = time.monotonic() - seconds
        return bool(since) and all(0.0 < t <= latest for t in since)

    def writers(self, link: Any) -> tuple[StatsWriter, ...]:
        """The rows ``link``'s lanes write, in lane order."""
        return tuple(self.table.writer(row) for row in link.stats_rows)

    def snapshot(self) -> Stats:
        """Every process's counters as of now, added up per segment, with a verdict."""
        table, main, topology = self.table, self.main, self._topology
        main.busy = max(0.0, time.monotonic() - table.read(topology.main_row)["started"] - main.wait_input)
        main.items_out = main.items_in
        main.publish()
        processes = []
        queued_to_main = 0
        for link in topology.children():
            found = make_process_stats(
                link.role.value,
                link.index,
                link.process.pid if link.process is not None else 0,
                [table.read(row) for row in link.stats_rows],
            )
            if link.data:  # a worker: exact and current, from this end of its channels
                traffic = [receiver.traffic() for receiver in link.data]
                queued = sum(t.queued_messages for t in traffic)
                queued_to_main += queued
                found = replace(found, bytes_out=sum(t.bytes for t in traffic), queued=queued)
            processes.append(found)
        # The main process's queue is the workers' channels towards it.
        mine = make_process_stats("main", 0, self._pid, [table.read(topology.main_row)])
        processes.append(replace(mine, queued=queued_to_main))
        now, before = lending(), self._lending_before
        return aggregate(processes, now._replace(lent=now.lent - before.lent, copied=now.copied - before.copied))
