"""The main-process side of a running service: starts the processes, opens each epoch,
reads the workers' outputs, pauses and resumes them, and stops everything.

    main segment <- WorkerReader k <- [data channel per (worker, output k)] <- worker w, lane k
                                       [control channel per child] -> dispatch, workers
    worker w <- [data channel per (dispatcher d, worker w)] <- dispatch process, lane d

Every blocking read also watches every child's sentinel, so a dead child is an error
at once, never a hang.

Why this cannot deadlock. Every channel has one writing thread and one reader, and every
wait is on a channel, a lock held only inside ``next()``, or a child's sentinel:

* control messages are drained by a listener thread in each child, so the main process
  never waits to send one;
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
always read and the cycle cannot close.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import pickle
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import IterDataPipe

from ..errors import ProcessDiedError, ServiceClosedError
from ..options import Options
from ..plan import Plan
from ..transport import ChannelBroken, ChannelError, EndOfStream, open_channel, wait_readable
from .diagnose import unpicklable_error
from .dispatch import DispatchSetup, dispatch_main
from .lifecycle import exit_description, stop_at_exit, stop_processes
from .messages import Kind
from .mux import ChannelMux
from .reader import read_as_ready, read_in_order
from .segments import build_dispatch_sources, build_main_pipeline, build_worker_program
from .stats import Stats, StatsTable, StatsWriter, aggregate, make_process_stats
from .worker import WorkerSetup, worker_main

# Control messages are small and rare; a few in flight is plenty.
_CONTROL_ITEMS = 4
_CONTROL_BYTES = 1 << 20
_DATA_BYTES = 64 << 20
_DEATH_GRACE = 2.0  # seconds a broken channel's process may take to be reaped
_STATS_LOG = logging.getLogger("mprs_plus.stats")


class WorkerReader(IterDataPipe):
    """The main segment's input for one worker output: the workers' items for the current
    epoch, round-robin (or as they are ready, with ``in_order=False``).

    An ``IterDataPipe`` so that DataLoader2 and torch's graph tools accept it as the
    root of the main segment; graph traversal finds nothing behind it.
    """

    def __init__(self, service: ServiceRuntime, branch: int = 0) -> None:
        self._service = service
        self._branch = branch

    def __getstate__(self) -> dict[str, Any]:
        return {}

    def __deepcopy__(self, memo: dict[int, Any]) -> WorkerReader:
        return self  # one reader per service, whatever copies the main segment


def _iterate_reader(reader: WorkerReader) -> Iterator[Any]:
    return reader._service.iterate(reader._branch)


# Assigned after the class is made, on purpose: torch's DataPipe metaclass wraps an
# ``__iter__`` found in the class body with per-item bookkeeping (profiling, iterator
# validity checks) that costs more than the shared-memory transport per item.
WorkerReader.__iter__ = _iterate_reader  # type: ignore[method-assign]


class ServiceResources:
    """Everything a running service must release: its processes and channel endpoints.

    Held by the ``ServiceRuntime`` facade, by its garbage-collection finalizer and by the
    exit hook, and by nothing else, so that dropping the facade can release it.
    """

    def __init__(self) -> None:
        self.owner_pid = os.getpid()
        self.stopped = False
        self.dispatch: Any = None
        self.workers: list[Any] = []
        self.controls: list[Any] = []  # senders to the dispatch process (first, if any) and workers
        self.data: list[Any] = []  # receivers from (worker w, output k), at w * outputs + k
        self.epoch = 0
        self.stopping = threading.Event()  # ends the periodic statistics logger
        self._drained: set[int] = set()  # data channels found closed while stopping

    def processes(self) -> list[Any]:
        return ([self.dispatch] if self.dispatch is not None else []) + self.workers

    def stop(self) -> None:
        """Stop every child and close every endpoint. Idempotent; a no-op in a forked child."""
        if self.stopped or os.getpid() != self.owner_pid:
            return
        self.stopped = True
        self.stopping.set()
        for control in self.controls:
            try:
                control.send((Kind.STOP, self.epoch, None))
            except ChannelError:
                pass
            control.close()
        stop_processes(self.processes(), drain=self._drain)
        for receiver in self.data:
            receiver.close()

    def _drain(self, timeout: float) -> None:
        """Discard worker output while stopping, so no worker stays blocked on a full channel."""
        open_receivers = [r for i, r in enumerate(self.data) if i not in self._drained]
        alive = {p.sentinel: p for p in self.processes() if p.exitcode is None}
        if not alive:
            return  # everyone exited since the caller looked: nothing left to wait for
        for ready in wait_readable(open_receivers, timeout, also=list(alive)):
            if ready in alive:
                # Its sentinel fired: the process is gone or in its last moments; reap it
                # rather than wake up again and again until the kernel lets us.
                alive[ready].join(_DEATH_GRACE)
                continue
            try:
                while ready.poll():
                    ready.recv(0)
            except ChannelError:
                self._drained.add(self.data.index(ready))


class ServiceRuntime:
    """The running service, as the reading service and the main segment see it.

    It stops on ``stop()``, when it is garbage collected, and at interpreter exit,
    whichever comes first.
    """

    def __init__(self, plan: Plan, options: Options) -> None:
        self.plan = plan
        self.options = options
        self._ctx = multiprocessing.get_context(options.multiprocessing_context)
        self._res = ServiceResources()
        self._outputs = 1
        self._mux: ChannelMux | None = None
        self._table: StatsTable | None = None
        self._rows: dict[tuple[str, int], list[int]] = {}  # (role, index) -> its lanes' rows
        self._main_stats: StatsWriter | None = None
        self._finalizer = weakref.finalize(self, self._res.stop)
        stop_at_exit(self._res)

    # -- start ---------------------------------------------------------------------------

    def start(self) -> Any:
        """Start every process; return the main segment, ready to iterate."""
        res, n = self._res, self.options.num_workers
        program = build_worker_program(self.plan)
        dispatch = build_dispatch_sources(self.plan)
        self._outputs = len(program.outputs)
        readers = [WorkerReader(self, k) for k in range(self._outputs)]
        main_pipeline = build_main_pipeline(self.plan, readers)
        stats = self._stats_rows(len(dispatch[0]) if dispatch is not None else 0, n)
        child_ends: list[Any] = []
        try:
            worker_inputs: list[list[Any]] = [[] for _ in range(n)]
            if dispatch is not None:
                sources, groups = dispatch
                buffer = self.options.dispatch_channel_items
                control_tx, control_rx = self._channel(_CONTROL_ITEMS, _CONTROL_BYTES)
                rows = []
                for _ in sources:
                    pairs = [self._channel(buffer, _DATA_BYTES) for _ in range(n)]
                    rows.append(tuple(tx for tx, _ in pairs))
                    for worker_id, (_, rx) in enumerate(pairs):
                        worker_inputs[worker_id].append(rx)
                setup = DispatchSetup(
                    sources,
                    n,
                    control_rx,
                    tuple(rows),
                    self.options.dispatch_init_fn,
                    groups,
                    min(64, buffer),
                    stats("dispatch", 0, len(sources)),
                )
                child_ends += [control_rx, *(tx for row in rows for tx in row)]
                child_ends += [rx for inputs in worker_inputs for rx in inputs]
                res.controls.append(control_tx)
                res.dispatch = self._start("mprs_plus dispatch process", dispatch_main, setup)
            for worker_id in range(n):
                control_tx, control_rx = self._channel(_CONTROL_ITEMS, _CONTROL_BYTES)
                pairs = [
                    self._channel(self.options.items_in_flight_per_worker, _DATA_BYTES) for _ in range(self._outputs)
                ]
                setup = WorkerSetup(
                    worker_id=worker_id,
                    num_workers=n,
                    program=program,
                    control=control_rx,
                    data=tuple(tx for tx, _ in pairs),
                    inputs=tuple(worker_inputs[worker_id]),
                    init_fn=self.options.worker_init_fn,
                    reset_fn=self.options.worker_reset_fn,
                    stats=stats("worker", worker_id, self._outputs),
                )
                child_ends += [control_rx, *(tx for tx, _ in pairs)]
                res.controls.append(control_tx)
                res.data.extend(rx for _, rx in pairs)
                res.workers.append(self._start(f"mprs_plus worker {worker_id}", worker_main, setup))
        except BaseException:
            res.stop()
            raise
        finally:
            for end in child_ends:
                end.release()  # each belongs to a child now
        sentinels = [p.sentinel for p in res.processes()]
        for receiver in res.data:
            receiver.watch(*sentinels)
        self._mux = ChannelMux(res.data, self._recv, self._wait_data)
        if self.options.stats_interval is not None:
            _start_stats_logger(self, self.options.stats_interval, res.stopping)
        return main_pipeline

    def _stats_rows(self, dispatchers: int, workers: int) -> Callable[[str, int, int], tuple[StatsWriter, ...]]:
        """Make the statistics table (a row per lane, and one for the main process) and
        return ``writers(role, index, lanes)`` handing out rows in order."""
        if not self.options.collect_stats:
            return lambda role, index, lanes: ()
        table = self._table = StatsTable(self._ctx, dispatchers + workers * self._outputs + 1)
        main_row = table.rows - 1
        self._main_stats = table.writer(main_row)
        self._main_stats.start()
        self._rows[("main", 0)] = [main_row]
        taken = [0]

        def writers(role: str, index: int, lanes: int) -> tuple[StatsWriter, ...]:
            rows = list(range(taken[0], taken[0] + lanes))
            taken[0] += lanes
            self._rows[(role, index)] = rows
            return tuple(table.writer(row) for row in rows)

        return writers

    def _channel(self, items: int, size: int) -> tuple[Any, Any]:
        return open_channel(self._ctx, capacity_items=items, capacity_bytes=size)

    def _start(self, name: str, target: Any, setup: Any) -> Any:
        process = self._ctx.Process(target=target, args=(setup,), name=name, daemon=True)
        try:
            process.start()
        except Exception as exc:
            if self._ctx.get_start_method() == "fork":
                raise
            raise unpicklable_error(setup, self._ctx.get_start_method(), name) from exc
        return process

    # -- epochs --------------------------------------------------------------------------

    def begin_epoch(self, seed_generator: Any, iter_reset_fn: Any = None) -> None:
        """Open a new epoch everywhere; items of earlier epochs still in flight are dropped."""
        res = self._check_open()
        res.epoch += 1
        if self._mux is not None:
            self._mux.epoch = res.epoch  # readers of the previous epoch end; its leftovers are dropped
        controls = list(res.controls)
        try:
            if res.dispatch is not None:
                controls.pop(0).send(_control(Kind.RESET, res.epoch, (seed_generator, iter_reset_fn)))
            for worker_id, control in enumerate(controls):
                control.send(_control(Kind.RESET, res.epoch, (seed_generator.spawn(worker_id), iter_reset_fn)))
        except ChannelError as exc:
            raise self._death_error() from exc

    def iterate(self, branch: int = 0) -> Iterator[Any]:
        """The current epoch's items of worker output ``branch``: in order, worker 0, 1, ...,
        N-1, 0, ... with exhausted workers skipped; or as ready with ``in_order=False``."""
        res = self._check_open()
        if self._mux is None:
            raise RuntimeError("internal error: iterate() before start()")
        channels = [w * self._outputs + branch for w in range(len(res.workers))]
        read = read_in_order if self.options.in_order else read_as_ready
        return self._stop_on_interrupt(read(self._mux, channels, res.epoch))

    def _stop_on_interrupt(self, items: Iterator[Any]) -> Iterator[Any]:
        stats = self._main_stats
        try:
            if stats is None:
                yield from items
                return
            for item in items:
                stats.items_in += 1
                yield item
        except KeyboardInterrupt:
            # Ctrl-C: the children ignore SIGINT and wait for us; end them before unwinding.
            self.stop()
            raise

    def _wait_data(self, indices: list[int]) -> list[int]:
        """Block until some of the data channels ``indices`` are readable; a child that
        died meanwhile is an error, and so is a wait longer than ``timeout``."""
        res, timeout = self._res, self.options.timeout
        index_of = {id(res.data[i]): i for i in indices}
        asked = time.perf_counter()
        ready = wait_readable([res.data[i] for i in indices], timeout, also=[p.sentinel for p in res.processes()])
        if self._main_stats is not None:
            self._main_stats.wait_input += time.perf_counter() - asked
        if not ready:
            workers = sorted({i // self._outputs for i in indices})
            raise TimeoutError(
                f"no item from worker {', '.join(map(str, workers))} within timeout={timeout} s; the workers are "
                "alive. Raise the timeout if items are this slow, or look for a stuck read in the pipeline."
            )
        found = [index_of[id(r)] for r in ready if id(r) in index_of]
        if not found:
            raise self._death_error()
        return found

    # -- pause, resume, limit ---------------------------------------------------------------

    def pause(self, pause_fn: Any = None) -> None:
        """Ask every child to stop producing at its next item boundary, pause() its DataPipes
        and run ``pause_fn`` on its segment. Waits for nothing: what the children already
        produced stays in their channels, in order."""
        self._broadcast(Kind.PAUSE, [pause_fn] * len(self._res.controls))

    def resume(self, resume_fn: Any = None) -> None:
        self._broadcast(Kind.RESUME, [resume_fn] * len(self._res.controls))

    def limit(self, num_batches: int | None, limit_fn: Any) -> int | None:
        """Send ``limit_fn`` to the children as torchdata does: with a dispatch process, it
        gets ``num_batches`` and each worker its share; without one, ``None`` everywhere.
        Returns what the main segment's ``limit_fn`` receives."""
        res = self._res
        if res.dispatch is None:
            self._broadcast(Kind.LIMIT, [(None, limit_fn)] * len(res.controls))
            return None
        n = len(res.workers)
        shares = [None if num_batches is None else num_batches // n + (w < num_batches % n) for w in range(n)]
        self._broadcast(Kind.LIMIT, [(num_batches, limit_fn)] + [(share, limit_fn) for share in shares])
        return num_batches

    def _broadcast(self, kind: Kind, payloads: list[Any]) -> None:
        res = self._check_open()
        try:
            for control, payload in zip(res.controls, payloads):
                control.send(_control(kind, res.epoch, payload))
        except ChannelError as exc:
            raise self._death_error() from exc

    def _recv(self, index: int) -> tuple[int, int, Any]:
        try:
            return self._res.data[index].recv()
        except (ChannelBroken, EndOfStream) as exc:
            raise self._death_error() from exc
        except ChannelError as exc:
            raise ServiceClosedError("the reading service was shut down during iteration") from exc

    def _death_error(self) -> Exception:
        if self._res.stopped:
            return ServiceClosedError("the reading service was shut down")
        dead = []
        processes = self._res.processes()
        # The channel can break a moment before the process has exited: give it that
        # moment, then reap the ones whose sentinel fired (they are gone or going).
        ready = wait_readable([], _DEATH_GRACE, also=[p.sentinel for p in processes])
        for process in processes:
            process.join(None if process.sentinel in ready else 0)
            if process.exitcode is not None:
                dead.append(f"{process.name} (pid {process.pid}) {exit_description(process)}")
        if not dead:
            return ProcessDiedError("a child process of the reading service closed its channel unexpectedly")
        return ProcessDiedError(
            "; ".join(dead) + ". The reading service cannot continue: look for an out-of-memory kill, a call "
            "to os._exit or a crash in native code in that process (its stderr may say more), then create "
            "a new DataLoader2."
        )

    def _check_open(self) -> ServiceResources:
        if self._res.stopped:
            raise ServiceClosedError(
                "this reading service has been shut down (DataLoader2.shutdown() or an earlier error); "
                "create a new DataLoader2 to iterate again"
            )
        return self._res

    # -- statistics ----------------------------------------------------------------------

    def stats(self) -> Stats:
        """Every process's counters as of now, added up per segment, with a verdict."""
        table, main = self._table, self._main_stats
        if table is None or main is None:
            return aggregate([])
        res = self._res
        traffic = [receiver.traffic() for receiver in res.data]
        main.busy = max(0.0, time.monotonic() - table.read(self._rows[("main", 0)][0])["started"] - main.wait_input)
        main.items_out = main.items_in
        main.publish()
        pids = {("dispatch", 0): res.dispatch.pid if res.dispatch is not None else 0, ("main", 0): os.getpid()}
        pids.update({("worker", w): p.pid for w, p in enumerate(res.workers)})
        processes = []
        for (role, index), rows in self._rows.items():
            found = make_process_stats(role, index, pids[(role, index)], [table.read(row) for row in rows])
            if role == "main":  # its queue is the workers' channels towards it
                found = dataclasses.replace(found, queued=sum(t.queued_messages for t in traffic))
            elif role == "worker":  # exact and current, from this end of the worker's channels
                mine = traffic[index * self._outputs : (index + 1) * self._outputs]
                found = dataclasses.replace(
                    found, bytes_out=sum(t.bytes for t in mine), queued=sum(t.queued_messages for t in mine)
                )
            processes.append(found)
        order = {"dispatch": 0, "worker": 1, "main": 2}
        return aggregate(sorted(processes, key=lambda p: (order[p.role], p.index)))

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        self._finalizer()


def _start_stats_logger(runtime: ServiceRuntime, interval: float, stopping: threading.Event) -> None:
    """Log ``stats().summary()`` every ``interval`` seconds until the service stops; holds the
    service only weakly, so it never keeps a dropped service alive."""
    service = weakref.ref(runtime)

    def run() -> None:
        while not stopping.wait(interval):
            live = service()
            if live is None:
                return
            _STATS_LOG.info("%s", live.stats().summary())
            del live

    threading.Thread(target=run, name="mprs_plus stats", daemon=True).start()


def _control(kind: Kind, epoch: int, payload: Any) -> tuple[int, int, bytes]:
    """A control message; its payload travels pickled on its own, so that a child that
    cannot unpickle it still knows which epoch fails (see ``control.py``)."""
    return (kind, epoch, pickle.dumps(payload, protocol=5))
