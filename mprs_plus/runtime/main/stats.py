"""The main process's view of the shared statistics table: which rows belong to which
child (from the topology, so no row is found by position), the main process's own row,
and a snapshot as ``mprs_plus.stats.Stats`` when statistics are asked for.

    worker w  --(writes its own rows)-->  [ StatsTable ]  <--(reads)-- StatsView.read()
    dispatch  --(writes its own rows)-->

The main process's own row also says where its time went, so that the verdict can tell
the service's work from the user's loop::

    the user's loop --next()--> ServiceClock (in_service) --> the main segment's DataPipes
        --> the workers' reader --> wait for a channel (wait_input), take a message out (receiving)

The report types load when a report is first made: not when a service starts, and not in
a stop, which keeps the figures as read (``Readings``) for a report made later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from torch.autograd import _profiler_enabled
from torch.autograd.profiler import record_function
from torch.utils.data import IterDataPipe

from ...segment import Segment
from ...transport import lending
from ..private_memory import resident
from ..stats import StatsTable, StatsWriter
from ..timeline import LaneTrace, Span, ServiceTrace, TimelineSource, TimelineTable

if TYPE_CHECKING:
    from ...stats import Stats


class StatsView:
    """The main process's view of a running service's statistics: the shared table, the
    main process's own row, and which rows and channels belong to which process (from the
    topology, so no row is found by position)."""

    def __init__(
        self, table: StatsTable, topology: Any, pid: int, placement: Any = None, timeline: TimelineTable | None = None
    ) -> None:
        self.table = table
        self._placement = placement  # children elsewhere: their rows are fetched, their nodes named
        self.main = table.writer(topology.main_row)  # written by the main process's reads
        self.main.start()
        # The timeline's rings, when one is recorded (``runtime/timeline.py``): the loop's
        # (the main row's) and the service's events (epochs, checkpoints, replacements).
        self.timeline = timeline
        self.service: ServiceTrace | None = None
        if timeline is not None:
            self.main.trace = timeline.ring(topology.main_row)
            self.main.trace.begin(Span.STEP)
            self.service = ServiceTrace(timeline.ring(timeline.service_row))
        self._topology = topology
        self._pid = pid
        self._lending_before = lending()  # the process's counters run across services
        # What the main process held as the service started: the workers' growth is judged
        # against it (``mprs_plus.stats.copying``). Its resident size: a cheap read.
        self.main_memory = resident()

    def writers(self, link: Any) -> tuple[StatsWriter, ...]:
        """The rows ``link``'s lanes write, in lane order (with their rings of the timeline)."""
        found = tuple(self.table.writer(row) for row in link.stats_rows)
        if self.timeline is not None:
            for writer in found:
                writer.trace = self.timeline.ring(writer._row)
        return found

    def timeline_source(self) -> TimelineSource | None:
        """What ``Stats.timeline()`` reads: the rings and whose they are; None when none is recorded."""
        if self.timeline is None:
            return None
        rows = [
            (link.role, link.index, k, row)
            for link in self._topology.children()
            for k, row in enumerate(link.stats_rows)
        ]
        rows.append((Segment.MAIN, 0, 0, self._topology.main_row))
        return TimelineSource(self.timeline, tuple(rows), self.main.trace)

    def read(self, epochs: int = 0) -> Readings:
        """What a snapshot is made of, read now from the table and the channels (which a
        stop then releases): plain figures, made into every process's counters added up per
        segment, with a verdict, by ``Readings.build``; ``epochs``: those begun so far,
        which the counts add up over. The report's types are not needed to read, so a stop
        that keeps the figures does not load them."""
        table, main, topology, placement = self.table, self.main, self._topology, self._placement
        if placement is not None:
            placement.refresh_stats(table, list(topology.children()))
        main.busy = max(0.0, time.monotonic() - table.read(topology.main_row)["started"] - main.wait_input)
        main.items_out = main.items_in
        main.publish()
        children = []
        queued_to_main = 0
        for link in topology.children():
            process = link.process
            node = refused = None
            if placement is not None and process is not None:
                node = placement.node_of(process)
                refused = placement.refused_connections(process)
            traffic = [receiver.traffic() for receiver in link.data]  # a worker's channels to this process
            counted = None
            if any(t.messages for t in traffic):
                # Exact and current, from this end. A receiver that leaves the counting to its
                # sender (a stream's) counts nothing: the worker's own row says it, as published.
                counted = (
                    sum(t.bytes for t in traffic),
                    sum(t.messages for t in traffic),
                    sum(t.queued_messages for t in traffic),
                )
            rows = [table.read(row) for row in link.stats_rows]
            if link.data:  # the main process's queue: what this worker sent and it did not read yet
                queued_to_main += counted[2] if counted else int(sum(row["queued"] for row in rows))
            pid = process.pid if process is not None else 0
            children.append((link.role, link.index, pid, rows, node, refused, counted))
        now, before = lending(), self._lending_before
        lent = now._replace(lent=now.lent - before.lent, copied=now.copied - before.copied)
        main_row = table.read(topology.main_row)
        main_part = (self._pid, main_row, queued_to_main)
        return Readings(children, main_part, lent, self.main_memory, epochs, self.timeline_source(), time.monotonic())


