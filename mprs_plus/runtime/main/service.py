"""The running service as the reading service sees it: a facade over three parts.

    ServiceRuntime --> Supervisor   (supervisor.py)  processes, control messages, stop
                   --> MainReader   (reader.py)      the epoch, the reads, death diagnosis
                   --> StatsView    (stats.py)       the statistics table
    all three built around one Topology (topology.py): which children, which channels

    main segment <- WorkerReader k <- [data channel per (worker, output k)] <- worker w, lane k
                                       [control channel per child] -> dispatch, workers
    worker w <- [data channel per (dispatcher d, worker w)] <- dispatch process, lane d

Every blocking read also watches every child's sentinel, so a dead child is an error
at once, never a hang.

Why this cannot deadlock. Every channel has one writing thread and one reader, and every
wait is on a channel, a lock held only inside ``next()``, or a child's sentinel:

* control messages are drained by a listener thread in each child, so the main process
  waits to send one only while a child is stopped or stuck, and then for a bounded time
  (``supervisor.py``); the stop closes the control channels instead of sending;
* a child thread never waits while holding unsent items, nor writes a channel while
  holding a lock (``lanes.py``); several outputs of a worker, or several dispatchers,
  write separate channels from separate threads, so a consumer that wants one output never
  waits behind another output's full channel;
* a reader about to block also drops stale messages from every channel it reads
  (``mux.py``), so no producer stays blocked on data of an abandoned epoch;
* pausing sends messages and waits for nothing.

What remains is inherent to a deterministic round-robin with bounded channels: the main
process waits for worker w's turn, w waits for its dispatched items, the dispatcher waits
for room at worker w', and w' waits for the main process to read it. The cycle closes only
when the per-worker item counts drift apart by more than the channels hold (a filter or a
flat-map after a dispatcher that keeps far more items on some workers than on others).
With one worker output, ``in_order=False`` reads whichever worker is ready, so w' is
always read and the cycle cannot close. When it does close, the read raises
``PipelineStuckError`` instead of waiting forever (``reader.MainChannels._wait_watching``:
every child's lane asleep in a channel wait, per the always-kept ``liveness.py`` slots, while
the main process waits), whether statistics are collected or not.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from torch.utils.data import IterDataPipe
from torch.utils.data.graph import traverse_dps

from ...errors import ServiceClosedError
from ...options import Options
from ...plan import Plan
from ...segment import Segment
from ...transport import Receiver, Sender
from ...transport._lend import pinning_as_now
from .lifecycle import stop_at_exit
from .gate import CLOSED_MESSAGE
from .reader import MainReader
from ..control_messages import Limit, Pause, Redeal, Reset, Resume, pack, pack_ends, take_back_ends
from .cursor import ReadCursor
from ..pausing import pause_datapipes, resume_datapipes
from ..segments import build_dispatch_sources, build_main_pipeline, build_worker_program
from ..stats import StatsTable
from ..timeline import ServiceTrace, Span, TimelineTable
from .stats import ServiceClock, StatsView
from .family import Figures
from .state import Lifecycle, State
from ..liveness import Liveness
from ..window import ItemWindow
from .supervisor import CONTROL_BYTES, CONTROL_ITEMS, Supervisor
from .lifecycle import DEATH_GRACE
from .replacement import LostItem, Replacements
from .topology import ChildLink, Topology, plan_topology
from ..child.worker import WorkerSetup, worker_main
from ..generators import GeneratorRecord, ReceivedRecords, SentRecord

if TYPE_CHECKING:
    from ...stats import Stats
    from .inprocess import InProcessRuntime

_DATA_BYTES = 64 << 20
# Items a replacement hands on one by one (``Reset.careful``): more than a worker's lane
# holds unsent at most (a message of 64 items, ``child/batching.py``), so the item its
# predecessor died making is among them: a replacement that dies making it too has sent
# every item before it, and the poison item's error takes exactly its place.
CAREFUL_ITEMS = 65
_STATS_LOG = logging.getLogger("mprs_plus.stats")


def open_runtime(datapipe: Any, plan: Plan, options: Options) -> ServiceRuntime | InProcessRuntime:
    """The runtime for ``plan``: child processes, or none when nothing runs in workers.
    Each kind's modules load when a plan needs it (a cold start waits for every import)."""
    if not plan.uses_processes:
        from .inprocess import InProcessRuntime

        return InProcessRuntime(datapipe, options)
    return ServiceRuntime(plan, options)


