"""Statistics of a running service, as the user reads them: per process, per segment,
and a one-sentence verdict naming what limits throughput, or saying that the pipeline keeps
up (``MultiProcessingReadingService.stats()``).

Plain frozen data, computed in the main process from the shared counters table
(``runtime/stats.py``, read by ``runtime/main/stats.py``). Loaded when statistics are
asked for, or kept as a service stops; never on the path to a loader's first item.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .autoscale import usable_cores
from .segment import Segment
from .transport import Lending


@dataclass(frozen=True)
class ProcessStats:
    """What one process did since the service started.

    Attributes:
        role: the segment the process runs: "dispatch", "worker" or "main" (a ``Segment``,
            which is a str, so ``role == "worker"`` reads as it looks).
        index: the worker's id; 0 for the dispatch and main processes.
        pid: its process id (a Ray actor's, on its node, with the Ray backend).
        items_in: items it received from the segment before it.
        items_out: items it handed on.
        busy_s: seconds running its DataPipes.
        waiting_input_s: seconds waiting for items to come in.
        waiting_output_s: seconds waiting for room to hand items on.
        bytes_out: bytes it wrote to its output channels.
        elapsed_s: seconds since it started.
        queued: items waiting in its output channel(s), where known.
        rescues: lost wake-ups the transport's watchdog made up for (0 unless there is a bug).
        late_wakeups: wake-ups the watchdog delivered because the process meant to wake the
            other end was kept off the CPU between publishing and waking (a loaded machine;
            each cost up to 0.1 s of latency, never an item).
        node: the cluster node it runs on, with a backend that places children on nodes;
            "" otherwise.
        messages_out: messages written to its output channels (each carries a batch of items).
        refused_connections: connections to its listening ports closed unread because they
            did not prove the service's secret (a Ray actor's data channels; 0 locally).
        in_service_s: the main process only: seconds inside the main segment's ``next()``,
            the waits for input included (not the user's loop); 0 where not measured.
        receiving_s: the main process only: seconds taking messages out of the channels
            and rebuilding their items.
        first_ask_s: the main process only: seconds from the service's start until the loop
            first asked for an item; 0: not yet.
        first_item_s: the main process only: seconds from the service's start until the loop
            first got an item; 0: not yet.
        large_built_in_place: large buffers it sent that were built straight into the memory
            that crosses (a batch collated into the channel's lend area): never copied.
        large_copied_in: large buffers it sent by copying them into that memory.
        private_bytes: children: memory only this process holds (its copies of pages it
            shared with the main process included), as last sampled; 0 where not measured.
        private_growth_bytes: children: the growth of ``private_bytes`` since it started.
        resident_growth_bytes: children: the growth of its resident memory since it started.
    """

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
    messages_out: int = 0  # messages written to its output channels (each carries a batch of items)
    # Connections to its listening ports that were closed unread: they did not prove the
    # service's secret (a Ray actor's data channels; always 0 for local processes).
    refused_connections: int = 0
    # The main process only: seconds inside the main segment's next() (not in the user's
    # loop; the waits for input included), and taking messages out of the channels and
    # rebuilding their items. 0 where not measured.
    in_service_s: float = 0.0
    receiving_s: float = 0.0
    # The main process only: seconds from the service's start until the loop first asked for
    # an item, and until it first got one (its start, not its steady state); 0: not yet.
    first_ask_s: float = 0.0
    first_item_s: float = 0.0
    # Large buffers it sent: built straight into the memory that crosses (a batch that
    # default_collate stacked into the channel's lend area), so never copied by it; and
    # those it copied into that memory.
    large_built_in_place: int = 0
    large_copied_in: int = 0
    # Children: bytes of memory only this process holds (copies of pages it shared with the
    # main process included), as last sampled, and its growth since the process started;
    # the growth of its resident memory beside it. 0 where not measured (docs/memory.md).
    private_bytes: int = 0
    private_growth_bytes: int = 0
    resident_growth_bytes: int = 0
    # Wake-ups the watchdog delivered because the process meant to wake the other end was
    # kept off the CPU between publishing and waking (a loaded machine, not a bug).
    late_wakeups: int = 0

    @property
    def copied_bytes(self) -> int:
        """Growth of its private memory beyond its resident memory's: pages it shared (with
        the main process, after a fork) and holds a copy of now. Its own allocations grow both."""
        return max(0, self.private_growth_bytes - max(0, self.resident_growth_bytes))

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def input_wait_fraction(self) -> float:
        return self.waiting_input_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def output_wait_fraction(self) -> float:
        return self.waiting_output_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def main_segment_s(self) -> float:
        """The main process: seconds running the main segment's own DataPipes (what the
        service did for the loop's next() besides waiting for items and receiving them)."""
        return max(0.0, self.in_service_s - self.waiting_input_s - self.receiving_s)

    @property
    def loop_s(self) -> float:
        """The main process: seconds outside the service once the loop first asked for an
        item: the user's loop (the training step, DataLoader2's own work, the time between
        epochs)."""
        inside = max(self.in_service_s, self.waiting_input_s + self.receiving_s)
        return max(0.0, self.elapsed_s - self.first_ask_s - inside)


def make_process_stats(
    role: Segment, index: int, pid: int, rows: list[dict[str, float]], now: float | None = None
) -> ProcessStats:
    """Add up the rows of one process's lanes (its elapsed time is its first lane's, up to
    ``now`` on the ``time.monotonic`` clock: when the rows were read; by default, now)."""
    started = min((row["started"] for row in rows if row["started"]), default=0.0)
    elapsed = (time.monotonic() if now is None else now) - started if started else 0.0
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
        late_wakeups=int(total("late_wakeups")),
        messages_out=int(total("messages_out")),
        in_service_s=total("in_service"),
        receiving_s=total("receiving"),
        first_ask_s=total("first_ask"),
        first_item_s=total("first_item"),
        large_built_in_place=int(total("lent_in_place")),
        large_copied_in=int(total("lent_copied")),
        **_memory(rows),
    )