class Readings:
    """A statistics snapshot's figures as read (``StatsView.read``), made into the report
    (``mprs_plus.stats.Stats``) by ``build``."""

    __slots__ = ("children", "main", "lent", "main_memory", "epochs", "trace", "at")

    def __init__(
        self, children: list[Any], main: tuple[Any, ...], lent: Any, main_memory: Any, epochs: int, trace: Any, at: float
    ) -> None:
        self.children, self.main, self.lent, self.main_memory = children, main, lent, main_memory
        self.epochs, self.trace, self.at = epochs, trace, at  # at: when read (time.monotonic)

    def build(self) -> Stats:
        from ...stats import aggregate, make_process_stats

        processes = []
        for role, index, pid, rows, node, refused, counted in self.children:
            found = make_process_stats(role, index, pid, rows, self.at)
            if node:
                found = replace(found, node=node)
            if refused:
                found = replace(found, refused_connections=refused)
            if counted is not None:
                found = replace(found, bytes_out=counted[0], messages_out=counted[1], queued=counted[2])
            processes.append(found)
        # The main process's queue is the workers' channels towards it.
        pid, main_row, queued_to_main = self.main
        mine = make_process_stats(Segment.MAIN, 0, pid, [main_row], self.at)
        processes.append(replace(mine, queued=queued_to_main))
        # Children placed on nodes (p.node): the verdict names the network for their channels.
        return replace(aggregate(processes, self.lent, self.main_memory), epochs=self.epochs, trace=self.trace)