def warnings_for(plan: Plan, options: Options) -> list[str]:
    """What the user should hear about running ``plan`` with ``options``: the plan's own
    footguns, and the options that do not fit it."""
    found = list(plan.warnings)
    if not options.in_order and len(plan.worker_outputs) > 1 and plan.uses_processes:
        found.append(
            f"in_order=False with {len(plan.worker_outputs)} worker outputs: each output is read as its items "
            "arrive, so a main-process DataPipe that joins outputs by position (zip) pairs items by arrival, not "
            "by index. Keep in_order=True for such joins."
        )
    return found


class WorkerReader(IterDataPipe):
    """The main segment's input for one worker output: the workers' items for the current
    epoch, round-robin (or as they are ready, with ``in_order=False``).

    An ``IterDataPipe`` so that DataLoader2 and torch's graph tools accept it as the
    root of the main segment; graph traversal finds nothing behind it. It holds the
    main-side reader, not the facade: the main segment never keeps the service alive.
    """

    def __init__(self, reader: MainReader, branch: int = 0) -> None:
        self._reader = reader
        self._branch = branch

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerReader:
        return self  # one reader per service, whatever copies the main segment


def _iterate_reader(reader: WorkerReader) -> Iterator[Any]:
    return reader._reader.iterate(reader._branch)


# Assigned after the class is made, on purpose: torch's DataPipe metaclass wraps an
# ``__iter__`` found in the class body with per-item bookkeeping (profiling, iterator
# validity checks) that costs more than the shared-memory transport per item.
WorkerReader.__iter__ = _iterate_reader  # type: ignore[method-assign]