def _memory(rows: list[dict[str, float]]) -> dict[str, int]:
    """A process's memory, from the lanes that sampled it (each samples the whole process)."""
    sampled = [row for row in rows if row.get("private_now") or row.get("resident_now")]
    if not sampled:
        return {}
    last = max(sampled, key=lambda row: row["private_now"])
    return {
        "private_bytes": int(last["private_now"]),
        "private_growth_bytes": int(last["private_now"] - min(row["private_start"] for row in sampled)),
        "resident_growth_bytes": int(last["resident_now"] - min(row["resident_start"] for row in sampled)),
    }


@dataclass(frozen=True)
class SegmentStats:
    """The processes of one segment, added up (fractions are averages over its processes).

    Attributes:
        segment: "dispatch", "worker" or "main" (a ``Segment``, which is a str).
        processes: how many processes run it.
        items_in: items they received, all together.
        items_out: items they handed on, all together.
        busy_fraction: share of their time spent running their DataPipes.
        input_wait_fraction: share of their time spent waiting for items to come in.
        output_wait_fraction: share of their time spent waiting for room to hand items on.
        bytes_out: bytes they wrote to their output channels.
        messages_out: messages they wrote to their output channels.
        receiving_fraction: the main segment only: share of the main process's time spent
            taking items out of the channels; 0 where not measured.
        main_segment_fraction: the main segment only: share spent running the main
            segment's own DataPipes.
        loop_fraction: the main segment only: share spent in the user's loop. With the input
            wait and the two above, these add up to the whole.
        starting_fraction: the main segment only: share spent before the loop first asked
            for an item.
    """

    segment: Segment  # a str: ``s.segment == "worker"`` reads as before
    processes: int
    items_in: int
    items_out: int
    busy_fraction: float
    input_wait_fraction: float
    output_wait_fraction: float
    bytes_out: int
    messages_out: int = 0
    # The main segment only: shares of the main process's time spent taking items out of the
    # channels, running the main segment's own DataPipes, and in the user's loop (with the
    # input wait above, they add up to the whole); 0 where not measured.
    receiving_fraction: float = 0.0
    main_segment_fraction: float = 0.0
    loop_fraction: float = 0.0
    starting_fraction: float = 0.0  # until the loop first asked for an item