class _InService:
    """The loop's iterator over the main segment: adds the seconds spent getting each item
    to ``writer.in_service``, from the loop's ``next()`` to the item found (or the end).

    A class, not a generator: a generator suspended at its ``yield`` keeps the last item it
    handed out alive for as long as the loop holds the iterator, after ``shutdown()`` too,
    and with it the lent buffer's shared memory."""

    __slots__ = ("_items", "_writer", "_first", "_at_end", "_profile_name", "_returned")

    def __init__(
        self,
        items: Iterator[Any],
        writer: StatsWriter,
        first: bool,
        at_end: Callable[[], None] | None = None,
        profile_name: str | None = None,
    ) -> None:
        self._items, self._writer, self._first, self._at_end = items, writer, first, at_end
        self._profile_name = profile_name
        self._returned = 0.0  # when the last item was handed to the loop (the timeline's step)

    def __iter__(self) -> _InService:
        return self

    def __next__(self) -> Any:
        clock = time.perf_counter
        asked = clock()
        try:
            item = next(self._items)
        except StopIteration:
            ended = clock()
            self._writer.in_service += ended - asked
            trace = self._writer.trace
            if trace is not None:
                self._traced(trace, asked, ended)
                trace.write(Span.EPOCH_END, ended, ended)
            if self._at_end is not None:
                self._at_end()  # the epoch's end: its counts are complete (memory as last sampled)
            raise
        got = clock()
        self._writer.in_service += got - asked
        trace = self._writer.trace  # the timeline's, when one is recorded
        if trace is not None:
            self._traced(trace, asked, got)
        if self._first:  # the service's first item: the end of its start, for the verdict
            self._first = False
            self._writer.first_item = time.monotonic() - self._writer.started_at
            if trace is not None:
                trace.span(Span.STARTUP, trace.began, got)
        return item

    def _traced(self, trace: LaneTrace, asked: float, got: float) -> None:
        """On the timeline: the loop's own time since its last item, then this ``next()``."""
        if self._returned:
            trace.item(self._returned, asked, got, Span.NEXT)
        else:
            trace.span(Span.NEXT, asked, got)
        self._returned = got

    def close(self) -> None:
        """As the loop closes its iterator: the main segment's own end."""
        close = getattr(self._items, "close", None)
        if close is not None:
            close()


class _ProfiledInService(_InService):
    """``_InService`` whose ``next()`` is a profiler range while a profiler runs (a class of
    its own: a loop that is not profiled this way pays nothing for it)."""

    __slots__ = ()

    def __next__(self) -> Any:
        if _profiler_enabled():
            with record_function(self._profile_name):
                return _InService.__next__(self)
        return _InService.__next__(self)


class ServiceClock(IterDataPipe):
    """The outermost DataPipe of the main segment: counts the seconds the user's loop spends
    waiting on ``next()`` (``in_service``), so that what is left of the main process's time
    is the loop's own. Copies (pickled, deep-copied) iterate without counting.

    ``at_end`` runs when an epoch's items are all handed out (the memory check of
    ``Figures``)."""

    def __init__(
        self,
        source: Any,
        writer: StatsWriter | None,
        at_end: Callable[[], None] | None = None,
        reads_workers: bool = False,
    ) -> None:
        self.source = source
        self._writer = writer
        self._at_end = at_end
        self._reads_workers = reads_workers  # the source is the workers' reader, which torch does not profile
        self._profile_name: str | None = None

    def profile_as_datapipe(self) -> None:
        """Mark each ``next()`` with a profiler range, as torch marks a DataPipe's: under
        DataLoader2, torchdata's reading service shows its main-process reader this way.
        Only where the source is the workers' reader: a DataPipe of the user's there is
        marked by torch itself."""
        if not self._reads_workers:
            return
        try:  # torch's own naming, a private function of torch's
            from torch.utils.data.datapipes._hook_iterator import _generate_iterdatapipe_msg

            self._profile_name = _generate_iterdatapipe_msg(self.source, simplify_dp_name=True)
        except Exception:  # moved or changed: what it gives for our reader
            self._profile_name = f"{type(self.source).__name__}()"

    def __getstate__(self) -> dict[str, Any]:
        return {"source": self.source}  # the writer's table crosses no process boundary

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.source, self._writer, self._at_end = state["source"], None, None
        self._reads_workers, self._profile_name = False, None


def _iterate_clocked(self: ServiceClock) -> Iterator[Any]:
    items = iter(self.source)
    writer = self._writer
    if writer is None:
        return items
    first = not writer.first_ask
    if first:
        # The service's first epoch: the time before is the start, not the steady state
        # the verdict is about.
        writer.first_ask = time.monotonic() - writer.started_at
    kind = _InService if self._profile_name is None else _ProfiledInService
    return kind(items, writer, first, self._at_end, self._profile_name)


# Assigned after the class is made: torch's DataPipe metaclass would wrap an ``__iter__``
# of the class body with per-item bookkeeping.
ServiceClock.__iter__ = _iterate_clocked  # type: ignore[method-assign]