class ServiceRuntime:
    """The running service, as the reading service sees it: the children and the main
    segment they feed. ``InProcessRuntime`` (``inprocess.py``) has the same surface.

    It stops on ``stop()``, when it is garbage collected, and at interpreter exit,
    whichever comes first. Its parts never reference it back, so dropping the last
    reference stops the children at once, without waiting for a garbage collection.
    Its state (``lifecycle``, ``state.py``) is the supervisor's.
    """

    in_processes = True

    def __init__(self, plan: Plan, options: Options) -> None:
        self.plan = plan
        self.options = options
        self._topology: Topology = plan_topology(plan, options.num_workers)
        self._ctx = multiprocessing.get_context(options.multiprocessing_context)
        placement = options.backend.open(self._ctx) if options.backend is not None else None
        self._supervisor = Supervisor(self._topology, self._ctx, placement)
        self.lifecycle: Lifecycle = self._supervisor.lifecycle
        self._reader: MainReader | None = None
        self._main: Any = None  # the main segment, once started
        # Replacing dead workers (``replacement.py``), when ``worker_restarts`` allows it:
        # each worker's setup, and what it was last sent (its epoch's Reset, then any
        # Pause/Resume/Limit), which a replacement is sent again.
        self._replacements: Replacements | None = None
        self._setups: dict[int, WorkerSetup] = {}
        self._sent: dict[int, list[Any]] = {}
        # Workers that send their generator records in-band (not of this host: Ray actors),
        # their records as the main process read them (``generators.ReceivedRecords``).
        self._received_records: dict[int, ReceivedRecords] | None = None
        self._handovers: _Handovers | None = None  # Redeals sent to the dispatch process
        self._service_trace: ServiceTrace | None = None  # the timeline's service events, when recorded
        self.figures = Figures()
        if self._supervisor.placement.on_this_host:
            # The children's figures are in this host's shared memory: read once they closed
            # their channels, their last figures published, while the kernel ends their
            # processes, rather than before they are told to stop (the first read imports
            # the report types: milliseconds a child blocked on a full channel would wait).
            self._supervisor.once_quiet(self.figures.freeze)
        else:
            self._supervisor.at_stop(self.figures.freeze)  # fetched from the children, before they stop
        weakref.finalize(self, self._supervisor.stop)
        stop_at_exit(self._supervisor)

    @property
    def counts_handed_out(self) -> bool:
        """Whether the reader's cursor counts what the user receives (the main segment is
        one worker output as is); else the main segment is counted at its end."""
        return isinstance(self._main, WorkerReader)

    def start(self) -> Any:
        """Open every channel and prepare every child; return the main segment, ready to
        iterate once an epoch begins.

        Under fork the children start in the first ``begin_epoch``, each with its first
        epoch already waiting in its control channel: worker 0 works on its first item
        while the main process still forks the others. Under spawn and forkserver they
        start here, where a segment that cannot be pickled is reported, and boot while
        the first epoch is sent."""
        supervisor, topology = self._supervisor, self._topology
        stats = None
        if self.options.collect_stats:
            timeline = None
            if self.options.timeline and supervisor.placement.on_this_host:  # rings in this host's memory
                timeline = TimelineTable(self._ctx, topology.stats_rows, self.options.timeline_capacity)
            stats = StatsView(
                StatsTable(self._ctx, topology.stats_rows), topology, os.getpid(), supervisor.placement, timeline
            )
        self._service_trace = stats.service if stats is not None else None
        # Kept whatever the options: a stuck read's evidence (and, to replace dead workers, the item each makes).
        liveness = Liveness(self._ctx, topology.stats_rows, positions=bool(self.options.worker_restarts))
        lanes = [row for link in topology.children() for row in link.stats_rows]
        replace = None
        if self.options.worker_restarts:
            if topology.dispatch is not None and not supervisor.placement.on_this_host:
                supervisor.stop()
                raise ValueError(
                    "worker_restarts with a dispatch process (sharding_round_robin_dispatch) is supported with local "
                    "workers only: a dispatch actor cannot be handed a replacement's channels. Pass worker_restarts=0 "
                    "with this backend (and take checkpoints to resume after a lost actor), or run local workers"
                )
            outputs = [self.plan.graph.datapipes[index] for index in self.plan.worker_outputs]
            skips_lost = len(outputs) == 1 and bool(getattr(outputs[0], "skips_lost", False))
            self._replacements = Replacements(
                self.options.worker_restarts,
                skips_lost,
                self.options.restarts_used,
                getattr(supervisor.placement, "oom_kills", None),
            )
            self.figures.replacements = self._replacements.made
            replace = pinning_as_now(_weak_method(self, ServiceRuntime._replace_worker))  # its channels pinned as ours
            if not supervisor.placement.on_this_host:
                self._received_records = {link.index: ReceivedRecords() for link in topology.workers}
        if replace is not None and topology.dispatch is not None and self._ctx is not None:
            self._handovers = handovers = _Handovers(self._ctx)
            dispatch = topology.dispatch
            supervisor.once_ended(lambda: handovers.take_back_untaken(dispatch))
        try:
            windows = _wire_children(
                self.plan, self.options, topology, supervisor, stats, liveness, self._ctx, self._setups,
                self._handovers,
            )
            self.lifecycle.advance(State.PREPARED)
            if self._ctx.get_start_method() != "fork" or supervisor.placement.start_at_once:
                supervisor.launch_all()
            else:
                _prime_graph_walks(self.plan)
            self._reader = MainReader(
                topology,
                supervisor.gate,
                supervisor.death_error,
                supervisor.stop,
                self.options.in_order,
                self.options.timeout,
                stats.main if stats is not None else None,
                lambda seconds: liveness.asleep_for(lanes, seconds),
                windows,
                replace,
                self._received_records,
                getattr(supervisor.placement, "death_grace", DEATH_GRACE),
            )
            self.figures.watch(stats, self._reader)
            # Weakly: the reader holds the supervisor's methods (a cycle would outlive the service).
            supervisor.when_released(_weak_method(self._reader, MainReader.drop_held, gone_ok=True))
            readers = [WorkerReader(self._reader, k) for k in range(topology.outputs)]
            self._main = build_main_pipeline(self.plan, readers)
        except BaseException:
            supervisor.stop()
            raise
        if self._replacements is not None and supervisor.placement.on_this_host:
            # A process of another node cannot be sampled here: its memory stays unknown.
            workers = topology.workers
            self._replacements.memory.start(
                self.lifecycle, lambda: [link.process.pid for link in workers if link.process is not None]
            )
        if self.options.stats_interval is not None:
            _start_stats_logger(self.figures, self.options.stats_interval, self.lifecycle)
        if stats is None:
            return self._main
        # What the loop iterates: the main segment, its time counted apart from the loop's.
        return ServiceClock(self._main, stats.main, self.figures.check_memory, isinstance(self._main, WorkerReader))

    # -- epochs, pause, resume, limit ----------------------------------------------------

    def begin_epoch(
        self, seed_generator: Any, iter_reset_fn: Any = None, skips: Sequence[int] = (), next_worker: int = 0
    ) -> Any:
        """Seed the main segment and open a new epoch everywhere; items of earlier epochs
        still in flight are dropped. Returns None: the main segment stays the same object
        (``InProcessRuntime`` may return a new one).

        ``seed_generator`` None leaves seeding to ``iter_reset_fn``, which may hand each worker
        its own function through ``iter_reset_fn.for_worker(w)``.

        A restored epoch passes ``skips[w]``, the items worker w drops before sending (the
        user had them), and ``next_worker``, whose turn comes first (``restore.py``).
        Children not started yet start here, one after another, each with its Reset
        already queued (see ``start``)."""
        reader = self._started()
        if reader.epoch:
            self.figures.check_memory()  # the epoch before may have been left unfinished
        if seed_generator is not None:  # None: a front end that seeds its workers itself (its reset function does)
            from torchdata.dataloader2.graph import set_graph_random_seed  # only where torchdata's seeding is used

            set_graph_random_seed(self._main, seed_generator)
        epoch = reader.begin_epoch(next_worker, skips)
        if self._service_trace is not None:
            self._service_trace.instant(Span.EPOCH, epoch)
        topology, supervisor = self._topology, self._supervisor
        resets: list[tuple[ChildLink, Reset]] = []  # all pickled before any child starts
        if topology.dispatch is not None:
            resets.append((topology.dispatch, Reset(epoch, pack((seed_generator, iter_reset_fn)))))
        # A reset function with ``for_worker(w)`` gives each worker its own (its share of an epoch's work).
        share = getattr(iter_reset_fn, "for_worker", None)
        for link in topology.workers:
            skip = (skips[link.index],) if skips else ()
            seeds = seed_generator.spawn(link.index) if seed_generator is not None else None
            reset_fn = share(link.index) if share is not None else iter_reset_fn
            resets.append((link, Reset(epoch, pack((seeds, reset_fn)), skip)))
        launching = supervisor.pending
        if self._replacements is not None:
            self._sent = {link.index: [reset] for link, reset in resets if link.role is Segment.WORKER}
            if not launching:
                # A worker that died while no epoch was read: replaced now, and sent this
                # epoch's Reset as it starts (seeded anew: see docs/worker-restarts.md).
                replaced = set(reader.replace_dead())
                resets = [(link, reset) for link, reset in resets if link not in replaced]
        try:
            if launching:
                self._launch_with(resets, next_worker)
            else:
                for link, reset in resets:
                    supervisor.send(link, reset)
        except BaseException:
            if launching:
                supervisor.stop()  # a child failed to start: stop those that did, release every channel
            raise
        return None

    def _launch_with(self, resets: list[tuple[ChildLink, Reset]], first_worker: int) -> None:
        """Start the children for their first epoch. The ones the first item needs (the
        dispatch process, and the worker whose turn comes first) start first, with their
        Reset already queued, so they work on it while the main process forks the others;
        the others get theirs once all are forked, so that on a machine with few cores
        they do not take the CPU the forks need."""
        supervisor, workers = self._supervisor, self._topology.workers
        urgent = [link for link in (self._topology.dispatch, workers[first_worker % len(workers)]) if link is not None]
        reset_of = dict(resets)
        for link in urgent:
            supervisor.send_first(link, reset_of.pop(link))
        supervisor.launch_all()
        for link, reset in reset_of.items():
            supervisor.send(link, reset)

    def worker_processes(self) -> list[Any]:
        """Each worker as torch's loader shows its own (``handles.ChildHandle``)."""
        from .handles import ChildHandle

        return [ChildHandle(link) for link in self._topology.workers]

    def read_cursor(self) -> ReadCursor | None:
        """What the main process handed out of the current epoch (one worker output), or
        None before it was read."""
        return self._started().cursors[0]

    def pause(self, pause_fn: Any = None) -> None:
        """pause() the main segment's DataPipes (e.g. fullsync, prefetch), then ask every
        child to stop producing at its next item boundary, pause() its DataPipes and run
        ``pause_fn`` on its segment. Waits for nothing: what the children already produced
        stays in their channels and in the main process's readers, in order."""
        pause_datapipes(self._main)
        self._broadcast(Pause, lambda link: pause_fn)

    def resume(self, resume_fn: Any = None) -> None:
        self._broadcast(Resume, lambda link: resume_fn)
        resume_datapipes(self._main)

    def limit(self, num_batches: int | None, limit_fn: Any) -> None:
        """Apply ``limit_fn`` as torchdata does: with a dispatch process, the dispatch
        process and the main segment get ``num_batches`` and each worker its share; without
        one, ``None`` everywhere."""
        if self._topology.dispatch is None:
            self._broadcast(Limit, lambda link: (None, limit_fn))
            limit_fn(self._main, None)
            return
        n = len(self._topology.workers)

        def share(link: ChildLink) -> tuple[int | None, Any]:
            if num_batches is None or link.role is Segment.DISPATCH:
                return (num_batches, limit_fn)
            return (num_batches // n + (link.index < num_batches % n), limit_fn)

        self._broadcast(Limit, share)
        limit_fn(self._main, num_batches)

    def _broadcast(self, kind: type[Pause | Resume | Limit], payload_of: Callable[[ChildLink], Any]) -> None:
        epoch = self._started().epoch
        for link in self._topology.children():
            message = kind(epoch, pack(payload_of(link)))
            if self._replacements is not None and link.role is Segment.WORKER:
                self._sent.setdefault(link.index, []).append(message)
            self._supervisor.send(link, message)

    # -- replacing a dead worker (``replacement.py``) -----------------------------------

    def _replace_worker(self, link: ChildLink, epoch: int, received: tuple[int, ...]) -> tuple[list[Any], ...]:
        """Start a new process for ``link``'s dead one, restored to ``received`` items per
        lane of ``epoch``; returns per lane the items the loop gets first (a ``LostItem``
        in the place of an item that killed two workers). Raises the user's error when
        the budget is spent."""
        replacements, supervisor = self._replacements, self._supervisor
        if replacements is None:
            raise RuntimeError("internal error: a worker replaced without worker_restarts")
        process = link.process
        trace = self._service_trace
        if trace is None:
            return self._replace(link, epoch, received)
        trace.instant(Span.DEATH, process.pid)  # on the dead life's track (``mprs_plus.timeline``)
        began = time.perf_counter()
        try:
            return self._replace(link, epoch, received)
        finally:
            trace.span(Span.REPLACING, began, time.perf_counter(), link.index)

    def note_span(self, kind: int, start: float, end: float) -> None:
        """A span of the service's events on the timeline (a checkpoint taken or restored,
        ``time.perf_counter()`` times), when one is recorded."""
        if self._service_trace is not None:
            self._service_trace.span(kind, start, end)

    def _replace(self, link: ChildLink, epoch: int, received: tuple[int, ...]) -> tuple[list[Any], ...]:
        replacements, supervisor = self._replacements, self._supervisor
        process = link.process
        process.join(DEATH_GRACE)
        setup = self._setups[link.index]
        record = setup.record if self._received_records is None else self._received_records[link.index]
        # Which item it died making: slots of this host's shared memory. A Ray actor writes
        # none: the items received stand for it (``Replacements.on_death``), unless it died
        # before its stream began (it sent no record of the epoch: ``ReceivedRecords.began``).
        if isinstance(record, ReceivedRecords):
            making = None if record.began(epoch) else (None,) * link.lanes
            record.new_actor()
        else:
            lanes = setup.liveness
            making = tuple(lane.making(epoch) for lane in lanes) or None
            for lane in lanes:
                lane.forget()  # the replacement has begun none yet
        made = replacements.on_death(
            link.index, process.pid, process.exitcode, epoch, received, supervisor.death_error, making
        )
        sent = self._sent.get(link.index, [])
        lost = tuple(made.items if made.poison else -1 for _ in received)
        skip = tuple(n + 1 if made.poison else n for n in received)
        dispatch = self._topology.dispatch
        opened = _open_worker_ends(supervisor.placement, self.options, link.lanes, dispatch.lanes if dispatch else 0)
        self._setups[link.index] = setup = setup._replace(
            control=opened.control_rx, data=opened.senders, inputs=opened.inputs
        )
        # Its statistics rows, liveness slots, item windows and generator record are the dead one's.
        try:
            supervisor.relaunch(link, opened.control, opened.receivers, worker_main, setup, opened.childs())
            if dispatch is not None:
                # Each dispatcher deals the new worker this epoch's items again, then goes on
                # dealing to it (``child/redeal.py``); the replacement replays from the start.
                payload = pack_ends(opened.dealt)
                try:
                    supervisor.send(dispatch, Redeal(link.index, payload))
                except BaseException:
                    take_back_ends(payload)  # never sent: nobody else will fetch them
                    raise
                if self._handovers is not None:
                    self._handovers.sent(payload)
        finally:
            for sender in opened.dealt:  # the dispatch process has its own now (or never will)
                with contextlib.suppress(Exception):
                    sender.release()
        if sent:
            first = sent[0]
            # The latest record at or before what the loop has (the poison item excluded).
            recorded = record.read(first.epoch, min(received)) if record is not None else None
            restore = pack(recorded) if recorded is not None else b""
            messages = [first._replace(skip=skip, restore=restore, lost=lost, careful=CAREFUL_ITEMS), *sent[1:]]
            for message in messages:
                if not self._send_to_replacement(link, message):
                    break
        lost_items: tuple[list[Any], ...] = tuple(
            [LostItem(link.index, made.items, made.pid, made.cause)] if made.poison else [] for _ in received
        )
        return lost_items

    def _send_to_replacement(self, link: ChildLink, message: Any) -> bool:
        """Send ``message`` to a replacement just started; False when it died already (the
        send found its reader gone): the next read finds it dead and replaces it in turn,
        sending the epoch's messages again, as for any death. Any other failure raises."""
        supervisor = self._supervisor
        try:
            supervisor.send(link, message)
            return True
        except Exception:
            if supervisor.lifecycle.closed:
                raise
            # Its ends close a moment before it can be reaped.
            link.process.join(getattr(supervisor.placement, "death_grace", DEATH_GRACE))
            if link.alive:
                raise
            return False

    def _started(self) -> MainReader:
        self._supervisor.gate.check()
        if self._reader is None:
            raise RuntimeError("internal error: the service was used before start()")
        return self._reader

    # -- statistics, stop ----------------------------------------------------------------

    def stats(self) -> Stats:
        """Every process's counters as of now, added up per segment, with a verdict; once
        the stop began, as they stood then."""
        return self.figures.snapshot()

    def stop(self) -> None:
        self._supervisor.stop()


def _wire_children(
    plan: Plan,
    options: Options,
    topology: Topology,
    supervisor: Supervisor,
    stats: StatsView | None,
    liveness: Liveness | None = None,
    ctx: Any = None,
    setups: dict[int, WorkerSetup] | None = None,
    handovers: _Handovers | None = None,
) -> dict[int, ItemWindow]:
    """Open every channel of ``topology``, fill in every link's endpoints (the one place
    that writes them) and freeze the topology; have the supervisor ready to start each
    child (dispatch process first). Every end is handed over as soon as it is open (to its
    link, or to the supervisor to hold for a child), so a failure half-way leaves the
    supervisor able to release everything opened so far. Returns the item window of each
    worker data channel, by the ``id`` of its receiver, when the options ask for windows
    (``Options.items_ahead``, workers of this host only: ``window.py``); ``setups``, when
    given, gets each worker's setup (a replacement starts from it, ``replace_worker``).

    Opening a channel commits no ring memory (pages are committed as messages first touch
    them, ``transport/_memory.py``), so this costs a few system calls per channel."""
    program = build_worker_program(plan)
    dispatch_sources = build_dispatch_sources(plan)
    placement = supervisor.placement
    dispatch = topology.dispatch if dispatch_sources is not None else None
    if dispatch is not None:
        dispatch.control, dispatch_control = placement.open_channel(
            capacity_items=CONTROL_ITEMS, capacity_bytes=CONTROL_BYTES, control=True
        )
        supervisor.hold(dispatch_control)
    opened: dict[int, _WorkerEnds] = {}
    for link in topology.workers:
        ends = _open_worker_ends(placement, options, link.lanes, dispatch.lanes if dispatch is not None else 0)
        supervisor.hold(*ends.childs(), *ends.dealt)  # between two children, both ends belong to them
        link.control, link.data = ends.control, ends.receivers
        opened[link.index] = ends
    if dispatch is not None and dispatch_sources is not None:
        sources, groups = dispatch_sources
        from ..child.dispatch import DispatchSetup, dispatch_main  # only a plan with a dispatch segment needs it

        setup = DispatchSetup(
            sources,
            len(topology.workers),
            dispatch_control,
            tuple(tuple(opened[w.index].dealt[d] for w in topology.workers) for d in range(dispatch.lanes)),
            options.dispatch_init_fn,
            groups,
            min(64, options.dispatch_channel_items),
            stats.writers(dispatch) if stats is not None else (),
            tuple(liveness.lane(row) for row in dispatch.stats_rows) if liveness is not None else (),
            redeals=bool(options.worker_restarts),
            taken=handovers.taken if handovers is not None else None,
        )
        supervisor.prepare(dispatch, dispatch_main, setup)  # prepared first: it starts first
    windowed = options.items_ahead is not None and placement.on_this_host and ctx is not None
    windows: dict[int, ItemWindow] = {}
    for link in topology.workers:
        ends = opened[link.index]
        lane_windows = []
        if windowed:
            lane_windows = [windows.setdefault(id(rx), ItemWindow(ctx, options.items_ahead)) for rx in ends.receivers]
        setup = WorkerSetup(
            worker_id=link.index,
            num_workers=len(topology.workers),
            program=program,
            control=ends.control_rx,
            data=ends.senders,
            inputs=ends.inputs,
            init_fn=options.worker_init_fn,
            reset_fn=options.worker_reset_fn,
            stats=stats.writers(link) if stats is not None else (),
            liveness=tuple(liveness.lane(row) for row in link.stats_rows) if liveness is not None else (),
            windows=tuple(lane_windows),
            record=_generator_record(options, supervisor.placement, ctx),
        )
        if setups is not None:
            setups[link.index] = setup
        supervisor.prepare(link, worker_main, setup)
    topology.freeze()
    return windows


def _generator_record(options: Options, placement: Any, ctx: Any) -> GeneratorRecord | SentRecord | None:
    """Where a worker records its generators for a replacement (``generators.py``): shared
    memory on this host; its data channel from a Ray actor, whose memory dies with it."""
    if not options.worker_restarts or ctx is None:
        return None
    return GeneratorRecord(ctx) if placement.on_this_host else SentRecord()


class _Handovers:
    """The ``Redeal`` payloads sent to the dispatch process, and how many of them it took
    (``taken``, a counter in shared memory it adds to before it fetches one's descriptors).
    multiprocessing's resource sharer keeps a copy of each descriptor until it is fetched:
    once the stop ended the dispatch process, the payloads it never took (it died before
    it read them, or gave up fetching them) are taken back here, or those copies would stay open for this process's
    life."""

    def __init__(self, ctx: Any) -> None:
        self.taken = ctx.RawValue("q", 0)
        self._sent: list[bytes] = []

    def sent(self, payload: bytes) -> None:
        self._sent.append(payload)

    def take_back_untaken(self, dispatch: ChildLink) -> None:
        process = dispatch.process
        if process is None or process.exitcode is None:
            return  # never started, or could not be ended (it may still fetch them): left alone
        untaken, self._sent = self._sent[self.taken.value :], []
        for payload in untaken:
            take_back_ends(payload)


class _WorkerEnds(NamedTuple):
    """The channels of one worker, opened together (``_open_worker_ends``)."""

    control: Sender  # main -> the worker: the main process's end
    control_rx: Receiver  # the worker's
    senders: tuple[Sender, ...]  # the worker's, one per output lane
    receivers: tuple[Receiver, ...]  # the main process's
    dealt: tuple[Sender, ...]  # dispatcher d -> the worker: the dispatch process's, one per dispatcher
    inputs: tuple[Receiver, ...]  # the worker's

    def childs(self) -> list[Any]:
        """The ends that belong to the worker process."""
        return [self.control_rx, *self.senders, *self.inputs]


def _open_worker_ends(placement: Any, options: Options, lanes: int, dispatchers: int) -> _WorkerEnds:
    """Open a worker's control channel, a data channel per output lane, and an input channel
    per dispatcher: as the service starts, and for a replacement. Closes what it opened
    when one fails to open."""
    opened: list[Any] = []

    def channel(items: int, size: int, control: bool = False, refill_at_half: bool = False) -> tuple[Any, Any]:
        ends = placement.open_channel(
            capacity_items=items, capacity_bytes=size, control=control, refill_at_half=refill_at_half
        )
        opened.extend(ends)
        return ends

    try:
        control, control_rx = channel(CONTROL_ITEMS, CONTROL_BYTES, control=True)
        # A worker with one output and no dispatcher feeds nothing but its own channel: it
        # may sleep until half of that was read (a wake-up per batch saved; see transport
        # _ring.py). With a dispatcher, or lanes that share a source, a reader waiting for
        # another process could be waiting for this one's next item.
        refill = lanes == 1 and dispatchers == 0
        data = [channel(options.items_in_flight_per_worker, _DATA_BYTES, refill_at_half=refill) for _ in range(lanes)]
        inputs = [channel(options.dispatch_channel_items, _DATA_BYTES) for _ in range(dispatchers)]
    except BaseException:
        for end in opened:
            with contextlib.suppress(Exception):
                end.close()
        raise
    return _WorkerEnds(
        control,
        control_rx,
        tuple(tx for tx, _ in data),
        tuple(rx for _, rx in data),
        tuple(tx for tx, _ in inputs),
        tuple(rx for _, rx in inputs),
    )


def _weak_method(owner: Any, method: Callable[..., Any], gone_ok: bool = False) -> Callable[..., Any]:
    """``method`` bound to ``owner`` through a weak reference: what the reader holds must
    not keep the runtime alive (its finalizer stops the children). Once ``owner`` is gone a
    call raises ``ServiceClosedError``, or with ``gone_ok`` does nothing."""
    ref = weakref.ref(owner)

    def call(*args: Any) -> Any:
        live = ref()
        if live is None:
            if gone_ok:
                return None
            raise ServiceClosedError(CLOSED_MESSAGE)
        return method(live, *args)

    return call


def _prime_graph_walks(plan: Plan) -> None:
    """Under fork, before the children start: walk their segments once here, as torch's
    graph walk (``traverse_dps``) will in every child, in ``apply_sharding`` and in each
    epoch's seeding.

    That walk asks ``isinstance(value, collections.abc.Collection)`` of every attribute of
    every DataPipe. The first answer for a type is slow (``abc`` checks it against every
    registered subclass of every ``Collection`` ABC, about a thousand checks for a
    three-stage pipeline) and is then cached on the ABC, and a forked child inherits the
    caches: asked once here instead of in every child, on its way to its first item.
    Best effort: a walk that fails here fails in the child too, which reports it."""
    with contextlib.suppress(Exception):
        for index in plan.worker_outputs:
            traverse_dps(plan.graph.datapipes[index])


def _start_stats_logger(figures: Figures, interval: float, lifecycle: Lifecycle) -> None:
    """Log ``stats().summary()`` every ``interval`` seconds until the service stops; holds the
    statistics only weakly, so it never keeps a dropped service alive."""
    lifecycle.every(interval, figures, lambda live: _STATS_LOG.info("%s", live.snapshot().summary()), "mprs_plus stats")