@dataclass(frozen=True)
class DeviceFeed:
    """What ``pin_memory=True`` (and ``device=``) did in the main process.

    Attributes:
        device: where items were moved, e.g. "cuda:0"; "" when they were only page-locked.
        items: items handed to the loop.
        bytes_to_device: tensor bytes the service copied to the device.
        pinned_copies: tensors that were not page-locked and were copied into such memory.
        waited_on_copy: items handed out while their copy to the device still ran (the
            loop's stream waits for it on the device): many mean the copies, not the
            workers, pace the loop.
    """

    device: str  # where items were moved; "" when they were only page-locked
    items: int  # items handed to the loop
    bytes_to_device: int  # tensor bytes copied to the device by the service
    pinned_copies: int  # tensors that were not page-locked and were copied into such memory
    # Items handed out while their copy to the device still ran (the loop's stream waits
    # for it on the device): many mean the copies, not the workers, pace the loop.
    waited_on_copy: int

    def summary(self) -> str:
        if not self.device:
            return f"  pinned: {self.items:,} items page-locked, {self.pinned_copies:,} tensors copied to do so"
        return (
            f"  to {self.device}: {self.items:,} items, {self.bytes_to_device / 1e6:,.1f} MB copied ahead of the loop; "
            f"{self.waited_on_copy:,} handed out before their copy finished; "
            f"{self.pinned_copies:,} tensors copied into page-locked memory first"
        )


