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

import multiprocessing
import os
import pickle
from collections.abc import Iterator
from typing import Any

from torch.utils.data import IterDataPipe

from ..errors import ProcessDiedError, ServiceClosedError
from ..options import Options
from ..plan import Plan
from ..transport import ChannelBroken, ChannelError, EndOfStream, open_channel, wait_readable
from .dispatch import DispatchSetup, dispatch_main
from .lifecycle import exit_description, stop_processes
from .messages import Kind
from .mux import ChannelMux
from .reader import read_as_ready, read_in_order
from .segments import build_dispatch_sources, build_main_pipeline, build_worker_program
from .worker import WorkerSetup, worker_main

# Control messages are small and rare; a few in flight is plenty.
_CONTROL_ITEMS = 4
_CONTROL_BYTES = 1 << 20
_DATA_BYTES = 64 << 20


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


class ServiceRuntime:
    """Processes and channels of one reading service; ``stop()`` is idempotent."""

    def __init__(self, plan: Plan, options: Options) -> None:
        self.plan = plan
        self.options = options
        self.owner_pid = os.getpid()
        self._ctx = multiprocessing.get_context(options.multiprocessing_context)
        self._epoch = 0
        self._stopped = False
        self._workers: list[Any] = []
        self._dispatch: Any = None
        self._controls: list[Any] = []  # senders to the dispatch process (first, if any) and workers
        self._data: list[Any] = []  # receivers from (worker w, output k), at w * outputs + k
        self._outputs = 1
        self._mux: ChannelMux | None = None
        self._drained: set[int] = set()  # data channels found closed while stopping
        self.main_pipeline: Any = None

    # -- start ---------------------------------------------------------------------------

    def start(self) -> Any:
        """Start every process; return the main segment, ready to iterate."""
        n = self.options.num_workers
        program = build_worker_program(self.plan)
        dispatch = build_dispatch_sources(self.plan)
        self._outputs = len(program.outputs)
        readers = [WorkerReader(self, k) for k in range(self._outputs)]
        self.main_pipeline = build_main_pipeline(self.plan, readers)
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
                    sources, n, control_rx, tuple(rows), self.options.dispatch_init_fn, groups, min(64, buffer)
                )
                child_ends += [control_rx, *(tx for row in rows for tx in row)]
                self._controls.append(control_tx)
                self._dispatch = self._start("mprs_plus dispatch", dispatch_main, setup)
                child_ends += [rx for inputs in worker_inputs for rx in inputs]
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
                )
                child_ends += [control_rx, *(tx for tx, _ in pairs)]
                self._controls.append(control_tx)
                self._data.extend(rx for _, rx in pairs)
                self._workers.append(self._start(f"mprs_plus worker {worker_id}", worker_main, setup))
        except BaseException:
            self.stop()
            raise
        finally:
            for end in child_ends:
                end.release()  # each belongs to a child now
        sentinels = [p.sentinel for p in self._processes()]
        for receiver in self._data:
            receiver.watch(*sentinels)
        self._mux = ChannelMux(self._data, self._recv, self._wait_data)
        return self.main_pipeline

    def _channel(self, items: int, size: int) -> tuple[Any, Any]:
        return open_channel(self._ctx, capacity_items=items, capacity_bytes=size)

    def _start(self, name: str, target: Any, setup: Any) -> Any:
        process = self._ctx.Process(target=target, args=(setup,), name=name, daemon=True)
        process.start()
        return process

    def _processes(self) -> list[Any]:
        return ([self._dispatch] if self._dispatch is not None else []) + self._workers

    # -- epochs --------------------------------------------------------------------------

    def begin_epoch(self, seed_generator: Any, iter_reset_fn: Any = None) -> None:
        """Open a new epoch everywhere; items of earlier epochs still in flight are dropped."""
        self._check_open()
        self._epoch += 1
        if self._mux is not None:
            self._mux.epoch = self._epoch  # readers of the previous epoch end; its leftovers are dropped
        controls = list(self._controls)
        try:
            if self._dispatch is not None:
                controls.pop(0).send(_control(Kind.RESET, self._epoch, (seed_generator, iter_reset_fn)))
            for worker_id, control in enumerate(controls):
                control.send(_control(Kind.RESET, self._epoch, (seed_generator.spawn(worker_id), iter_reset_fn)))
        except ChannelError as exc:
            raise self._death_error() from exc

    def iterate(self, branch: int = 0) -> Iterator[Any]:
        """The current epoch's items of worker output ``branch``: in order, worker 0, 1, ...,
        N-1, 0, ... with exhausted workers skipped; or as ready with ``in_order=False``."""
        self._check_open()
        assert self._mux is not None, "internal error: iterate() before start()"
        channels = [w * self._outputs + branch for w in range(len(self._workers))]
        read = read_in_order if self.options.in_order else read_as_ready
        return read(self._mux, channels, self._epoch)

    def _wait_data(self, indices: list[int]) -> list[int]:
        """Block until some of the data channels ``indices`` are readable; a child that
        died meanwhile is an error."""
        index_of = {id(self._data[i]): i for i in indices}
        ready = wait_readable([self._data[i] for i in indices], None, also=[p.sentinel for p in self._processes()])
        found = [index_of[id(r)] for r in ready if id(r) in index_of]
        if not found and ready:
            raise self._death_error()
        return found

    # -- pause, resume, limit ---------------------------------------------------------------

    def pause(self, pause_fn: Any = None) -> None:
        """Ask every child to stop producing at its next item boundary, pause() its DataPipes
        and run ``pause_fn`` on its segment. Waits for nothing: what the children already
        produced stays in their channels, in order."""
        self._broadcast(Kind.PAUSE, [pause_fn] * len(self._controls))

    def resume(self, resume_fn: Any = None) -> None:
        self._broadcast(Kind.RESUME, [resume_fn] * len(self._controls))

    def limit(self, num_batches: int | None, limit_fn: Any) -> int | None:
        """Send ``limit_fn`` to the children as torchdata does: with a dispatch process, it
        gets ``num_batches`` and each worker its share; without one, ``None`` everywhere.
        Returns what the main segment's ``limit_fn`` receives."""
        if self._dispatch is None:
            self._broadcast(Kind.LIMIT, [(None, limit_fn)] * len(self._controls))
            return None
        n = len(self._workers)
        shares = [None if num_batches is None else num_batches // n + (w < num_batches % n) for w in range(n)]
        self._broadcast(Kind.LIMIT, [(num_batches, limit_fn)] + [(share, limit_fn) for share in shares])
        return num_batches

    def _broadcast(self, kind: Kind, payloads: list[Any]) -> None:
        self._check_open()
        try:
            for control, payload in zip(self._controls, payloads):
                control.send(_control(kind, self._epoch, payload))
        except ChannelError as exc:
            raise self._death_error() from exc

    def _recv(self, worker_id: int) -> tuple[int, int, Any]:
        try:
            return self._data[worker_id].recv()
        except (ChannelBroken, EndOfStream) as exc:
            raise self._death_error() from exc
        except ChannelError as exc:
            raise ServiceClosedError("the reading service was shut down during iteration") from exc

    def _death_error(self) -> Exception:
        dead = []
        for process in self._processes():
            process.join(0)
            if process.exitcode is not None:
                dead.append(f"{process.name} (pid {process.pid}) {exit_description(process)}")
        if self._stopped:
            return ServiceClosedError("the reading service was shut down")
        if not dead:
            return ProcessDiedError("a child process of the reading service closed its channel unexpectedly")
        return ProcessDiedError(
            "; ".join(dead) + ". The reading service cannot continue: look for an out-of-memory kill or a "
            "crash in native code in that process, then create a new DataLoader2."
        )

    def _check_open(self) -> None:
        if self._stopped:
            raise ServiceClosedError(
                "this reading service has been shut down (DataLoader2.shutdown() or an earlier error); "
                "create a new DataLoader2 to iterate again"
            )

    # -- stop ----------------------------------------------------------------------------

    def stop(self) -> None:
        if self._stopped or os.getpid() != self.owner_pid:
            return
        self._stopped = True
        for control in self._controls:
            try:
                control.send((Kind.STOP, self._epoch, None))
            except ChannelError:
                pass
            control.close()
        stop_processes(self._processes(), drain=self._drain)
        for receiver in self._data:
            receiver.close()

    def _drain(self, timeout: float) -> None:
        """Discard worker output while stopping, so no worker stays blocked on a full channel."""
        open_receivers = [r for i, r in enumerate(self._data) if i not in self._drained]
        sentinels = [p.sentinel for p in self._processes() if p.exitcode is None]
        if not open_receivers and not sentinels:
            return  # waiting on nothing would sleep the whole timeout
        for ready in wait_readable(open_receivers, timeout, also=sentinels):
            if ready in open_receivers:
                try:
                    while ready.poll():
                        ready.recv(0)
                except ChannelError:
                    self._drained.add(self._data.index(ready))


def _control(kind: Kind, epoch: int, payload: Any) -> tuple[int, int, bytes]:
    """A control message; its payload travels pickled on its own, so that a child that
    cannot unpickle it still knows which epoch fails (see ``control.py``)."""
    return (kind, epoch, pickle.dumps(payload, protocol=5))
