"""Statistics of a running service, as the user reads them: per process, per segment,
and a one-sentence verdict naming the bottleneck (``MultiProcessingReadingService.stats()``).

Plain frozen data, computed in the main process from the shared counters table
(``runtime/stats.py``, read by ``runtime/main/stats.py``). Loaded when statistics are
asked for, or kept as a service stops; never on the path to a loader's first item.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .segment import Segment
from .transport import Lending


@dataclass(frozen=True)
class ProcessStats:
    """What one process did since the service started."""

    role: Segment  # the segment the process runs; a str, so role == "worker" also reads
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


def make_process_stats(role: Segment, index: int, pid: int, rows: list[dict[str, float]]) -> ProcessStats:
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

    segment: Segment  # a str: ``s.segment == "worker"`` reads as before
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
    for role in Segment:
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


def bottleneck(segments: list[SegmentStats]) -> str:
    """One sentence naming the stage that limits throughput, and what to do about it."""
    by_name = {s.segment: s for s in segments}
    workers, main, dispatch = by_name.get(Segment.WORKER), by_name.get(Segment.MAIN), by_name.get(Segment.DISPATCH)
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