@dataclass(frozen=True)
class Stats:
    """A snapshot of a running service: per process, per segment, and a verdict.

    ``print(stats)`` shows ``summary()``; every count adds up over all the epochs since the
    service started.

    Attributes:
        processes: one ``ProcessStats`` per process: the dispatch process, the workers and
            the main process.
        segments: one ``SegmentStats`` per segment, its processes added up.
        bottleneck: the verdict: a sentence naming what limits throughput, or saying that
            the pipeline keeps up.
        large_buffers: a ``Lending(lent, copied, held_buffers, held_bytes)``: large buffers
            the main process received as views of shared memory or copied (the user held
            too many already, or the worker had no room left to lend), and those held now
            by any service of this process.
        device: with ``pin_memory=True``, what was page-locked and moved to the device;
            None otherwise.
        epochs: epochs begun since the service started.
        replacements: dead workers replaced (``worker_restarts``), in order: each a record
            with ``worker``, ``pid``, ``cause`` ("SIGKILL", "exit code 3"), ``epoch``,
            ``items``, ``rss_bytes``, ``out_of_memory`` and ``poison``.
        main_memory_bytes: the main process's resident memory when the service started,
            against which the workers' memory growth is judged.
        memory: the sentence naming workers that copy what they share with the main
            process (copy-on-access); "" when none do.
    """

    processes: tuple[ProcessStats, ...]
    segments: tuple[SegmentStats, ...]
    bottleneck: str
    # Large buffers the main process received since the service started: lent as views
    # of shared memory, or copied (the user held too many already, or the worker had no
    # room left to lend); and those held now, by any service of this process (docs/stats.md).
    large_buffers: Lending = Lending(0, 0, 0, 0)
    # With pin_memory=True: what was page-locked and moved to the device (docs/gpu.md).
    device: DeviceFeed | None = None
    # Epochs begun since the service started: every count above adds up over all of them.
    epochs: int = 0
    # Dead workers replaced (``worker_restarts``), in order: each a record with ``worker``,
    # ``pid``, ``cause`` ("SIGKILL", "exit code 3"), ``epoch``, ``items``, ``rss_bytes``,
    # ``out_of_memory``, ``poison`` and ``oom_kill`` (docs/worker-restarts.md).
    replacements: tuple[Any, ...] = ()

    @property
    def replacement_causes(self) -> dict[str, int]:
        """How many dead workers were replaced, by how they ended."""
        causes: dict[str, int] = {}
        for made in self.replacements:
            causes[made.cause] = causes.get(made.cause, 0) + 1
        return causes
    # The main process's resident memory when the service started, against which the
    # workers' growth is judged, and the sentence naming copy-on-access ("" when none).
    main_memory_bytes: int = 0
    memory: str = ""
    # num_workers="auto": the count chosen, how it got there and why ("" otherwise).
    workers_chosen: str = ""

    # The timeline's rings, when one is recorded (``timeline=True``): read by ``timeline()``.
    trace: Any = field(default=None, repr=False, compare=False)

    def timeline(self) -> dict[str, Any]:
        """What every process did, when, as a Chrome trace-event JSON object (Perfetto,
        ``chrome://tracing``, ``python -m mprs_plus timeline``): read from the rings now,
        the last spans of each process (docs/profiling.md). ValueError when no timeline was
        recorded: pass ``timeline=True`` to the loader or the reading service."""
        if self.trace is None:
            raise ValueError(
                "no timeline was recorded: pass timeline=True to mprs_plus.DataLoader or "
                "MultiProcessingReadingService; it is recorded with worker processes of this machine "
                "(num_workers > 0, no Ray backend) once an epoch began"
            )
        from .timeline import trace

        return trace(self.trace, {made.pid: made.cause for made in self.replacements})

    def write_timeline(self, path: str | os.PathLike[str]) -> str:
        """Write ``timeline()`` to ``path`` (JSON); returns the path."""
        import json

        with open(path, "w") as f:
            json.dump(self.timeline(), f)
        return os.fspath(path)

    def scalars(self, prefix: str = "mprs_plus/") -> dict[str, float]:
        """The figures worth a chart, flat, for a logger: Lightning's ``log_dict``,
        TensorBoard's ``add_scalar``, ``wandb.log`` (docs/profiling.md, Loggers). Names
        start with ``prefix``; 0.0 where not measured yet."""
        main, workers = self.segment(Segment.MAIN), self.segment(Segment.WORKER)
        loop = next((p for p in self.processes if p.role == Segment.MAIN), None)
        each = [p for p in self.processes if p.role == Segment.WORKER]
        found = {
            "items_per_s": loop.items_in / loop.elapsed_s if loop is not None and loop.elapsed_s > 0 else 0.0,
            "loop_wait_share": main.input_wait_fraction if main is not None else 0.0,
            "workers_busy_share": workers.busy_fraction if workers is not None else 0.0,
            "workers_waiting_for_space_share": workers.output_wait_fraction if workers is not None else 0.0,
            "replacements": float(len(self.replacements)),
            "workers_private_mib": sum(p.private_bytes for p in each) / 2**20,
            "workers_copied_mib": sum(p.copied_bytes for p in each) / 2**20,
        }
        return {prefix + name: float(value) for name, value in found.items()}

    def segment(self, name: str) -> SegmentStats | None:
        return next((s for s in self.segments if s.segment == name), None)

    @property
    def refused_connections(self) -> int:
        """Connections every process's listening ports closed unread, added up."""
        return sum(p.refused_connections for p in self.processes)

    def __str__(self) -> str:
        return self.summary()  # what print(stats) shows; repr(stats) stays the dataclass's

    def summary(self) -> str:
        lines = [self.bottleneck]
        if self.workers_chosen:
            lines.append(f"  {self.workers_chosen}")
        if self.segments:
            over = f"{self.epochs} epoch{'s' if self.epochs != 1 else ''}" if self.epochs else "every epoch so far"
            lines.append(f"  counts since the service started, over {over} (not per epoch):")
        placed = [p for p in self.processes if p.node]
        if placed:
            lines.append("  on nodes: " + ", ".join(f"{p.role} {p.index}: {p.node}" for p in placed))
        for s in self.segments:
            lines.append(
                f"  {s.segment:<8} x{s.processes}: in {s.items_in:>9,} out {s.items_out:>9,}  "
                f"busy {s.busy_fraction:4.0%}  waiting for input {s.input_wait_fraction:4.0%}  "
                f"waiting for space {s.output_wait_fraction:4.0%}  {s.bytes_out / 1e6:,.1f} MB sent"
            )
        main = self.segment(Segment.MAIN)
        if main is not None and (main.loop_fraction or main.receiving_fraction or main.main_segment_fraction):
            lines.append(
                f"  the main process's time: starting {main.starting_fraction:.0%}, waiting for the workers' items "
                f"{main.input_wait_fraction:.0%}, taking "
                f"them out of the channels {main.receiving_fraction:.0%}, the main segment's DataPipes "
                f"{main.main_segment_fraction:.0%}, your loop {main.loop_fraction:.0%}"
            )
        # Children on other nodes: what each sent over the network, message by message.
        for p in placed:
            lines.append(
                f"  {p.role} {p.index} sent {p.items_out:,} items in {p.messages_out:,} messages"
                f"{_per_message(p.items_out, p.messages_out)}, {p.bytes_out / 1e6:,.1f} MB: "
                f"busy {p.busy_fraction:.0%}, waiting for space {p.output_wait_fraction:.0%}"
            )
        refused = self.refused_connections
        if refused:
            # Someone who does not hold the secret reached a port: worth a look at who.
            whose = {Segment.DISPATCH: "dispatch process's", Segment.WORKER: "workers'", Segment.MAIN: "main's"}
            at = {p.role for p in self.processes if p.refused_connections}
            roles = [whose[role] for role in Segment if role in at]
            lines.append(
                f"  {refused:,} connection{'s' if refused != 1 else ''} refused at the {' and '.join(roles)} ports "
                "(they did not prove the service's secret)"
            )
        built = sum(p.large_built_in_place for p in self.processes)
        copied_in = sum(p.large_copied_in for p in self.processes)
        if built or copied_in:
            lines.append(
                f"  large buffers sent: {built:,} built straight into shared memory (no copy), "
                f"{copied_in:,} copied into it"
            )
        large = self.large_buffers
        if large.lent or large.copied:
            lines.append(
                f"  large buffers: {large.lent:,} handed over as views of shared memory, {large.copied:,} copied "
                f"(too many held, or no room to lend); {large.held_buffers:,} held now, {large.held_bytes / 1e6:,.1f} MB"
            )
        workers = [p for p in self.processes if p.role == Segment.WORKER and p.private_bytes]
        if workers:
            lines.append(
                f"  workers' private memory: {sum(p.private_bytes for p in workers) / 2**20:,.0f} MiB across "
                f"{len(workers)}, {_signed_mib(sum(p.private_growth_bytes for p in workers))} since they started "
                f"({_signed_mib(sum(p.copied_bytes for p in workers))} of it pages copied from what they shared; "
                f"the main process held {self.main_memory_bytes / 2**20:,.0f} MiB at the start)"
            )
        if self.device is not None:
            lines.append(self.device.summary())
        if self.replacements:
            causes = ", ".join(f"{cause} x{count}" for cause, count in self.replacement_causes.items())
            poison = sum(1 for made in self.replacements if made.poison)
            oom = sum(1 for made in self.replacements if getattr(made, "oom_kill", False))
            lines.append(
                f"  dead workers replaced: {len(self.replacements)} ({causes})"
                + (f"; {oom} killed by the out-of-memory killer" if oom else "")
                + (f"; {poison} item{'s' if poison != 1 else ''} left out (killed two workers)" if poison else "")
            )
        return "\n".join(lines)


def aggregate(
    processes: list[ProcessStats], large_buffers: Lending | None = None, main_memory_bytes: int = 0
) -> Stats:
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
                messages_out=sum(p.messages_out for p in members),
                receiving_fraction=_share(members, lambda p: p.receiving_s),
                main_segment_fraction=_share(members, lambda p: p.main_segment_s),
                loop_fraction=_share(members, lambda p: p.loop_s),
                starting_fraction=_share(members, lambda p: p.first_ask_s),
            )
        )
    large = large_buffers if large_buffers is not None else Lending(0, 0, 0, 0)
    network = any(p.node for p in processes)  # children placed on nodes talk over the network
    each_worker = [p for p in processes if p.role == Segment.WORKER]
    # Local workers share this host's cores: past one a core, more of them add nothing.
    cores = 0 if network else _host_cores()
    verdict = bottleneck(segments, network=network, startup=_startup(processes), each_worker=each_worker, cores=cores)
    memory = copying(processes, main_memory_bytes)
    if memory:
        verdict = f"{memory}. Throughput: {verdict}"
    return Stats(
        tuple(processes), tuple(segments), verdict, large, main_memory_bytes=main_memory_bytes, memory=memory
    )


@functools.cache
def _host_cores() -> int:
    """``usable_cores()``, read once a process: a statistics read comes at every epoch's
    end (the memory check), and the cgroup's files cost a tenth of a millisecond."""
    return usable_cores()


def _signed_mib(n: int) -> str:
    return f"{'+' if n >= 0 else '-'}{abs(n) / 2**20:,.0f} MiB"


# The workers' private memory grew, together, by more than this share of what the main
# process held at the start, and mostly by copies of pages they shared with it: the verdict
# names copy-on-access (docs/memory.md).
COPYING_SHARE = 0.25
# ...and by at least this many bytes: a small process's workers copying a few pages of the
# interpreter's own objects are not worth a warning.
COPYING_AT_LEAST = 256 * 2**20


def copying(processes: list[ProcessStats], main_memory_bytes: int) -> str:
    """The sentence naming copy-on-access, or "" when the workers do not copy much.

    Judged on the workers' private memory growth since they started (``ProcessStats``):
    it must exceed ``COPYING_SHARE`` of the main process's resident memory at the start and
    ``COPYING_AT_LEAST`` bytes, and at least half of it must be pages copied from what the
    workers shared (private memory grew where resident memory did not: a worker's own
    allocations, decoded images say, grow both and are not this)."""
    workers = [p for p in processes if p.role == Segment.WORKER and p.private_bytes]
    growth = sum(max(0, p.private_growth_bytes) for p in workers)
    copied = sum(p.copied_bytes for p in workers)
    if not workers or main_memory_bytes <= 0:
        return ""
    if growth <= COPYING_SHARE * main_memory_bytes or growth < COPYING_AT_LEAST or 2 * copied < growth:
        return ""
    n = len(workers)
    return (
        f"workers are copying the dataset they share with the main process (+{growth / 2**30:.2f} GiB across "
        f"{n} worker{'s' if n != 1 else ''}; the main process held {main_memory_bytes / 2**30:.2f} GiB at the "
        "start): each Python object a worker reads has its reference count changed, and the kernel copies its "
        "page into that worker. Hold the records as numpy or Arrow columns, or in a mprs_plus.SharedList, "
        "which every worker maps without a copy (see 'Memory' in the docs)"
    )


def _share(members: list[ProcessStats], seconds: Callable[[ProcessStats], float]) -> float:
    """The main process's split of its time, as a fraction of its life; 0 for other roles
    and where the split was not measured (no in_service or receiving time counted)."""
    measured = [p for p in members if p.role == Segment.MAIN and p.elapsed_s > 0 and (p.in_service_s or p.receiving_s)]
    return sum(seconds(p) / p.elapsed_s for p in measured) / len(measured) if measured else 0.0


def _startup(processes: list[ProcessStats]) -> tuple[float, float]:
    """(seconds of the main process's life before the loop got its first item, or before
    its last child began to run, its life so far): the waits of a short run are mostly the
    service starting, not its work."""
    main = next((p for p in processes if p.role == Segment.MAIN), None)
    children = [p.elapsed_s for p in processes if p.role != Segment.MAIN and p.elapsed_s > 0]
    if main is None or not children or main.elapsed_s <= 0:
        return 0.0, 0.0
    # Until the loop held its first item: the service and its workers starting, the first
    # item made and carried; where not measured, until the last child ran.
    return max(0.0, main.elapsed_s - min(children), main.first_item_s), main.elapsed_s


def _seconds(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _per_message(items: int, messages: int) -> str:
    return f" ({items / messages:,.1f} items per message)" if messages else ""


# The main process waits for items less than this share of its life: the pipeline keeps up.
KEEPS_UP = 0.2


# One worker this much busier than another that waits for room (rule 2's uneven workers).
UNEVEN = 0.2


def bottleneck(
    segments: list[SegmentStats],
    *,
    network: bool = False,
    startup: tuple[float, float] = (0.0, 0.0),
    each_worker: Sequence[ProcessStats] = (),
    cores: int = 0,
) -> str:
    """One sentence naming what limits throughput and what to do about it, or saying that
    the pipeline keeps up and there is nothing to change. Never both.

    ``network``: a backend placed the children on a cluster's nodes (Ray's), so their
    channels are the network; otherwise they are this host's transport. ``startup``: the
    seconds the main process lived before its last child began to run, and its whole life
    so far. ``cores``: the cores this host lets the workers use, where they run on it (0:
    unknown, or on a cluster's nodes). Fractions are of each process's lifetime so far;
    ``W`` is the share of its life the main process waited for the workers' items. The
    rules, in order:

    0. W > 50% and most of the main process's life (> 50%) went by before the children
       ran: their start, which says nothing yet of the steady state.
    1. W < 20% (``KEEPS_UP``): the items are there when the loop asks; the main process
       sets the pace. Of its time, the largest share names what: the main segment's own
       DataPipes (the main segment), taking items out of the channels (the transport, or
       the network), or the user's loop: the pipeline keeps up.
    2. Otherwise the loop waits for items, and the verdict names what keeps them from
       coming: the channel to the main process when the workers too wait to hand items on
       (> 50%) and W > 50%; the dispatch process when it is busy (> 70%) and the workers wait
       for its items (> 50%); one worker when it is busy (>= 50%) and busier by ``UNEVEN``
       than another that waits for room (> 20%): the loop takes the workers' items in
       turn, so all go at the slowest one's pace (``each_worker``: the workers' own
       figures); the workers when they are busy (>= 50%: add workers, unless there are as
       many as ``cores`` already, when another would only share a core with one); the
       channel from the dispatch process when the workers wait for its items; else the
       channel to the main process (idle workers whose items are slow to cross). "Add
       workers" is never said of idle workers.
    """
    by_name = {s.segment: s for s in segments}
    workers, main, dispatch = by_name.get(Segment.WORKER), by_name.get(Segment.MAIN), by_name.get(Segment.DISPATCH)
    if workers is None or main is None:
        return "no statistics yet: the service has not run an epoch"
    if main.items_in == 0 and workers.items_out == 0:
        return "no items have moved yet"
    waits = main.input_wait_fraction
    starting, lived = startup
    if lived > 0 and starting / lived > 0.5 and (waits > 0.5 or main.starting_fraction + waits > 0.5):
        how = " (Ray starts an actor for each, on its node)" if network else ""
        return (
            f"starting the workers took most of the time so far: {_seconds(starting)} s of the main process's "
            f"{_seconds(lived)} s went by before the loop had its first item (the workers starting{how}, the first "
            "items made and carried); they start once and serve every epoch, so ask again after a longer run to "
            "see what limits the flow of items"
        )
    channel = "the network" if network else "the transport"
    if waits < KEEPS_UP:
        return _main_process_sets_the_pace(main, channel)
    if workers.output_wait_fraction > 0.5 and waits > 0.5:
        # Both ends wait on the channel between them: it moves the bytes too slowly.
        if network:
            return (
                f"the network is the bottleneck: workers wait {workers.output_wait_fraction:.0%} of the time to hand "
                f"items on while the main process waits {waits:.0%} of the time for them; send fewer bytes per item "
                "(decode or crop on the workers, compress) or run the workers nearer"
            )
        return (
            f"the transport is the bottleneck: workers spend {workers.output_wait_fraction:.0%} of the time handing "
            f"items on (serializing them, waiting for space) while the main process waits {waits:.0%} of the time "
            "for them; send fewer bytes per item, as arrays or tensors rather than many small Python objects"
        )
    if dispatch is not None and workers.input_wait_fraction > 0.5 and dispatch.busy_fraction > 0.7:
        return (
            f"the dispatch process is the bottleneck: it is {dispatch.busy_fraction:.0%} busy while the workers "
            f"wait {workers.input_wait_fraction:.0%} of the time for items and the main process waits {waits:.0%} "
            "of the time for theirs; move work after the dispatcher (sharding_round_robin_dispatch)"
        )
    uneven = _uneven(each_worker)
    if uneven is not None:
        slow, waiting = uneven
        return (
            f"worker {slow.index} is the bottleneck: it is {slow.busy_fraction:.0%} busy while worker "
            f"{waiting.index} waits {waiting.output_wait_fraction:.0%} of the time for room in its channel and the main "
            f"process waits {waits:.0%} of the time for items; the loop takes the workers' items in turn, so all go "
            f"at the pace of the slowest: find what makes worker {slow.index} slower (its share of the samples, "
            "what else runs on its core), or take items as they are ready (in_order=False)"
        )
    if workers.busy_fraction >= 0.5:
        said = (
            f"the workers are the bottleneck: they are {workers.busy_fraction:.0%} busy and the main process waits "
            f"{waits:.0%} of the time for their items"
        )
        if cores and workers.processes >= cores:
            # Another worker would take its core from one of these: the same work, shared.
            return (
                f"{said}; each of this host's {cores} usable cores already runs one of the {workers.processes} "
                "workers, so more workers would only share them: make the work per item cheaper, or run the "
                "workers on more cores (backend=\"ray\" places them on a cluster's nodes)"
            )
        return f"{said}; add workers, or make the work per item cheaper"
    # Mostly idle workers and a waiting loop: the items are slow to cross, not to make.
    if dispatch is not None and workers.input_wait_fraction > 0.5:
        between = "between the dispatch process and the workers" if network else "from the dispatch process"
        return (
            f"{channel} {between} is the bottleneck: the workers are only {workers.busy_fraction:.0%} busy and "
            f"wait {workers.input_wait_fraction:.0%} of the time for dispatched items, while the dispatch "
            f"process is {dispatch.busy_fraction:.0%} busy; each item crosses at a cost of its own: dispatch "
            "fewer, bigger items (batch them before sharding_round_robin_dispatch); more workers will not help"
        )
    per_message = _per_message(workers.items_out, workers.messages_out)
    if network:
        return (
            f"the network is the bottleneck: the workers are only {workers.busy_fraction:.0%} busy while the "
            f"main process waits {waits:.0%} of the time for their items, which cross the network from the Ray "
            f"actors to the training process at a cost per message{per_message}; send fewer, bigger items (batch "
            "them in the worker segment), or use local workers; more workers will not help"
        )
    return (
        f"the transport is the bottleneck: the workers are only {workers.busy_fraction:.0%} busy while the "
        f"main process waits {waits:.0%} of the time for their items, which cross to the main process at a cost "
        f"per message{per_message}; send fewer, bigger items (batch them in the worker segment); more workers "
        "will not help"
    )


def _uneven(each_worker: Sequence[ProcessStats]) -> tuple[ProcessStats, ProcessStats] | None:
    """(the busiest worker, the one waiting longest for room) where the first is busy
    (>= 50%) and busier by ``UNEVEN`` than the second, which waits for room (> 20%)."""
    if len(each_worker) < 2:
        return None
    slow = max(each_worker, key=lambda p: p.busy_fraction)
    waiting = max(each_worker, key=lambda p: p.output_wait_fraction)
    if (
        slow is not waiting
        and slow.busy_fraction >= 0.5
        and waiting.output_wait_fraction > 0.2
        and slow.busy_fraction - waiting.busy_fraction >= UNEVEN
    ):
        return slow, waiting
    return None


def _main_process_sets_the_pace(main: SegmentStats, channel: str) -> str:
    """The loop seldom waits for items: name the largest share of the main process's time."""
    waits = main.input_wait_fraction
    own, receiving = main.main_segment_fraction, main.receiving_fraction
    # Where the split was not measured, everything but the wait counts as the loop's.
    loop = main.loop_fraction if (own or receiving or main.loop_fraction) else 1.0 - waits
    if own > max(receiving, loop):
        return (
            f"the main segment is the bottleneck: its DataPipes (those from the first non-replicable one on, run "
            f"in the main process) take {own:.0%} of the main process's time, while it waits only {waits:.0%} of "
            f"the time for the workers' items; move their work before the first non-replicable DataPipe so that "
            "the workers run it (the plan's warnings name such stages); more workers will not help"
        )
    if receiving > loop:
        return (
            f"{channel} is the bottleneck: the main process spends {receiving:.0%} of its time taking items out of "
            f"the workers' channels (rebuilding them from their bytes), more than on anything else; send fewer, "
            "bigger items (batch them in the worker segment), as arrays or tensors rather than many small Python "
            "objects; more workers will not help"
        )
    return (
        f"the pipeline keeps up: the main process waits only {waits:.0%} of the time for the workers' items, "
        f"and your loop (the training step, and DataLoader2 handing items over) takes {loop:.0%}: it sets the "
        "pace. Nothing to change in the pipeline; more workers will not help"
    )
